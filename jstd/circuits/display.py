"""Looking at an attribution graph: in the browser (``view``: jstd.viewer's self-contained page of the pruned graph)
and as a figure (``plot_graph``: matplotlib, nodes by layer and position).

``jstd.view`` is this ``view``: it takes a ``Graph`` (pruned and written as the frontend JSON here) or anything
``jstd.viewer.view`` takes (a graph JSON's path, text or dict). It lives in ``circuits`` because the viewer sits
below the circuits (it imports nothing else of jstd, so a graph opens where only the JSON is).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from jstd import viewer
from jstd.circuits.frontend import frontend_json
from jstd.circuits.graph import Graph
from jstd.circuits.prune import Pruned, prune

INSTALL = "pip install jstd[plots]"


def labelled(graph: Graph, tokenizer=None, scan: str | None = None) -> Graph:
    """``graph`` with what the frontend JSON needs: token strings (from ``tokenizer``, else the ids), the prompt,
    and a scan (``scan``, else the graph's, else ``"jstd"``)."""
    tokens = graph.prompt_tokens
    if tokens is None:
        ids = [int(t) for t in graph.input_tokens]
        tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(t) for t in ids]
    prompt = graph.input_string if graph.input_string is not None else " ".join(tokens)
    return dataclasses.replace(graph, prompt_tokens=list(tokens), input_string=prompt,
                               scan=scan or graph.scan or "jstd")


def node_id(data: dict, graph: Graph, i: int) -> str:
    """The frontend JSON's ``node_id`` of graph node ``i`` (jstd's ids: ``jstd.circuits.frontend``). KeyError
    where the pruned JSON does not hold it."""
    kind, *rest = graph.node(i)
    L, n = graph.num_layers, graph.n_pos
    if kind == "feature":
        l, p, f = rest
        wanted = f"{l}_{f}_{p}"
    elif kind == "error":
        l, p = rest
        wanted = f"{l}_error_{p}"
    elif kind == "token":
        p, t = rest
        wanted = f"E_{t}_{p}"
    else:
        wanted = f"{L + 1}_{rest[1]}_{n - 1}"
    if not any(node["node_id"] == wanted for node in data["nodes"]):
        raise KeyError(f"node {i} ({kind} {rest}) is not in the pruned graph's JSON")
    return wanted


def view(graph, out: str | os.PathLike | None = None, *, slug: str | None = None, tokenizer=None,
         node_threshold: float = 0.8, edge_threshold: float = 0.98, pin: int | None = None,
         open_browser: bool = False) -> Path:
    """Writes the viewer page (``jstd.viewer.view``: one self-contained HTML file, no network) of ``graph`` and
    returns its path.

    graph: a ``jstd.circuits.Graph`` — pruned at ``node_threshold`` / ``edge_threshold`` and written as the JSON
        circuit-tracer's frontend reads (``frontend_json``; token labels from the graph, else from ``tokenizer``,
        else the ids; ``slug`` default ``"graph"``); ``pin``: a graph node index to pin when the page opens (its
        paths to the logits highlighted) — or anything ``jstd.viewer.view`` takes (a path to a graph JSON, its text,
        or the dict), drawn as it is (``pin`` and the thresholds then do not apply).
    out: the page's path (default: beside a JSON file, else in the temporary folder).

    Raises KeyError for a ``pin`` the pruned graph dropped; the viewer's errors for a bad graph file."""
    if not isinstance(graph, Graph):
        if pin is not None:
            raise ValueError("view: pin= is a node index of a jstd.circuits.Graph; a graph JSON names its pinned "
                             "node in qParams.clickedId")
        return viewer.view(graph, out, open_browser)
    data = frontend_json(labelled(graph, tokenizer), slug or "graph", node_threshold=node_threshold,
                         edge_threshold=edge_threshold)
    if pin is not None:
        data["qParams"]["clickedId"] = node_id(data, graph, pin)
    return viewer.view(data, out, open_browser)


