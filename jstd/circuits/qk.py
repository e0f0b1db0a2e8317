"""Attention explained in the local replacement model: QK attributions and head loadings (after Kamath et al.
2025, "Tracing Attention Computation Through Feature Interactions").

In the local replacement model (``jstd.circuits.replacement``: norms' ``1 / rms`` and attention patterns held,
each MLP's output a sum of sources) the residual stream, and so each head's query and key, is *linear* in the
graph's sources: feature outputs ``a · W_dec``, error vectors, token embeddings, and constants (each block's
``b_dec``, the BOS position's MLP output, attention biases). Rotary embedding is a fixed linear map at the prompt's
positions and a held q/k norm a fixed diagonal, so ``q = Σ_s q_s + q_bias`` and ``k = Σ_t k_t + k_bias`` exactly,
``q_s`` the query source ``s`` alone produces along those linear paths. The attention score (before any soft-cap
and the mask) is then the bilinear sum

    score = scale · q · k = Σ_{s, t} scale · q_s · k_t

``qk_attribution`` returns every term: ``terms[s, t]`` with sources in the graph's node order (features, errors,
tokens) and one more, the bias (everything constant: ``q - Σ_s q_s``). Its entries sum to the score the model
computes (tested to 1e-5 relative against the forward's own score).

``head_loadings``: an edge ``A[t, s]`` of the graph is a sum over linear paths from source ``s`` to target ``t``; a
path crosses each block's attention at most through one head, so the part of the edge carried by head ``h`` of
block ``l`` is exactly ``⟨∂⟨v_t, x_t⟩/∂o_{l,h}, ∂o_{l,h}/∂s · u_s⟩`` (``o_{l,h}`` the head's output at every
position; one backward from the target, one forward from the source). For each block, the heads' loadings plus
the paths that skip that block's attention sum to the edge; an edge between positions ``p_s ≠ p_t`` has no path
that skips every attention.

``qk_graph`` computes both for the heads and edges asked for and attaches them to the graph (``Graph.qk``, a
``QKGraph``: saved and loaded with it); ``frontend_json`` then adds them to the JSON as extra data
(``graph_json_extras``): a top-level ``qk`` list, each node's part of each score (``qk`` on nodes) and each
link's ``head_loadings``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jstd.circuits.attribute import ZERO_POSITIONS
from jstd.circuits.graph import Graph
from jstd.circuits.qk_data import QK, QKGraph
from jstd.circuits.replacement import SkipOnly, prompt_values
from jstd.circuits.transcoders import Transcoders
from jstd.core.edits import Add
from jstd.nn.attention import Attention
from jstd.nn.frozen import frozen
from jstd.run import run
from jstd.sae.splice import Source

QUERIES, KEYS = "layers.self_attn.attention_queries", "layers.self_attn.attention_keys"
HEADS = "layers.self_attn.attention_head_outputs"


def _attention(model) -> Attention:
    found = [m for m in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, Attention)) if isinstance(m, Attention)]
    if not found:
        raise ValueError("qk_attribution: this model has no softmax attention (jstd.nn.Attention)")
    return found[0]


def _sources(model, graph: Graph, tc: Transcoders):
    """The graph's source vectors at their places: ``(U [L, n, S, d] sparse as (layer, pos, index, vector) lists,
    embeddings [n, d], token count)``; features and errors write at ``y``, tokens at the embeddings."""
    tokens = jnp.asarray(np.asarray(graph.input_tokens)[None], jnp.int32)
    v = prompt_values(model, tokens, tc.input_site, tc.output_site)
    x = v["x"][:, 0].astype(jnp.float32)
    acts = tc.encode(x).at[:, :ZERO_POSITIONS].set(0)
    errors = np.asarray((v["y"][:, 0].astype(jnp.float32) - (tc.decode(acts) + tc.skip(x))).at[:, :ZERO_POSITIONS]
                        .set(0))
    chosen = np.asarray(graph.active_features)[np.asarray(graph.selected_features)]
    values = np.asarray(graph.activation_values)[np.asarray(graph.selected_features)]
    decoders = tc.decoder_vectors(chosen[:, 0], chosen[:, 2]) * values[:, None, None]  # [n_f, L, d]
    return tokens, chosen, decoders, errors, np.asarray(v["embeddings"][0], np.float32)


def _replacement(model, tokens, tc: Transcoders, reads, heads_delta: bool = False):
    """``f(δ_y, ε[, δ_heads]) -> reads``: the local replacement model (as ``replacement.linearised``) reading
    ``reads``, with perturbations at the MLP outputs, the embeddings and (optionally) every head's output."""
    model = frozen(model)
    x_site, y_site = tc.input_site, tc.output_site

    def f(deltas):
        edits = [Source(x_site, y_site), SkipOnly(y_site, tc.W_skip, deltas[0]), Add("token_embeddings", deltas[1])]
        if heads_delta:
            edits.append(Add(HEADS, deltas[2]))
        out = run(model, tokens, edits, reads=reads)
        return tuple(out[r] for r in reads)

    return f


