"""Softmax attention: the mask, the explicit path and the fused path.

Layouts: queries [batch, heads, seq, dim], keys and values
[batch, kv_heads, seq, dim] (before the grouped-query repeat: query head h
reads key/value head h // (heads // kv_heads)), outputs [batch, seq, heads, dim].
Both paths compute the same function; the explicit one materializes the scores
and the probabilities so that they can be read and edited.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


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


def scores(
    q: Float[Array, "batch heads q dim"], k: Float[Array, "batch kv_heads k dim"], scale: float,
    mask: Bool[Array, "batch 1 q k"] | None,
) -> Float[Array, "batch heads q k"]:
    """scale · q·kᵀ, masked entries set to the dtype's minimum (as transformers' eager attention); ``mask``
    None attends everywhere (a vision tower)."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, h // kv, t, d)
    s = jnp.einsum("bkgqd,bksd->bkgqs", qg, k).reshape(b, h, t, k.shape[2]) * jnp.asarray(scale, q.dtype)
    return s if mask is None else jnp.where(mask, s, jnp.finfo(s.dtype).min)


def probabilities(scores: Float[Array, "batch heads q k"]) -> Float[Array, "batch heads q k"]:
    """Softmax over keys in float32, cast back to the scores' dtype."""
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(scores.dtype)


def mix(p: Float[Array, "batch heads q k"], v: Float[Array, "batch kv_heads k dim"]) -> Float[Array, "batch q heads dim"]:
    """Each head's pattern times its key/value head's values."""
    b, h, t, s = p.shape
    kv = v.shape[1]
    out = jnp.einsum("bkgqs,bksd->bqkgd", p.reshape(b, kv, h // kv, t, s), v)
    return out.reshape(b, t, h, v.shape[-1])


def fused(
    q: Float[Array, "batch heads q dim"], k: Float[Array, "batch kv_heads k dim"], v: Float[Array, "batch kv_heads k dim"],
    scale: float, mask: Bool[Array, "batch 1 q k"] | None,
) -> Float[Array, "batch q heads dim"]:
    """The same function through ``jax.nn.dot_product_attention`` (cuDNN/flash where available)."""
    t = lambda x: jnp.swapaxes(x, 1, 2)
    return jax.nn.dot_product_attention(t(q), t(k), t(v), mask=mask, scale=scale)
