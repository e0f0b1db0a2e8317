"""Mixture-of-experts routing and the grouped expert product, as array functions.

    probs            = softmax(router_logits in float32)          # every reference: float32
    weights, indices = top_k(probs)                               # torch.topk's order: largest first
    weights          = weights / sum(weights)   (where the family renormalises), cast as the family casts
    expert_outputs   = down_e(act(gate_e(x)) · up_e(x)) for each chosen e       # [tokens, top_k, hidden]

gpt-oss differs in both: its router takes the top-k of the logits and the softmax of those alone (``route(...,
top_k_first=True)``: the same weights as softmax, top-k, renormalise, in another order of roundings), and its
experts add biases and apply a clamped SwiGLU (``clamped``: ``(clamp(up) + 1) · g · sigmoid(alpha · g)``, ``g`` the
gate clamped from above). DeepSeek's routers (``group_limited``) score by softmax (V2) or sigmoid (V3, with a
bias that moves the choice only), limit the choice to the best groups of experts and scale the weights.

The expert product never forms every expert for every token: the ``tokens · top_k`` chosen pairs are sorted by
expert and multiplied tile by tile, each tile through its one expert (``grouped``), so memory is
O(tokens · top_k), not O(tokens · experts), and nothing is dropped (capacity is unlimited, as in transformers).
With very few experts (``DENSE_EXPERTS``) the dense product of every expert is faster on the CPU and is used
instead (same values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.kernels.activations import activation
from jstd.kernels.rounding import rounded

# at most this many experts (and tokens · top_k at most DENSE_PAIRS): every expert for every token, one einsum
DENSE_EXPERTS = 4
DENSE_PAIRS = 4096


def route(logits: Float[Array, "... experts"], k: int, normalize: bool, weights_dtype, top_k_first: bool = False
          ) -> tuple[Float[Array, "... top_k"], Int[Array, "... top_k"]]:
    """``(router_weights, expert_indices)`` from the router's logits: softmax in float32, the ``k`` largest
    (largest first), divided by their sum when ``normalize``, cast to ``weights_dtype`` (the
    logits' dtype on the Qwen and OLMoE lines, float32 on Mixtral, which never casts back). ``top_k_first``
    (gpt-oss): the ``k`` largest logits, then their softmax in float32, cast to ``weights_dtype``.

    Ties (equal probabilities: equal logits, common in bfloat16) break as torch's CPU ``topk`` breaks them
    (``top_k``)."""
    if top_k_first:
        values, indices = top_k(logits, k)
        return jax.nn.softmax(values.astype(jnp.float32), axis=-1).astype(weights_dtype), indices
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    values, indices = top_k(probs, k)
    if normalize:
        values = values / jnp.sum(values, axis=-1, keepdims=True)
    return values.astype(weights_dtype), indices


def top_k_sigmoid(logits: Float[Array, "... experts"], k: int) -> tuple[Float[Array, "... top_k"], Int[Array, "... top_k"]]:
    """Llama 4's routing: the ``k`` largest logits (ties as torch's ``topk``), each weighted by its sigmoid in
    float32, cast to the logits' dtype (transformers' ``Llama4Router``; the weights are independent, not
    normalised)."""
    values, indices = top_k(logits, k)
    return jax.nn.sigmoid(values.astype(jnp.float32)).astype(logits.dtype), indices


def group_limited(logits: Float[Array, "... experts"], k: int, scoring: str, groups: tuple[int, int] | None,
                  normalize: bool, scale: float, bias: Float[Array, "experts"] | None = None
                  ) -> tuple[Float[Array, "... top_k"], Int[Array, "... top_k"]]:
    """DeepSeek's routing (transformers' ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``), in float32:

        scores  = softmax(logits)  (``scoring="softmax"``: V2)  |  sigmoid(logits)  (``"sigmoid"``: V3)
        choice  = scores + bias                                   # V3's e_score_correction_bias: the choice only
        groups  = the experts cut into ``n_group`` equal groups; each scored by its largest choice (softmax) or
                  the sum of its two largest (sigmoid); all but the ``topk_group`` best masked (0 / -inf)
        indices = top_k(choice, k);  weights = scores[indices]    (the scores, not the biased choice)
        weights = weights / (sum(weights) + 1e-20)  where ``normalize`` (V3's norm_topk_prob; V2 never)
        weights = weights · scale                                 # routed_scaling_factor

    ``groups`` None (V2's ``greedy``): no group limit. The chosen experts come in ascending expert order (torch's
    ``topk(sorted=False)`` leaves the order unspecified; the weighted sum does not depend on it), the weights in
    float32. Ties break as torch's CPU ``topk`` (``top_k``)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if groups is not None:
        n_group, topk_group = groups
        per = choice.reshape(*choice.shape[:-1], n_group, -1)
        group_scores = per.max(-1) if scoring == "softmax" else jnp.sum(jax.lax.top_k(per, 2)[0], axis=-1)
        chosen = top_k(group_scores, topk_group)[1]
        keep = jnp.any(jnp.arange(n_group)[:, None] == chosen[..., None, :], axis=-1)  # [..., n_group]
        keep = jnp.repeat(keep, per.shape[-1], axis=-1)
        choice = jnp.where(keep, choice, 0.0 if scoring == "softmax" else -jnp.inf)
    indices = jnp.sort(top_k(choice, k)[1], axis=-1)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * jnp.float32(scale), indices.astype(jnp.int32)


def sparsemixer(logits: Float[Array, "... experts"], jitter_eps: float
                ) -> tuple[Float[Array, "... 2"], Int[Array, "... 2"]]:
    """Phi-3.5-MoE's routing as transformers' ``sparsemixer`` runs at inference (``training`` False): two
    experts a token, each chosen by an argmax and weighted by a softmax over the experts near it.

    First: ``e1 = argmax(l)``; the experts whose relative gap ``(max - l) / max(|l|, max)`` exceeds
    ``2 · jitter_eps`` are masked (-inf) and ``w1`` is ``e1``'s softmax probability over the rest. Second: ``e1``
    masked, ``e2`` the argmax of the rest, the mask by the gap to that maximum, ``w2`` ``e2``'s softmax probability
    over the experts it leaves (``e1`` excluded). The weights are not renormalised; softmax in float32, cast to the
    logits' dtype; ties go to the lower index (torch's ``max``)."""
    dtype = logits.dtype

    def choose(scores):
        top = jnp.max(scores, axis=-1, keepdims=True)
        index = jnp.argmax(scores, axis=-1)[..., None]
        # each step rounded to the logits' dtype as torch rounds it (a bfloat16 gap at the threshold decides)
        far = rounded(rounded(top - logits) / jnp.maximum(jnp.abs(logits), top)) > 2 * jitter_eps
        gates = jax.nn.softmax(jnp.where(far, -jnp.inf, scores).astype(jnp.float32), axis=-1).astype(dtype)
        return jnp.take_along_axis(gates, index, axis=-1), index

    w1, e1 = choose(logits)
    w2, e2 = choose(jnp.where(jnp.arange(logits.shape[-1]) == e1, -jnp.inf, logits))
    return jnp.concatenate([w1, w2], axis=-1), jnp.concatenate([e1, e2], axis=-1).astype(jnp.int32)


def top_k(probs: Float[Array, "... n"], k: int) -> tuple[Float[Array, "... k"], Int[Array, "... k"]]:
    """The ``k`` largest of ``probs`` and their indices, largest first, with ties broken as torch's CPU
    ``torch.topk`` breaks them: it selects with libstdc++'s ``std::nth_element`` (introselect) and sorts the first
    ``k - 1`` by insertion, so among equal values neither the lower index nor any fixed rule wins (of eight
    experts with equal top values, torch may take the last and the first). Rows without equal neighbours among
    the ``k + 1`` largest take ``jax.lax.top_k`` (the same result); when some row has them, the rows with ties are
    replayed on the host (``jax.pure_callback``, ``torch_topk_row``) under a ``lax.cond``, so only such calls pay.

    Where torch takes ``std::partial_sort`` instead (``64 · k <= n``) or sorts past 16 (``k > 17``), and where the
    whole row is chosen (``k == n``), ties go to the lower index (``jax.lax.top_k``)."""
    n = probs.shape[-1]
    if k >= n or 64 * k <= n or k > 17:
        return jax.lax.top_k(probs, k)
    values, indices = jax.lax.top_k(probs, k + 1)
    tied = jnp.any(values[..., 1:] == values[..., :-1], axis=-1)
    indices = indices[..., :k]

    def replay(probs, tied, indices):
        return jax.pure_callback(_torch_topk, jax.ShapeDtypeStruct(indices.shape, indices.dtype), probs, tied,
                                 indices, vmap_method="broadcast_all")

    # the choice has no gradient (the callback none at all): the values below are gathered from probs
    indices = jax.lax.cond(jnp.any(tied), replay, lambda p, t, i: i, jax.lax.stop_gradient(probs), tied, indices)
    return jnp.take_along_axis(probs, indices, axis=-1), indices


def _torch_topk(probs, tied, indices):
    """``indices`` with each tied row's replaced by ``torch_topk_row``'s (host arrays)."""
    probs, tied, out = np.asarray(probs), np.asarray(tied), np.array(indices)
    k = out.shape[-1]
    flat_p, flat_t, flat_o = probs.reshape(-1, probs.shape[-1]), tied.reshape(-1), out.reshape(-1, k)
    for r in np.flatnonzero(flat_t):
        flat_o[r] = torch_topk_row(flat_p[r], k)
    return flat_o.reshape(out.shape)


def torch_topk_row(values, k: int) -> list[int]:
    """The indices torch's CPU ``topk(values, k)`` (largest, sorted, ``64 · k > n``) returns for one row: libstdc++'s
    ``std::nth_element`` (introselect: median-of-three pivot moved to the front, Hoare partition, insertion sort
    of the last few) on (value, index) pairs compared by value alone, then ``std::sort`` of the first ``k - 1``
    (an insertion sort: at most 16). Equal values are never reordered by index. (The selection's depth limit,
    ``2 · log2(n)``, past which libstdc++ switches to a heap select, is not reached on rows of equal values, which
    the partition splits evenly; were it reached, the rest is taken in stable order.)"""
    q = [(float(v), j) for j, v in enumerate(values)]
    n = len(q)
    above = lambda a, b: q[a][0] > q[b][0]

    def swap(a, b):
        q[a], q[b] = q[b], q[a]

    def insertion_sort(first, last):
        for i in range(first + 1, last):
            val, j = q[i], i
            if val[0] > q[first][0]:
                q[first + 1:i + 1] = q[first:i]
                q[first] = val
                continue
            while val[0] > q[j - 1][0]:
                q[j] = q[j - 1]
                j -= 1
            q[j] = val

    first, last, nth = 0, n, k - 1
    depth = 2 * (n.bit_length() - 1)
    while last - first > 3:
        if depth == 0:
            q[first:last] = sorted(q[first:last], key=lambda p: -p[0])
            break
        depth -= 1
        a, b, c = first + 1, first + (last - first) // 2, last - 1
        if above(a, b):
            swap(first, b if above(b, c) else c if above(a, c) else a)
        else:
            swap(first, a if above(a, c) else c if above(b, c) else b)
        lo, hi = first + 1, last
        while True:
            while above(lo, first):
                lo += 1
            hi -= 1
            while above(first, hi):
                hi -= 1
            if not lo < hi:
                break
            swap(lo, hi)
            lo += 1
        if lo <= nth:
            first = lo
        else:
            last = lo
    else:
        insertion_sort(first, last)
    insertion_sort(0, k - 1)
    return [j for _, j in q[:k]]


def clamped(limit: float, alpha: float):
    """gpt-oss' experts' gated product of ``(gate, up)``: ``(clamp(up, ±limit) + 1) · g · sigmoid(g · alpha)`` with
    ``g = min(gate, limit)``, each step in the inputs' dtype as transformers' ``GptOssExperts._apply_gate``."""
    def product(gate, up):
        gate = jnp.minimum(gate, jnp.asarray(limit, gate.dtype))
        up = jnp.clip(up, jnp.asarray(-limit, up.dtype), jnp.asarray(limit, up.dtype))
        glu = gate * jax.nn.sigmoid(gate * jnp.asarray(alpha, gate.dtype))
        return (up + jnp.asarray(1, up.dtype)) * glu
    return product


def expert_outputs(x: Float[Array, "tokens hidden"], indices: Int[Array, "tokens top_k"],
                   gate_up: Float[Array, "experts hidden two_mlp"], down: Float[Array, "experts mlp hidden"],
                   act: str, dense: bool | None = None, gate_up_bias: Float[Array, "experts two_mlp"] | None = None,
                   down_bias: Float[Array, "experts hidden"] | None = None, product=None
                   ) -> Float[Array, "tokens top_k hidden"]:
    """Each chosen expert's output for each token: ``down_e(act(gate_e(x)) · up_e(x))`` with ``gate_up[e]`` the
    gate's columns then the up's (``[hidden, 2 · mlp]``). ``dense``: None chooses (the dense product for at most
    ``DENSE_EXPERTS`` experts and ``DENSE_PAIRS`` pairs, else the grouped product), True / False force it.
    ``gate_up_bias``, ``down_bias``: each expert's biases (gpt-oss); ``product``: ``(gate, up) -> neurons`` in
    place of ``act(gate) · up`` (gpt-oss' ``clamped``).

    The grouped product's values come from ``segments`` (each chosen expert's weights taken once, its rows in
    windows; under ``vmap``, one call on the batch's rows: a ``custom_vmap``); its derivatives (``jax.jvp``,
    ``jax.grad``: a ``custom_jvp``) from ``grouped``'s tile scan, which JAX can transpose (``segments``'
    data-dependent loops cannot be). The two agree to float rounding."""
    tokens, k = indices.shape
    experts = gate_up.shape[0]
    if dense is None:
        dense = experts <= DENSE_EXPERTS and tokens * k <= DENSE_PAIRS
    f = activation(act)
    product = product or (lambda gate, up: f(gate) * up)
    if dense:
        h = jnp.einsum("th,ehm->etm", x, gate_up)
        h = h if gate_up_bias is None else h + gate_up_bias[:, None]
        y = jnp.einsum("etm,emh->eth", product(*jnp.split(h, 2, axis=-1)), down)               # [experts, tokens, hidden]
        y = y if down_bias is None else y + down_bias[:, None]
        return jnp.take_along_axis(jnp.swapaxes(y, 0, 1), indices[..., None], axis=1)

    def one(w, e):  # expert e's weights, sliced here once (the barrier keeps XLA from slicing them per window)
        w = jax.lax.optimization_barrier(jax.tree.map(lambda a: a[e], w))
        return lambda xs: _expert(xs, w[0], w[1], product, w[2], w[3])

    @jax.custom_batching.custom_vmap
    def values(x, indices, w):
        return segments(x, indices, lambda e: one(w, e), experts)

    @values.def_vmap
    def _(size, batched, x, indices, w):
        # rows are independent: a batch of calls is one call on the batch's rows (under vmap, data-dependent loops
        # would run every item to the longest and slice by gathers); weights batched (a vmap over models): in turn
        spread = lambda a, b: a if b else jnp.broadcast_to(a, (size,) + a.shape)
        x, indices = spread(x, batched[0]), spread(indices, batched[1])
        if any(jax.tree.leaves(batched[2])):
            return jax.lax.map(lambda a: values(*a), (x, indices, jax.tree.map(spread, w, batched[2]))), True
        y = values(x.reshape(-1, x.shape[-1]), indices.reshape(-1, indices.shape[-1]), w)
        return y.reshape(indices.shape + y.shape[2:]), True

    @jax.custom_jvp  # the indices an argument, not a closure: a closed-over tracer breaks jax.vjp's transposition
    def run(x, indices, w):
        return values(x, indices, w)

    @run.defjvp
    def _(primals, tangents):
        x, indices, w = primals
        tiles = lambda x, w: grouped(x, indices, lambda xs, e: one(w, e)(xs), experts)
        return run(*primals), jax.jvp(tiles, (x, w), (tangents[0], tangents[2]))[1]

    return run(x, indices, (gate_up, down, gate_up_bias, down_bias))


def _expert(xs, gate_up, down, product, gate_up_bias=None, down_bias=None):
    h = xs @ gate_up
    y = product(*jnp.split(h if gate_up_bias is None else h + gate_up_bias, 2, axis=-1)) @ down
    return y if down_bias is None else y + down_bias


def segment_rows(pairs: int, experts: int) -> int:
    """The rows of ``segments``' large windows: the largest power of two at most an expert's mean share of the
    ``pairs``, between 16 and 256 (its small windows are a quarter of that, at least 8)."""
    share = max(1, pairs // experts)
    return int(min(256, max(16, 1 << (share.bit_length() - 1))))


def segments(x: Float[Array, "tokens hidden"], indices: Int[Array, "tokens top_k"], expert, experts: int,
             window: int | None = None) -> Float[Array, "tokens top_k out"]:
    """``expert(e)(rows)`` (``expert(e)`` takes its weights once; ``rows`` ``[n, hidden]`` of tokens that chose
    expert ``e``) for every chosen (token, expert) pair, as ``[tokens, top_k, out]``, touching only the experts
    some token chose, and each of those once.

    The ``tokens · top_k`` pairs are sorted by expert; a loop over the chosen experts (as many as there are) takes
    each one's weights, then its contiguous segment of sorted rows in windows of ``window`` rows (``segment_rows``)
    while that many remain and of a quarter of that for the rest. A window that runs past its segment computes
    the next expert's first rows with this expert's weights; the next expert's windows overwrite them (and the
    rows past the last segment are padding, dropped), so every pair's row is its own expert's. Memory is
    O(pairs · hidden); the work is that of the pairs plus at most one small window an expert. The loops are
    data-dependent (``lax.while_loop``): values and ``vmap`` only, no transpose (``expert_outputs`` differentiates
    through ``grouped``). ``jax.lax.ragged_dot`` would compute every expert for every row on the CPU."""
    tokens, k = indices.shape
    pairs, hidden = tokens * k, x.shape[-1]
    big = window or segment_rows(pairs, experts)
    small = max(8, big // 4)
    big = max(1, min(big, pairs))  # no larger than the rows (and their padding) it slices
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)                                # pair order grouped by expert
    sizes = jnp.bincount(flat, length=experts)
    ends = jnp.cumsum(sizes)
    chosen = jnp.nonzero(sizes, size=experts, fill_value=0)[0]           # the chosen experts first, ascending
    rows = jnp.concatenate([x[order // k], jnp.zeros((small, hidden), x.dtype)])  # padding: the last overrun
    out = jax.eval_shape(lambda r: expert(0)(r), rows[:small])

    def over(f, size, pos, end, y, more):  # f on windows of `size` rows from pos while `more(pos, end)`
        def step(c):
            pos, y = c
            return pos + size, jax.lax.dynamic_update_slice_in_dim(y, f(jax.lax.dynamic_slice_in_dim(
                rows, pos, size)), pos, 0)
        return jax.lax.while_loop(lambda c: more(*c[:1], end), step, (pos, y))

    def one(i, y):
        e = chosen[i]
        f, end = expert(e), ends[e]
        pos, y = over(f, big, end - sizes[e], end, y, lambda pos, end: end - pos >= big)
        return over(f, small, pos, end, y, lambda pos, end: pos < end)[1]

    y = jax.lax.fori_loop(0, jnp.count_nonzero(sizes), one, jnp.zeros((pairs + small,) + out.shape[1:], out.dtype))
    inverse = jnp.zeros(pairs, jnp.int32).at[order].set(jnp.arange(pairs, dtype=jnp.int32), unique_indices=True)
    return y[inverse].reshape(tokens, k, *out.shape[1:])


def tile_rows(pairs: int, experts: int) -> int:
    """The rows of one tile of the grouped product: a power of two near a quarter of an expert's mean share of
    the ``pairs`` (so padding each expert's group to whole tiles adds about an eighth), between 8 and 128."""
    share = max(1, pairs // (4 * experts))
    return int(min(128, max(8, 1 << (share.bit_length() - 1))))


def grouped(x: Float[Array, "tokens hidden"], indices: Int[Array, "tokens top_k"], expert, experts: int,
            tile: int | None = None) -> Float[Array, "tokens top_k out"]:
    """``expert(rows, e)`` (rows ``[tile, hidden]`` of tokens that chose expert ``e``) for every chosen (token,
    expert) pair, as ``[tokens, top_k, out]``, without forming any expert for the tokens that did not choose it.

    The ``tokens · top_k`` pairs are sorted by expert and each expert's group is padded to whole tiles of
    ``tile`` rows (``tile_rows``); a ``lax.scan`` over the tiles (at most ``pairs / tile + experts``, a static
    bound) runs each tile through its expert. Memory is O(pairs · hidden) and the work that of the pairs plus the
    padding, whatever the number of experts (``jax.lax.ragged_dot`` lowers to every expert for every row on the
    CPU and has no batching rule for ``vmap``; this has both)."""
    tokens, k = indices.shape
    pairs = tokens * k
    tile = tile or tile_rows(pairs, experts)
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)                                # pair order grouped by expert
    sizes = jnp.bincount(flat, length=experts)
    padded = (sizes + tile - 1) // tile * tile
    start, padded_start = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
    sorted_expert = flat[order]
    slot = padded_start[sorted_expert] + jnp.arange(pairs) - start[sorted_expert]   # each sorted pair's padded row
    tiles = -(-pairs // tile) + experts
    source = jnp.full((tiles * tile,), pairs, jnp.int32).at[slot].set(jnp.arange(pairs, dtype=jnp.int32))
    rows = jnp.concatenate([x, jnp.zeros((1, x.shape[-1]), x.dtype)])[
        jnp.concatenate([order // k, jnp.array([tokens])])[source]]          # padding rows read zeros
    tile_expert = jnp.clip(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(tiles) * tile, side="right"), 0,
                           experts - 1)

    def step(_, t):
        rows_t, e = t
        return None, expert(rows_t, e)

    _, y = jax.lax.scan(step, None, (rows.reshape(tiles, tile, -1), tile_expert))
    y = y.reshape(tiles * tile, -1)[slot]                                   # [pairs, out], sorted by expert
    return jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(tokens, k, -1)


def weighted(outputs: Float[Array, "... top_k hidden"], weights: Float[Array, "... top_k"]
             ) -> Float[Array, "... top_k hidden"]:
    """Each chosen expert's contribution ``weights[k] · outputs[k]``, formed in the promoted dtype of the two and
    cast to the outputs' dtype, as transformers forms it before the sum (``combine``)."""
    return (outputs * weights[..., None]).astype(outputs.dtype)


def combine(outputs: Float[Array, "... top_k hidden"], weights: Float[Array, "... top_k"],
            indices: Int[Array, "... top_k"]) -> Float[Array, "... hidden"]:
    """``Σ_k weights[k] · outputs[k]`` as transformers sums it: each contribution formed in the promoted dtype of
    the two and cast to the outputs' dtype, then added in ascending expert order (its ``index_add_`` loop over
    experts), each add in that dtype."""
    contributions = weighted(outputs, weights)
    if outputs.shape[-2] > 2:  # with two, the order of one add does not matter
        by_expert = jnp.argsort(indices, axis=-1, stable=True)
        contributions = jnp.take_along_axis(contributions, by_expert[..., None], axis=-2)
    total = contributions[..., 0, :]
    for j in range(1, outputs.shape[-2]):
        total = total + contributions[..., j, :]
    return total