def _contract(graph: Graph, chosen, decoders, errors, embeddings, g_y, g_e):
    """``[m, S]``: ⟨g, source⟩ for every graph source, from gradients ``g_y [m, L, n, d]``, ``g_e [m, n, d]``."""
    g_y, g_e = np.asarray(g_y, np.float64), np.asarray(g_e, np.float64)
    feats = np.einsum("mfld,fld->mf", g_y[:, :, chosen[:, 1]].transpose(0, 2, 1, 3), decoders.astype(np.float64))
    errs = np.einsum("mlpd,lpd->mlp", g_y, errors.astype(np.float64)).reshape(len(g_y), -1)
    toks = np.einsum("mpd,pd->mp", g_e, embeddings.astype(np.float64))
    return np.concatenate([feats, errs, toks], 1)


def qk_attribution(model, graph: Graph, transcoders: Transcoders, *, layer: int, head: int, query_pos: int,
                   key_pos: int) -> QK:
    """The QK attribution (module docstring) of head ``head`` of block ``layer`` at (``query_pos``, ``key_pos``)
    of the prompt of ``graph`` (``jstd.attribute(model, prompt, transcoders)``).

    Raises ValueError for a block, head or positions outside the model and prompt, a key after the query, or a
    model whose attention soft-caps its scores (a capped score is not bilinear in the sources)."""
    tc = transcoders
    attn = _attention(model)
    c = model.config
    n = len(graph.input_tokens)
    H = attn.q.shape[-2]
    if not 0 <= layer < c.num_layers or not 0 <= head < H:
        raise ValueError(f"qk_attribution: block {layer}, head {head} is outside the model's {c.num_layers} blocks "
                         f"of {H} heads")
    if not 0 <= key_pos <= query_pos < n:
        raise ValueError(f"qk_attribution: positions (query {query_pos}, key {key_pos}) must satisfy 0 <= key <= "
                         f"query < {n} (the prompt's length; attention is causal)")
    if attn.softcap is not None:
        raise ValueError("qk_attribution: this model soft-caps its attention scores (tanh), which is not bilinear; "
                         "the decomposition covers scale · q · k before the cap only")
    tokens, chosen, decoders, errors, embeddings = _sources(model, graph, tc)
    L, d = tc.num_layers, tc.d_out
    f = _replacement(model, tokens, tc, (QUERIES, KEYS))
    zeros = (jnp.zeros((L, 1, n, d), jnp.float32), jnp.zeros((1, n, d), jnp.float32))
    (q_all, k_all), pull = jax.vjp(f, zeros)
    kv = k_all.shape[2]
    kv_head = head // (H // kv)
    q = np.asarray(q_all[layer, 0, head, query_pos], np.float64)
    k = np.asarray(k_all[layer, 0, kv_head, key_pos], np.float64)
    dh = q.shape[-1]
    eye = jnp.eye(dh, dtype=jnp.float32)
    ct_q = jnp.zeros((2 * dh,) + q_all.shape, q_all.dtype).at[:dh, layer, 0, head, query_pos].set(eye)
    ct_k = jnp.zeros((2 * dh,) + k_all.shape, k_all.dtype).at[dh:, layer, 0, kv_head, key_pos].set(eye)
    (g_y, g_e), = jax.jit(jax.vmap(pull))((ct_q, ct_k))
    per = _contract(graph, chosen, decoders, errors, embeddings, g_y[:, :, 0], g_e[:, 0])  # [2 dh, S]
    Q, K = per[:dh].T, per[dh:].T  # [S, dh]
    Q = np.concatenate([Q, (q - Q.sum(0))[None]])
    K = np.concatenate([K, (k - K.sum(0))[None]])
    scale = float(attn.scale)
    terms = scale * Q @ K.T
    return QK(layer, head, query_pos, key_pos, terms, Q, K, float(scale * q @ k), scale)


