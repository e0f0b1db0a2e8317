"""``jstd.attribute``: the attribution graph of a prompt through a transcoder set, as circuit-tracer 0.5.0
computes it (Ameisen et al. 2025), from jstd's own forward.

1. Tokens: a string is tokenized without special tokens; ids are used as given; with a tokenizer, a prompt whose
   first id is not a special token gets the first truthy id of ``[bos, pad, eos, *all_special_ids]`` prepended
   (circuit-tracer's rule: id 0 is never prepended). Position 0 (the BOS) has no feature or error nodes.
2. One forward reads the transcoders' inputs ``x_l`` and outputs ``y_l``; the active features are the nonzero
   activations at positions >= 1, ordered by (block, position, feature). Errors are
   ``y_l - (Σ active a · decoder + b_dec_l + skip_l(x_l))`` (zero at position 0).
3. Logit targets: by default the most probable next tokens (``softmax`` of the model's logits at the last position)
   up to ``max_n_logits``, the shortest prefix whose cumulative probability reaches ``desired_logit_prob``; each
   reads the demeaned unembedding ``W_U[:, v] - mean_u W_U[:, u]`` at the final norm's output.
4. Edges are direct effects in the local replacement model (``jstd.circuits.replacement``), computed for
   ``batch_size`` targets at a time by one compiled program (a ``vmap`` over one ``vjp``'s cotangents): logit rows
   first, then feature rows — every feature, or with ``max_feature_nodes`` the most influential ones, visited in
   circuit-tracer's order (after each ``update_interval · batch_size`` rows the features not yet visited are
   re-ranked by their influence on the logits through the rows computed so far).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jstd.circuits.graph import Graph
from jstd.circuits.replacement import direct_effects, prompt_values
from jstd.circuits.sharding import batch_for, place, place_sources, place_targets
from jstd.circuits.transcoders import Transcoders

ZERO_POSITIONS = 1  # the BOS position carries no feature or error node


def prompt_tokens(prompt, tokenizer=None, vocab_size: int | None = None) -> np.ndarray:
    """The ids circuit-tracer attributes for ``prompt`` (a string, or ids), the BOS rule applied with a
    tokenizer. ValueError for a string without a tokenizer, an empty prompt, or ids outside the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("attribute: a text prompt needs tokenizer= (jstd.load_processor(path)); or pass ids")
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    else:
        ids = [int(i) for i in np.asarray(prompt).reshape(-1)]
    if tokenizer is not None and (not ids or ids[0] not in tokenizer.all_special_ids):
        candidates = [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id,
                      *tokenizer.all_special_ids]
        bos = next(filter(None, candidates), None)
        if bos is None:
            raise ValueError("attribute: the tokenizer has no special token to begin the prompt with; pass ids that "
                             "begin with one")
        ids = [int(bos)] + ids
    if len(ids) < 2:
        raise ValueError(f"attribute: the prompt has {len(ids)} token(s); position 0 (the BOS) carries no features, "
                         "so a graph needs at least 2")
    if vocab_size is not None and not all(0 <= i < vocab_size for i in ids):
        raise ValueError(f"attribute: token ids {[i for i in ids if not 0 <= i < vocab_size]} are outside the "
                         f"vocabulary 0..{vocab_size - 1}")
    return np.asarray(ids, np.int64)


def demeaned_unembedding(model, ids) -> np.ndarray:
    """``[k, d]``: ``W_U[:, v] - mean_u W_U[:, u]`` for each ``v`` in ``ids``: the gradient of ``logit_v -
    mean(logits)`` (before any final soft-cap) with respect to the final norm's output."""
    _, linear = model.readout()
    d = model.config.hidden_size
    V = jax.eval_shape(linear, jax.ShapeDtypeStruct((d,), jnp.float32)).shape[-1]
    _, pull = jax.vjp(lambda h: linear(h).astype(jnp.float32), jnp.zeros((d,), jnp.float32))
    onehot = jax.nn.one_hot(jnp.asarray(ids), V, dtype=jnp.float32) - 1.0 / V
    return np.asarray(jax.vmap(lambda c: pull(c)[0])(onehot), np.float32)


