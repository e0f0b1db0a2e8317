"""The inverse of a unit lower-triangular matrix by recursive 2x2 block inversion (the chunked gated delta
rule's ``T = (I + A)^{-1}``, :mod:`jstd.kernels.gated_delta`), in plain JAX."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

# float32 matrix products at full float32 precision (TPU/GPU would otherwise use
# bf16/tf32 passes for float32 dots; on the CPU this is free).
PRECISION = lax.Precision.HIGHEST


def precise_einsum(spec: str, a: Float[Array, "..."], b: Float[Array, "..."]) -> Float[Array, "..."]:
    """``jnp.einsum(spec, a, b)`` at ``PRECISION`` (full float32 products on every backend)."""
    return jnp.einsum(spec, a, b, precision=PRECISION)


def unit_lower_inverse(a: Float[Array, "... n n"]) -> Float[Array, "... n n"]:
    """``(I + tril(a, -1))^{-1}`` by recursive 2x2 block inversion (``n`` a power of two).

    Only the strictly lower triangle of ``a`` is read. With ``M = [[M11, 0], [M21, M22]]``,
    ``M^{-1} = [[X, 0], [-Y M21 X, Y]]`` with ``X = M11^{-1}, Y = M22^{-1}``; the diagonal
    blocks are inverted first (all of one size at once, as batched products), then merged
    pairwise: ``log2(n)`` levels of small matrix products, no powers of the matrix (which
    overflow / cancel) and no sequential row-by-row substitution. This is the standard
    recursive triangular inversion, whose error bound matches forward substitution's.
    """
    n = a.shape[-1]
    if n & (n - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two size, got {n}")
    batch = a.shape[:-2]
    # diagonal blocks of `a` at every level, from the whole matrix down to size-2 blocks:
    # diag[s] has shape [..., n // (2s), 2s, 2s] (the diagonal 2s-blocks)
    diag = {}
    cur = a[..., None, :, :]  # [..., 1, n, n]
    s = n // 2
    while s >= 1:
        diag[s] = cur
        top = cur[..., :s, :s]
        bot = cur[..., s:, s:]
        cur = jnp.stack([top, bot], axis=-3).reshape(*batch, -1, s, s)
        s //= 2
    inv = jnp.ones((*batch, n, 1, 1), a.dtype)  # inverses of the 1x1 diagonal blocks
    s = 1
    while s < n:
        m21 = diag[s][..., s:, :s]  # [..., n // 2s, s, s]
        pair = inv.reshape(*batch, -1, 2, s, s)
        x, y = pair[..., 0, :, :], pair[..., 1, :, :]
        if s == 1:
            z = -m21  # x = y = 1
        elif s < 16:  # tiny blocks: an elementwise multiply-reduce, not tiny matrix products
            ym = jnp.sum(y[..., :, :, None] * m21[..., None, :, :], axis=-2)
            z = -jnp.sum(ym[..., :, :, None] * x[..., None, :, :], axis=-2)
        else:
            z = -precise_einsum("...ij,...jk->...ik", precise_einsum("...ij,...jk->...ik", y, m21), x)
        zeros = jnp.zeros_like(x)
        inv = jnp.concatenate(
            [jnp.concatenate([x, zeros], axis=-1), jnp.concatenate([z, y], axis=-1)], axis=-2
        )
        s *= 2
    return inv[..., 0, :, :]
