"""Gated delta rule, chunked form, as Pallas kernels.

Same math, signature and results as :func:`jstd.kernels.gated_delta.chunk_gated_delta_rule`
(plus ``interpret``); :mod:`jstd.kernels.select` runs it on GPU and TPU backends. The delta rule is separable
over the state's value columns (column ``j`` of ``S`` only ever reads ``v[:, j]``), so value columns split
across programs exactly. Two layouts, picked by the default backend:

* GPU (Triton) and the interpreter: the split layout, three calls over [batch x head, ...] arrays, so that
  no program holds more than a few small tiles (the sm_90a cubins spill no registers; docs/scale.md):

  1. ``gated_delta_ut``, grid (batch x head, chunk), chunks in parallel: the UT transform of each chunk,
     ``w = T (beta e^gamma k)`` and ``u = T (beta v)``;
  2. ``gated_delta_state``, grid (batch x head, value block), the only sequential part: a ``fori_loop`` over
     the chunks carrying the float32 state ``[key_dim, block_v]`` (in row blocks), storing each chunk's start
     state and its corrections ``delta = u - w S``;
  3. ``gated_delta_out``, grid (batch x head, chunk, value block), in parallel:
     ``o = (e^gamma q) S_start + (q k^T decay) delta``.

  Tiles, warps and product precision: :class:`SplitConfig` (``GPU``). The chunk-start states
  ``[B, H, N, key_dim, value_dim]`` float32 are materialised between the calls.
* TPU (Mosaic): one call, grid (batch, head, value block, chunk) with the chunk axis sequential
  (``"arbitrary"``), one chunk's blocks per step (VMEM holds a chunk, not the sequence) and the state in a
  VMEM scratch buffer.

On a mesh (``jax.set_mesh``) the kernels run once per shard under ``jax.shard_map``, rows
over ``data`` and heads over ``model`` (XLA cannot partition a Pallas call; see
``_per_shard``), so they compose with jstd's sharding rules and with ``vmap``.

No accelerator was available to run them here. Both layouts are tested with the Pallas
interpreter on the CPU (on a 2 x 2 mesh too), both lower (to Triton IR and to Mosaic TPU
MLIR), and with the ``aot`` extra the TPU layout compiles through libtpu's Mosaic for a
v5e slice and the split layout's kernels compile to sm_90a cubins without register spills
(``jstd.aot.kernels.triton_cubins``; tests/test_aot.py). Lowering-friendly by construction:

* only 2-D values, loads/stores of power-of-two ``[chunk, dim]`` tiles (Triton's
  constraint: head dims must be powers of two on GPUs), chunks of at least 16 (Triton's
  smallest dot), no value slicing, no cumsum / gather / dynamic value indexing in the
  kernel (the in-chunk cumulative decay is computed outside, as a column and a row);
* the UT inverse ``(I + A)^{-1}`` is the recursive 2x2-block inversion written with
  full ``[C, C]`` products and iota masks: ``T <- T - T E_s T`` for ``s = 2, 4, ..., C/2``
  where ``E_s`` keeps ``A``'s off-diagonal ``s``-blocks inside each ``2s``-block. The
  zero blocks add exact zeros, so it is numerically the block algorithm (stable; no
  matrix powers);
* float32 products at ``Precision.HIGHEST`` (IEEE on Triton, full f32 on Mosaic); column blocks are
  loaded from refs (``ref[:, pl.ds(...)]``), never sliced from values;
* Triton is asked for explicitly on GPUs (this JAX defaults ``pallas_call`` to Mosaic
  GPU, whose blocks must fit in shared memory).

Gradients: a ``custom_vjp`` whose backward pass is the VJP of the plain-JAX chunked
form (recomputed from the inputs), so gradients equal the plain form's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from jstd.kernels import gated_delta as _gd
from jstd.kernels.platform import platform

__all__ = ["pallas_chunk_gated_delta_rule"]

_HI = lax.Precision.HIGHEST


def _dot(a, b, contract=(1, 0), precision=_HI):
    """2-D product contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``."""
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision, preferred_element_type=a.dtype
    )


def _unit_lower_inverse_masked(a, row, col, precision=_HI):
    """``(I + strict_tril(a))^{-1}`` for a [C, C] value, C a power of two, with masked full products."""
    C = a.shape[0]
    # level s = 1: the 2x2 blocks' inverse is I - (their sub-diagonal entry)
    same2 = (row >> 1) == (col >> 1)
    t = jnp.where(row == col, 1.0, 0.0) - jnp.where(same2 & (row > col), a, 0.0)
    s, shift = 2, 1
    while s < C:
        # the off-diagonal s-block (lower-left) inside each 2s-block of `a`
        e_mask = ((row >> (shift + 1)) == (col >> (shift + 1))) & (((row >> shift) & 1) == 1) & (((col >> shift) & 1) == 0)
        e = jnp.where(e_mask, a, 0.0)
        t = t - _dot(_dot(t, e, precision=precision), t, precision=precision)
        s, shift = s * 2, shift + 1
    return t


def _chunk(S, qc, kc, vc, bc, gcol, grow):
    """One chunk for one (batch, head, value block); all values 2-D.

    S [Dk, BV] incoming state; qc, kc [C, Dk]; vc [C, BV]; bc, gcol [C, 1] (beta and the
    in-chunk cumulative log decay as columns); grow [1, C] (the same decay as a row).
    Returns (outgoing state, out [C, BV], deltas [C, BV]).
    """
    C = qc.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    last = lax.broadcasted_iota(jnp.int32, (1, C), 1) == C - 1
    glast = jnp.sum(jnp.where(last, grow, 0.0), axis=1, keepdims=True)  # [1, 1]
    dec = jnp.exp(jnp.where(row >= col, gcol - grow, -jnp.inf))  # [C, C], masked before the exp
    kk = _dot(kc, kc, (1, 1))
    qk = _dot(qc, kc, (1, 1))
    a = jnp.where(row > col, bc * kk * dec, 0.0)
    t = _unit_lower_inverse_masked(a, row, col)
    e = jnp.exp(gcol)  # [C, 1]
    # the delta-rule corrections T (beta v - beta e^gamma k S), then the outputs
    delta = _dot(t, vc * bc - _dot(kc * (bc * e), S))  # [C, BV]
    o = _dot(qc * e, S) + _dot(qk * dec, delta)
    kd = kc * jnp.exp(glast - gcol)  # [C, Dk] keys decayed to the chunk end
    return S * jnp.exp(glast) + _dot(kd, delta, (0, 0)), o, delta


def _ut_kernel(k_ref, v_ref, b_ref, gc_ref, gr_ref, w_ref, u_ref, *, block, precision):
    """Grid (batch x head, chunk), all chunks in parallel: the chunk's UT transform, ``w = T (beta e^gamma k)``
    [C, Dk] and ``u = T (beta v)`` [C, Dv], with ``T = (I + strict_tril(beta k k^T decay))^{-1}``; the
    products go ``block`` columns at a time (loaded from the refs by column block)."""
    bc, gcol = b_ref[...], gc_ref[...]
    C = bc.shape[0]
    blocks = lambda ref: [pl.ds(i, block) for i in range(0, ref.shape[1], block)]
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    dec = jnp.exp(jnp.where(row >= col, gcol - gr_ref[...], -jnp.inf))  # [C, C], masked before the exp
    kk = functools.reduce(jnp.add, (_dot(k_ref[:, c], k_ref[:, c], (1, 1), precision) for c in blocks(k_ref)))
    t = _unit_lower_inverse_masked(jnp.where(row > col, bc * kk * dec, 0.0), row, col, precision)
    bk = bc * jnp.exp(gcol)
    for c in blocks(k_ref):
        w_ref[:, c] = _dot(t, k_ref[:, c] * bk, precision=precision)
    for c in blocks(v_ref):
        u_ref[:, c] = _dot(t, v_ref[:, c] * bc, precision=precision)


def _state_kernel(w_ref, u_ref, k_ref, gc_ref, gr_ref, s0_ref, h_ref, d_ref, sf_ref, *, C, N, block_k, precision):
    """Grid (batch x head, value block): the only sequential part. Walks the N chunks with a fori_loop carrying
    the float32 state ``[Dk, BV]`` as ``Dk / block_k`` row blocks; per chunk it stores the chunk-start state
    and the corrections ``delta = u - w S`` and moves the state to the chunk's end."""
    Dk = k_ref.shape[1]
    cols = [pl.ds(i * block_k, block_k) for i in range(Dk // block_k)]

    def body(n, S):
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        delta = u_ref[rows, :]
        for c, s in zip(cols, S):
            h_ref[n, c, :] = s
            delta = delta - _dot(w_ref[rows, c], s, precision=precision)
        d_ref[rows, :] = delta
        gcol, grow = gc_ref[rows, :], gr_ref[n]
        last = lax.broadcasted_iota(jnp.int32, grow.shape, 1) == C - 1
        glast = jnp.sum(jnp.where(last, grow, 0.0), axis=1, keepdims=True)  # [1, 1]
        decay_to_end = jnp.exp(glast - gcol)  # [C, 1]
        return tuple(s * jnp.exp(glast) + _dot(k_ref[rows, c] * decay_to_end, delta, (0, 0), precision)
                     for c, s in zip(cols, S))

    S = lax.fori_loop(0, N, body, tuple(s0_ref[c, :] for c in cols))
    for c, s in zip(cols, S):
        sf_ref[c, :] = s


def _output_kernel(q_ref, k_ref, gc_ref, gr_ref, h_ref, d_ref, o_ref, *, precision):
    """Grid (batch x head, chunk, value block), all in parallel: ``o = (e^gamma q) S_start + (q k^T decay) delta``."""
    q, gcol = q_ref[...], gc_ref[...]
    C = q.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    dec = jnp.exp(jnp.where(row >= col, gcol - gr_ref[...], -jnp.inf))
    qk = _dot(q, k_ref[...], (1, 1), precision) * dec
    o = _dot(q * jnp.exp(gcol), h_ref[...], precision=precision) + _dot(qk, d_ref[...], precision=precision)
    o_ref[...] = o.astype(o_ref.dtype)


def _blocked_kernel(q_ref, k_ref, v_ref, b_ref, gc_ref, gr_ref, s0_ref, o_ref, sf_ref, *refs, N, return_states):
    """Grid (batch, head, value block, chunk) with the chunk axis sequential ("arbitrary"),
    one chunk's blocks per step and the state in a VMEM scratch (the TPU / Mosaic layout:
    VMEM holds a chunk, not the sequence)."""
    *extra_refs, state_ref = refs
    n = pl.program_id(3)

    @pl.when(n == 0)
    def _():
        state_ref[...] = s0_ref[...].astype(state_ref.dtype)

    S = state_ref[...]
    S_new, o, delta = _chunk(S, q_ref[...], k_ref[...], v_ref[...], b_ref[...], gc_ref[...], gr_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)
    if return_states:
        starts_ref, deltas_ref = extra_refs
        starts_ref[...] = S
        deltas_ref[...] = delta
    state_ref[...] = S_new

    @pl.when(n == N - 1)
    def _():
        sf_ref[...] = S_new


def _default_backend() -> str:
    # the default backend's, or a deviceless compile's target (jstd.kernels.platform.compiling_for); a function, so
    # that tests can lower for another platform
    return platform()


def _block_v(Dv: int, backend: str) -> int:
    """Value columns per program of the TPU layout: the whole head up to 128 (TPU lanes)."""
    return 128 if Dv > 128 and Dv % 128 == 0 else Dv


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Tiles, warps and product precision of the split (GPU) layout; a block larger than its dimension, or not
    dividing it, gives way to the whole dimension.

    ``ut_block``: columns per product in the UT kernel; ``state_block_v`` / ``state_block_k``: value columns per
    state-kernel program and the rows of each block of its loop-carried state; ``out_block_v``: value columns per
    output-kernel program (at most the chunk); ``warps`` / ``stages``: Triton's, by kernel name; ``precision``:
    the products' on GPUs (the interpreter uses the highest). The defaults compile to sm_90a cubins without
    register spills for key and value heads of 128 at chunks of 16 and 32 (the DeltaNet mixer's; chunks of 64
    spill: docs/scale.md)."""

    ut_block: int = 32
    state_block_v: int = 16
    state_block_k: int = 32
    out_block_v: int = 32
    warps: tuple = (("gated_delta_ut", 8), ("gated_delta_state", 8), ("gated_delta_out", 8))
    stages: int = 1
    precision: object = _HI


GPU = SplitConfig()


def triton_params(kernel: str, config: SplitConfig | None = None):
    """The Triton compiler params of split-layout kernel ``kernel`` (also what ``jstd.aot.kernels`` compiles its
    cubin with). Triton explicitly: this JAX would otherwise pick Mosaic GPU, whose blocks must fit in SMEM."""
    from jax.experimental.pallas import triton as pltriton

    config = config or GPU
    return pltriton.CompilerParams(num_warps=dict(config.warps)[kernel], num_stages=config.stages)


def _split(qh, kh, vh, bcol, gcol, grow, s0, *, C, N, out_dtype, interpret, gpu):
    """The split layout: three calls over [batch x head, ...] arrays (a Triton grid has at most 3 axes).
    Returns (out [BH, Tp, Dv], final state, chunk-start states [BH, N, Dk, Dv], deltas [BH, Tp, Dv])."""
    BH, Tp, Dk = kh.shape
    Dv = vh.shape[-1]
    dt = kh.dtype
    config = GPU
    precision = config.precision if gpu else _HI
    # a block that does not divide its dimension gives way to the whole dimension; the output block is at most the
    # chunk (wider ones spilled at chunks of 16)
    fit = lambda b, d: b if d % b == 0 else d
    BU = fit(min(config.ut_block, math.gcd(Dk, Dv)), math.gcd(Dk, Dv))  # (it splits both k's and v's columns)
    BVs, BK = fit(min(config.state_block_v, Dv), Dv), fit(min(config.state_block_k, Dk), Dk)
    BVo = fit(min(config.out_block_v, Dv, C), Dv)
    sds = jax.ShapeDtypeStruct
    spec = pl.BlockSpec

    def call(kernel, name, grid, in_specs, out_specs, out_shape, *args):
        params = triton_params(name, config) if gpu and not interpret else None
        return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                              interpret=interpret, compiler_params=params, name=name)(*args)

    # 1. per chunk, in parallel: the UT transform
    chunk = lambda d: spec((None, C, d), lambda i, n: (i, n, 0))
    row_spec = spec((None, None, 1, C), lambda i, n: (i, n, 0, 0))
    w, u = call(functools.partial(_ut_kernel, block=BU, precision=precision), "gated_delta_ut", (BH, N),
                [chunk(Dk), chunk(Dv), chunk(1), chunk(1), row_spec], [chunk(Dk), chunk(Dv)],
                [sds((BH, Tp, Dk), dt), sds((BH, Tp, Dv), dt)], kh, vh, bcol, gcol, grow)
    # 2. per value block, sequential over chunks: the state
    whole = lambda *shape: spec((None, *shape), lambda i, j: (i,) + (0,) * len(shape))
    vcols = lambda *shape: spec((None, *shape), lambda i, j: (i,) + (0,) * (len(shape) - 1) + (j,))
    starts, deltas, final = call(
        functools.partial(_state_kernel, C=C, N=N, block_k=BK, precision=precision), "gated_delta_state",
        (BH, Dv // BVs), [whole(Tp, Dk), vcols(Tp, BVs), whole(Tp, Dk), whole(Tp, 1), whole(N, 1, C), vcols(Dk, BVs)],
        [vcols(N, Dk, BVs), vcols(Tp, BVs), vcols(Dk, BVs)],
        [sds((BH, N, Dk, Dv), dt), sds((BH, Tp, Dv), dt), sds((BH, Dk, Dv), dt)], w, u, kh, gcol, grow, s0)
    # 3. per chunk and value block, in parallel: the outputs
    chunk3 = lambda d: spec((None, C, d), lambda i, n, j: (i, n, 0))
    vblock = spec((None, C, BVo), lambda i, n, j: (i, n, j))
    out = call(functools.partial(_output_kernel, precision=precision), "gated_delta_out", (BH, N, Dv // BVo),
               [chunk3(Dk), chunk3(Dk), chunk3(1), spec((None, None, 1, C), lambda i, n, j: (i, n, 0, 0)),
                spec((None, None, Dk, BVo), lambda i, n, j: (i, n, 0, j)), vblock], vblock,
               sds((BH, Tp, Dv), out_dtype), qh, kh, gcol, grow, starts, deltas)
    return out, final, starts, deltas


def _forward(q, k, v, g, beta, initial_state, *, use_qk_l2norm, chunk_size, return_states, interpret):
    out_dtype = q.dtype
    T = q.shape[1]
    p = _gd.prepare(q, k, v, g, beta, initial_state, use_qk_l2norm)
    B, _, H, Dk = p.q.shape
    Dv = p.v.shape[-1]
    # at least 16 (Triton's smallest dot) unless a smaller chunk is asked for
    C = max(_gd.chunk_size_for(T, chunk_size), min(chunk_size, 16))
    pad = (-T) % C
    Tp = T + pad
    N = Tp // C
    qp, kp, vp, gp, bp = (_gd.pad_time(x, pad) for x in (p.q, p.k, p.v, p.g, p.beta))
    gamma = jnp.cumsum(gp.reshape(B, N, C, H), axis=2)  # in-chunk cumulative log decay
    heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, H, ...] -> [B, H, T, ...]
    qh, kh, vh = heads_major(qp), heads_major(kp), heads_major(vp)
    bcol = heads_major(bp)[..., None]  # [B, H, Tp, 1]
    gcol = heads_major(gamma.reshape(B, Tp, H))[..., None]  # [B, H, Tp, 1]
    grow = jnp.transpose(gamma, (0, 3, 1, 2))[:, :, :, None, :]  # [B, H, N, 1, C]

    backend = _default_backend()
    dt = p.q.dtype
    if backend == "tpu":  # sequence-blocked grid: one chunk per step, the state in VMEM scratch
        from jax.experimental.pallas import tpu as pltpu

        BV = _block_v(Dv, backend)
        out_shape = [jax.ShapeDtypeStruct((B, H, Tp, Dv), out_dtype), jax.ShapeDtypeStruct((B, H, Dk, Dv), dt)]
        if return_states:
            out_shape += [jax.ShapeDtypeStruct((B, H, N, Dk, Dv), dt), jax.ShapeDtypeStruct((B, H, Tp, Dv), dt)]
        spec = pl.BlockSpec
        grid = (B, H, Dv // BV, N)
        seq = lambda d: spec((None, None, C, d), lambda b, h, j, n: (b, h, n, 0))
        seq_v = spec((None, None, C, BV), lambda b, h, j, n: (b, h, n, j))
        state = spec((None, None, Dk, BV), lambda b, h, j, n: (b, h, 0, j))
        in_specs = [seq(Dk), seq(Dk), seq_v, seq(1), seq(1), spec((None, None, None, 1, C), lambda b, h, j, n: (b, h, n, 0, 0)), state]
        out_specs = [seq_v, state]
        if return_states:
            out_specs += [spec((None, None, None, Dk, BV), lambda b, h, j, n: (b, h, n, 0, j)), seq_v]
        outs = pl.pallas_call(
            functools.partial(_blocked_kernel, N=N, return_states=return_states),
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((Dk, BV), dt)],
            interpret=interpret,
            compiler_params=None if interpret
            else pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",)),
            name="gated_delta_chunk",
        )(qh, kh, vh, bcol, gcol, grow, p.state)
    else:  # the split layout (GPU, the interpreter elsewhere): per-chunk kernels around a state-only loop
        flat = lambda x: x.reshape(B * H, *x.shape[2:])
        outs = _split(*(flat(x) for x in (qh, kh, vh, bcol, gcol, grow, p.state)), C=C, N=N, out_dtype=out_dtype,
                      interpret=interpret, gpu=backend == "gpu")
        outs = [x.reshape(B, H, *x.shape[1:]) for x in outs]
    out = jnp.swapaxes(outs[0], 1, 2)[:, :T]
    if not return_states:
        return out, outs[1]
    starts, deltas = outs[2], outs[3]
    # chunk-major layouts for the shared in-chunk state recomputation
    starts = jnp.transpose(starts, (2, 0, 1, 3, 4))  # [N, B, H, Dk, Dv]
    deltas = jnp.transpose(deltas.reshape(B, H, N, C, Dv), (2, 0, 1, 3, 4))
    kc = _gd.to_chunks(kp, C)
    gc = _gd.to_chunks(gp, C)
    states = _gd.in_chunk_states(starts, deltas, kc, gc)[:, :T]
    return out, outs[1], states


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _pallas_core(q, k, v, g, beta, initial_state, opts):
    return _forward(q, k, v, g, beta, initial_state, **dict(opts))


def _pallas_core_fwd(q, k, v, g, beta, initial_state, opts):
    return _forward(q, k, v, g, beta, initial_state, **dict(opts)), (q, k, v, g, beta, initial_state)


def _pallas_core_bwd(opts, res, ct):
    o = dict(opts)
    del o["interpret"]

    def plain(q, k, v, g, beta, initial_state):
        return _gd.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, **o)

    _, vjp = jax.vjp(plain, *res)
    return vjp(ct)


_pallas_core.defvjp(_pallas_core_fwd, _pallas_core_bwd)


def pallas_chunk_gated_delta_rule(
    q: Float[Array, "batch seq qk_heads key_dim"],
    k: Float[Array, "batch seq qk_heads key_dim"],
    v: Float[Array, "batch seq heads value_dim"],
    g: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    *,
    initial_state: Float[Array, "batch heads key_dim value_dim"] | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int | None = None,
    return_states: bool = False,
    interpret: bool = False,
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """Gated delta rule by chunks, as a Pallas kernel.

    Same arguments, layouts, dtypes, results and exactness as
    :func:`jstd.kernels.gated_delta.chunk_gated_delta_rule` (``q, k: [B, T, Hk, Dk]``,
    ``v: [B, T, H, Dv]``, ``g, beta: [B, T, H]``, state ``[B, H, Dk, Dv]`` float32; returns
    ``(out, final_state)`` or ``(out, final_state, states)``, ``out`` in ``q.dtype``),
    plus ``interpret`` (run the kernel with the Pallas interpreter, e.g. on the CPU).
    ``chunk_size`` None: 32 on GPUs (``GPU``'s tiles compile without register spills at 16 and 32; 64 spills),
    64 elsewhere.

    The input preparation (head grouping, float32 upcast, l2norm, q scaling, padding to
    a multiple of the chunk, in-chunk cumulative decay) and, with ``return_states``, the
    per-token states (from the kernel's chunk-start states and deltas) are plain JAX; the
    chunk products, the UT inverse and the state scan run in the kernel. Differentiable
    (the backward pass is the plain chunked form's).
    """
    if chunk_size is None:
        chunk_size = 32 if _default_backend() == "gpu" else 64
    if initial_state is None:
        dt = jnp.promote_types(jnp.float32, jnp.result_type(q, k, v, g, beta))
        initial_state = jnp.zeros((v.shape[0], v.shape[2], k.shape[3], v.shape[3]), dt)
    opts = (
        ("use_qk_l2norm", bool(use_qk_l2norm)),
        ("chunk_size", int(chunk_size)),
        ("return_states", bool(return_states)),
        ("interpret", bool(interpret)),
    )
    return _per_shard(q, k, v, g, beta, initial_state, opts)


# the mesh axes the kernel splits its calls over (jstd.sharding's names): rows over ``data``, heads over ``model``
BATCH_AXIS, HEAD_AXIS = "data", "model"


def _per_shard(q, k, v, g, beta, initial_state, opts):
    """``_pallas_core`` once per shard of the enclosing mesh (``jax.set_mesh``; none: one call).

    A Pallas kernel cannot be partitioned by XLA ("Mosaic kernels cannot be automatically partitioned"), so on a
    mesh it runs under ``jax.shard_map``: rows split over ``BATCH_AXIS`` and heads over ``HEAD_AXIS`` where the
    mesh has the axis and it divides them (key/query heads and value heads alike: grouped heads stay with their
    group), every other axis replicated. The delta rule is independent across rows and heads, so each shard's
    call computes its part of the whole call's result exactly; inputs sharded otherwise are resharded to these
    specs by XLA. Composes with ``vmap`` (a sweep's entry axis is batched through the map)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape) if not mesh.empty else {}
    B, Hk, H = q.shape[0], k.shape[2], v.shape[2]
    b = BATCH_AXIS if sizes.get(BATCH_AXIS, 1) > 1 and B % sizes[BATCH_AXIS] == 0 else None
    h = HEAD_AXIS if sizes.get(HEAD_AXIS, 1) > 1 and Hk % sizes[HEAD_AXIS] == 0 and H % sizes[HEAD_AXIS] == 0 else None
    if b is None and h is None:
        return _pallas_core(q, k, v, g, beta, initial_state, opts)
    P = jax.sharding.PartitionSpec
    seq4, seq3, state = P(b, None, h, None), P(b, None, h), P(b, h, None, None)
    outs = (seq4, state) + ((P(b, None, h, None, None),) if dict(opts)["return_states"] else ())
    mapped = jax.shard_map(lambda *a: _pallas_core(*a, opts), mesh=mesh, in_specs=(seq4, seq4, seq4, seq3, seq3, state),
                           out_specs=outs, check_vma=False)
    return mapped(q, k, v, g, beta, initial_state)