def logit_targets(model, logits_last, targets, max_n_logits: int, desired_logit_prob: float, tokenizer=None,
                  vocab_size: int | None = None):
    """``(ids, probabilities, vectors, labels)`` of the logit targets (see ``attribute``). ``logits_last``: the
    model's logits at the last position (after any soft-cap)."""
    V = logits_last.shape[-1]
    vocab_size = vocab_size or V
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits_last, jnp.float32)))
    label = (lambda i: tokenizer.decode([int(i)])) if tokenizer is not None else (lambda i: str(int(i)))
    if targets is None:
        order = np.argsort(-probs, kind="stable")[:max_n_logits]
        top = probs[order]
        cutoff = int(np.searchsorted(np.cumsum(top, dtype=np.float32), np.float32(desired_logit_prob))) + 1
        ids = order[:cutoff]
    else:
        targets = list(targets) if not isinstance(targets, np.ndarray) else list(targets.reshape(-1))
        if not targets:
            raise ValueError("attribute: targets is empty; pass None for the salient logits")
        if all(isinstance(t, tuple) for t in targets):  # custom directions (label, weight, vector)
            d = model.config.hidden_size
            vecs = np.stack([np.asarray(t[2], np.float32).reshape(-1) for t in targets])
            if vecs.shape[1] != d:
                raise ValueError(f"attribute: custom target vectors are {vecs.shape[1]} wide; the final norm's output "
                                 f"is {d}")
            ids = np.arange(len(targets)) + vocab_size
            return (ids.astype(np.int64), np.asarray([t[1] for t in targets], np.float32), vecs,
                    [str(t[0]) for t in targets])
        if all(isinstance(t, str) for t in targets):
            if tokenizer is None:
                raise ValueError("attribute: token-string targets need tokenizer=")
            ids = []
            for t in targets:
                enc = tokenizer(t, add_special_tokens=False)["input_ids"]
                if len(enc) != 1:
                    raise ValueError(f"attribute: target {t!r} is {len(enc)} tokens ({enc}); a logit target is one "
                                     "token")
                ids.append(enc[0])
        else:
            ids = [int(t) for t in targets]
        bad = [i for i in ids if not 0 <= i < V]
        if bad:
            raise ValueError(f"attribute: target ids {bad} are outside the vocabulary 0..{V - 1}")
        ids = np.asarray(ids)
    return (ids.astype(np.int64), probs[ids].astype(np.float32), demeaned_unembedding(model, ids),
            [label(i) for i in ids])


def _check(model, tc: Transcoders):
    c = model.config
    if tc.num_layers != c.num_layers:
        raise ValueError(f"attribute: the transcoders cover {tc.num_layers} blocks; the model has {c.num_layers}")
    if tc.d_in != c.hidden_size or tc.d_out != c.hidden_size:
        raise ValueError(f"attribute: the transcoders read {tc.d_in} and write {tc.d_out} features wide; the model's "
                         f"stream is {c.hidden_size}")
    missing = [s for s in (tc.input_site, tc.output_site) if s not in model.sites]
    if missing:
        raise ValueError(f"attribute: this model does not serve {', '.join(missing)} (the transcoders' "
                         f"{tc.input_hook} / {tc.output_hook})")


def _bucket(k: int) -> int:
    return max(8, 1 << (max(k, 1) - 1).bit_length())


