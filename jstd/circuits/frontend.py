"""The JSON that circuit-tracer's local graph server and Neuronpedia read (circuit-tracer 0.5.0's
``create_graph_files``): ``{metadata, qParams, nodes, links}`` of the pruned graph, and ``graph-metadata.json``.

Node ids are circuit-tracer's — feature ``{layer}_{feature}_{pos}``, token ``E_{id}_{pos}`` (an image token's
too: its clerp and the metadata's ``prompt_tokens`` entry say ``img{i} patch{j}``, and its node carries ``image``
and ``patch``), logit
``{L+1}_{id}_{n-1}`` — except errors: circuit-tracer names error ``(l, p)`` ``0_{l}_{p}``, which is also the id of
feature ``l`` of block 0 at position ``p`` (both can be in one graph, and the links then cannot tell them apart).
jstd names errors ``{l}_error_{p}`` (never a feature's id: feature ids are numbers); ``circuit_tracer_ids=True``
writes circuit-tracer's ids, collisions included. Every other field is as circuit-tracer writes it. A graph with
QK attributions or head loadings (``Graph.qk``, ``jstd.circuits.qk_graph``) adds them as extra data
(``jstd.circuits.qk.graph_json_extras``: a top-level ``qk``, ``qk`` on nodes, ``head_loadings`` on links), which
circuit-tracer's frontend ignores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from jstd.circuits.graph import Graph
from jstd.circuits.prune import prune
from jstd.circuits.qk import graph_json_extras
from jstd.io.staging import atomic


def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def _node(node_id, feature, layer, pos, kind, js, influence=None, activation=None, token_prob=0.0, target=False,
          clerp=""):
    return {"node_id": node_id, "feature": feature, "layer": layer, "ctx_idx": pos, "feature_type": kind,
            "token_prob": token_prob, "is_target_logit": target, "run_idx": 0, "reverse_ctx_idx": 0, "jsNodeId": js,
            "clerp": clerp, "influence": influence, "activation": activation}


def frontend_json(graph: Graph, slug: str, *, node_threshold: float = 0.8, edge_threshold: float = 0.98,
                  scan: str | None = None, circuit_tracer_ids: bool = False) -> dict:
    """The ``<slug>.json`` dict of ``graph`` pruned at the thresholds (``jstd.circuits.prune``). ``scan``: the
    transcoder set's identifier (default ``graph.scan``; required by the frontend)."""
    scan = scan or graph.scan
    if scan is None:
        raise ValueError("frontend_json: the graph has no scan (the transcoder set's identifier); pass scan=")
    if graph.prompt_tokens is None or graph.input_string is None:
        raise ValueError("frontend_json: the graph has no token strings; attribute with tokenizer=")
    node_mask, edge_mask, cumulative = prune(graph, node_threshold, edge_threshold)
    L, n = graph.num_layers, graph.n_pos
    nodes = {}
    for i in np.nonzero(node_mask)[0]:
        kind, *rest = graph.node(i)
        influence = float(cumulative[i])
        if kind == "feature":
            l, p, f = rest
            a = float(graph.activation_values[graph.selected_features[i]])
            nodes[i] = _node(f"{l}_{f}_{p}", _cantor(l, f), str(l), p, "cross layer transcoder", f"{l}_{f}-0",
                             influence, a)
        elif kind == "error":
            l, p = rest
            node_id = f"0_{l}_{p}" if circuit_tracer_ids else f"{l}_error_{p}"
            nodes[i] = _node(node_id, -1, str(l), p, "mlp reconstruction error", f"{l}_{p}-0", influence)
        elif kind == "token":
            p, t = rest
            nodes[i] = _node(f"E_{t}_{p}", p, "E", p, "embedding", f"E_{t}-{p}", influence)
            if graph.image_patch(i) is not None:  # an image node: labelled, its image and patch as extra data
                image, patch = graph.image_patch(i)
                nodes[i].update(clerp=graph.input_label(p), image=image, patch=patch)
        else:
            k, v = rest
            prob = float(graph.logit_probabilities[k])
            nodes[i] = _node(f"{L + 1}_{v}_{n - 1}", v, str(L + 1), n - 1, "logit", f"L_{v}-{n - 1}",
                             token_prob=prob, target=k == 0, clerp=f'Output "{graph.logit_strings[k]}" (p={prob:.3f})')
    dsts, srcs = edge_mask.nonzero()  # a dense or a scipy.sparse mask (a SparseAdjacency's graph)
    weights = np.asarray(graph.adjacency[dsts, srcs], np.float32).reshape(-1)
    links = [{"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": float(a)}
             for s, t, a in zip(srcs, dsts, weights) if s in nodes and t in nodes]
    connected = {e["source"] for e in links} | {e["target"] for e in links}
    used = [v for v in nodes.values() if v["node_id"] in connected or v["feature_type"] in ("embedding", "logit")]
    tokens = [graph.input_label(p) for p in range(n)]  # the token strings; "img{i} patch{j}" at image tokens
    metadata = {"slug": slug, "scan": scan, "transcoder_list": [], "prompt_tokens": tokens,
                "prompt": graph.input_string, "node_threshold": node_threshold, "schema_version": 1}
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    data = {"metadata": metadata, "qParams": qparams, "nodes": used, "links": links}
    if graph.qk is not None:  # QK attributions and head loadings (jstd.circuits.qk_graph) as extra data
        graph_json_extras(data, graph, graph.qk.attributions, graph.qk.loadings)
    return data


def write_frontend(graph: Graph, slug: str, folder: str | os.PathLike, **kwargs) -> Path:
    """Write ``folder/<slug>.json`` (``frontend_json``) and add its metadata to ``folder/graph-metadata.json``
    (``{"graphs": [...]}``, one entry per slug), as circuit-tracer's ``create_graph_files``. Returns the JSON's
    path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = frontend_json(graph, slug, **kwargs)
    path = folder / f"{slug}.json"
    with atomic(path, "w") as fh:
        json.dump(data, fh)
    index = folder / "graph-metadata.json"
    graphs = json.loads(index.read_text()).get("graphs", []) if index.exists() else []
    graphs = [g for g in graphs if g.get("slug") != slug] + [data["metadata"]]
    with atomic(index, "w") as fh:
        json.dump({"graphs": graphs}, fh, indent=2)
    return path
