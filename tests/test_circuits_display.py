"""Looking at a graph: ``top_path`` against every path enumerated, ``plot_graph`` draws the pruned graph, ``view``
(``jstd.view``) takes a ``Graph`` and pins a node. Synthetic graphs, no model: milliseconds."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import jstd
from jstd.circuits import Graph, prune, top_path
from jstd.circuits.paths import node_layers
from jstd.circuits.prune import normalized


def random_graph(seed=0, L=3, n=4, features=10, k=3, density=0.5) -> Graph:
    """A graph with circuit-tracer's node order and a DAG's edges: a source reaches a target at a higher rank (tokens,
    blocks, logits) and a position not after it (logits read the last position)."""
    rng = np.random.default_rng(seed)
    active = np.array(sorted({(int(rng.integers(L)), int(rng.integers(1, n)), int(rng.integers(50)))
                              for _ in range(features)}), np.int64)
    nf = len(active)
    N = nf + L * n + n + k
    g = Graph(np.zeros((N, N), np.float32), active, rng.uniform(0.1, 2, nf).astype(np.float32), np.arange(nf),
              np.arange(n, dtype=np.int64) + 5, np.arange(k, dtype=np.int64) + 20,
              np.sort(rng.uniform(0.05, 0.5, k)).astype(np.float32)[::-1].copy(), np.zeros((k, 8), np.float32), L, 64,
              [f"w{i}" for i in range(k)], scan="test")
    rank = node_layers(g)
    pos = np.array([g.node(i)[2] if g.node(i)[0] == "feature" else g.node(i)[2] if g.node(i)[0] == "error"
                    else g.node(i)[1] if g.node(i)[0] == "token" else n - 1 for i in range(N)])
    allowed = (rank[:, None] > rank[None, :]) & (pos[:, None] >= pos[None, :])
    allowed[g.error_start:g.logit_start] = False  # rows of errors and tokens are zero
    A = np.where(allowed & (rng.random((N, N)) < density), rng.normal(size=(N, N)), 0).astype(np.float32)
    g.adjacency = A
    return g


def every_path(g: Graph, target: int, W: np.ndarray, sources):
    """(strength, nodes) of every path from ``sources`` to logit ``target`` over the nonzero entries of ``W``."""
    t = g.logit_start + target
    out = []

    def walk(node, strength, trail):
        if node == t:
            out.append((strength, trail))
            return
        for nxt in np.nonzero(W[:, node])[0]:
            walk(int(nxt), strength * float(W[nxt, node]), trail + [int(nxt)])

    for s in sources:
        walk(int(s), 1.0, [int(s)])
    return out


@pytest.mark.parametrize("seed", range(4))
def test_top_path_is_the_strongest_of_all_paths(seed):
    g = random_graph(seed)
    W = normalized(g.adjacency)
    for target in range(g.n_logits):
        tokens = every_path(g, target, W, range(g.token_start, g.logit_start))
        best = max(tokens)
        got = top_path(g, target=target)
        assert got.strength == pytest.approx(best[0], rel=1e-6) and got.nodes == best[1]
        assert got.shares == pytest.approx([W[b, a] for a, b in zip(got.nodes, got.nodes[1:])], rel=1e-6)
        assert got.weights == [g.adjacency[b, a] for a, b in zip(got.nodes, got.nodes[1:])]
        anywhere = max(every_path(g, target, W, range(g.logit_start)))
        assert top_path(g, target=target, sources="any").strength == pytest.approx(anywhere[0], rel=1e-6)
    # in the pruned graph: only kept nodes and edges, shares still of the full graph's inputs
    p = prune(g, 0.6, 0.8)
    kept = np.where(p.edge_mask & p.node_mask[:, None] & p.node_mask[None, :], W, 0)
    paths = every_path(g, 0, kept, range(g.token_start, g.logit_start))
    if paths:
        assert top_path(g, p).nodes == max(paths)[1]
        assert all(p.node_mask[i] for i in top_path(g, p).nodes)


def test_top_path_refuses():
    g = random_graph(1)
    with pytest.raises(ValueError, match="not a logit target"):
        top_path(g, target=g.n_logits)
    with pytest.raises(ValueError, match="sources"):
        top_path(g, sources="features")
    g.adjacency[g.logit_start] = 0
    with pytest.raises(ValueError, match="no path reaches logit target 0"):
        top_path(g)


def test_plot_graph_draws_the_pruned_graph(tmp_path):
    from PIL import Image

    g = random_graph(2)
    p = prune(g)
    fig = jstd.circuits.plot_graph(g, p, highlight=top_path(g, p).nodes, path=tmp_path / "g.png")
    ax = fig.axes[0]
    edges = int((p.edge_mask & p.node_mask[:, None] & p.node_mask[None, :]).sum())
    assert len(ax.lines) == edges + len(top_path(g, p).nodes) - 1        # every kept edge, then the path on top
    assert len(ax.collections) == int(p.node_mask.sum())                  # one marker a kept node
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(t) for t in g.input_tokens]
    png = np.asarray(Image.open(tmp_path / "g.png").convert("L"))
    assert (png < 128).mean() > 0.005


def test_view_takes_a_graph(tmp_path):
    g = random_graph(3)
    p = prune(g)
    path = top_path(g, p)
    page = jstd.view(g, tmp_path / "g.html", pin=path.nodes[0])
    data = json.loads(re.search(r'id="page-data">(.*?)</script>', page.read_text(), re.S).group(1))
    want = jstd.circuits.frontend_json(jstd.circuits.display.labelled(g), "graph")
    assert data["nodes"] == want["nodes"] and data["links"] == want["links"]
    assert data["metadata"]["prompt_tokens"] == [str(t) for t in g.input_tokens]
    token = g.node(path.nodes[0])
    assert data["qParams"]["clickedId"] == f"E_{token[2]}_{token[1]}"
    # a graph JSON goes straight to the viewer, as jstd.viewer.view
    assert jstd.view(data, tmp_path / "again.html").read_text() == page.read_text()
    with pytest.raises(ValueError, match="pin= is a node index"):
        jstd.view(data, tmp_path / "x.html", pin=0)
    dropped = np.nonzero(~p.node_mask[:g.n_features])[0]
    assert len(dropped)
    with pytest.raises(KeyError, match="not in the pruned graph"):
        jstd.view(g, tmp_path / "y.html", pin=int(dropped[0]))
