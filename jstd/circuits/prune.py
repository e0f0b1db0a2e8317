"""Pruning an attribution graph and scoring it, as circuit-tracer 0.5.0 defines them (``graph.py``: ``prune_graph``,
``compute_graph_scores``), in float32 numpy.

Influence: with ``W = |A| / rowsum(|A|)`` (row sums clamped at 1e-10) and logit weights ``w`` (the targets'
probabilities on the logit nodes, zero elsewhere), a node's influence is ``Σ_{k>=1} (w · W^k)``: how much of the
probability-weighted logits flows through it, along every path (the graph is a DAG, so the series ends).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jstd.circuits.graph import Graph


def normalized(A: np.ndarray) -> np.ndarray:
    """``|A|`` with each row divided by its sum (clamped at 1e-10)."""
    W = np.abs(A).astype(np.float32)
    return W / np.maximum(W.sum(1, keepdims=True), np.float32(1e-10))


def influence(W: np.ndarray, weights: np.ndarray, max_iter: int = 1000) -> np.ndarray:
    """``Σ_{k>=1} weights · W^k``. RuntimeError when the series does not end in ``max_iter`` steps (a cycle)."""
    current = weights @ W
    total = current.copy()
    for _ in range(max_iter):
        if not current.any():
            return total
        current = current @ W
        total += current
    raise RuntimeError(f"influence: no end after {max_iter} steps; the graph has a cycle")


def logit_weights(graph: Graph) -> np.ndarray:
    w = np.zeros(graph.n_nodes, np.float32)
    w[graph.logit_start:] = graph.logit_probabilities
    return w


def threshold(scores: np.ndarray, fraction: float) -> np.float32:
    """The score at which the scores sorted descending first reach ``fraction`` of their total."""
    ordered = np.sort(scores.astype(np.float32))[::-1]
    cumulative = np.cumsum(ordered, dtype=np.float32) / ordered.sum(dtype=np.float32)
    return ordered[min(int(np.searchsorted(cumulative, np.float32(fraction))), len(ordered) - 1)]


class Pruned(NamedTuple):
    """node_mask ``[N]``, edge_mask ``[N, N]`` (``[target, source]``), cumulative_scores ``[N]`` (each node's
    cumulative share of the total influence at its rank: small is important)."""

    node_mask: np.ndarray
    edge_mask: np.ndarray
    cumulative_scores: np.ndarray


def prune(graph: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """circuit-tracer's ``prune_graph``: keep the nodes holding ``node_threshold`` of the influence (every token and
    logit node kept), then the edges holding ``edge_threshold`` of the influence-weighted edge scores among them;
    then, until nothing changes, drop feature and error nodes without a kept outgoing edge and feature nodes
    without a kept incoming edge, and their edges. ValueError for thresholds outside [0, 1]."""
    for name, t in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= t <= 1.0:
            raise ValueError(f"prune: {name} must be between 0.0 and 1.0, got {t}")
    A = graph.adjacency
    w = logit_weights(graph)
    kept_ends = graph.n_logits + graph.n_pos
    node_influence = influence(normalized(A), w)
    node_mask = node_influence >= threshold(node_influence, node_threshold)
    node_mask[-kept_ends:] = True
    pruned = A.copy()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    W = normalized(pruned)
    edge_scores = W * (influence(W, w) + w)[:, None]
    edge_mask = edge_scores >= threshold(edge_scores.reshape(-1), edge_threshold)
    nf = graph.n_features
    old = node_mask.copy()
    node_mask[:-kept_ends] &= edge_mask[:, :-kept_ends].any(0)
    node_mask[:nf] &= edge_mask[:nf].any(1)
    while not np.array_equal(node_mask, old):
        old = node_mask.copy()
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[:-kept_ends] &= edge_mask[:, :-kept_ends].any(0)
        node_mask[:nf] &= edge_mask[:nf].any(1)
    order = np.argsort(-node_influence, kind="stable")
    cumulative = np.cumsum(node_influence[order], dtype=np.float32) / node_influence.sum(dtype=np.float32)
    scores = np.zeros_like(node_influence)
    scores[order] = cumulative
    return Pruned(node_mask, edge_mask, scores)


def graph_scores(graph: Graph) -> tuple[float, float]:
    """circuit-tracer's ``compute_graph_scores``: ``(replacement, completeness)``. Replacement: the token nodes'
    influence over the token and error nodes' together (how much of the logits' dependence on the input flows
    through features). Completeness: ``Σ (1 - error share of each node's |inputs|) · (I + w) / Σ (I + w)``."""
    W = normalized(graph.adjacency)
    w = logit_weights(graph)
    I = influence(W, w)
    errors = slice(graph.error_start, graph.token_start)
    token = I[graph.token_start:graph.logit_start].sum(dtype=np.float32)
    error = I[errors].sum(dtype=np.float32)
    replacement = token / (token + error)
    out = I + w
    completeness = ((1 - W[:, errors].sum(1, dtype=np.float32)) * out).sum(dtype=np.float32) / out.sum(dtype=np.float32)
    return float(replacement), float(completeness)
