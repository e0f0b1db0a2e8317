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
   ``batch_size`` targets at a time by one compiled program (a ``vmap`` over one ``vjp``'s cotangents) and
   contracted with the sources by a second one on the device (``source_columns``): logit rows first, then feature
   rows — every feature, or with ``max_feature_nodes`` the most influential ones, visited in
   circuit-tracer's order (after each ``update_interval · batch_size`` rows the features not yet visited are
   re-ranked by their influence on the logits through the rows computed so far).
5. Several prompts in one call are padded on the right to one length and share every compiled program; each
   graph is its prompt's own. ``edges_per_row`` keeps each row's largest edges (``SparseAdjacency``).
"""

from __future__ import annotations

import collections
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jstd.circuits.graph import Graph, SparseAdjacency
from jstd.circuits.inputs import cuttable, has_images, image_prompt, with_features
from jstd.circuits.replacement import prompt_values, source_columns, target_gradients
from jstd.circuits.sharding import Sources, batch_for, place, place_sources, place_targets
from jstd.circuits.transcoders import Transcoders

ZERO_POSITIONS = 1  # the BOS position carries no feature or error node
IN_FLIGHT = 3  # batches dispatched ahead of the one being read back
LENGTHS = 6  # a long prompt's batches run the first P positions, P rounded up to a sixth of the prompt


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
    return np.asarray(_demeaned_unembedding(model, jnp.asarray(np.asarray(ids), jnp.int32)), np.float32)


@jax.jit
def _demeaned_unembedding(model, ids):
    """``demeaned_unembedding`` compiled (one program per target count, not a new trace every call)."""
    _, linear = model.readout()
    d = model.config.hidden_size
    V = jax.eval_shape(linear, jax.ShapeDtypeStruct((d,), jnp.float32)).shape[-1]
    _, pull = jax.vjp(lambda h: linear(h).astype(jnp.float32), jnp.zeros((d,), jnp.float32))
    onehot = jax.nn.one_hot(ids, V, dtype=jnp.float32) - 1.0 / V
    return jax.vmap(lambda c: pull(c)[0])(onehot)


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


def _slots(k: int) -> int:
    """A block's slot count rounded up (powers of two to 32, then multiples of 32): few distinct shapes, little
    padding."""
    return max(8, 1 << (max(k, 1) - 1).bit_length()) if k <= 32 else -(-k // 32) * 32


class _Sources:
    """The prompt's sources laid out per block and position for ``source_columns``: block ``lo`` holds ``[n, K_lo,
    d]``, the activation-scaled vectors of the features writing there (slot = rank among those at the same
    position, in active order), and ``columns [L, A]`` each feature's flat slot in block ``lo``'s ``[n, K_lo]``
    (``position · K_lo + slot``; -1: none). ``min_slots``: per-block lower bounds (prompts of one call share
    shapes); ``A`` is ``n_active`` rounded up to a multiple of 256 (the extra columns write nowhere: zero)."""

    def __init__(self, tc: Transcoders, acts: np.ndarray, min_slots: tuple[int, ...] | None = None,
                 min_width: int = 0):
        L, n, _ = acts.shape
        layer, pos, feat = np.nonzero(acts)
        self.active = np.stack([layer, pos, feat], 1).astype(np.int64)
        self.values = acts[layer, pos, feat].astype(np.float32)
        vectors = tc.decoder_vectors(layer, feat) * self.values[:, None, None]  # [n_active, L, d]
        writes = np.arange(L)[None, :] >= layer[:, None] if tc.cross_layer else np.arange(L)[None, :] == layer[:, None]
        slot = np.zeros((len(layer), L), np.int64)
        K = []
        for lo in range(L):  # each feature's slot among those writing at (lo, its position), in active order
            at = np.nonzero(writes[:, lo])[0]
            order = np.argsort(pos[at], kind="stable")
            first = np.searchsorted(pos[at][order], pos[at][order], side="left")
            slot[at[order], lo] = np.arange(len(at)) - first
            K.append(_slots(int(slot[at, lo].max()) + 1 if len(at) else 1))
        if min_slots is not None:
            K = [max(a, b) for a, b in zip(K, min_slots)]
        self.K = tuple(K)
        self.U = []
        A = max(-(-max(len(layer), 1) // 256) * 256, min_width)
        self.columns = np.full((L, A), -1, np.int32)
        for lo in range(L):
            at = np.nonzero(writes[:, lo])[0]
            U = np.zeros((n, K[lo], tc.d_out), np.float32)
            U[pos[at], slot[at, lo]] = vectors[at, lo]
            self.U.append(U)
            self.columns[lo, at] = pos[at] * K[lo] + slot[at, lo]


@functools.partial(jax.jit, static_argnames="e")
def top_edges(rows, e: int):
    """Each row's ``e`` entries largest in magnitude (largest first) with their columns, and ``Σ |row|``."""
    _, columns = jax.lax.top_k(jnp.abs(rows), e)
    return jnp.take_along_axis(rows, columns, 1), columns, jnp.abs(rows).sum(1)


