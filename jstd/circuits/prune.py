"""Pruning an attribution graph and scoring it, as circuit-tracer 0.5.0 defines them (``graph.py``: ``prune_graph``,
``compute_graph_scores``), in float32 numpy.

Influence: with ``W = |A| / rowsum(|A|)`` (row sums clamped at 1e-10) and logit weights ``w`` (the targets'
probabilities on the logit nodes, zero elsewhere), a node's influence is ``Σ_{k>=1} (w · W^k)``: how much of the
probability-weighted logits flows through it, along every path (the graph is a DAG, so the series ends).

A graph whose adjacency is a ``SparseAdjacency`` (``edges_per_row``) is pruned and scored on its kept edges with
the same definitions: each row is normalised by its full ``Σ |A|`` (stored with it), so every kept edge's weight
is the dense graph's, and influence flows only along kept edges (a lower bound of the dense influence: the paths
through dropped edges are missing). After node pruning, a row's sum over the nodes kept counts its dropped edges
as still there. With every nonzero edge kept (``k`` at least the widest row) the results are the dense graph's.
``Pruned.edge_mask`` is then a ``scipy.sparse.csr_array`` of booleans.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jstd.circuits.graph import Graph, SparseAdjacency


def normalized(A):
    """``|A|`` with each row divided by its sum (clamped at 1e-10). A ``SparseAdjacency``: its kept entries over
    the full row sums, as a ``scipy.sparse.csr_array``."""
    if isinstance(A, SparseAdjacency):
        return _scaled(A, A.row_abs_sums)
    W = np.abs(A).astype(np.float32)
    return W / np.maximum(W.sum(1, keepdims=True), np.float32(1e-10))


def _scaled(A: SparseAdjacency, sums: np.ndarray, keep=None):
    """``|kept entries| / max(sums, 1e-10)`` per row as a csr_array; ``keep`` (per entry, bool): zero the others."""
    from scipy.sparse import csr_array

    rows = np.repeat(np.arange(A.shape[0]), np.diff(A.indptr))
    data = np.abs(A.data).astype(np.float32) / np.maximum(sums.astype(np.float32), np.float32(1e-10))[rows]
    if keep is not None:
        data = np.where(keep, data, np.float32(0))
    return csr_array((data, A.indices, A.indptr), shape=A.shape)


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
    sparse = isinstance(A, SparseAdjacency)
    if sparse:
        rows = np.repeat(np.arange(A.shape[0]), np.diff(A.indptr))
        both = node_mask[rows] & node_mask[A.indices]
        magnitude = np.abs(A.data).astype(np.float32)
        # the row's sum over the nodes kept: its kept entries there, and the edges it dropped
        dropped = A.row_abs_sums - np.bincount(rows, magnitude, A.shape[0]).astype(np.float32)
        sums = np.bincount(rows, np.where(both, magnitude, 0), A.shape[0]).astype(np.float32) + np.maximum(dropped, 0)
        W = _scaled(A, np.where(node_mask, sums, 0), both)
        factor = (influence(W, w) + w)[rows]
        scores = W.data * factor
        edge = scores >= threshold(scores, edge_threshold)
        targets, sources = rows[edge], A.indices[edge]
    else:
        pruned = A.copy()
        pruned[~node_mask] = 0
        pruned[:, ~node_mask] = 0
        W = normalized(pruned)
        edge_scores = W * (influence(W, w) + w)[:, None]
        targets, sources = np.nonzero(edge_scores >= threshold(edge_scores.reshape(-1), edge_threshold))
    nf, N = graph.n_features, graph.n_nodes
    alive = np.ones(len(targets), bool)
    # until nothing changes: drop nodes without a kept outgoing edge (features, errors) or incoming one (features)
    while True:
        old = node_mask.copy()
        node_mask[:-kept_ends] &= np.bincount(sources[alive], minlength=N)[:-kept_ends] > 0
        node_mask[:nf] &= np.bincount(targets[alive], minlength=N)[:nf] > 0
        if np.array_equal(node_mask, old):
            break
        alive &= node_mask[targets] & node_mask[sources]
    targets, sources = targets[alive], sources[alive]
    if sparse:
        from scipy.sparse import csr_array

        edge_mask = csr_array((np.ones(len(targets), bool), (targets, sources)), shape=A.shape)
    else:
        edge_mask = np.zeros(A.shape, bool)
        edge_mask[targets, sources] = True
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
    error_share = np.asarray(W[:, errors].sum(1), np.float32).reshape(-1)
    completeness = ((1 - error_share) * out).sum(dtype=np.float32) / out.sum(dtype=np.float32)
    return float(replacement), float(completeness)
