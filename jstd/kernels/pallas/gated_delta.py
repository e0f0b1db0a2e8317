"""Gated delta rule, chunked form, as a Pallas kernel.

Same math, signature and results as :func:`jstd.kernels.gated_delta.chunk_gated_delta_rule`
(plus ``interpret``); :mod:`jstd.kernels.select` runs it on GPU and TPU backends. A kernel
program handles one (batch, head, value-column block): the delta rule is separable over
the state's value columns (column ``j`` of ``S`` only ever reads ``v[:, j]``), so value
columns split across programs exactly; each program
recomputes its chunks' UT inverse. Two grid layouts, picked by the default backend:

* GPU (Triton) and the interpreter: grid (batch, head, value block) with whole-sequence
  blocks; the kernel walks the chunks with a ``fori_loop``, the float32 state
  ``[key_dim, block_v]`` being the loop carry (GPU programs run in parallel, so a state
  cannot be carried across grid steps). ``block_v`` is 64 on GPUs.
* TPU (Mosaic): grid (batch, head, value block, chunk) with the chunk axis sequential
  (``"arbitrary"``), one chunk's blocks per step (VMEM holds a chunk, not the sequence)
  and the state in a VMEM scratch buffer.

On a mesh (``jax.set_mesh``) the kernel runs once per shard under ``jax.shard_map``, rows
over ``data`` and heads over ``model`` (XLA cannot partition a Pallas call; see
``_per_shard``), so it composes with jstd's sharding rules and with ``vmap``.

No accelerator was available to run it here. Both layouts are tested with the Pallas
interpreter on the CPU (on a 2 x 2 mesh too), both lower (to Triton IR and to Mosaic TPU
MLIR), and with the ``aot`` extra the TPU layout compiles through libtpu's Mosaic for a
v5e slice (tests/test_aot.py). The GPU layout's Triton IR compiles to an sm_90a cubin
(``jstd.aot.kernels.triton_cubin``) that still spills registers (docs/scale.md). Lowering-friendly by construction:

* only 2-D values, loads/stores of power-of-two ``[chunk, dim]`` tiles (Triton's
  constraint: head dims must be powers of two on GPUs), chunks of at least 16 (Triton's
  smallest dot), no value slicing, no cumsum / gather / dynamic value indexing in the
  kernel (the in-chunk cumulative decay is computed outside, as a column and a row);
* the UT inverse ``(I + A)^{-1}`` is the recursive 2x2-block inversion written with
  full ``[C, C]`` products and iota masks: ``T <- T - T E_s T`` for ``s = 2, 4, ..., C/2``
  where ``E_s`` keeps ``A``'s off-diagonal ``s``-blocks inside each ``2s``-block. The
  zero blocks add exact zeros, so it is numerically the block algorithm (stable; no
  matrix powers);
* float32 products at ``Precision.HIGHEST`` (IEEE on Triton, full f32 on Mosaic);
* Triton is asked for explicitly on GPUs (this JAX defaults ``pallas_call`` to Mosaic
  GPU, whose blocks must fit in shared memory).

Gradients: a ``custom_vjp`` whose backward pass is the VJP of the plain-JAX chunked
form (recomputed from the inputs), so gradients equal the plain form's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from jstd.kernels import gated_delta as _gd
from jstd.kernels.platform import platform

__all__ = ["pallas_chunk_gated_delta_rule"]

_HI = lax.Precision.HIGHEST


def _dot(a, b, contract=(1, 0)):
    """2-D product contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``."""
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), precision=_HI, preferred_element_type=a.dtype
    )


def _unit_lower_inverse_masked(a, row, col):
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
        t = t - _dot(_dot(t, e), t)
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


def _loop_kernel(q_ref, k_ref, v_ref, b_ref, gc_ref, gr_ref, s0_ref, o_ref, sf_ref, *extra_refs, C, N, return_states):
    """Grid (batch, head, value block); walks the N chunks of the whole-sequence blocks with
    a fori_loop (the GPU / Triton layout: programs run in parallel, so the state is a loop carry)."""
    dt = q_ref.dtype  # the compute dtype (float32)

    def body(n, S):
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        S_new, o, delta = _chunk(
            S, q_ref[rows, :], k_ref[rows, :], v_ref[rows, :], b_ref[rows, :], gc_ref[rows, :], gr_ref[n]
        )
        o_ref[rows, :] = o.astype(o_ref.dtype)
        if return_states:
            starts_ref, deltas_ref = extra_refs
            starts_ref[n] = S
            deltas_ref[rows, :] = delta
        return S_new

    sf_ref[...] = lax.fori_loop(0, N, body, s0_ref[...].astype(dt))


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
    """Value columns per program: the whole head up to 128 (TPU lanes); 64 on GPUs, where
    a [Dk, 64] float32 state tile keeps register pressure down and doubles the programs."""
    bv = 64 if backend == "gpu" else 128
    return bv if Dv > bv and Dv % bv == 0 else Dv


def triton_params():
    """The Triton compiler params of the GPU layout (also what ``jstd.aot.kernels`` compiles the cubin with).
    Triton explicitly: this JAX would otherwise pick Mosaic GPU, whose blocks must fit in SMEM."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=1)


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
    BV = _block_v(Dv, backend)
    dt = p.q.dtype
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, Dv), out_dtype), jax.ShapeDtypeStruct((B, H, Dk, Dv), dt)]
    if return_states:
        out_shape += [jax.ShapeDtypeStruct((B, H, N, Dk, Dv), dt), jax.ShapeDtypeStruct((B, H, Tp, Dv), dt)]
    spec = lambda shape, index: pl.BlockSpec(shape, index)
    if backend == "tpu":  # sequence-blocked grid: one chunk per step, the state in VMEM scratch
        from jax.experimental.pallas import tpu as pltpu

        grid = (B, H, Dv // BV, N)
        seq = lambda d: spec((None, None, C, d), lambda b, h, j, n: (b, h, n, 0))
        seq_v = spec((None, None, C, BV), lambda b, h, j, n: (b, h, n, j))
        state = spec((None, None, Dk, BV), lambda b, h, j, n: (b, h, 0, j))
        in_specs = [seq(Dk), seq(Dk), seq_v, seq(1), seq(1), spec((None, None, None, 1, C), lambda b, h, j, n: (b, h, n, 0, 0)), state]
        out_specs = [seq_v, state]
        if return_states:
            out_specs += [spec((None, None, None, Dk, BV), lambda b, h, j, n: (b, h, n, 0, j)), seq_v]
        kernel = functools.partial(_blocked_kernel, N=N, return_states=return_states)
        scratch = [pltpu.VMEM((Dk, BV), dt)]
        params = None if interpret else pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",))
    else:  # whole-sequence blocks, chunks walked in the kernel (programs may run in parallel)
        grid = (B, H, Dv // BV)
        full = lambda *shape: spec((None, None, *shape), lambda b, h, j: (b, h) + (0,) * len(shape))
        vcols = lambda *shape: spec((None, None, *shape), lambda b, h, j: (b, h) + (0,) * (len(shape) - 1) + (j,))
        in_specs = [full(Tp, Dk), full(Tp, Dk), vcols(Tp, BV), full(Tp, 1), full(Tp, 1), full(N, 1, C), vcols(Dk, BV)]
        out_specs = [vcols(Tp, BV), vcols(Dk, BV)]
        if return_states:
            out_specs += [vcols(N, Dk, BV), vcols(Tp, BV)]
        kernel = functools.partial(_loop_kernel, C=C, N=N, return_states=return_states)
        scratch = []
        params = triton_params() if backend == "gpu" and not interpret else None
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
        interpret=interpret,
        compiler_params=params,
        name="gated_delta_chunk",
    )(qh, kh, vh, bcol, gcol, grow, p.state)
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
    chunk_size: int = 64,
    return_states: bool = False,
    interpret: bool = False,
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """Gated delta rule by chunks, as a Pallas kernel.

    Same arguments, layouts, dtypes, results and exactness as
    :func:`jstd.kernels.gated_delta.chunk_gated_delta_rule` (``q, k: [B, T, Hk, Dk]``,
    ``v: [B, T, H, Dv]``, ``g, beta: [B, T, H]``, state ``[B, H, Dk, Dv]`` float32; returns
    ``(out, final_state)`` or ``(out, final_state, states)``, ``out`` in ``q.dtype``),
    plus ``interpret`` (run the kernel with the Pallas interpreter, e.g. on the CPU).

    The input preparation (head grouping, float32 upcast, l2norm, q scaling, padding to
    a multiple of the chunk, in-chunk cumulative decay) and, with ``return_states``, the
    per-token states (from the kernel's chunk-start states and deltas) are plain JAX; the
    chunk products, the UT inverse and the state scan run in the kernel. Differentiable
    (the backward pass is the plain chunked form's).
    """
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
