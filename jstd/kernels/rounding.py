"""Rounding a value before its consumers read it, where XLA would otherwise fuse past it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@jax.custom_jvp
def rounded(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """``x`` itself, rounded to its dtype before any consumer reads it.

    XLA contracts a multiply feeding an add into one fused multiply-add, which
    adds the *unrounded* product: a block adding a norm's output (``weight ·
    normed``) would add something other than the value read at the site, and
    an edit there would change the rounding where it does not edit.
    ``nextafter(x, x)`` is exactly ``x`` but opaque to the compiler, so the
    product is rounded once, as torch rounds it. (``lax.optimization_barrier``
    is gone before fusion.) The same trick as HyperCLOVA X's contributions.
    """
    return jnp.nextafter(x, x)


@rounded.defjvp
def _rounded_jvp(primals, tangents):
    # the identity: gradients pass unchanged (nextafter has no differentiation rule)
    return rounded(primals[0]), tangents[0]


def times(x: Float[Array, "..."], multiplier: float) -> Float[Array, "..."]:
    """``x * multiplier`` as torch computes a tensor times a Python float: in float32, cast back.

    (In bfloat16 torch keeps the scalar at float32 precision; rounding it to
    bfloat16 first, as ``x * multiplier`` would in JAX, differs for 0.3.)
    """
    return (x.astype(jnp.float32) * jnp.float32(multiplier)).astype(x.dtype)
