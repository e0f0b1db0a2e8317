"""Synthetic attribution graphs in the frontend JSON (circuit-tracer's ``create_graph_files`` format): a random DAG
of token, feature, error and logit nodes, and a large one pruned as circuit-tracer prunes (influence from the
logits, a node threshold, an edge-score threshold), for the viewer's tests."""

from __future__ import annotations

import numpy as np


def cantor(a: int, b: int) -> int:
    return (a + b) * (a + b + 1) // 2 + b


def token_node(token_id: int, p: int, influence: float) -> dict:
    return {"node_id": f"E_{token_id}_{p}", "feature": p, "layer": "E", "ctx_idx": p, "feature_type": "embedding",
            "token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0,
            "jsNodeId": f"E_{token_id}-{p}", "clerp": "", "influence": influence, "activation": None}


def feature_node(layer: int, p: int, f: int, activation: float, influence: float) -> dict:
    return {"node_id": f"{layer}_{f}_{p}", "feature": cantor(layer, f), "layer": str(layer), "ctx_idx": p,
            "feature_type": "cross layer transcoder", "token_prob": 0.0, "is_target_logit": False, "run_idx": 0,
            "reverse_ctx_idx": 0, "jsNodeId": f"{layer}_{f}-0", "clerp": "", "influence": influence,
            "activation": activation}


def error_node(layer: int, p: int, influence: float, node_id: str | None = None) -> dict:
    """circuit-tracer's id ``0_{layer}_{p}`` (which a layer-0 feature ``layer`` at ``p`` shares) unless ``node_id``."""
    return {"node_id": node_id or f"0_{layer}_{p}", "feature": -1, "layer": str(layer), "ctx_idx": p,
            "feature_type": "mlp reconstruction error", "token_prob": 0.0, "is_target_logit": False, "run_idx": 0,
            "reverse_ctx_idx": 0, "jsNodeId": f"{layer}_{p}-0", "clerp": "", "influence": influence,
            "activation": None}


def logit_node(layers: int, vocab_id: int, p: int, word: str, prob: float, target: bool) -> dict:
    return {"node_id": f"{layers + 1}_{vocab_id}_{p}", "feature": vocab_id, "layer": str(layers + 1), "ctx_idx": p,
            "feature_type": "logit", "token_prob": prob, "is_target_logit": target, "run_idx": 0,
            "reverse_ctx_idx": 0, "jsNodeId": f"L_{vocab_id}-{p}", "clerp": f'Output "{word}" (p={prob:.3f})',
            "influence": None, "activation": None}


def graph_json(prompt_tokens, nodes, links, slug="synthetic") -> dict:
    return {"metadata": {"slug": slug, "scan": "synthetic", "transcoder_list": [], "prompt_tokens": prompt_tokens,
                         "prompt": "".join(prompt_tokens), "node_threshold": 0.8, "schema_version": 1},
            "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
            "nodes": nodes, "links": links}


WORDS = ["The", " cat", " sat", " on", " the", " mat", " and", " the", " cat", " sat", " again", "."]


def random_dag(seed: int = 0, layers: int = 3, positions: int = 6, features: int = 14, errors: bool = True,
               error_id=None, edge_p: float = 0.35) -> dict:
    """A small random graph: every token, ``features`` random features, an error per (layer, position) when
    ``errors``, 3 logits at the last position; edges from a lower row to a higher one at the same or an earlier
    position, each kept with probability ``edge_p``, weights of both signs. ``error_id(layer, p)`` renames the
    error nodes (jstd's ids); circuit-tracer's by default."""
    rng = np.random.default_rng(seed)
    tokens = WORDS[:positions]
    nodes = [token_node(100 + p, p, float(rng.uniform(0.2, 1))) for p in range(positions)]
    seen = set()
    while len(seen) < features:
        seen.add((int(rng.integers(layers)), int(rng.integers(positions)), int(rng.integers(10, 60))))
    nodes += [feature_node(l, p, f, float(rng.uniform(0.1, 9)), float(rng.uniform(0, 1))) for l, p, f in sorted(seen)]
    if errors:
        nodes += [error_node(l, p, float(rng.uniform(0, 1)), error_id(l, p) if error_id else None)
                  for l in range(layers) for p in range(positions)]
    probs = [0.6, 0.25, 0.1]
    nodes += [logit_node(layers, 500 + k, positions - 1, w, pr, k == 0)
              for k, (w, pr) in enumerate(zip([" mat", " rug", ' "floor"</script>'], probs))]
    rank = lambda n: -1 if n["layer"] == "E" else int(n["layer"])
    links = []
    for t in nodes:
        for s in nodes:
            if rank(s) < rank(t) and s["ctx_idx"] <= t["ctx_idx"] and t["feature_type"] != "embedding" \
                    and s["feature_type"] != "logit" and rng.random() < edge_p:
                if t["feature_type"] == "mlp reconstruction error":
                    continue  # nothing writes into an error node
                links.append({"source": s["node_id"], "target": t["node_id"],
                              "weight": float(rng.choice([-1, 1]) * rng.lognormal(-1, 1))})
    return graph_json(tokens, nodes, links)


