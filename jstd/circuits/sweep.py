"""Many prompts' attribution graphs aggregated: ``aggregate_edges``.

Graphs of different prompts have different nodes; what they share is *what* a node is: a feature ``(layer,
feature)`` wherever it fires, an error of a block, a token id (an image token: its image and patch), a logit's vocab
id. ``node_keys`` names each node so; ``aggregate_edges`` sums each graph's edges by (target key, source key) pair
(a feature firing at several positions is one key) and reduces over the graphs: the mean over all graphs (a pair
absent from a graph counts as zero there), the mean over the graphs holding the pair, and how many do.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jstd.circuits.graph import Graph


def node_keys(graph: Graph) -> list[tuple]:
    """Each node's position-free key: ``("feature", layer, feature)``, ``("error", layer)``, ``("token", id)``,
    ``("image", image, patch)`` (an image token: one key per image and patch, as ``Graph.input_label`` labels it;
    every image token has the one id), ``("logit", id)``."""
    keys = []
    for i in range(graph.n_nodes):
        kind, *rest = graph.node(i)
        if kind == "feature":
            keys.append(("feature", rest[0], rest[2]))
        elif kind == "error":
            keys.append(("error", rest[0]))
        elif (patch := graph.image_patch(i)) is not None:
            keys.append(("image", *patch))
        else:
            keys.append((kind, rest[-1]))
    return keys


@dataclasses.dataclass
class EdgeTable:
    """Edges aggregated over ``n_graphs`` graphs: row ``j`` is the pair ``keys[targets[j]] <- keys[sources[j]]``.

    mean: the sum of the pair's edges in a graph, averaged over all graphs (absent: 0); mean_present: averaged
    over the ``count`` graphs that hold the pair (a nonzero edge)."""

    keys: list[tuple]
    targets: np.ndarray
    sources: np.ndarray
    mean: np.ndarray
    mean_present: np.ndarray
    count: np.ndarray
    n_graphs: int

    def top(self, k: int = 20, *, by: str = "mean") -> list[tuple[tuple, tuple, float, int]]:
        """The ``k`` pairs largest in magnitude of ``by`` (``mean`` or ``mean_present``): ``(target key, source key,
        value, count)``."""
        v = getattr(self, by)
        order = np.argsort(-np.abs(v), kind="stable")[:k]
        return [(self.keys[self.targets[j]], self.keys[self.sources[j]], float(v[j]), int(self.count[j]))
                for j in order]

    def weight(self, target: tuple, source: tuple, *, by: str = "mean") -> float:
        """The aggregated weight of ``target <- source`` (0 where no graph holds the pair)."""
        index = {k: i for i, k in enumerate(self.keys)}
        if target not in index or source not in index:
            return 0.0
        hit = np.nonzero((self.targets == index[target]) & (self.sources == index[source]))[0]
        return float(getattr(self, by)[hit[0]]) if len(hit) else 0.0


def aggregate_edges(graphs: Sequence[Graph]) -> EdgeTable:
    """``graphs`` (e.g. ``jstd.attribute(model, prompts, transcoders)``, one per prompt) aggregated by node keys
    (module docstring). ValueError for no graphs."""
    if not graphs:
        raise ValueError("aggregate_edges: no graphs given")
    index: dict[tuple, int] = {}
    sums: dict[tuple[int, int], float] = {}
    counts: dict[tuple[int, int], int] = {}
    for g in graphs:
        ids = np.asarray([index.setdefault(k, len(index)) for k in node_keys(g)], np.int64)
        t, s = np.nonzero(g.adjacency)
        if not len(t):
            continue
        pair = ids[t] * (1 << 32) + ids[s]
        unique, inverse = np.unique(pair, return_inverse=True)
        summed = np.bincount(inverse, weights=g.adjacency[t, s].astype(np.float64), minlength=len(unique))
        for p, v in zip(unique.tolist(), summed.tolist()):
            key = divmod(p, 1 << 32)
            sums[key] = sums.get(key, 0.0) + v
            counts[key] = counts.get(key, 0) + 1
    pairs = sorted(sums)
    targets = np.asarray([p[0] for p in pairs], np.int64)
    sources = np.asarray([p[1] for p in pairs], np.int64)
    total = np.asarray([sums[p] for p in pairs], np.float64)
    count = np.asarray([counts[p] for p in pairs], np.int64)
    keys = [None] * len(index)
    for k, i in index.items():
        keys[i] = k
    return EdgeTable(keys, targets, sources, total / len(graphs), total / np.maximum(count, 1), count, len(graphs))