def head_loadings(model, graph: Graph, transcoders: Transcoders, target: int, source: int) -> np.ndarray:
    """``[L, heads]``: the part of edge ``graph.adjacency[target, source]`` carried by each head (module
    docstring): ``target`` a feature node, ``source`` a feature, error or token node (graph indices). For each block
    ``l``, ``loadings[l].sum()`` plus the paths that skip block ``l``'s attention is the edge. ValueError for other
    nodes."""
    tc = transcoders
    n_f, n = graph.n_features, len(graph.input_tokens)
    if not 0 <= target < n_f:
        raise ValueError(f"head_loadings: target {target} is not a feature node (0..{n_f - 1}); edges into features "
                         "are the ones attention can carry")
    if not 0 <= source < graph.logit_start:
        raise ValueError(f"head_loadings: source {source} is not a feature, error or token node "
                         f"(0..{graph.logit_start - 1})")
    tokens, chosen, decoders, errors, embeddings = _sources(model, graph, tc)
    L, d = tc.num_layers, tc.d_out
    probe = run(model, tokens, reads=(HEADS,))[HEADS]  # [L, 1, n, H, dh]
    f = _replacement(model, tokens, tc, (tc.input_site, HEADS), heads_delta=True)
    zeros = (jnp.zeros((L, 1, n, d), jnp.float32), jnp.zeros((1, n, d), jnp.float32), jnp.zeros(probe.shape, jnp.float32))
    # the source's tangent
    d_y, d_e = np.zeros((L, 1, n, d), np.float32), np.zeros((1, n, d), np.float32)
    if source < n_f:
        d_y[:, 0, chosen[source, 1]] = decoders[source]
    elif source < graph.token_start:
        l, p = divmod(source - graph.error_start, n)
        d_y[l, 0, p] = errors[l, p]
    else:
        p = source - graph.token_start
        d_e[0, p] = embeddings[p]
    _, (_, t_heads) = jax.jvp(f, (zeros,), ((jnp.asarray(d_y), jnp.asarray(d_e), zeros[2]),))
    # the target's gradient at every head's output
    lt, pt, ft = chosen[target]
    (x, heads_out), pull = jax.vjp(f, zeros)
    ct_x = jnp.zeros(x.shape, x.dtype).at[lt, 0, pt].set(jnp.asarray(tc.W_enc[lt, ft], x.dtype))
    (_, _, g_heads), = pull((ct_x, jnp.zeros_like(heads_out)))
    return np.einsum("lpht,lpht->lh", np.asarray(g_heads[:, 0], np.float64), np.asarray(t_heads[:, 0], np.float64)
                     ).astype(np.float32)