def pruned_large(seed: int = 0, nodes_before: int = 3000, keep: int = 200, layers: int = 16,
                 positions: int = 12, edge_share: float = 0.98, density: float = 0.1) -> tuple[dict, int]:
    """A graph of ``nodes_before`` nodes (tokens, errors per layer and position, logits, the rest features) with
    sparse random direct effects, pruned as circuit-tracer prunes: node influence I = sum_k w W^k from the logits'
    probabilities (W = |A| normalised by row), the ``keep`` most influential features and errors plus every token
    and logit, then the edges holding ``edge_share`` of the total score W'[t, s] I'[t] (circuit-tracer: 0.98). Returns (graph JSON, edges before)."""
    rng = np.random.default_rng(seed)
    n_logits = 5
    kinds, rows, where = [], [], []
    for p in range(positions):
        kinds.append(("E", p)), rows.append(-1), where.append(p)
    for l in range(layers):
        for p in range(positions):
            kinds.append(("err", l)), rows.append(l), where.append(p)
    n_features = nodes_before - len(kinds) - n_logits
    feats = rng.integers(0, [layers, positions, 16384], size=(n_features, 3))
    for l, p, f in feats:
        kinds.append(("F", int(f))), rows.append(int(l)), where.append(int(p))
    for k in range(n_logits):
        kinds.append(("L", 900 + k)), rows.append(layers + 1), where.append(positions - 1)
    n = len(kinds)
    rows, where = np.asarray(rows), np.asarray(where)
    is_err = np.array([k[0] == "err" for k in kinds])
    is_logit = np.array([k[0] == "L" for k in kinds])
    # sparse direct effects, as edge lists: target t, source s (a lower row, the same or an earlier position)
    t, s = rng.integers(0, n, (2, int(density * n * n)))
    ok = (rows[s] < rows[t]) & (where[s] <= where[t]) & ~is_err[t] & ~is_logit[s] & (rows[t] >= 0) & (s != t)
    t, s = np.unique(np.stack([t[ok], s[ok]]), axis=1)
    a = rng.normal(0, 1, len(t)) * rng.lognormal(-1, 1, len(t))
    probs = np.sort(rng.dirichlet(np.ones(n_logits)))[::-1]
    w = np.zeros(n)
    w[is_logit] = probs

    def influence_of(mask):       # sum_k w W^k, W = |A| normalised by row, over the edges in mask
        norm = np.abs(a) * mask / np.maximum(np.bincount(t, np.abs(a) * mask, n), 1e-10)[t]
        total, x = np.zeros(n), w.copy()
        for _ in range(layers + 2):
            x = np.bincount(s, x[t] * norm, n)
            total += x
        return total, norm

    influence, _ = influence_of(np.ones(len(t)))
    candidate = ~is_logit & (rows >= 0)
    kept = np.zeros(n, bool)
    kept[np.flatnonzero(candidate)[np.argsort(-influence[candidate])[:keep]]] = True
    kept |= is_logit | (rows < 0)
    I2, norm = influence_of(kept[t] & kept[s])
    score = norm * (I2 + w)[t]
    flat = np.sort(score[score > 0])[::-1]
    cut = flat[min(np.searchsorted(np.cumsum(flat) / flat.sum(), edge_share), len(flat) - 1)]
    order = np.argsort(-influence)
    cumulative = np.empty(n)
    cumulative[order] = np.cumsum(influence[order]) / max(influence.sum(), 1e-10)
    tokens = [f" w{p}" for p in range(positions)]
    ids, nodes = {}, []
    for i in np.flatnonzero(kept):
        kind, val = kinds[i]
        l, p = int(rows[i]), int(where[i])
        if kind == "E":
            node = token_node(100 + p, p, float(cumulative[i]))
        elif kind == "err":
            node = error_node(l, p, float(cumulative[i]))
        elif kind == "F":
            node = feature_node(l, p, val, float(rng.uniform(0.1, 9)), float(cumulative[i]))
        else:
            k = val - 900
            node = logit_node(layers, val, p, f" out{k}", float(probs[k]), k == 0)
        if node["node_id"] in ids.values():      # two random features drawn at one (layer, position, index)
            continue
        ids[i] = node["node_id"]
        nodes.append(node)
    links = [{"source": ids[j], "target": ids[i], "weight": float(v)}
             for i, j, v in zip(t[score >= cut], s[score >= cut], a[score >= cut]) if j in ids and i in ids]
    links.sort(key=lambda l: (l["target"], l["source"]))
    return graph_json(tokens, nodes, links, slug="pruned-3000"), len(t)