class _Sources:
    """The prompt's sources laid out per (block, position) for ``direct_effects``, and the gather that turns its
    per-slot results into feature columns."""

    def __init__(self, tc: Transcoders, acts: np.ndarray, min_slots: int = 1):
        L, n, _ = acts.shape
        layer, pos, feat = np.nonzero(acts)
        self.active = np.stack([layer, pos, feat], 1).astype(np.int64)
        self.values = acts[layer, pos, feat].astype(np.float32)
        vectors = tc.decoder_vectors(layer, feat) * self.values[:, None, None]  # [n_active, L, d]
        writes = np.arange(L)[None, :] >= layer[:, None] if tc.cross_layer else np.arange(L)[None, :] == layer[:, None]
        K, U = min_slots, None
        flat = np.full((len(layer), L), 0, np.int64)
        slot = np.zeros((len(layer), L), np.int64)
        for lo in range(L):  # each feature's slot among those writing at (lo, its position), in active order
            at = np.nonzero(writes[:, lo])[0]
            order = np.argsort(pos[at], kind="stable")
            first = np.searchsorted(pos[at][order], pos[at][order], side="left")
            slot[at[order], lo] = np.arange(len(at)) - first
            if len(at):
                K = max(K, int(slot[at, lo].max()) + 1)
        K = self.K = _bucket(K)
        U = np.zeros((L, n, K, tc.d_out), np.float32)
        flat[:] = L * n * K  # the zero column appended in ``columns``
        for lo in range(L):
            at = np.nonzero(writes[:, lo])[0]
            U[lo, pos[at], slot[at, lo]] = vectors[at, lo]
            flat[at, lo] = (lo * n + pos[at]) * K + slot[at, lo]
        self.U = U
        self.flat = flat

    def columns(self, c: np.ndarray) -> np.ndarray:
        """``[B, n_active]`` feature columns from ``direct_effects``' per-slot ``[B, L, n, K]``."""
        B = c.shape[0]
        padded = np.concatenate([c.reshape(B, -1), np.zeros((B, 1), c.dtype)], 1)
        return padded[:, self.flat].sum(-1)


def _influences(edge_rows: np.ndarray, logit_p: np.ndarray, row_nodes: np.ndarray, max_iter: int = 128):
    """circuit-tracer's ``compute_partial_influences``: influence of every node on the logits through the rows
    computed so far (power iteration on the row-normalised |rows|)."""
    W = np.abs(edge_rows).astype(np.float32)
    W /= np.maximum(W.sum(1, keepdims=True), np.float32(1e-8))
    influence = np.zeros(edge_rows.shape[1], np.float32)
    prod = np.zeros(edge_rows.shape[1], np.float32)
    prod[-len(logit_p):] = logit_p
    for _ in range(max_iter):
        prod = prod[row_nodes] @ W
        if not prod.any():
            return influence
        influence += prod
    raise RuntimeError("attribute: the influence ranking did not converge in 128 steps (the rows are not a DAG)")


