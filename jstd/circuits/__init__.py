"""Attribution graphs (circuit tracing, Ameisen et al. 2025) as circuit-tracer 0.5.0 computes them: transcoder sets
(``Transcoders``: per-layer and cross-layer, circuit-tracer's files and SAELens transcoders), ``attribute`` (the
graph of a prompt in the local replacement model), ``prune`` and ``graph_scores``, the frontend JSON, and
interventions on feature nodes; the strongest path (``top_path``), a figure (``plot_graph``) and the
browser page (``view``, also ``jstd.view``) of a graph."""

from jstd.circuits.attribute import attribute, prompt_tokens
from jstd.circuits.files import find_transcoders, from_saes, load_transcoders, save_transcoders
from jstd.circuits.frontend import frontend_json, write_frontend
from jstd.circuits.graph import Graph, SparseAdjacency
from jstd.circuits.interventions import frozen_effect, intervene
from jstd.circuits.paths import GraphPath, top_path
from jstd.circuits.prune import Pruned, graph_scores, prune
from jstd.circuits.qk import QK, QKGraph, graph_json_extras, head_loadings, qk_attribution, qk_graph
from jstd.circuits.sweep import EdgeTable, aggregate_edges, node_keys
from jstd.circuits.train import TrainedCLT, train_clt
from jstd.circuits.transcoders import Transcoders
from jstd.circuits.display import plot_graph, view

__all__ = ["Transcoders", "load_transcoders", "save_transcoders", "find_transcoders", "from_saes", "attribute",
           "prompt_tokens", "Graph", "SparseAdjacency", "prune", "Pruned", "graph_scores", "frontend_json",
           "write_frontend", "intervene", "frozen_effect", "train_clt", "TrainedCLT", "qk_attribution", "QK", "head_loadings",
           "qk_graph", "QKGraph", "graph_json_extras", "aggregate_edges", "EdgeTable", "node_keys", "top_path", "GraphPath",
           "view", "plot_graph"]
