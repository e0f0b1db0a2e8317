"""The strongest path of an attribution graph: from an input (a token, or any node) to a logit target, the path whose
edges carry the largest product of shares.

An edge's share is the part of its target's absolute input it carries: ``W[t, s] = |A[t, s]| / Σ_s' |A[t, s']|``
(circuit-tracer's normalisation, the one its influence and pruning use: ``jstd.circuits.prune.normalized``). A
path's strength is the product of its edges' shares, so a path of one strong edge beats one of two edges each half
as strong. The graph is a DAG whose edges go up the layers (tokens, then blocks 0..L-1, then the logits), so the
best path to a target is found exactly by one pass over the layers from the top (dynamic programming), not by
search.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jstd.circuits.graph import Graph
from jstd.circuits.prune import Pruned, normalized


class GraphPath(NamedTuple):
    """``nodes``: graph node indices from the source to the target; ``weights``: the adjacency entry of each edge
    (``A[nodes[i + 1], nodes[i]]``, signed); ``shares``: each edge's share of its target's absolute input;
    ``strength``: their product."""

    nodes: list[int]
    weights: list[float]
    shares: list[float]
    strength: float


def node_layers(graph: Graph) -> np.ndarray:
    """``[N]`` each node's rank in the DAG's order: tokens -1, a feature or an error its block, logits ``L``."""
    rank = np.empty(graph.n_nodes, np.int64)
    rank[:graph.n_features] = graph.active_features[graph.selected_features][:, 0]
    rank[graph.error_start:graph.token_start] = np.repeat(np.arange(graph.num_layers), graph.n_pos)
    rank[graph.token_start:graph.logit_start] = -1
    rank[graph.logit_start:] = graph.num_layers
    return rank


def top_path(graph: Graph, pruned: Pruned | None = None, *, target: int = 0, sources: str = "tokens") -> GraphPath:
    """The strongest path (module docstring) into logit target ``target`` (0: the most probable; an index into
    ``graph.logit_token_ids``) from a token node (``sources="tokens"``) or from any node (``"any"``). With
    ``pruned`` (``jstd.circuits.prune(graph)``), only the pruned graph's nodes and edges count (shares are still of
    the full graph's inputs, so the pruned graph does not inflate them).

    Raises ValueError for a target outside the logit targets, an unknown ``sources``, or a target no source
    reaches (a pruned graph that dropped every path)."""
    if not 0 <= target < graph.n_logits:
        raise ValueError(f"top_path: target {target} is not a logit target (0..{graph.n_logits - 1})")
    if sources not in ("tokens", "any"):
        raise ValueError(f"top_path: sources is 'tokens' or 'any', got {sources!r}")
    W = normalized(graph.adjacency)
    if pruned is not None:
        W = np.where(pruned.edge_mask & pruned.node_mask[:, None] & pruned.node_mask[None, :], W, np.float32(0))
    rank = node_layers(graph)
    t = graph.logit_start + target
    best = np.zeros(graph.n_nodes, np.float64)
    best[t] = 1.0
    step = np.full(graph.n_nodes, -1, np.int64)  # the next node on each node's best path
    for layer in range(graph.num_layers - 1, -2, -1):
        here = np.nonzero(rank == layer)[0]
        above = np.nonzero((rank > layer) & (best > 0))[0]
        if not len(here) or not len(above):
            continue
        through = best[above, None] * W[np.ix_(above, here)]  # [above, here]
        pick = through.argmax(0)
        best[here] = through[pick, np.arange(len(here))]
        step[here] = np.where(best[here] > 0, above[pick], -1)
    pool = np.arange(graph.token_start, graph.logit_start) if sources == "tokens" else np.nonzero(rank < rank[t])[0]
    start = int(pool[np.argmax(best[pool])])
    if best[start] <= 0:
        raise ValueError(f"top_path: no path reaches logit target {target} from {sources} nodes"
                         + (" in the pruned graph" if pruned is not None else ""))
    nodes = [start]
    while nodes[-1] != t:
        nodes.append(int(step[nodes[-1]]))
    A, Wf = graph.adjacency, normalized(graph.adjacency)
    edges = list(zip(nodes[:-1], nodes[1:]))
    return GraphPath(nodes, [float(A[b, a]) for a, b in edges], [float(Wf[b, a]) for a, b in edges], float(best[start]))