def _runs(index: np.ndarray) -> list[tuple[int, int, int]]:
    """``index`` (ascending) as runs ``(first source, first destination, length)``: ``dst[:, b:b + w] = src[:, a:a +
    w]`` for each run is ``dst[:, :len(index)] = src[:, index]`` (slices, no gather)."""
    if not len(index):
        return []
    breaks = np.nonzero(np.diff(index) != 1)[0] + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(index)]])
    return [(int(index[a]), int(a), int(b - a)) for a, b in zip(starts, ends)]


def _sliced(edge, st: int, total: int):
    """The first ``st`` top-edge rows as a csr_array ``[st, total]`` (for ``_influences``)."""
    from scipy.sparse import csr_array

    values, cols, _ = (a[:st] for a in edge)
    hit = (cols >= 0) & (values != 0)
    return csr_array((values[hit], (np.nonzero(hit)[0], cols[hit])), shape=(st, total))


def _sparse_adjacency(edge, order, selected, n_active: int, keep: int, total: int) -> SparseAdjacency:
    """The ``SparseAdjacency`` of the top-edge rows (``order``: feature rows in active order, then the logits),
    columns of the features not selected dropped and the rest renumbered as the dense graph's."""
    values, cols, sums = (a[order] for a in edge)
    new_column = np.full(total, -1, np.int64)
    new_column[selected] = np.arange(len(selected))
    new_column[n_active:] = np.arange(n_active, total) - n_active + len(selected)
    renumbered = np.where(cols >= 0, new_column[np.maximum(cols, 0)], -1)
    # a row's sum over the graph's columns: less its kept edges from features that did not become nodes
    sums = sums - np.where((cols >= 0) & (renumbered < 0), np.abs(values), 0).sum(1, dtype=np.float32)
    cols = renumbered
    hit = (cols >= 0) & (values != 0)
    N = total - n_active + len(selected)
    k = len(order) - keep
    counts = np.zeros(N, np.int64)
    counts[:keep] = hit[:keep].sum(1)
    counts[N - k:] = hit[keep:].sum(1)
    row_sums = np.zeros(N, np.float32)
    row_sums[:keep], row_sums[N - k:] = sums[:keep], sums[keep:]
    return SparseAdjacency(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), cols[hit].astype(np.int64),
                           values[hit].astype(np.float32), row_sums, (N, N))


