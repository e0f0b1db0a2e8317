"""Soft-capping (Gemma 2's attention scores and final logits): ``tanh(x / cap) · cap``, rounded as torch rounds it."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float


def softcap(x: Float[Array, "..."], cap: float | None) -> Float[Array, "..."]:
    """``tanh(x / cap) · cap`` in ``x``'s dtype, each of the three steps rounded to it (torch's ``x / c``,
    ``tanh``, ``· c`` on a tensor, each computed in float32 and cast back); ``cap`` None: ``x`` itself.

    Bounded by ``±cap``, close to the identity for ``|x| ≪ cap``; the slope at 0 is 1."""
    if cap is None:
        return x
    f32, dtype, c = jnp.float32, x.dtype, jnp.float32(cap)
    y = (x.astype(f32) / c).astype(dtype)
    y = jnp.tanh(y.astype(f32)).astype(dtype)
    return (y.astype(f32) * c).astype(dtype)