def qk_graph(model, graph: Graph, transcoders: Transcoders, *, heads: Sequence[tuple[int, int, int, int]] = (),
             loadings: Sequence[tuple[int, int]] = ()) -> Graph:
    """``graph`` with ``qk`` set (a copy; the graph's arrays shared): the QK attribution (``qk_attribution``) of
    each ``(layer, head, query_pos, key_pos)`` in ``heads`` and the head loadings (``head_loadings``) of each
    ``(target, source)`` edge (graph node indices) in ``loadings``, added to what ``graph.qk`` already holds (a
    request asked again is computed again and replaces the old). The graph's own fields are unchanged. Raises
    ValueError as ``qk_attribution`` and ``head_loadings`` do."""
    old = graph.qk or QKGraph()
    asked = [tuple(int(v) for v in h) for h in heads]
    for h in asked:
        if len(h) != 4:
            raise ValueError(f"qk_graph: heads are (layer, head, query_pos, key_pos); got {h}")
    new = [qk_attribution(model, graph, transcoders, layer=l, head=h, query_pos=q, key_pos=k) for l, h, q, k in asked]
    kept = [a for a in old.attributions if (a.layer, a.head, a.query_pos, a.key_pos) not in set(asked)]
    loads = dict(old.loadings)
    for t, s in loadings:
        loads[int(t), int(s)] = head_loadings(model, graph, transcoders, int(t), int(s))
    return dataclasses.replace(graph, qk=QKGraph(kept + new, loads))


def graph_json_extras(data: dict, graph: Graph, qk: list[QK] = (), loadings: dict | None = None, top: int = 20
                      ) -> dict:
    """``data`` (``jstd.circuits.frontend_json``'s dict) with QK attributions and head loadings added as extra
    data: ``data["qk"]`` one entry per ``QK`` (``layer, head, query_pos, key_pos, score``, its ``top`` terms as
    ``{"query": node_id, "key": node_id, "value"}`` with ``"bias"`` for the bias, and the bias's totals
    ``{"query", "key"}``); each node of ``data`` that is a source of a ``QK`` gets ``"qk"``: ``[{"qk": index into
    data["qk"], "query": its row's sum, "key": its column's sum}]`` (its part of the score through the query and
    the key; the parts of every source and the bias sum, each side, to the score); and, for each ``(target, source)``
    of ``loadings`` (graph indices -> ``[L, heads]``), the matching link gets ``"head_loadings"`` (a list per block).
    Node ids are the JSON's own. Returns ``data`` (changed in place)."""
    errors = {(n["layer"], n["ctx_idx"]): n["node_id"] for n in data["nodes"]
              if n["feature_type"] == "mlp reconstruction error"}
    names = [_node_id(graph, i, errors) for i in range(graph.logit_start)] + ["bias"]
    data["qk"] = [{"layer": a.layer, "head": a.head, "query_pos": a.query_pos, "key_pos": a.key_pos,
                   "score": a.score, "terms": [{"query": names[s], "key": names[t], "value": v}
                                               for s, t, v in a.top(top)],
                   "bias": {"query": float(a.query_totals[-1]), "key": float(a.key_totals[-1])}} for a in qk]
    index = {name: i for i, name in enumerate(names[:-1])}
    for node in data["nodes"]:
        i = index.get(node["node_id"])
        if i is None:
            continue
        parts = [{"qk": j, "query": float(a.query_totals[i]), "key": float(a.key_totals[i])} for j, a in enumerate(qk)
                 if a.query_totals[i] != 0 or a.key_totals[i] != 0]
        if parts:
            node["qk"] = parts
    if loadings:
        by_pair = {(_node_id(graph, t, errors), _node_id(graph, s, errors)): np.asarray(v).tolist()
                   for (t, s), v in loadings.items()}
        for link in data["links"]:
            got = by_pair.get((link["target"], link["source"]))
            if got is not None:
                link["head_loadings"] = got
    return data


def _node_id(graph: Graph, i: int, errors: dict) -> str:
    """The frontend JSON's node id of graph node ``i``: features ``{l}_{f}_{p}``, tokens ``E_{id}_{p}``, errors as
    the JSON names them (``errors``: (layer, position) -> id; ``{l}_error_{p}``, jstd's default, when absent)."""
    kind, *rest = graph.node(i)
    if kind == "feature":
        l, p, f = rest
        return f"{l}_{f}_{p}"
    if kind == "error":
        l, p = rest
        return errors.get((str(l), p), f"{l}_error_{p}")
    if kind == "token":
        p, t = rest
        return f"E_{t}_{p}"
    k, v = rest
    return f"{graph.num_layers + 1}_{v}_{graph.n_pos - 1}"
