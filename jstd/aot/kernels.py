"""The Pallas gated-delta kernel compiled for real backends without a device: Mosaic for TPU, Triton for sm_90a.

``mosaic(target, ...)`` compiles the kernel alone (``jstd.kernels.pallas.gated_delta``, per shard under
``jax.shard_map``) on a TPU target's mesh and returns its ``Report``. ``triton_cubin(...)`` lowers the kernel as
XLA:GPU would run it, takes the Triton IR that Pallas produces, compiles it with the ``triton`` wheel for
``GPUTarget("cuda", 90, 32)`` (sm_90a) with the kernel's own warps and stages, and reads ptxas' verbose report:
registers, stack frame, spill stores and loads. ``chunk_cost(C, dk, dv)`` is the kernel's arithmetic per chunk
and head, counted from its products.
"""

from __future__ import annotations

import contextlib
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


def _kernel(*a):
    return pallas_gated_delta.pallas_chunk_gated_delta_rule(*a, use_qk_l2norm=True, chunk_size=32)


def mosaic(target: Target, *, batch: int = 4, seq: int = 1024, qk_heads: int = 16, heads: int = 32, dk: int = 128,
           dv: int = 128, dtype=jnp.bfloat16, model_axis: int = 2):
    """The ``Report`` of the Pallas kernel alone compiled with Mosaic for the TPU ``target`` on a (data, model)
    mesh, rows over ``data`` and heads over ``model`` (Qwen3.5-4B's DeltaNet heads by default)."""
    mesh = make_mesh(target.chips // model_axis, model_axis, devices=target.devices)
    report, compiled = compile_report(_kernel, _args(batch, seq, qk_heads, heads, dk, dv, dtype, mesh), target,
                                      program="gated_delta", mesh=mesh, layout="rows/heads")
    return report, compiled


def triton_ir(*, batch: int = 1, seq: int = 200, heads: int = 2, dk: int = 128, dv: int = 128,
              dtype=jnp.bfloat16) -> tuple[str, dict]:
    """``(Triton IR text, the kernel's Triton compiler params)`` of the kernel lowered for CUDA (no device)."""
    from jax._src.pallas.triton import lowering  # where Pallas turns the kernel into a Triton module

    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = original(*a, **k)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        with compiling_for("gpu"):
            jax.jit(_kernel).trace(*_args(batch, seq, heads, heads, dk, dv, dtype)).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    if not captured:
        raise RuntimeError("the kernel did not lower to Triton (is the CUDA plugin installed?)")
    params = pallas_gated_delta.triton_params()
    return captured[-1], dict(num_warps=params.num_warps, num_stages=params.num_stages)


def triton_cubin(**shape) -> dict:
    """ptxas' figures for the kernel's cubin on sm_90a: ``registers``, ``stack`` (bytes), ``spill_stores``,
    ``spill_loads`` (bytes per thread), ``shared`` (bytes per block), ``num_warps``, ``num_stages``, ``seconds``
    (Triton's compile). ``shape``: ``triton_ir``'s keywords."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    ir, options = triton_ir(**shape)
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "gated_delta_chunk.ttir"
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


def ptxas_report(verbose: str) -> dict:
    """Registers, stack frame and spill bytes from ``ptxas -v`` output."""
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, verbose)) else 0
    return dict(registers=number(r"Used (\d+) registers"), stack=number(r"(\d+) bytes stack frame"),
                spill_stores=number(r"(\d+) bytes spill stores"), spill_loads=number(r"(\d+) bytes spill loads"))


def chunk_cost(C: int = 32, dk: int = 128, dv: int = 128) -> dict:
    """FLOPs, bytes moved and arithmetic intensity of one chunk of ``C`` tokens for one head (float32 inputs as
    the kernel reads them, outputs in bfloat16): the products ``k kᵀ``, ``q kᵀ`` (2·C²·dk each), the UT inverse
    (log2(C) - 1 levels of two C×C×C products), ``k S``, ``q S``, ``kᵀ Δ`` (2·C·dk·dv each), ``T (…)`` and
    ``(q kᵀ ∘ decay) Δ`` (2·C²·dv each)."""
    flops = 2 * 2 * C * C * dk + (int(math.log2(C)) - 1) * 2 * 2 * C ** 3 + 3 * 2 * C * dk * dv + 2 * 2 * C * C * dv
    moved = 4 * (2 * C * dk + C * dv + 2 * C + C) + 2 * C * dv
    return dict(flops=flops, bytes=moved, intensity=flops / moved)