def attribute(model, inputs, transcoders: Transcoders, *, targets=None, max_n_logits: int = 10,
              desired_logit_prob: float = 0.95, max_feature_nodes: int | None = None, batch_size: int = 256,
              update_interval: int = 4, tokenizer=None, mesh=None, layout=None) -> Graph | list[Graph]:
    """The attribution graph (``jstd.circuits.Graph``) of ``inputs`` through ``transcoders`` (module docstring).

    inputs: a prompt (a string with ``tokenizer=``, or token ids ``[n]``) or a list of prompts (a list of graphs
        back; the compiled programs are shared, so 16 prompts of one length compile once).
    targets: None (salient logits), token ids, token strings (one token each, with ``tokenizer=``), or custom
        directions ``[(label, weight, vector [d]), ...]`` (virtual ids ``vocab_size + i``; the vector read at the
        final norm's output as given).
    max_feature_nodes: keep at most this many feature nodes (the most influential, circuit-tracer's order).
    batch_size: targets per compiled backward (memory ``batch_size · L · n · d`` floats; results do not depend
        on it). tokenizer: for text, the BOS rule, target strings and labels (``jstd.load_processor``).
    mesh, layout: on a ``jax.sharding.Mesh`` (``jstd.sharding.mesh()``), the model and the transcoders placed
        under ``layout`` (a ``jstd.sharding.LAYOUTS`` name or a rule list; None: ``"FSDP"``) and each batch of
        targets split over ``data`` (``batch_size`` rounded up to a multiple of it): ``jstd.circuits.sharding``.
        The same graph. ValueError for a layout without a mesh or an unknown layout.

    Exact as circuit-tracer within float32 rounding (tests/test_circuits.py compares every entry). Raises
    ValueError for transcoders that do not fit the model, bad prompts or targets.
    """
    settings = dict(targets=targets, max_n_logits=max_n_logits, desired_logit_prob=desired_logit_prob,
                    max_feature_nodes=max_feature_nodes, batch_size=batch_size, update_interval=update_interval,
                    tokenizer=tokenizer, mesh=mesh)
    if mesh is not None:
        model, transcoders = place(model, transcoders, mesh, "FSDP" if layout is None else layout)
    elif layout is not None:
        raise ValueError("attribute: layout= places the model and transcoders on a mesh: pass mesh= too "
                         "(jstd.sharding.mesh())")
    several = isinstance(inputs, (list, tuple)) and inputs and not isinstance(inputs[0], (int, np.integer))
    if several or (isinstance(inputs, np.ndarray) and inputs.ndim == 2):
        # one slot count for every prompt, so prompts of one length share every compiled program
        slots = max(_Sources(transcoders, _activations(model, transcoders, prompt_tokens(
            p, tokenizer, model.config.vocab_size))).K for p in inputs)
        return [_attribute(model, p, transcoders, slots, **settings) for p in inputs]
    return _attribute(model, inputs, transcoders, 1, **settings)


def _activations(model, tc: Transcoders, ids: np.ndarray) -> np.ndarray:
    _check(model, tc)
    v = prompt_values(model, jnp.asarray(ids[None], jnp.int32), tc.input_site, tc.output_site)
    return np.asarray(tc.encode(v["x"][:, 0].astype(jnp.float32)).at[:, :ZERO_POSITIONS].set(0))


