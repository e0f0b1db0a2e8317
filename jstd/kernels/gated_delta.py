"""Gated delta rule (Gated DeltaNet) linear attention in plain JAX.

The recurrence, per batch element and value head, with a float32 state ``S`` of
shape ``[key_dim, value_dim]`` and for each token ``t``::

    S     <- exp(g_t) * S                      # gated decay (g_t <= 0 is a log decay)
    delta  = beta_t * (v_t - S^T k_t)          # delta rule: write only the correction
    S     <- S + k_t delta^T
    o_t    = S^T q_t                           # q_t is scaled by 1/sqrt(key_dim)

Two forms compute it:

* :func:`recurrent_gated_delta_rule` runs the recurrence token by token under
  ``lax.scan`` (the decoding form, and the reference for the others).
* :func:`chunk_gated_delta_rule` runs it by chunks of ``C`` tokens (the WY / UT
  representation; ``C = 32`` by default): everything inside a chunk is a handful of
  matrix products and a CxC unit-triangular inverse (:mod:`jstd.kernels.triangular`), and
  only the ``[key_dim, value_dim]`` state is carried from chunk to chunk by a ``lax.scan``.
  Its memory grows linearly in the sequence length (only the inputs and outputs do; the
  working set is one chunk).

A Pallas version of the chunked form lives in :mod:`jstd.kernels.pallas.gated_delta`;
:mod:`jstd.kernels.select` picks among the three by backend (what the DeltaNet mixer calls).

Conventions, shared by all forms and matching transformers'
``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``:

* layouts are ``[batch, seq, heads, dim]``: ``q, k: [B, T, Hk, Dk]``,
  ``v: [B, T, Hv, Dv]``, ``g, beta: [B, T, Hv]``; states ``[B, Hv, Dk, Dv]``.
  ``Hv`` must be a multiple of ``Hk``: each query/key head serves ``Hv // Hk``
  consecutive value heads (``repeat_interleave`` semantics).
* all arithmetic is float32 whatever the input dtypes (inputs are upcast first);
  the output has ``q``'s dtype and the states are float32. (Exception: if an input is
  float64, with x64 enabled, everything runs in float64; the reference would use float32.)
* with ``use_qk_l2norm`` q and k are normalised as ``x * rsqrt(sum(x**2) + 1e-6)``
  (eps *inside* the rsqrt, as FLA and transformers do), then q is always scaled by
  ``key_dim ** -0.5``.

Mathematically the forms are equal; numerically they differ by float32 rounding
only (they sum the same terms in different orders).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from jstd.kernels.triangular import precise_einsum, unit_lower_inverse

__all__ = [
    "chunk_gated_delta_rule",
    "l2norm",
    "recurrent_gated_delta_rule",
    "unit_lower_inverse",  # jstd.kernels.triangular's, used by the chunked form (and cited here by benchmarks)
]

L2NORM_EPS = 1e-6


def l2norm(x: Float[Array, "... d"], eps: float = L2NORM_EPS) -> Float[Array, "... d"]:
    """``x * rsqrt(sum(x**2, -1) + eps)``: the FLA / transformers l2norm (eps inside the rsqrt)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class Prepared(NamedTuple):
    q: Array  # [B, T, H, Dk] float32, (normalised,) scaled
    k: Array  # [B, T, H, Dk] float32, (normalised)
    v: Array  # [B, T, H, Dv] float32
    g: Array  # [B, T, H] float32
    beta: Array  # [B, T, H] float32
    state: Array  # [B, H, Dk, Dv] float32


