"""Compile one program for a target and read back what the compiler says: bytes per chip, FLOPs, collectives.

``compile_report(fn, args, target, ...)`` lowers ``jax.jit(fn)`` on the abstract ``args`` and compiles it for the
target's compile-only devices; the ``Report`` holds the compiled program's own figures (``memory_analysis``:
argument, temporary, output and aliased bytes of one chip; ``cost_analysis``: FLOPs, where the backend gives
them: XLA:TPU does, XLA:GPU does not), the collectives in its HLO (by kind: how many ops and the bytes they
produce per chip, each op counted once even inside a loop), and every all-gather whose result is the whole of a
sharded parameter (``whole_gathers``: a layout that gathers a weight whole onto each chip). ``check(report)``
raises ``DoesNotFit`` with the numbers when the program needs more than a chip holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time

import jax

from jstd.aot.targets import GiB, Target
from jstd.kernels.platform import compiling_for
from jstd.models.namemap import leaf_paths

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# parameters smaller than this are gathered whole by design (norm weights, biases) and are not reported
WHOLE_GATHER_MIN_ELEMENTS = 1 << 20
# an operand that is an argument of the entry computation (``%param``, ``%param.3``; not a fused computation's
# ``%param_0.12``)
_ARGUMENT = re.compile(r"%param(\.\d+)?[),]")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


class DoesNotFit(ValueError):
    """A program needs more memory per chip than the target's chips hold."""