def _influences(edge_rows, logit_p: np.ndarray, row_nodes: np.ndarray, max_iter: int = 128, row_sums=None):
    """circuit-tracer's ``compute_partial_influences``: influence of every node on the logits through the rows
    computed so far (power iteration on the row-normalised |rows|)."""
    if hasattr(edge_rows, "tocsr"):  # top edges: |values| over their rows' full sums
        W = abs(edge_rows).astype(np.float32)
        W = W.multiply(1 / np.maximum(row_sums, np.float32(1e-8))[:, None]).tocsr()
    else:
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
              update_interval: int = 4, tokenizer=None, edges_per_row: int | None = None, mesh=None,
              layout=None) -> Graph | list[Graph]:
    """The attribution graph (``jstd.circuits.Graph``) of ``inputs`` through ``transcoders`` (module docstring).

    inputs: a prompt (a string with ``tokenizer=``, or token ids ``[n]``; for an image-text wrapper, also what
        ``jstd.run`` takes with images: a ``jstd.Inputs`` or the processor's output for one text and its images)
        or a list of prompts (a list of graphs back, in order). A prompt with images has one input node per image
        token, its merged embedding (the projector's feature row), in its position's token slot, labelled by
        image and patch (``Graph.image_patches``; ``jstd.circuits.inputs``: the tower is frozen, out of the
        graph); prompts with images are attributed one at a time. The prompts of one call are padded on the
        right to the longest (with id 0; the model is causal, so nothing at a real position sees the padding) and
        run their forwards as one batch; every
        compiled program is shared, so a call compiles once whatever its prompts' lengths. Each prompt's graph is
        its own (its ``n`` positions, no padding node) and equals the graph of the prompt alone within float32
        rounding.
    targets: None (salient logits), token ids, token strings (one token each, with ``tokenizer=``), or custom
        directions ``[(label, weight, vector [d]), ...]`` (virtual ids ``vocab_size + i``; the vector read at the
        final norm's output as given); the same for every prompt of a list.
    max_feature_nodes: keep at most this many feature nodes (the most influential, circuit-tracer's order).
    batch_size: targets per compiled backward (memory ``batch_size · L · n · d`` floats; results do not depend
        on it). tokenizer: for text, the BOS rule, target strings and labels (``jstd.load_processor``).
    edges_per_row: None (a dense adjacency), or keep each row's ``edges_per_row`` largest edges by magnitude (chosen
        on the device, batch by batch, so no dense row block reaches the host): ``graph.adjacency`` is then a
        ``SparseAdjacency`` of at most ``N · edges_per_row`` entries with each row's full ``Σ |A|`` (see
        ``jstd.circuits.prune`` for what pruning then computes; with ``max_feature_nodes`` below the active
        count, a row's sum leaves out its kept edges from features that did not become nodes, but still counts
        the dropped ones, and the visiting order ranks influence through the kept edges, so other features may
        become nodes than in the dense graph).
    mesh, layout: on a ``jax.sharding.Mesh`` (``jstd.sharding.mesh()``), the model and the transcoders placed
        under ``layout`` (a ``jstd.sharding.LAYOUTS`` name or a rule list; None: ``"FSDP"``) and each batch of
        targets split over ``data`` (``batch_size`` rounded up to a multiple of it): ``jstd.circuits.sharding``.
        The same graph. ValueError for a layout without a mesh or an unknown layout.

    Exact as circuit-tracer within float32 rounding (tests/test_circuits.py compares every entry). Raises
    ValueError for transcoders that do not fit the model, bad prompts or targets.
    """
    tc = transcoders
    if hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer"):  # a processor: its tokenizer
        tokenizer = tokenizer.tokenizer
    if mesh is not None:
        model, tc = place(model, tc, mesh, "FSDP" if layout is None else layout)
    elif layout is not None:
        raise ValueError("attribute: layout= places the model and transcoders on a mesh: pass mesh= too "
                         "(jstd.sharding.mesh())")
    _check(model, tc)
    if batch_size < 1 or update_interval < 1:
        raise ValueError(f"attribute: batch_size ({batch_size}) and update_interval ({update_interval}) must be >= 1")
    batch_size = batch_for(batch_size, mesh)
    several = isinstance(inputs, (list, tuple)) and inputs and not isinstance(inputs[0], (int, np.integer))
    several = several or (isinstance(inputs, np.ndarray) and inputs.ndim == 2)
    prompts = list(inputs) if several else [inputs]
    image = patches = None
    if several and any(map(has_images, prompts)):  # prompts with images: one at a time (jstd.circuits.inputs)
        return [attribute(model, p, tc, targets=targets, max_n_logits=max_n_logits,
                          desired_logit_prob=desired_logit_prob, max_feature_nodes=max_feature_nodes,
                          batch_size=batch_size, update_interval=update_interval, tokenizer=tokenizer,
                          edges_per_row=edges_per_row, mesh=mesh) for p in prompts]
    if has_images(inputs):
        ids, image, patches = image_prompt(model, inputs, lambda i: prompt_tokens(i, tokenizer,
                                                                                 model.config.vocab_size))
        ids = [ids]
    else:
        ids = [prompt_tokens(p, tokenizer, model.config.vocab_size) for p in prompts]
    N = max(len(i) for i in ids)
    tokens = np.zeros((len(ids), N), np.int32)  # right padding: id 0 after each prompt's end
    for g, i in enumerate(ids):
        tokens[g, :len(i)] = i
    v = prompt_values(model, jnp.asarray(tokens) if image is None else image, tc.input_site, tc.output_site)
    embeddings = v["embeddings"].astype(jnp.float32)
    if image is not None:  # the image features held, and at the image tokens the input vectors
        image, embeddings = with_features(model, image, embeddings)
    x = v["x"].astype(jnp.float32)
    acts = tc.encode(x).at[:, :, :ZERO_POSITIONS].set(0)
    errors = (v["y"].astype(jnp.float32) - (tc.decode(acts) + tc.skip(x))).at[:, :, :ZERO_POSITIONS].set(0)
    real = jnp.asarray(np.arange(N)[None, :] < np.asarray([len(i) for i in ids])[:, None])[None, :, :, None]
    acts, errors = np.asarray(jnp.where(real, acts, 0)), jnp.where(real, errors, 0)
    sources = [_Sources(tc, acts[:, g]) for g in range(len(ids))]
    slots = tuple(max(s.K[lo] for s in sources) for lo in range(tc.num_layers))
    width = max(s.columns.shape[1] for s in sources)
    if len(ids) > 1:  # one set of shapes for every prompt, so every compiled program is shared
        sources = [_Sources(tc, acts[:, g], slots, width) for g in range(len(ids))]
    if edges_per_row is not None and edges_per_row < 1:
        raise ValueError(f"attribute: edges_per_row ({edges_per_row}) must be >= 1, or None for a dense adjacency")
    settings = dict(targets=targets, max_n_logits=max_n_logits, desired_logit_prob=desired_logit_prob,
                    max_feature_nodes=max_feature_nodes, batch_size=batch_size, update_interval=update_interval,
                    tokenizer=tokenizer, edges_per_row=edges_per_row, mesh=mesh)
    logits = np.asarray(v["logits"][np.arange(len(ids)), [len(i) - 1 for i in ids]])
    graphs = [_attribute(model, tc, ids[g], jnp.asarray(tokens[g:g + 1]) if image is None else image, sources[g],
                         errors[:, g], embeddings[g], logits[g], outputs=v["y"][:, g:g + 1], **settings)
              for g in range(len(ids))]
    if image is not None:
        graphs[0].image_patches = patches
    return graphs if several else graphs[0]