def _position(graph: Graph, kept: np.ndarray) -> dict[int, tuple[float, float]]:
    """(x, y) of every kept node: x its position (nodes sharing a cell spread across it), y its row (tokens 0,
    block l at l + 1, logits L + 1; logits spread along the last column's row)."""
    L = graph.num_layers
    cells: dict[tuple[int, int], list[int]] = {}
    for i in kept:
        kind, *rest = graph.node(i)
        cell = {"feature": lambda: (rest[0] + 1, rest[1]), "error": lambda: (rest[0] + 1, rest[1]),
                "token": lambda: (0, rest[0]), "logit": lambda: (L + 1, graph.n_pos - 1)}[kind]()
        cells.setdefault(cell, []).append(int(i))
    xy = {}
    for (row, col), members in cells.items():
        width = 0.7 if row <= L else min(0.3 * len(members), 3.0)
        for j, i in enumerate(members):
            offset = 0.0 if len(members) == 1 else width * (j / (len(members) - 1) - 0.5)
            xy[i] = (col + offset - (width / 2 if row == L + 1 and len(members) > 1 else 0.0), float(row))
    return xy


def plot_graph(graph: Graph, pruned: Pruned | None = None, *, highlight: Sequence[int] = (), labels=None,
               title: str | None = None, path: str | os.PathLike | None = None):
    """The pruned graph as a matplotlib ``Figure``: nodes by layer (rows: token embeddings at the bottom, blocks,
    logit targets at the top) and position (columns, labelled with ``labels`` or the graph's token strings or ids,
    ``img{i} patch{j}`` at image tokens); features as circles, errors as squares, tokens and logits as diamonds;
    edges blue (positive) or red (negative), as wide and as opaque as |weight| over the largest kept;
    ``highlight`` (graph node indices along a path, e.g. ``top_path(...).nodes``) drawn on top in black.
    ``pruned`` defaults to ``prune(graph)``. Writes a PNG to ``path`` when given. Requires matplotlib
    (``pip install jstd[plots]``)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"plot_graph needs matplotlib, which is not installed: {INSTALL}") from e
    pruned = prune(graph) if pruned is None else pruned
    kept = np.nonzero(pruned.node_mask)[0]
    xy = _position(graph, kept)
    L, n = graph.num_layers, graph.n_pos
    labels = list(labels if labels is not None else map(graph.input_label, range(graph.n_pos)))
    fig = Figure(figsize=(max(6.0, 0.42 * n + 1.5), 1.1 * (L + 2) + 1.0))
    ax = fig.add_subplot()
    A = graph.adjacency
    dst, src = np.nonzero(pruned.edge_mask)
    edges = [(s, t) for s, t in zip(src, dst) if s in xy and t in xy]
    top = max((abs(float(A[t, s])) for s, t in edges), default=1.0) or 1.0
    for s, t in sorted(edges, key=lambda e: abs(float(A[e[1], e[0]]))):
        w = float(A[t, s])
        strength = abs(w) / top
        ax.plot(*zip(xy[s], xy[t]), color="#2060c0" if w > 0 else "#c03030", lw=0.4 + 3.0 * strength,
                alpha=0.25 + 0.6 * strength, zorder=1)
    path_edges = list(zip(highlight[:-1], highlight[1:]))
    for s, t in path_edges:
        if s in xy and t in xy:
            ax.plot(*zip(xy[s], xy[t]), color="black", lw=2.5, zorder=2)
    marker = {"feature": "o", "error": "s", "token": "D", "logit": "D"}
    colour = {"feature": "#f0a030", "error": "#a0a0a0", "token": "#60a060", "logit": "#8060c0"}
    on_path = set(int(i) for i in highlight)
    for i, (x, y) in xy.items():
        kind = graph.node(i)[0]
        ax.scatter([x], [y], s=90 if i in on_path else 45, marker=marker[kind], color=colour[kind],
                   edgecolors="black" if i in on_path else "none", linewidths=1.5, zorder=3)
        if kind == "feature":
            ax.annotate(str(graph.node(i)[3]), (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                        fontsize=6, zorder=4)
        elif kind == "logit":
            k = graph.node(i)[1]
            ax.annotate(f"{graph.logit_strings[k]} {graph.logit_probabilities[k]:.2f}", (x, y), rotation=60,
                        textcoords="offset points", xytext=(-2, 6), ha="left", fontsize=6, zorder=4)
    ax.set_xticks(range(n), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(L + 2), ["tokens", *(f"block {l}" for l in range(L)), "logits"], fontsize=8)
    ax.set_xlim(-0.8, n - 0.2)
    ax.set_ylim(-0.5, L + 2.2)
    ax.grid(axis="y", color="#eeeeee", zorder=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"pruned attribution graph: {len(xy)} nodes, {len(edges)} edges", fontsize=9)
    fig.tight_layout()
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig
