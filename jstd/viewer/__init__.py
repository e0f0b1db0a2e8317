"""Pages to look at, not read: self-contained HTML (script, styles and data inline; no network, no CDN, no build
step) that open from disk in any browser.

- ``view(graph, out=None, open_browser=False)``: an attribution graph in the JSON that circuit-tracer's frontend
  and Neuronpedia read (jstd writes the same), drawn by layer and position, with hover details, pinned paths to the
  logits and an edge-threshold slider (``graph.py``; the page is ``static/graph.*``).
- ``attention_figure``, ``grid_figure``, ``view_figures``: attention patterns and heatmaps (a patching sweep, a
  logit lens) in the same style, hover for values (``figures.py``; ``static/figures.*``).
- ``serve(text, port)``: one page over HTTP on 127.0.0.1 only (``page.py``).
- ``Chromium``: a headless Chromium over the DevTools pipe, for tests and screenshots (``headless.py``).

This package imports nothing else of jstd (no JAX): a graph opens where only the JSON is.
"""

from jstd.viewer.figures import attention_figure, figures_page, grid_figure, view_figures
from jstd.viewer.graph import GraphFileError, SharedIdWarning, check_graph, graph_page, load_graph, view
from jstd.viewer.headless import BrowserError, Chromium, find_chromium
from jstd.viewer.page import page, serve, write

__all__ = ["view", "graph_page", "load_graph", "check_graph", "GraphFileError", "SharedIdWarning",
           "attention_figure", "grid_figure", "figures_page", "view_figures",
           "page", "serve", "write", "Chromium", "BrowserError", "find_chromium"]
