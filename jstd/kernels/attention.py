"""Softmax attention: the mask, the explicit path and the fused path.

Layouts: queries [batch, heads, seq, dim], keys and values
[batch, kv_heads, seq, dim] (before the grouped-query repeat: query head h
reads key/value head h // (heads // kv_heads)), outputs [batch, seq, heads, dim].
Both paths compute the same function; the explicit one materializes the scores
and the probabilities so that they can be read and edited.

A sliding window (``window_mask``) is one more mask: a query at index ``i``
attends keys at indices ``i - window + 1 .. i`` (transformers' sliding-window
mask and sliding cache). Bidirectional blocks (``block_mask``: Gemma 3's images) are runs of
positions that attend to each other whatever their order: OR-ed into the causal mask before a window narrows it.
Soft-capped scores (``softcap``: Gemma 2) are
``tanh(s / cap) · cap`` of the scaled scores, before the mask. ALiBi (``alibi_bias``: BLOOM) adds
``slope_h · position(key)`` to the scores, before the mask.

Attention sinks (``sinks``: gpt-oss) are one learned logit per head that joins every row's softmax as one more
column (``sink_probabilities``): the sink takes probability mass but adds no value, so a row's probabilities over
the real keys sum to less than 1. Chunked attention (``chunk_mask``: Llama 4's local blocks) is one more mask: a
query attends only the keys of its own chunk of ``chunk`` positions, counted from the row's first real token.

How scores are made beyond the scale and the mask is one static record, ``ScoreOptions`` (soft-cap, ALiBi, float32
products), so a family's new option is a field there, not one more argument of every kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jstd.kernels.platform import platform
from jstd.kernels.rounding import times
from jstd.kernels.softcap import softcap as capped


@dataclasses.dataclass(frozen=True)
class ScoreOptions:
    """How ``scores`` turns ``scale · q·kᵀ`` into the scores (static and hashable: a jit-static field).

    ``softcap`` (Gemma 2): ``tanh(s / cap) · cap`` of the scaled product, before the mask. ``alibi`` (BLOOM): ALiBi
    slopes, one a head: ``alibi_bias`` added before the mask. ``float32_scores`` (GPT-Neo, GPT-J): queries and keys
    cast to float32 before the product (the scores are float32 whatever the model's dtype; the caller casts the
    probabilities to the values' dtype). ``scaled_queries`` (OPT): the queries multiplied by the scale (in float32,
    rounded to their dtype) before an unscaled product, as OPT scales ``q_proj``'s output (in bfloat16 not the
    product scaled after). The default is none of them: the plain scaled product."""

    softcap: float | None = None
    alibi: tuple[float, ...] | None = None
    float32_scores: bool = False
    scaled_queries: bool = False

    @property
    def plain(self) -> bool:
        """Whether ``jax.nn.dot_product_attention`` computes these scores (no cap, no float32 product; ALiBi
        goes in as its ``bias``)."""
        return self.softcap is None and not self.float32_scores

    def queries(self, q: Float[Array, "batch heads q dim"], scale: float
                ) -> tuple[Float[Array, "batch heads q dim"], float, "ScoreOptions"]:
        """``(q, scale, options)`` as the product takes them: with ``scaled_queries``, the queries scaled (float32,
        rounded once: torch's tensor times a Python float), scale 1 and the option spent; else unchanged."""
        if not self.scaled_queries:
            return q, scale, self
        return times(q, scale), 1.0, dataclasses.replace(self, scaled_queries=False)


PLAIN = ScoreOptions()


def checked_options(options: ScoreOptions | None) -> ScoreOptions:
    """``options`` (None: ``PLAIN``); TypeError naming the record for anything else (a soft-cap or ALiBi slopes
    passed where the record goes)."""
    if options is None:
        return PLAIN
    if not isinstance(options, ScoreOptions):
        raise TypeError(f"the attention kernels take their score options as one kernels.attention.ScoreOptions "
                        f"record (softcap=, alibi=, float32_scores=, scaled_queries=), got {type(options).__name__} "
                        f"{options!r}")
    return options


def positions_and_mask(
    tokens: Int[Array, "batch seq"], attention_mask: Int[Array, "batch seq"] | None
) -> tuple[Int[Array, "batch seq"], Bool[Array, "batch 1 seq seq"]]:
    """Position ids and the boolean causal mask (True: attend).

    With an ``attention_mask`` (zeros are padding, typically on the left), a
    token's position counts only the real tokens before it, so each row gets the
    positions of its unpadded prompt; padding keys are masked. Padding queries
    get position 1 (as transformers' generation does); their values are unused.
    """
    batch, seq = tokens.shape
    causal = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
    if attention_mask is None:
        return jnp.broadcast_to(jnp.arange(seq), (batch, seq)), causal
    real = attention_mask.astype(bool)
    positions = jnp.where(real, jnp.cumsum(real, axis=-1) - 1, 1)
    return positions, causal & real[:, None, None, :]


def window_mask(
    query_index: Int[Array, "batch q"], key_index: Int[Array, "batch k"], window: int
) -> Bool[Array, "batch 1 q k"]:
    """True where a key is inside a query's sliding window: ``key_index > query_index - window``.

    Indices count every position of the sequence, padding included (as transformers' cache positions), so
    with left padding a row's real tokens see the same keys as the row unpadded; combine with the causal and
    padding mask (``&``)."""
    return (key_index[:, None, :] > query_index[:, :, None] - window)[:, None]


def left_padding(mask: Bool[Array, "batch 1 q k"]) -> Int[Array, "batch"]:
    """Each row's left padding: the keys before the first one its last query sees (transformers'
    ``left_padding_tokens``: the leading zeros of the attention mask; 0 on a row that is padded on the right)."""
    return jnp.sum(jnp.cumsum(mask[:, 0, -1, :], axis=-1) == 0, axis=-1)


def chunk_mask(query_index: Int[Array, "batch q"], key_index: Int[Array, "batch k"], chunk: int,
               padding: Int[Array, "batch"]) -> Bool[Array, "batch 1 q k"]:
    """True where a key lies in its query's chunk: ``(key - padding) // chunk == (query - padding) // chunk``
    (transformers' ``chunked_overlay``; indices as ``window_mask``'s, ``padding`` from ``left_padding``, so a
    left-padded row's chunks start at its first real token, as the row's own). Combine with the causal and padding
    mask (``&``)."""
    pad = padding[:, None]
    return (((key_index - pad) // chunk)[:, None, :] == ((query_index - pad) // chunk)[:, :, None])[:, None]


def bidirectional_blocks(inside: Bool[Array, "batch seq"]) -> Int[Array, "batch seq"]:
    """Each position's bidirectional block: the runs of consecutive True positions of ``inside`` numbered 0, 1, …
    along each row, -1 outside them (transformers' ``block_sequence_ids`` from ``token_type_ids``)."""
    before = jnp.pad(inside, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(inside, jnp.cumsum(inside & ~before, axis=1) - 1, -1)


def block_mask(query_block: Int[Array, "batch q"], key_block: Int[Array, "batch k"]) -> Bool[Array, "batch 1 q k"]:
    """True where a query and a key lie in one bidirectional block (``bidirectional_blocks``; -1 is no block): OR it
    into the causal mask (later keys of the block become visible), then narrow by any sliding window (``&``), as
    transformers composes them (a window never hides a later key)."""
    q = query_block[:, :, None]
    return ((q == key_block[:, None, :]) & (q >= 0))[:, None]


def alibi_slopes(heads: int) -> tuple[float, ...]:
    """ALiBi's slope per head (Press et al.; BLOOM's ``_get_alibi_slopes``), as float32 values: ``2^(-8i/n)`` for
    the ``n`` = largest power of two <= ``heads``, then the odd powers of the next base for the remaining heads."""
    import math

    import numpy as np

    def powers(n, count, step):
        base = np.float32(2 ** (-(2 ** -(math.log2(n) - 3))))
        return [float(np.float32(base ** np.float32(p))) for p in range(1, 1 + step * count, step)]

    closest = 2 ** math.floor(math.log2(heads))
    slopes = powers(closest, closest, 1)
    if closest != heads:
        slopes += powers(2 * closest, min(closest, heads - closest), 2)
    return tuple(slopes)


def alibi_bias(slopes: tuple[float, ...], mask: Bool[Array, "batch 1 q k"], dtype) -> Float[Array, "batch heads q k"]:
    """ALiBi's term of the scores: ``slope_h · position(key)``, a key's position being the count of real keys
    before it that the query sees (``cumsum(mask) - 1`` along the keys: on a plain run the key's position, padding
    not counted; on a ``Context`` the cached run's). That is BLOOM's form: the bias ``-slope · (query - key)`` of
    the paper plus ``slope · query``, a per-query constant the softmax ignores. float32 products cast to ``dtype``
    (torch's ``build_alibi_tensor``)."""
    position = (jnp.cumsum(mask, axis=-1) - 1).astype(jnp.float32)  # [batch, 1, q, k]
    return (jnp.asarray(slopes, jnp.float32)[None, :, None, None] * position).astype(dtype)


def scores(
    q: Float[Array, "batch heads q dim"], k: Float[Array, "batch kv_heads k dim"], scale: float,
    mask: Bool[Array, "batch 1 q k"] | None, options: ScoreOptions | None = PLAIN,
) -> Float[Array, "batch heads q k"]:
    """scale · q·kᵀ as ``options`` make it (soft-capped, plus ALiBi's bias, float32 products), masked entries set
    to the dtype's minimum (as transformers' eager attention). The product is rounded to the inputs' dtype, then
    multiplied by ``scale`` in float32 and rounded once more (torch's tensor times a Python float); with ALiBi,
    ``scale · q·kᵀ + bias`` is computed in float32 and rounded once (BLOOM's ``baddbmm``). ``mask`` None
    attends everywhere (a vision tower). ``options`` None is ``PLAIN``; TypeError for anything else but a
    ``ScoreOptions`` (the record replaced the positional ``softcap`` / ``alibi`` arguments)."""
    q, scale, options = checked_options(options).queries(q, scale)
    if options.float32_scores:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    softcap, alibi = options.softcap, options.alibi
    b, h, t, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, h // kv, t, d)
    product = lambda dtype=None: jnp.einsum("bkgqd,bksd->bkgqs", qg, k, preferred_element_type=dtype
                                            ).reshape(b, h, t, k.shape[2])
    if alibi is None:
        # torch's product times a Python float: in float32, rounded once (rounding the scale to bf16 first differs
        # where it is no power of two: head_dim 24, 80, 96, Gemma 2's query_pre_attn_scalar)
        s = capped(times(product(), scale), softcap)
    else:  # BLOOM's baddbmm: scale · q·kᵀ plus the (rounded) bias in float32, rounded once
        s = capped(product(jnp.float32) * jnp.float32(scale), softcap)
        s = (s + alibi_bias(alibi, mask, q.dtype).astype(jnp.float32)).astype(q.dtype)
    return s if mask is None else jnp.where(mask, s, jnp.finfo(s.dtype).min)


def probabilities(scores: Float[Array, "batch heads q k"]) -> Float[Array, "batch heads q k"]:
    """Softmax over keys in float32, cast back to the scores' dtype."""
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(scores.dtype)


def sink_probabilities(scores: Float[Array, "batch heads q k"], sinks: Float[Array, "heads"]
                       ) -> tuple[Float[Array, "batch heads q k"], Float[Array, "batch heads q"]]:
    """``(probabilities over the keys, the sink's probability)``: the softmax of each row of ``scores`` with the
    head's sink logit as one more column, as transformers' gpt-oss eager attention computes it (the row's maximum
    subtracted in the scores' dtype, the softmax in float32, cast back); the keys' probabilities sum to
    ``1 - sink``."""
    column = jnp.broadcast_to(sinks.astype(scores.dtype)[None, :, None, None], (*scores.shape[:3], 1))
    joint = jnp.concatenate([scores, column], axis=-1)
    joint = joint - jnp.max(joint, axis=-1, keepdims=True)
    p = jax.nn.softmax(joint.astype(jnp.float32), axis=-1).astype(scores.dtype)
    return p[..., :-1], p[..., -1]


def mix(p: Float[Array, "batch heads q k"], v: Float[Array, "batch kv_heads k dim"]) -> Float[Array, "batch q heads dim"]:
    """Each head's pattern times its key/value head's values."""
    b, h, t, s = p.shape
    kv = v.shape[1]
    out = jnp.einsum("bkgqs,bksd->bqkgd", p.reshape(b, kv, h // kv, t, s), v)
    return out.reshape(b, t, h, v.shape[-1])


def fused(
    q: Float[Array, "batch heads q dim"], k: Float[Array, "batch kv_heads k dim"], v: Float[Array, "batch kv_heads k dim"],
    scale: float, mask: Bool[Array, "batch 1 q k"] | None, options: ScoreOptions | None = PLAIN,
    sinks: Float[Array, "heads"] | None = None,
    past: tuple[Float[Array, "batch kv_heads cached dim"], Float[Array, "batch kv_heads cached dim"]] | None = None,
) -> Float[Array, "batch q heads dim"]:
    """The same function through ``jax.nn.dot_product_attention`` (cuDNN/flash where available; ALiBi as its
    ``bias``); with ``sinks`` or options that kernel has no place for (``ScoreOptions.plain`` false) the explicit
    computation, unmaterialized, the probabilities cast to the values' dtype after the softmax. ``options`` as
    ``scores``'.

    ``past``: cached ``(keys, values)`` that come before ``k`` and ``v`` on the key axis (``mask`` spans both). On
    the CPU's plain path they are attended where they lie (``grouped``): a decoding step reads each block's cache
    once instead of copying it next to the token's own key; elsewhere they are concatenated first."""
    q, scale, options = checked_options(options).queries(q, scale)
    if past is not None and not (options.plain and sinks is None and platform() == "cpu"):
        (k, v), past = joined(past, k, v), None
    if sinks is not None:
        return mix(sink_probabilities(scores(q, k, scale, mask, options), sinks)[0], v)
    if not options.plain:
        return mix(probabilities(scores(q, k, scale, mask, options)).astype(v.dtype), v)
    bias = None if options.alibi is None else alibi_bias(options.alibi, mask, q.dtype)
    if platform() == "cpu":
        return grouped(q, k, v, scale, mask, bias, past)
    t = lambda x: jnp.swapaxes(x, 1, 2)
    return jax.nn.dot_product_attention(t(q), t(k), t(v), bias=bias, mask=mask, scale=scale)


def joined(
    past: tuple[Float[Array, "batch kv_heads cached dim"], Float[Array, "batch kv_heads cached dim"]],
    k: Float[Array, "batch kv_heads k dim"], v: Float[Array, "batch kv_heads k dim"],
) -> tuple[Float[Array, "batch kv_heads cached+k dim"], Float[Array, "batch kv_heads cached+k dim"]]:
    """The cached ``(keys, values)`` then ``k`` and ``v``, on the key axis, in ``k``'s and ``v``'s dtypes (a copy of
    the cache: what ``grouped`` avoids on the CPU's plain path)."""
    return tuple(jnp.concatenate([cached.astype(own.dtype), own], axis=2) for cached, own in zip(past, (k, v)))


def grouped(
    q: Float[Array, "batch heads q dim"], k: Float[Array, "batch kv_heads k dim"], v: Float[Array, "batch kv_heads k dim"],
    scale: float, mask: Bool[Array, "batch 1 q k"] | None, bias: Float[Array, "batch heads q k"] | None = None,
    past: tuple[Float[Array, "batch kv_heads cached dim"], Float[Array, "batch kv_heads cached dim"]] | None = None,
) -> Float[Array, "batch q heads dim"]:
    """``jax.nn.dot_product_attention``'s XLA computation (float32 logits from the inputs' dtype, scaled, plus
    ``bias``, masked entries set to ``-0.7 · max``, softmax in float32, probabilities cast to the keys' dtype, times
    the values), laid out for the CPU: each key/value head's query heads are one matrix of ``group · q`` rows
    (``q`` as it comes, head-major: a free reshape), so both products are plain batched matrix products over
    ``[batch, kv_heads]`` in the arrays' own layout, and the softmax runs over contiguous rows; only the output is
    transposed to ``[batch, q, heads, dim]``. (JAX's own runs the products once per query head of a group and
    transposes the queries, the probabilities and the output around them.)

    ``past``: cached ``(keys, values)`` before ``k`` and ``v`` on the key axis (``mask`` and ``bias`` span both),
    each multiplied where it lies: the logits of both joined (one softmax over every key), the values' products
    summed in float32 and cast once, so no copy of the cache next to the new keys is made."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    g = h // kv
    dtype = jnp.promote_types(q.dtype, jnp.float32)
    precision = {jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
                 jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32}.get(jnp.dtype(q.dtype))
    keys, values = ((k,), (v,)) if past is None else ((past[0].astype(k.dtype), k), (past[1].astype(v.dtype), v))
    rows = q.reshape(b, kv, g * t, d)
    logits = [jnp.einsum("bkqd,bksd->bkqs", rows, x, precision=precision, preferred_element_type=dtype)
              for x in keys]
    logits = (logits[0] if past is None else jnp.concatenate(logits, axis=-1)).reshape(b, kv, g, t, -1)
    s = logits.shape[-1]
    logits = logits * jnp.asarray(scale, dtype)
    if bias is not None:
        logits = (logits + bias.reshape(-1, kv, g, t, s)).astype(dtype)
    if mask is not None:
        negative = -0.7 * min(float(jnp.finfo(dtype).max), float(jnp.finfo(jnp.float32).max))
        logits = jnp.where(mask[:, :, None], logits, jnp.asarray(negative, dtype))
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(k.dtype).reshape(b, kv, g * t, s)
    if past is None:
        out = jnp.einsum("bkqs,bksd->bkqd", p, v)
    else:
        cached = past[0].shape[2]
        out = sum(jnp.einsum("bkqs,bksd->bkqd", part, x, preferred_element_type=jnp.float32)
                  for part, x in zip((p[..., :cached], p[..., cached:]), values)).astype(v.dtype)
    return jnp.swapaxes(out.reshape(b, h, t, v.shape[-1]), 1, 2)
