"""An attribution graph's page: the graph JSON that circuit-tracer's frontend and Neuronpedia read (``{metadata,
qParams, nodes, links}``; jstd writes the same), checked, and inlined into the viewer page.

The fields the page reads: ``metadata.prompt_tokens`` (the column labels) and ``prompt``/``slug`` (the title);
``qParams.clickedId`` (a node pinned on opening); each node's ``node_id``, ``feature``, ``layer``, ``ctx_idx``,
``feature_type`` (``"embedding"``, ``"logit"``, ``"... error"``, anything else a feature), ``token_prob``,
``is_target_logit``, ``clerp``, ``influence``, ``activation``; each link's ``source``, ``target`` (node ids) and
``weight``."""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from collections import Counter
from pathlib import Path

from jstd.viewer.page import page, write

NODE_FIELDS = ("node_id", "layer", "ctx_idx", "feature_type")
LINK_FIELDS = ("source", "target", "weight")


class GraphFileError(ValueError):
    """A graph JSON the viewer cannot draw; the message names the field and what it should be."""


class SharedIdWarning(UserWarning):
    """Two nodes of a graph JSON share one ``node_id`` (circuit-tracer names an error node ``0_{layer}_{position}``,
    as it names the layer-0 feature of that index): links cannot tell them apart, so the first takes the id's edges."""


def load_graph(graph) -> tuple[dict, Path | None]:
    """(the graph as a dict, the file it came from or None) from a path to a graph JSON, its text, or the dict.
    Raises GraphFileError on a file that is not one (missing fields, links to nodes it does not have, non-finite
    weights) and warns (SharedIdWarning) where node ids repeat."""
    source = None
    if isinstance(graph, (str, os.PathLike)) and not str(graph).lstrip().startswith("{"):
        source = Path(graph)
        if not source.is_file():
            raise FileNotFoundError(f"no graph JSON at {source}")
        try:
            graph = json.loads(source.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise GraphFileError(f"{source} is not JSON ({e})") from None
    elif isinstance(graph, str):
        try:
            graph = json.loads(graph)
        except json.JSONDecodeError as e:
            raise GraphFileError(f"the graph text is not JSON ({e})") from None
    if not isinstance(graph, dict):
        raise TypeError(f"view a graph JSON: a path to one, its text, or the dict; got {type(graph).__name__}")
    check_graph(graph, str(source) if source else "the graph")
    return graph, source


def check_graph(graph: dict, name: str = "the graph") -> None:
    """Raises GraphFileError where ``graph`` is not drawable: ``nodes`` and ``links`` lists, each node with
    ``node_id``, ``layer``, ``ctx_idx`` (an int >= 0) and ``feature_type``, each link with ``source`` and ``target``
    naming nodes it has and a finite ``weight``; a feature's or error's ``layer`` a block number. Warns
    (SharedIdWarning) where node ids repeat."""
    for key in ("nodes", "links"):
        if not isinstance(graph.get(key), list):
            raise GraphFileError(f"{name} has no {key!r} list: a graph JSON (circuit-tracer's frontend format) is "
                                 "{metadata, qParams, nodes, links}")
    for i, node in enumerate(graph["nodes"]):
        missing = [f for f in NODE_FIELDS if not isinstance(node, dict) or f not in node]
        if missing:
            raise GraphFileError(f"{name}: node {i} has no {', '.join(map(repr, missing))} (every node has "
                                 f"{', '.join(NODE_FIELDS)})")
        kind = str(node["feature_type"]).lower()
        if node["layer"] != "E" and kind not in ("embedding", "logit") and not str(node["layer"]).isdigit():
            raise GraphFileError(f"{name}: node {node['node_id']!r} ({node['feature_type']}) has layer "
                                 f"{node['layer']!r}; a feature's or an error's layer is a block number")
        if not isinstance(node["ctx_idx"], int) or node["ctx_idx"] < 0:
            raise GraphFileError(f"{name}: node {node['node_id']!r} has ctx_idx {node['ctx_idx']!r}; a position is "
                                 "an int >= 0")
    ids = Counter(node["node_id"] for node in graph["nodes"])
    for i, link in enumerate(graph["links"]):
        missing = [f for f in LINK_FIELDS if not isinstance(link, dict) or f not in link]
        if missing:
            raise GraphFileError(f"{name}: link {i} has no {', '.join(map(repr, missing))} (every link has "
                                 f"{', '.join(LINK_FIELDS)})")
        for end in ("source", "target"):
            if link[end] not in ids:
                raise GraphFileError(f"{name}: link {i}'s {end} {link[end]!r} is no node's node_id")
        w = link["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise GraphFileError(f"{name}: link {i} ({link['source']} -> {link['target']}) has weight {w!r}; a "
                                 "weight is a finite number")
    shared = [node_id for node_id, count in ids.items() if count > 1]
    if shared:
        warnings.warn(f"{name}: {len(shared)} node id(s) belong to more than one node ({', '.join(shared[:3])}"
                      f"{', ...' if len(shared) > 3 else ''}); links name nodes by id, so the first node with an id "
                      "takes its edges (the page says so too)", SharedIdWarning, stacklevel=3)


def graph_page(graph) -> str:
    """The viewer page (one self-contained HTML document) of ``graph``: a path, JSON text or dict (load_graph)."""
    graph, _ = load_graph(graph)
    return checked_page(graph)


def checked_page(graph: dict) -> str:
    """The viewer page of a graph dict that ``check_graph`` passed."""
    meta = graph.get("metadata") or {}
    return page("graph", graph, f"{meta.get('slug') or 'attribution graph'} (jstd viewer)")


def view(graph, out=None, open_browser: bool = False) -> Path:
    """Writes the viewer page of ``graph`` (a path to a graph JSON, its text, or the dict, in the format
    circuit-tracer's frontend reads) to ``out`` and returns its path: one HTML file with the script, styles and
    graph inline, which opens from disk with no network. ``out=None``: beside the JSON file (``GRAPH.html``), or
    in the temporary folder for a dict. ``open_browser``: also open it in the default browser.

    The page: nodes by layer (rows; token embeddings at the bottom, logits at the top) and position (columns,
    labelled with the prompt's tokens), edges coloured by sign and sized by |weight|, nodes sized by influence;
    hover for a node's details (feature index and activation, error, token, logit and probability, top input and
    output edges), click to pin a node and its paths to the logits, a slider for the edge threshold."""
    loaded, source = load_graph(graph)
    if out is None:
        if source is not None:
            out = source.with_suffix(".html")
        else:
            slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in str((loaded.get("metadata") or {})
                                                                               .get("slug") or "graph"))
            out = Path(tempfile.gettempdir()) / f"jstd-{slug}.html"
    return write(checked_page(loaded), out, open_browser)