def _check(q, k, v, g, beta, initial_state):
    """Validates shapes; returns (B, T, Hk, Hv, Dk, Dv, compute dtype)."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must share a [batch, seq, heads, key_dim] shape, got {q.shape} and {k.shape}")
    B, T, Hk, Dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [batch, seq, heads, value_dim] matching q, got {v.shape} for q {q.shape}")
    Hv, Dv = v.shape[2:]
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"g and beta must be [batch, seq, value_heads] = {(B, T, Hv)}, got {g.shape} and {beta.shape}")
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of query/key heads ({Hk})")
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise ValueError(
            f"initial_state must be [batch, heads, key_dim, value_dim] = {(B, Hv, Dk, Dv)}, got {initial_state.shape}"
        )
    # float32 arithmetic (float64 only if an input is float64, e.g. for gradient checks under x64)
    dtype = jnp.promote_types(jnp.float32, jnp.result_type(q, k, v, g, beta))
    return B, T, Hk, Hv, Dk, Dv, dtype


def _initial_state(initial_state, shape, dtype):
    return jnp.zeros(shape, dtype) if initial_state is None else initial_state.astype(dtype)


def _prep_qkv(q, k, v, g, beta, *, n_rep, use_qk_l2norm, dtype):
    """Upcasts, expands grouped q/k heads, normalises and scales: any [B, T, H, ...] slice."""
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    if n_rep > 1:
        q = jnp.repeat(q, n_rep, axis=2)
        k = jnp.repeat(k, n_rep, axis=2)
    if use_qk_l2norm:
        q = l2norm(q)
        k = l2norm(k)
    return q * (q.shape[-1] ** -0.5), k, v, g, beta


def prepare(q, k, v, g, beta, initial_state, use_qk_l2norm) -> Prepared:
    """Checks shapes, expands grouped q/k heads, upcasts to float32, normalises and scales q/k."""
    B, T, Hk, Hv, Dk, Dv, dtype = _check(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = _prep_qkv(q, k, v, g, beta, n_rep=Hv // Hk, use_qk_l2norm=use_qk_l2norm, dtype=dtype)
    return Prepared(q, k, v, g, beta, _initial_state(initial_state, (B, Hv, Dk, Dv), dtype))


# ----------------------------------------------------------------------------------------------
# Recurrent form
# ----------------------------------------------------------------------------------------------


def recurrent_gated_delta_rule(
    q: Float[Array, "batch seq qk_heads key_dim"],
    k: Float[Array, "batch seq qk_heads key_dim"],
    v: Float[Array, "batch seq heads value_dim"],
    g: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    *,
    initial_state: Float[Array, "batch heads key_dim value_dim"] | None = None,
    use_qk_l2norm: bool = False,
    return_states: bool = False,
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """Gated delta rule, token by token under ``lax.scan``.

    Args:
        q, k: ``[batch, seq, qk_heads, key_dim]``, any float dtype.
        v: ``[batch, seq, heads, value_dim]``; ``heads`` a multiple of ``qk_heads``.
        g: ``[batch, seq, heads]`` log decay (the state is multiplied by ``exp(g)``).
        beta: ``[batch, seq, heads]`` write strength.
        initial_state: optional ``[batch, heads, key_dim, value_dim]`` state (zeros if
            omitted); upcast to float32.
        use_qk_l2norm: l2-normalise q and k (eps 1e-6 inside the rsqrt) before use.
        return_states: static flag; also return the state after every token.

    Returns:
        ``(out, final_state)``, or ``(out, final_state, states)`` with ``return_states``:
        ``out`` is ``[batch, seq, heads, value_dim]`` in ``q.dtype``; ``final_state`` is
        ``[batch, heads, key_dim, value_dim]`` float32; ``states`` is
        ``[batch, seq, heads, key_dim, value_dim]`` float32 (``states[:, t]`` is the state
        after token ``t``, ``states[:, -1] == final_state``).

    All arithmetic is float32. Per step the state is read twice (one product giving
    ``S^T k`` and ``S^T q`` from the state before the update, one fused decay-and-write),
    which is algebraically the reference's ``o = (S_new)^T q``.
    """
    out_dtype = q.dtype
    p = prepare(q, k, v, g, beta, initial_state, use_qk_l2norm)
    # time-major for the scan
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (p.q, p.k, p.v, p.g, p.beta))

    def step(S, x):
        qt, kt, vt, gt, bt = x  # [B, H, D*] / [B, H]
        decay = jnp.exp(gt)[..., None]  # [B, H, 1]
        # one pass over the old state for both reads: S^T [k, q]
        reads = precise_einsum("bhkv,bhnk->bhnv", S, jnp.stack([kt, qt], axis=2)) * decay[..., None]
        delta = bt[..., None] * (vt - reads[:, :, 0])  # [B, H, Dv]
        # o = (e^g S + k delta^T)^T q = e^g S^T q + delta (k . q)
        o = reads[:, :, 1] + delta * jnp.sum(kt * qt, axis=-1, keepdims=True)
        S = S * decay[..., None] + kt[..., :, None] * delta[..., None, :]
        return S, ((o, S) if return_states else o)

    final, ys = lax.scan(step, p.state, xs)
    if return_states:
        o, states = ys
        return jnp.moveaxis(o, 0, 1).astype(out_dtype), final, jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(ys, 0, 1).astype(out_dtype), final


# ----------------------------------------------------------------------------------------------
# Chunked (WY / UT) form
# ----------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunk_size_for(T: int, chunk_size: int) -> int:
    """The chunk length for ``T`` tokens: ``chunk_size`` (a power of two), or the smallest power of two covering a
    shorter sequence."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    # short sequences use a smaller chunk (any chunk size gives the same result)
    return min(chunk_size, _next_pow2(max(T, 1)))