def _attribute(model, inputs, transcoders: Transcoders, min_slots: int, *, targets, max_n_logits, desired_logit_prob,
               max_feature_nodes, batch_size, update_interval, tokenizer, mesh=None) -> Graph:
    tc = transcoders
    _check(model, tc)
    if batch_size < 1 or update_interval < 1:
        raise ValueError(f"attribute: batch_size ({batch_size}) and update_interval ({update_interval}) must be >= 1")
    batch_size = batch_for(batch_size, mesh)
    vocab = tokenizer.vocab_size if tokenizer is not None else model.config.vocab_size
    ids = prompt_tokens(inputs, tokenizer, model.config.vocab_size)
    tokens = jnp.asarray(ids[None], jnp.int32)
    L, n = tc.num_layers, len(ids)
    v = prompt_values(model, tokens, tc.input_site, tc.output_site)
    x = v["x"][:, 0].astype(jnp.float32)
    acts = tc.encode(x).at[:, :ZERO_POSITIONS].set(0)
    errors = (v["y"][:, 0].astype(jnp.float32) - (tc.decode(acts) + tc.skip(x))).at[:, :ZERO_POSITIONS].set(0)
    acts = np.asarray(acts)
    src = _Sources(tc, acts, min_slots)
    n_active = len(src.values)
    token_vectors = v["embeddings"][0].astype(jnp.float32)
    t_ids, t_probs, t_vecs, t_labels = logit_targets(model, np.asarray(v["logits"][0, -1]), targets, max_n_logits,
                                                    desired_logit_prob, tokenizer, vocab)
    k = len(t_ids)
    enc = lambda layer, feature: np.asarray(tc.W_enc[layer, feature], np.float32)  # rows alone to the host
    U, E, token_vectors = place_sources(mesh, src.U, errors, token_vectors)

    # Programs that skip what a batch cannot reach, once enough rows share them (small graphs use one program):
    # a batch of features read before block D runs only the first D blocks (circuit-tracer, too, backpropagates
    # from the deepest layer in a batch), and one whose targets lie at positions < P only the first P positions
    # (a causal model: nothing later reaches them; P rounded up to a quarter of the prompt, so at most 4 lengths).
    by_depth = n_active > 4 * batch_size
    lengths = sorted({-(-n * i // 4) for i in range(1, 5)}) if by_depth and n >= 16 else [n]
    cut = {P: (tokens[:, :P], U[:, :P], E[:, :P], token_vectors[:P]) for P in lengths}

    def rows(layers, positions, vectors):
        """The source columns ``[m, n_active + L·n + n]`` of targets, ``batch_size`` at a time."""
        out = []
        for s in range(0, len(layers), batch_size):
            m = min(batch_size, len(layers) - s)
            depth = min(int(layers[s:s + m].max()) + 1, L) if by_depth else L
            P = next(P for P in lengths if P > int(positions[s:s + m].max()))
            pad = lambda a: np.concatenate([a[s:s + m], np.zeros((batch_size - m,) + a.shape[1:], a.dtype)])
            toks, U_P, E_P, T_P = cut[P]
            c, ce, ct = direct_effects(model, toks, tc, *place_targets(
                mesh, pad(layers).astype(np.int32), pad(positions).astype(np.int32), pad(vectors)), U_P, E_P, T_P,
                depth=depth)
            c, ce, ct = np.asarray(c)[:m], np.asarray(ce)[:m], np.asarray(ct)[:m]
            D = c.shape[1]
            full = np.zeros((m, L, n) + c.shape[3:], c.dtype)
            full[:, :D, :P] = c
            errs = np.zeros((m, L, n), ce.dtype)
            errs[:, :D, :P] = ce
            toks_cols = np.zeros((m, n), ct.dtype)
            toks_cols[:, :P] = ct
            out.append(np.concatenate([src.columns(full), errs.reshape(m, L * n), toks_cols], 1))
        return np.concatenate(out) if out else np.zeros((0, n_active + (L + 1) * n), np.float32)

    n_sources = n_active + (L + 1) * n
    total = n_sources + k
    keep = n_active if max_feature_nodes is None else max(0, min(int(max_feature_nodes), n_active))
    edge = np.zeros((keep + k, total), np.float32)
    row_nodes = np.zeros(keep + k, np.int64)
    edge[:k, :n_sources] = rows(np.full(k, L), np.full(k, n - 1), t_vecs.astype(np.float32))
    row_nodes[:k] = np.arange(k) + n_sources
    visited = np.zeros(n_active, bool)
    st, n_visited = k, 0
    f_layer, f_pos, f_feat = src.active.T
    while n_visited < keep:
        if keep == n_active:
            pending = np.arange(n_active)
        else:
            influence = _influences(edge[:st], t_probs, row_nodes[:st])
            rank = np.argsort(-influence[:n_active], kind="stable")
            pending = rank[~visited[rank]][:min(update_interval * batch_size, keep - n_visited)]
        got = rows(f_layer[pending], f_pos[pending], enc(f_layer[pending], f_feat[pending]))
        edge[st:st + len(pending), :n_sources] = got
        row_nodes[st:st + len(pending)] = pending
        visited[pending] = True
        st += len(pending)
        n_visited += len(pending)
    selected = np.nonzero(visited)[0]
    if keep < n_active:
        edge = edge[:, np.concatenate([selected, np.arange(n_active, total)])]
    edge = edge[np.argsort(row_nodes, kind="stable")]
    N = edge.shape[1]
    A = np.zeros((N, N), np.float32)
    A[:keep] = edge[:keep]
    A[N - k:] = edge[keep:]
    strings = None if tokenizer is None else [tokenizer.decode([int(t)]) for t in ids]
    return Graph(A, src.active, src.values, selected.astype(np.int64), ids, t_ids, t_probs, t_vecs, L, int(vocab),
                 t_labels, tc.scan, None if tokenizer is None else tokenizer.decode([int(t) for t in ids]), strings)