def _attribute(model, tc: Transcoders, ids: np.ndarray, tokens, src: _Sources, errors, token_vectors, logits_last, *,
               targets, max_n_logits, desired_logit_prob, max_feature_nodes, batch_size, update_interval,
               tokenizer, edges_per_row, mesh, outputs) -> Graph:
    """One prompt's graph: ``ids [n]``, ``tokens [1, N]`` (padded on the right to ``N >= n``; or an
    ``ImagePrompt``), its sources and ``errors [L, N, d]``, ``token_vectors [N, d]`` (zeros and ignored past
    ``n``), ``outputs [L, 1, N, d]`` its MLP outputs (held in the backward: ``replacement.SkipOnly``)."""
    vocab = tokenizer.vocab_size if tokenizer is not None else model.config.vocab_size
    L, n, N = tc.num_layers, len(ids), tokens.shape[1]
    n_active = len(src.values)
    t_ids, t_probs, t_vecs, t_labels = logit_targets(model, logits_last, targets, max_n_logits, desired_logit_prob,
                                                    tokenizer, vocab)
    k = len(t_ids)
    enc = lambda layer, feature: np.asarray(tc.W_enc[layer, feature], np.float32)  # the rows alone to the host
    placed = place_sources(mesh, Sources(tuple(jnp.asarray(u) for u in src.U), errors, token_vectors))
    columns = jnp.asarray(src.columns)
    # the prompt's own columns among source_columns' [A | L·N | N]
    A = src.columns.shape[1]
    keep_columns = np.concatenate([np.arange(n_active), A + (np.arange(L)[:, None] * N + np.arange(n)).reshape(-1),
                                   A + L * N + np.arange(n)])

    # Programs that skip what a batch cannot reach, once enough rows share them (small graphs use one program):
    # a batch of features read before block D runs only the first D blocks (circuit-tracer, too, backpropagates
    # from the deepest layer in a batch), and one whose targets lie at positions < P only the first P positions
    # (a causal model: nothing later reaches them; P rounded up to a sixth of the prompt: ``LENGTHS``).
    by_depth = n_active > 4 * batch_size
    cut = by_depth and N >= 16 and cuttable(tokens)
    lengths = sorted({-(-N * i // LENGTHS) for i in range(1, LENGTHS + 1)}) if cut else [N]
    held = outputs[:, :, :max(lengths)]
    cut_inputs = {}  # P -> (tokens, held outputs) of the first P positions, sliced once

    def rows(layers, positions, vectors, write):
        """The rows of targets against the prompt's sources, ``batch_size`` at a time, each batch handed to
        ``write(at, got)`` as it comes back (``at``: the indices of its rows among ``layers``; ``got``: ``[m, A +
        (L+1)·N]`` in ``source_columns``' padded columns, or with ``edges_per_row`` ``(values [m, e], columns [m,
        e] as the prompt's, Σ|row| [m])``, each row's top edges by magnitude). A batch is read back ``IN_FLIGHT``
        batches after it is dispatched: the device runs ahead while the host files the rows it has.

        The targets go by block, and within a block by position, ascending in even blocks and descending in odd
        ones, cut every ``batch_size`` rows: only the last batch is padded (with many batches, to a power of two),
        and a batch that straddles two blocks meets them where their positions are alike (both late, or both
        early)."""
        order = np.lexsort((np.where(layers % 2 == 1, -positions, positions), layers))
        layers, positions, vectors = layers[order], positions[order], vectors[order]
        flight = collections.deque()

        def land():
            at, m, c = flight.popleft()
            if edges_per_row is None:
                write(at, np.asarray(c)[:m])
            else:
                values, cols, sums = (np.asarray(part)[:m] for part in c)
                write(at, (values, prompt_column[cols], sums))

        for s in range(0, len(layers), batch_size):
            m = min(batch_size, len(layers) - s)
            depth = min(int(layers[s:s + m].max()) + 1, L) if by_depth else L
            P = next(P for P in lengths if P > int(positions[s:s + m].max()))
            if P not in cut_inputs:
                cut_inputs[P] = (tokens if P == N else tokens[:, :P], held[:, :, :P])
            # a short last batch (the logits) of a graph with many batches: padded to a power of two, not batch_size
            size = batch_for(min(batch_size, max(8, 1 << (m - 1).bit_length())), mesh) if by_depth else batch_size
            pad = lambda a: np.concatenate([a[s:s + m], np.zeros((size - m,) + a.shape[1:], a.dtype)])
            g_y, g_e = target_gradients(model, cut_inputs[P][0], tc, *place_targets(
                mesh, pad(layers).astype(np.int32), pad(positions).astype(np.int32), pad(vectors)),
                cut_inputs[P][1], depth=depth)
            # a feature target of block l reads nothing from block l's MLP output or later ones
            reach = int(layers[s:s + m].max())
            reach = reach if reach < L else None
            c = source_columns(g_y, g_e, placed.vectors, placed.errors, placed.tokens, columns, reach=reach, mesh=mesh)
            flight.append((order[s:s + m], m, c if edges_per_row is None else top_edges(c, min(edges_per_row,
                                                                                            c.shape[1]))))
            if len(flight) > IN_FLIGHT:
                land()
        while flight:
            land()

    n_sources = n_active + (L + 1) * n
    total = n_sources + k
    keep = n_active if max_feature_nodes is None else max(0, min(int(max_feature_nodes), n_active))
    sparse = edges_per_row is not None
    direct = not sparse and keep == n_active  # every feature a node: rows go straight to the adjacency
    if sparse:  # source_columns' padded column -> the prompt's column (-1: padding, always 0)
        prompt_column = np.full(A + (L + 1) * N, -1, np.int64)
        prompt_column[keep_columns] = np.arange(n_sources)
        width = min(edges_per_row, len(prompt_column))
        edge = (np.zeros((keep + k, width), np.float32), np.full((keep + k, width), -1, np.int64),
                np.zeros(keep + k, np.float32))
    else:  # the adjacency itself, or the rows in visiting order (logits first)
        edge = np.zeros((total, total) if direct else (keep + k, total), np.float32)
    runs = _runs(keep_columns)

    def into(rows_at: np.ndarray):
        """``write`` for ``rows``: the batch's rows to ``edge``'s rows ``rows_at[at]``."""
        def write(at, got):
            r = rows_at[at]
            if sparse:
                for part, g in zip(edge, got):
                    part[r] = g
            else:
                for a, b, w in runs:
                    edge[r, b:b + w] = got[:, a:a + w]
        return write

    row_nodes = np.zeros(keep + k, np.int64)
    rows(np.full(k, L), np.full(k, n - 1), t_vecs.astype(np.float32),
         into(np.arange(total - k, total) if direct else np.arange(k)))
    row_nodes[:k] = np.arange(k) + n_sources
    visited = np.zeros(n_active, bool)
    st, n_visited = k, 0
    f_layer, f_pos, f_feat = src.active.T
    while n_visited < keep:
        if keep == n_active:
            pending = np.arange(n_active)
        else:
            influence = (_influences(_sliced(edge, st, total), t_probs, row_nodes[:st], row_sums=edge[2][:st])
                         if sparse else _influences(edge[:st], t_probs, row_nodes[:st]))
            rank = np.argsort(-influence[:n_active], kind="stable")
            pending = rank[~visited[rank]][:min(update_interval * batch_size, keep - n_visited)]
        rows(f_layer[pending], f_pos[pending], enc(f_layer[pending], f_feat[pending]),
             into(pending if direct else st + np.arange(len(pending))))
        row_nodes[st:st + len(pending)] = pending
        visited[pending] = True
        st += len(pending)
        n_visited += len(pending)
    selected = np.nonzero(visited)[0]
    order = np.argsort(row_nodes, kind="stable")  # feature rows in active order, then the logits
    if sparse:
        A = _sparse_adjacency(edge, order, selected, n_active, keep, total)
    elif direct:
        A = edge
    else:
        edge = edge[:, np.concatenate([selected, np.arange(n_active, total)])][order]
        N = edge.shape[1]
        A = np.zeros((N, N), np.float32)
        A[:keep] = edge[:keep]
        A[N - k:] = edge[keep:]
    strings = None if tokenizer is None else [tokenizer.decode([int(t)]) for t in ids]
    return Graph(A, src.active, src.values, selected.astype(np.int64), ids, t_ids, t_probs, t_vecs, L, int(vocab),
                 t_labels, tc.scan, None if tokenizer is None else tokenizer.decode([int(t) for t in ids]), strings)
