"""The Pallas gated-delta kernel compiled for real backends without a device: Mosaic for TPU, Triton for sm_90a.

``mosaic(target, ...)`` compiles the kernel alone (``jstd.kernels.pallas.gated_delta``, per shard under
``jax.shard_map``) on a TPU target's mesh and returns its ``Report``. ``triton_ir(...)`` lowers the forward as
XLA:GPU would run it and takes the Triton IR that Pallas produces for each of its kernels; ``triton_cubin(...)``
compiles one with the ``triton`` wheel for ``GPUTarget("cuda", 90, 32)`` (sm_90a) with that kernel's own warps
and stages and reads ptxas' verbose report: registers, stack frame, spill stores and loads (``triton_cubins``:
all of them). ``chunk_cost(C, dk, dv)`` is each kernel's arithmetic per chunk and head, counted from its
products and loads.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jstd.aot.report import compile_report
from jstd.aot.targets import Target
from jstd.kernels.pallas import gated_delta as pallas_gated_delta
from jstd.kernels.platform import compiling_for
from jstd.sharding import mesh as make_mesh


def _args(batch, seq, qk_heads, heads, dk, dv, dtype, mesh=None):
    def sds(shape, dt, spec):
        sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(*spec))
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    seq4 = ("data", None, "model", None)
    return (sds((batch, seq, qk_heads, dk), dtype, seq4), sds((batch, seq, qk_heads, dk), dtype, seq4),
            sds((batch, seq, heads, dv), dtype, seq4), sds((batch, seq, heads), jnp.float32, seq4[:3]),
            sds((batch, seq, heads), jnp.float32, seq4[:3]))


def _kernel(*a, chunk_size=None):  # None: the kernel's default for the platform compiled for
    return pallas_gated_delta.pallas_chunk_gated_delta_rule(*a, use_qk_l2norm=True, chunk_size=chunk_size)


def mosaic(target: Target, *, batch: int = 4, seq: int = 1024, qk_heads: int = 16, heads: int = 32, dk: int = 128,
           dv: int = 128, dtype=jnp.bfloat16, model_axis: int = 2):
    """The ``Report`` of the Pallas kernel alone compiled with Mosaic for the TPU ``target`` on a (data, model)
    mesh, rows over ``data`` and heads over ``model`` (Qwen3.5-4B's DeltaNet heads by default)."""
    mesh = make_mesh(target.chips // model_axis, model_axis, devices=target.devices)
    report, compiled = compile_report(_kernel, _args(batch, seq, qk_heads, heads, dk, dv, dtype, mesh), target,
                                      program="gated_delta", mesh=mesh, layout="rows/heads")
    return report, compiled


def triton_ir(*, batch: int = 1, seq: int = 200, heads: int = 2, dk: int = 128, dv: int = 128,
              dtype=jnp.bfloat16, chunk: int | None = None) -> list[tuple[str, str, dict]]:
    """``(kernel name, Triton IR text, its Triton compiler params)`` for each kernel the forward launches (chunks
    of ``chunk``; None: the public kernel's GPU default, 32, as the DeltaNet mixer calls it too), lowered for CUDA
    (no device)."""
    import sys

    from jax._src.pallas.triton import lowering  # where Pallas turns each kernel into a Triton module

    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = original(*a, **k)
        caller = sys._getframe(1).f_locals  # Pallas' Triton call lowering: the call's name, warps and stages
        params = dict(num_warps=caller["num_warps"], num_stages=caller["num_stages"])
        captured.append((caller["name"], result.module.operation.get_asm(enable_debug_info=False), params))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        with compiling_for("gpu"):
            forward = jax.jit(functools.partial(_kernel, chunk_size=chunk))
            forward.trace(*_args(batch, seq, heads, heads, dk, dv, dtype)).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    if not captured:
        raise RuntimeError("the kernel did not lower to Triton (is the CUDA plugin installed?)")
    return captured


def triton_cubin(ir: str, num_warps: int, num_stages: int) -> dict:
    """ptxas' figures for one kernel's Triton IR compiled to an sm_90a cubin with ``num_warps`` / ``num_stages``:
    ``registers``, ``stack`` (bytes), ``spill_stores``, ``spill_loads`` (bytes per thread), ``shared`` (bytes
    per block), ``num_warps``, ``num_stages``, ``seconds`` (Triton's compile)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    options = dict(num_warps=num_warps, num_stages=num_stages)
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ttir"
        src.write_text(ir)
        start = time.perf_counter()
        saved = {k: os.environ.get(k) for k in ("TRITON_DUMP_PTXAS_LOG", "TRITON_CACHE_DIR")}
        knobs.nvidia.dump_ptxas_log = True  # Triton prints its own ptxas -v run (its flags, its cubin)
        knobs.cache.dir = str(Path(tmp) / "cache")  # a fresh compile, not a cached cubin (which prints nothing)
        try:
            with contextlib.redirect_stdout(log):
                kernel = triton.compile(str(src), target=GPUTarget("cuda", 90, 32), options=options)
        finally:
            del knobs.nvidia.dump_ptxas_log, knobs.cache.dir
            for key, value in saved.items():
                os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        seconds = time.perf_counter() - start
    if "registers" not in log.getvalue():
        raise RuntimeError(f"no ptxas report in Triton's output: {log.getvalue()[-500:]!r}")
    return dict(ptxas_report(log.getvalue()), shared=kernel.metadata.shared, seconds=seconds, **options)


def triton_cubins(**shape) -> dict[str, dict]:
    """``triton_cubin``'s figures for each kernel the forward launches, by kernel name. ``shape``: ``triton_ir``'s
    keywords."""
    return {name: triton_cubin(ir, **params) for name, ir, params in triton_ir(**shape)}


def ptxas_report(verbose: str) -> dict:
    """Registers, stack frame and spill bytes from ``ptxas -v`` output (which states each, zeros included; a
    figure it does not state is an error, not a zero)."""
    def number(pattern):
        if (m := re.search(pattern, verbose)) is None:
            raise ValueError(f"no {pattern!r} in ptxas' report: {verbose[-500:]!r}")
        return int(m.group(1))

    return dict(registers=number(r"Used (\d+) registers"), stack=number(r"(\d+) bytes stack frame"),
                spill_stores=number(r"(\d+) bytes spill stores"), spill_loads=number(r"(\d+) bytes spill loads"))


def chunk_cost(C: int = 32, dk: int = 128, dv: int = 128, config=None) -> dict[str, dict]:
    """FLOPs, bytes moved and arithmetic intensity of one chunk of ``C`` tokens for one head, by kernel of the split
    layout (``config``: its ``SplitConfig``, the GPU one by default) and in ``"total"``. Float32 operands as the
    kernels read them, outputs in bfloat16; a tile re-read by each value-block program counts once per program.

    * ``gated_delta_ut``: ``k kᵀ`` (2·C²·dk), the UT inverse (log2(C) - 1 levels of two C×C×C products),
      ``w = T(…k)`` (2·C²·dk), ``u = T(…v)`` (2·C²·dv); reads k, v, β, γ (column and row), writes w, u.
    * ``gated_delta_state``: ``w S`` and ``(decayed k)ᵀ Δ`` (2·C·dk·dv each); each of the dv / block_v programs
      reads w, k, γ, its u columns, writes its Δ columns and the chunk-start state.
    * ``gated_delta_out``: ``q kᵀ`` (2·C²·dk, in each program), ``q S`` (2·C·dk·dv), ``(q kᵀ ∘ decay) Δ``
      (2·C²·dv); each of the dv / out_block_v programs reads q, k, γ, its state and Δ columns, writes its output
      columns."""
    config = config or pallas_gated_delta.GPU
    f32, bf16 = 4, 2
    state_programs = dv // min(config.state_block_v, dv)
    out_programs = dv // min(config.out_block_v, dv, C)
    cost = {
        "gated_delta_ut": (2 * C * C * dk + (int(math.log2(C)) - 1) * 2 * 2 * C ** 3 + 2 * C * C * dk + 2 * C * C * dv,
                           f32 * (C * dk + C * dv + 3 * C) + f32 * (C * dk + C * dv)),
        "gated_delta_state": (2 * 2 * C * dk * dv,
                              f32 * (state_programs * (2 * C * dk + 2 * C) + C * dv) + f32 * (C * dv + dk * dv)),
        "gated_delta_out": (out_programs * 2 * C * C * dk + 2 * C * dk * dv + 2 * C * C * dv,
                            f32 * (out_programs * (2 * C * dk + 2 * C) + dk * dv + C * dv) + bf16 * C * dv),
    }
    cost["total"] = tuple(map(sum, zip(*cost.values())))
    return {name: dict(flops=flops, bytes=moved, intensity=flops / moved) for name, (flops, moved) in cost.items()}