@dataclasses.dataclass
class Report:
    """What the compiler says of one program on one target (bytes are per chip)."""

    program: str
    target: str
    chips: int
    mesh: dict
    layout: str
    chip_memory: int
    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    alias_bytes: int
    flops: float | None
    collectives: dict  # kind -> (ops, bytes per chip)
    whole_gathers: list  # "path shape" of each sharded parameter an all-gather produces whole
    compile_seconds: float

    @property
    def peak_bytes(self) -> int:
        """Arguments + temporaries + outputs less what outputs alias: the memory the program needs on one chip."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.chip_memory

    def row(self) -> str:
        """One markdown table row: program, target, mesh, layout, GiB per chip (args/temp/out), fits, TFLOPs,
        collectives, the weights gathered whole."""
        g = lambda b: f"{b / GiB:.2f}"
        flops = "n/a" if self.flops is None else f"{self.flops / 1e12:.2f}"
        coll = ", ".join(f"{k} {n}" for k, (n, _) in self.collectives.items() if n) or "none"
        mesh = "×".join(f"{v}" for v in self.mesh.values())
        return (f"| {self.program} | {self.target} | {mesh} | {self.layout} | {g(self.peak_bytes)} of "
                f"{g(self.chip_memory)} ({g(self.argument_bytes)} / {g(self.temp_bytes)} / {g(self.output_bytes)}) | "
                f"{'yes' if self.fits else 'NO'} | {flops} | {coll} | {', '.join(self.whole_gathers) or 'none'} |")

    def __str__(self):
        g = lambda b: f"{b / GiB:.3f} GiB"
        lines = [f"{self.program} on {self.target} ({self.chips} chips, mesh {self.mesh}, {self.layout}): "
                 f"{g(self.peak_bytes)} per chip of {g(self.chip_memory)} — {'fits' if self.fits else 'DOES NOT FIT'}",
                 f"  arguments {g(self.argument_bytes)}, temporaries {g(self.temp_bytes)}, outputs "
                 f"{g(self.output_bytes)}, aliased {g(self.alias_bytes)}",
                 f"  FLOPs per chip: {'not reported by this backend' if self.flops is None else f'{self.flops:.4g}'}",
                 "  collectives: " + (", ".join(f"{k} ×{n} ({b / 2**20:.1f} MiB)" for k, (n, b) in
                                               self.collectives.items() if n) or "none"),
                 f"  whole-weight gathers: {', '.join(self.whole_gathers) or 'none'}",
                 f"  compiled in {self.compile_seconds:.1f} s"]
        return "\n".join(lines)


def compile_report(fn, args, target: Target, *, program: str = "", mesh=None, layout: str = "") -> tuple:
    """``(Report, compiled)`` of ``jax.jit(fn)`` compiled for ``target`` on the abstract ``args`` (leaves carry
    their shardings on ``mesh``, a mesh of ``target.devices``). Traced with the kernels picked and laid out for the
    target's platform (``jstd.kernels.platform.compiling_for``: the Pallas gated-delta kernel on TPU and GPU) and
    under ``jax.set_mesh(mesh)``, so Pallas kernels run per shard (``jax.shard_map``)."""
    start = time.perf_counter()
    mesh_context = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
    with checks_lowered_for(target), compiling_for(target.platform), mesh_context:
        compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    flops = float(cost["flops"]) if cost and "flops" in cost else None
    text = compiled.as_text()
    report = Report(
        program=program, target=target.name, chips=target.chips,
        mesh={} if mesh is None else dict(zip(mesh.axis_names, mesh.devices.shape)), layout=layout,
        chip_memory=target.chip_memory, argument_bytes=int(memory.argument_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), flops=flops, collectives=collectives(text),
        whole_gathers=whole_gathers(text, args[0]), compile_seconds=seconds)
    return report, compiled


@contextlib.contextmanager
def checks_lowered_for(target: Target):
    """On a GPU target, jstd's runtime checks (``eqx.error_if``: a host callback, which XLA:GPU lowers only with a
    live GPU client) become equinox's ``EQX_ON_ERROR=nan`` form while the program is traced: the same program
    without the host callback. TPU programs keep them as they are. Traces cached with the other form are
    dropped before and after (``jax.clear_caches``)."""
    if target.platform != "cuda":
        yield
        return
    from equinox import _errors  # equinox reads EQX_ON_ERROR from here each time a check is traced

    before = _errors.EQX_ON_ERROR
    jax.clear_caches()
    _errors.EQX_ON_ERROR = "nan"
    try:
        yield
    finally:
        _errors.EQX_ON_ERROR = before
        jax.clear_caches()


def collectives(hlo: str) -> dict:
    """``{kind: (ops, bytes)}`` of the collectives in compiled HLO text: each op (``-start`` forms counted, their
    ``-done`` not) and the bytes of its result on one chip."""
    out = {k: [0, 0] for k in COLLECTIVES}
    for line in hlo.splitlines():
        for kind in COLLECTIVES:
            at = line.find(f" {kind}(")
            if at < 0:
                at = line.find(f" {kind}-start(")
            if at < 0:
                continue
            shapes = _SHAPE.findall(line[:at])
            if shapes:
                dt, dims = shapes[-1]
                out[kind][0] += 1
                out[kind][1] += _BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
            break
    return {k: tuple(v) for k, v in out.items()}


def whole_gathers(hlo: str, model) -> list[str]:
    """The sharded parameters of ``model`` (abstract leaves with shardings) that an all-gather in ``hlo`` produces
    whole, at least ``WHOLE_GATHER_MIN_ELEMENTS`` elements: a result of the parameter's dtype whose dimensions are
    the whole parameter's (or one block's of a stacked one), in any order; or, for an all-gather of a program
    argument itself, as many elements (XLA:TPU gathers an argument in a shape of its own: a [4096, 1024] weight as
    [8192, 512]). Activations of a weight's size but another shape are not reported; one of a weight's very
    shape is (a [1024, 4096] stream of 1024 tokens matches a [1024, 4096] weight): read a report as "check these"."""
    hlo_dtype = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "float64": "f64"}
    by_dims, by_count = {}, {}
    for path, leaf in leaf_paths(model):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not hasattr(sharding, "shard_shape"):
            continue
        shape, dt = tuple(leaf.shape), hlo_dtype.get(str(leaf.dtype))
        if sharding.shard_shape(shape) == shape or math.prod(shape) < WHOLE_GATHER_MIN_ELEMENTS:
            continue
        by_dims.setdefault((dt, tuple(sorted(shape))), f"{path} {list(shape)}")
        by_count.setdefault((dt, math.prod(shape)), f"{path} {list(shape)}")
        if len(shape) >= 3 and math.prod(shape[1:]) >= WHOLE_GATHER_MIN_ELEMENTS and \
                sharding.shard_shape(shape)[1:] != shape[1:]:
            by_dims.setdefault((dt, tuple(sorted(shape[1:]))), f"{path}[block] {list(shape[1:])}")
    found = []
    for line in hlo.splitlines():
        at = max(line.find(" all-gather("), line.find(" all-gather-start("))
        if at < 0:
            continue
        shapes = _SHAPE.findall(line[:at])
        if not shapes:
            continue
        dt, text = shapes[-1]
        dims = tuple(int(d) for d in text.split(",") if d)
        entry = by_dims.get((dt, tuple(sorted(d for d in dims))))
        if entry is None and _ARGUMENT.match(line[line.index("(", at) + 1:]):
            entry = by_count.get((dt, math.prod(dims)))
        if entry is not None and entry not in found:
            found.append(entry)
    return found


def check(report: Report) -> Report:
    """``report`` if its program fits a chip; else raises DoesNotFit with the numbers and what to change."""
    if report.fits:
        return report
    g = lambda b: f"{b / GiB:.2f} GiB"
    raise DoesNotFit(
        f"{report.program} under {report.layout} on {report.target} (mesh {report.mesh}) needs {g(report.peak_bytes)} "
        f"per chip (arguments {g(report.argument_bytes)}, temporaries {g(report.temp_bytes)}, outputs "
        f"{g(report.output_bytes)}, aliased {g(report.alias_bytes)}); a chip holds {g(report.chip_memory)}: "
        "shard more (FSDP_TP, a larger model axis), use more chips, or pass fewer rows, a shorter sequence or a "
        "smaller sweep chunk")