def to_chunks(x: Array, C: int) -> Array:
    """[B, Tp, H, ...] -> [N, B, H, C, ...] (chunk-major, heads before positions)."""
    B, Tp, H = x.shape[:3]
    x = x.reshape(B, Tp // C, C, H, *x.shape[3:])
    return jnp.moveaxis(x, (1, 2), (0, 3))


def _batch_to_chunk_major(x: Array, C: int) -> Array:
    """[B, N*C, ...] -> [N, B, C, ...], or [N, C, ...] when B == 1 (a free reshape).

    (With B == 1 the size-1 batch axis is dropped: XLA would otherwise give the reshaped
    array a layout that it copies before the loop.)
    """
    B, Tp = x.shape[:2]
    if B == 1:
        return x.reshape(Tp // C, C, *x.shape[2:])
    return jnp.moveaxis(x.reshape(B, Tp // C, C, *x.shape[2:]), 1, 0)


def _chunk_major_to_batch(x: Array, B: int) -> Array:
    """Inverse of :func:`_batch_to_chunk_major`."""
    if B == 1:
        return x.reshape(1, -1, *x.shape[2:])
    return jnp.moveaxis(x, 0, 1).reshape(B, -1, *x.shape[3:])


def pad_time(x: Array, pad: int) -> Array:
    """``x`` ``[B, T, ...]`` with ``pad`` zero positions appended on the time axis."""
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths)


def _pairwise_decay(gamma: Array, mask: Array) -> Array:
    """``exp(gamma_i - gamma_j)`` where ``mask`` holds, else 0; gamma: [..., C] -> [..., C, C].

    The mask is applied before the exp so that the excluded (positive) differences never
    overflow. The differences come from a K=2 product ``[gamma_i, 1] . [1, -gamma_j]``
    (exact: one rounding, like a subtraction) rather than a broadcast subtraction: XLA's CPU
    backend does not vectorise an exp fused with an outer broadcast (10x slower).
    """
    one = jnp.ones_like(gamma)
    diff = precise_einsum("...ik,...jk->...ij", jnp.stack([gamma, one], -1), jnp.stack([one, -gamma], -1))
    return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def _qk_scales(x: Array, scale: float, *, use_qk_l2norm: bool, dtype) -> Array:
    """Per-row factors ``[..., D] -> [...]`` that :func:`_prep_qkv` would apply to ``x``:
    ``scale * rsqrt(sum(x**2) + eps)`` with the l2norm, else just ``scale``."""
    if not use_qk_l2norm:
        return jnp.full(x.shape[:-1], scale, dtype)
    x = x.astype(dtype)
    return lax.rsqrt(jnp.sum(x * x, axis=-1) + L2NORM_EPS) * scale


def _chunk_body(S, z, v, g, beta, sk, sq):
    """One chunk of ``C`` tokens for all batch elements and heads.

    ``S``: [B, H, Dk, Dv] incoming state; ``z``: [B, H, 2C, Dk] the chunk's *raw* keys
    then queries (upcast, heads expanded, neither normalised nor scaled); ``sk, sq``:
    [B, H, C] the row factors that turn them into the prepared k and q (l2norm and, for q,
    ``Dk ** -0.5``); ``v``: [B, H, C, Dv]; ``g, beta``: [B, H, C]. Returns (outgoing
    state, out [B, H, C, Dv], deltas [B, H, C, Dv]).

    The row factors are applied to the products' results, which are small (C x C) or are
    read by an element-wise step anyway, instead of to the inputs
    (``(diag(s) X) Y = diag(s) (X Y)``): both big products with ``z`` (``z k^T`` and
    ``z S``) read it as is, and no normalised copy of q and k is formed.
    """
    C = z.shape[-2] // 2
    gamma = jnp.cumsum(g, axis=-1)  # log decay from the chunk start
    i = jnp.arange(C)
    dec = _pairwise_decay(gamma, i[:, None] >= i[None, :])  # causal, incl. diagonal
    col = sk[..., None, :]  # k_j's factor, for the columns of k k^T and q k^T
    zk = precise_einsum("bhik,bhjk->bhij", z, z[..., :C, :])  # raw k k^T and q k^T in one product
    # strictly lower UT system A = beta k k^T * decay, and P = q k^T * decay
    a = jnp.where(i[:, None] > i[None, :], zk[..., :C, :] * ((beta * sk)[..., :, None] * col) * dec, 0.0)
    p = zk[..., C:, :] * (sq[..., :, None] * col) * dec
    t = unit_lower_inverse(a)  # T = (I + A)^{-1}
    e = jnp.exp(gamma)
    r = precise_einsum("bhik,bhkv->bhiv", z, S)  # raw k S and q S in one product with the state
    # the delta-rule corrections (= the recurrence's deltas): T (beta v - beta e^gamma k S)
    delta = precise_einsum("bhij,bhjv->bhiv", t, (v - r[..., :C, :] * (e * sk)[..., None]) * beta[..., None])
    o = r[..., C:, :] * (e * sq)[..., None] + precise_einsum("bhij,bhjv->bhiv", p, delta)
    glast = gamma[..., -1:]
    # keys decayed to the chunk end, formed transposed ([Dk, C]): the state update is then
    # a plain (non-transposed) batched product, which XLA's CPU backend runs faster
    kd_t = jnp.swapaxes(z[..., :C, :] * (jnp.exp(glast - gamma) * sk)[..., None], -1, -2)
    S_new = S * jnp.exp(glast)[..., None] + precise_einsum("bhkc,bhcv->bhkv", kd_t, delta)
    return S_new, o, delta


def in_chunk_states(starts, deltas, k, g):
    """States after every token from the chunk-start states and the deltas.

    starts [N, B, H, Dk, Dv]; deltas [N, B, H, C, Dv]; k [N, B, H, C, Dk]; g [N, B, H, C].
    Returns [B, N*C, H, Dk, Dv]. Runs the (now linear) recurrence S <- e^g S + k delta^T
    over the C positions of all chunks at once.
    """
    xs = (jnp.moveaxis(g, -1, 0), jnp.moveaxis(k, -2, 0), jnp.moveaxis(deltas, -2, 0))

    def step(S, x):
        gc, kc, dc = x
        S = S * jnp.exp(gc)[..., None, None] + kc[..., :, None] * dc[..., None, :]
        return S, S

    _, states = lax.scan(step, starts, xs)  # [C, N, B, H, Dk, Dv]
    B, H = starts.shape[1:3]
    states = states.transpose(2, 1, 0, 3, 4, 5)  # [B, N, C, H, Dk, Dv]
    return states.reshape(B, -1, H, *starts.shape[-2:])


def chunk_gated_delta_rule(
    q: Float[Array, "batch seq qk_heads key_dim"],
    k: Float[Array, "batch seq qk_heads key_dim"],
    v: Float[Array, "batch seq heads value_dim"],
    g: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    *,
    initial_state: Float[Array, "batch heads key_dim value_dim"] | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 32,
    return_states: bool = False,
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """Gated delta rule by chunks (WY / UT representation), in plain JAX.

    Same arguments, layouts, dtypes and returns as :func:`recurrent_gated_delta_rule`,
    plus ``chunk_size`` (a power of two; sequences shorter than it use the next power of
    two above their length). Any chunk size gives the same result up to float32 rounding.
    The default, 32, is the fastest on the 2-core CPU of ``benchmarks/gated_delta.py``
    (float32, 8 heads of 128, 2048 tokens: ~25% faster than 64; 16 is close, and ahead
    when only one core is free): per token, the products that only a chunked form does
    (``k k^T``, ``q k^T``, the inverse and the two products with it) grow with ``C``,
    while the state products (``k S``, ``q S`` and the update, as many as the recurrence
    does) do not; smaller chunks mean more, smaller steps.

    Inside each chunk of ``C`` tokens, with ``gamma`` the in-chunk cumulative log decay,
    ``A = strict_tril(beta k k^T * exp(gamma_i - gamma_j))`` and ``T = (I + A)^{-1}``
    (inverted by :func:`unit_lower_inverse`), the deltas are
    ``delta = T (beta v) - T (beta e^gamma k) S`` for the incoming state ``S``; the outputs
    ``e^gamma q S + P delta`` with ``P = tril(q k^T * exp(gamma_i - gamma_j))``; and the
    outgoing state ``e^gamma_C S + (k e^(gamma_C - gamma))^T delta``. A ``lax.scan`` over
    the chunks carries the float32 state; each step works on one chunk of all batch
    elements and heads (batched products), reading the raw inputs in place (the l2norm and
    scale factors of q and k are computed once, per row, and applied to products, see
    :func:`_chunk_body`), so the memory is
    linear in the sequence length and the working set stays cache-sized. The sequence is
    padded to a multiple of ``C`` with ``g = beta = 0`` (and zero q, k, v), which is exact:
    a padded token neither decays nor writes the state. Per-token states are only formed
    with ``return_states`` (from the chunk-start states and the deltas).
    """
    out_dtype = q.dtype
    B, T, Hk, H, Dk, Dv, dtype = _check(q, k, v, g, beta, initial_state)
    state = _initial_state(initial_state, (B, H, Dk, Dv), dtype)
    C = chunk_size_for(T, chunk_size)
    pad = (-T) % C
    # the l2norm / scale factors of every q and k row, [B, T, Hk]: one pass over q and k
    sq = _qk_scales(q, Dk**-0.5, use_qk_l2norm=use_qk_l2norm, dtype=dtype)
    sk = _qk_scales(k, 1.0, use_qk_l2norm=use_qk_l2norm, dtype=dtype)
    # chunk-major views of the raw inputs: [N, B, C, H, ...] (free for B == 1)
    xs = tuple(_batch_to_chunk_major(pad_time(x, pad), C) for x in (q, k, v, g, beta, sk, sq))
    heads_major = lambda x: jnp.swapaxes(x.astype(dtype), 1, 2)  # [B, C, H, ...] -> [B, H, C, ...]
    expand = lambda x: jnp.repeat(x, H // Hk, axis=1) if H > Hk else x  # grouped q/k heads

    def step(S, x):
        if B == 1:
            x = tuple(y[None] for y in x)
        qc, kc, vc, gc, bc, skc, sqc = (heads_major(y) for y in x)
        z = expand(jnp.concatenate([kc, qc], axis=-2))  # [B, H, 2C, Dk]
        S_new, o, delta = _chunk_body(S, z, vc, gc, bc, expand(skc), expand(sqc))
        o = jnp.swapaxes(o, 1, 2).astype(out_dtype)
        if B == 1:
            o = o[0]
        if return_states:  # the prepared keys, for the per-token states
            return S_new, (o, S, delta, z[..., :C, :] * expand(skc)[..., None], gc)
        return S_new, o

    final, ys = lax.scan(step, state, xs)
    o = ys[0] if return_states else ys
    out = _chunk_major_to_batch(o, B)[:, :T]
    if return_states:
        _, starts, deltas, kc, gc = ys
        return out, final, in_chunk_states(starts, deltas, kc, gc)[:, :T]
    return out, final
