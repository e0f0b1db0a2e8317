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
from jstd.nn.namemap import leaf_paths

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# parameters smaller than this are gathered whole by design (norm weights, biases) and are not reported
WHOLE_GATHER_MIN_ELEMENTS = 1 << 20
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
    xla_options: dict = dataclasses.field(default_factory=dict)  # what the compile needed beyond the defaults

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
        program = self.program + "".join(f" (XLA {k}={v})" for k, v in self.xla_options.items())
        return (f"| {program} | {self.target} | {mesh} | {self.layout} | {g(self.peak_bytes)} of "
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
        if self.xla_options:
            flags = " ".join(f"--{k}={str(v).lower()}" for k, v in self.xla_options.items())
            lines.append(f"  compiled only with XLA options {self.xla_options} (XLA's defaults fail); a run on the "
                         f"device needs them too: XLA_FLAGS='{flags}'")
        return "\n".join(lines)


def compile_report(fn, args, target: Target, *, program: str = "", mesh=None, layout: str = "",
                   keep_unused: bool = False) -> tuple:
    """``(Report, compiled)`` of ``jax.jit(fn)`` compiled for ``target`` on the abstract ``args`` (leaves carry
    their shardings on ``mesh``, a mesh of ``target.devices``). Traced with the kernels picked and laid out for the
    target's platform (``jstd.kernels.platform.compiling_for``: the Pallas gated-delta kernel on TPU and GPU) and
    under ``jax.set_mesh(mesh)``, so Pallas kernels run per shard (``jax.shard_map``). ``keep_unused``: arguments
    ``fn`` does not read stay in the program (and in its argument bytes): values resident on the chips meanwhile."""
    start = time.perf_counter()
    mesh_context = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
    options = {}
    with checks_lowered_for(target), compiling_for(target.platform), mesh_context:
        lowered = jax.jit(fn, keep_unused=keep_unused).lower(*args)
        try:
            try:
                compiled = lowered.compile()
            except jax.errors.JaxRuntimeError as e:
                if target.platform != "cuda" or _TRITON_GEMM_TILING not in str(e):
                    raise
                options = {"xla_gpu_enable_triton_gemm": False}  # XLA:GPU's Triton GEMMs found no tiling: cuBLAS
                compiled = lowered.compile(compiler_options=options)
        except jax.errors.JaxRuntimeError as e:  # the compiler's own refusal: far more than a chip holds
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            where = f"{program} under {layout} on {target.name} (mesh {dict(zip(mesh.axis_names, mesh.devices.shape)) if mesh else {}})"
            raise DoesNotFit(f"{where}: the compiler refused it, {str(e).splitlines()[0]}; {_ADVICE}") from None
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
        whole_gathers=whole_gathers(text, args[0]), compile_seconds=seconds, xla_options=options)
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


# what a value passes through unchanged in its elements (laid out, shaped or typed anew)
# (a collective permute moves shards between chips, each chip still holds a shard of the weight; an all-gather
# gathers more of it: XLA:GPU gathers a weight sharded over two mesh axes over one axis, then the other)
_PASS = ("bitcast", "copy", "copy-start", "copy-done", "reshape", "transpose", "convert", "bitcast-convert",
         "optimization-barrier", "collective-permute", "collective-permute-start", "collective-permute-done",
         "slice-start", "all-gather", "all-gather-start", "all-gather-done")
_SLICE = ("slice", "dynamic-slice", "slice-done")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) ")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = ")


def _balanced(text: str) -> int:
    """The index of the parenthesis closing the one that opens ``text``'s first character's group (``text`` starts
    inside it, at depth 1)."""
    depth = 1
    for at, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return at
    return len(text)


def _computations(hlo: str) -> tuple[dict, str]:
    """``({computation: {instruction: (type, opcode, operand names, attributes, operand text)}}, entry name)`` of
    an HLO text; each computation's root is stored under the key ``None`` as well."""
    comps, entry, current = {}, "", None
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" ") and (m := _HEADER.match(line)):
            current = comps.setdefault(m.group(2), {})
            entry = m.group(2) if m.group(1) else entry
            continue
        if current is None or not (m := _INSTRUCTION.match(line)):
            continue
        rhs = line[m.end():]
        if rhs.startswith("("):  # a tuple type, up to its closing parenthesis
            end = _balanced(rhs[1:]) + 1
            type_, rest = rhs[:end + 1], rhs[end + 1:].lstrip()
        else:
            type_, _, rest = rhs.partition(" ")
        opcode, _, rest = rest.partition("(")
        end = _balanced(rest)
        inst = (type_, opcode, re.findall(r"%([\w.\-]+)", rest[:end]), rest[end + 1:], rest[:end])
        current[m.group(2)] = inst
        if m.group(1):
            current[None] = inst
    return comps, entry


def _callers(comps: dict) -> dict:
    """``{computation: (calling computation, calling instruction, operand number of its parameter 0)}``: fused
    computations (parameter k is the fusion's operand k), loop bodies (the loop's operand 0) and a conditional's
    branches (branch b's parameter is the conditional's operand b + 1)."""
    out = {}
    for outer, insts in comps.items():
        for name, (_, opcode, _, attrs, _) in insts.items():
            if name is None:
                continue
            if opcode == "fusion" and (m := re.search(r"calls=%([\w.\-]+)", attrs)):
                out.setdefault(m.group(1), (outer, name, 0))
            elif opcode == "while" and (m := re.search(r"body=%([\w.\-]+)", attrs)):
                out.setdefault(m.group(1), (outer, name, 0))
            elif opcode == "conditional" and (m := re.search(r"branch_computations=\{([^}]*)\}", attrs)):
                for b, branch in enumerate(re.findall(r"%([\w.\-]+)", m.group(1))):
                    out.setdefault(branch, (outer, name, b + 1))
    return out


def _count(type_: str) -> int:
    shapes = _SHAPE.findall(type_)
    return math.prod(int(d) for d in shapes[-1][1].split(",") if d) if shapes else 0


def _sources(comps: dict, callers: dict, entry: str, comp: str, name, index=None, sliced=None, depth=0) -> list:
    """``[(entry parameter number, elements of the slice taken of it or None)]``: the program arguments whose
    elements the value ``name`` of ``comp`` (its tuple element ``index``) holds unchanged, through copies,
    bitcasts, reshapes, transposes, slices, fusions' parameters and roots, a loop's carried tuple and a
    conditional's branches (one source per branch); empty when it is computed. ``name`` None: the root."""
    inst = comps.get(comp, {}).get(name)
    if inst is None or depth > 256:
        return []
    type_, opcode, operands, attrs, args = inst
    follow = lambda c, n, i=None, s=sliced: _sources(comps, callers, entry, c, n, i, s, depth + 1)
    if opcode == "parameter":
        number = int(args)
        if comp == entry:
            return [(number, sliced)] if index is None else []
        if comp not in callers:
            return []
        outer, call, first = callers[comp]
        call_operands = comps[outer][call][2]
        at = first + number
        return follow(outer, call_operands[at], index) if at < len(call_operands) else []
    if index is not None:  # an element of a tuple
        if opcode == "tuple":
            return follow(comp, operands[index]) if index < len(operands) else []
        if opcode in ("copy-start", "collective-permute-start"):  # (source, destination, ...): the source's elements
            return follow(comp, operands[0]) if index in (0, 1) else []
        if opcode == "fusion" and (m := re.search(r"calls=%([\w.\-]+)", attrs)):
            return follow(m.group(1), None, index)
        if opcode == "custom-call" and 'custom_call_target="AsyncCollective' in attrs and index < len(operands):
            # XLA:TPU's asynchronous collective: element 0 of its start is the collective's input, carried along
            inner = comps[comp].get(operands[index])
            if inner is not None and inner[1] in COLLECTIVES:
                return follow(comp, inner[2][0]) if index == 0 and inner[2] else []
            return follow(comp, operands[index])
        if opcode == "conditional" and (m := re.search(r"branch_computations=\{([^}]*)\}", attrs)):
            return [s for b in re.findall(r"%([\w.\-]+)", m.group(1)) for s in follow(b, None, index)]
        return []
    if opcode == "get-tuple-element" and operands:
        return follow(comp, operands[0], int(re.search(r"index=(\d+)", attrs).group(1)))
    if opcode in _SLICE and operands:
        return follow(comp, operands[0], None, _count(type_) if sliced is None else sliced)
    if opcode in _PASS and operands:
        return follow(comp, operands[0])
    if opcode == "fusion" and (m := re.search(r"calls=%([\w.\-]+)", attrs)):
        return follow(m.group(1), None)
    if opcode == "custom-call" and 'custom_call_target="ConcatBitcast"' in attrs:
        # XLA:TPU puts an argument's slices back together: the argument itself when they are all of it
        parts = {n for operand in operands for n, _ in follow(comp, operand, None, None)}
        whole = next((i for n, i in comps[entry].items() if n is not None and i[1] == "parameter"
                      and len(parts) == 1 and int(i[4]) in parts), None)
        return [(parts.pop(), sliced)] if whole and _count(whole[0]) == _count(type_) else []
    return []


def _argument_name(line_metadata: str) -> str | None:
    """A program argument's leaf path from its ``op_name`` (``model.layers.slots[0].attn.q`` ->
    ``layers.slots.0.attn.q``: the argument's own name dropped, indices and keys dotted)."""
    m = re.search(r'op_name="([^"]+)"', line_metadata)
    if not m or "." not in m.group(1):
        return None
    path = m.group(1).split(".", 1)[1]
    return re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path).strip(".")


def whole_gathers(hlo: str, model) -> list[str]:
    """The sharded parameters of ``model`` (abstract leaves with shardings, at least ``WHOLE_GATHER_MIN_ELEMENTS``
    elements) that an all-gather in ``hlo`` produces whole. Each all-gather's operand is followed back (through
    copies, bitcasts, reshapes, transposes, slices, fusions' parameters and roots, a loop's carried tuple) to the
    program argument whose elements it holds, named by its metadata; the gather is whole when its result holds
    as many elements as that argument's global shape (``path [shape]``), or, when a slice of it was taken (one
    block of a stacked weight, in a loop over blocks), as many as the slice's global extent
    (``path[block] [shape]`` for one block). A gather of a computed value (an activation) is never reported."""
    leaves = {}
    for path, leaf in leaf_paths(model):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not hasattr(sharding, "shard_shape"):
            continue
        shape = tuple(leaf.shape)
        if sharding.shard_shape(shape) != shape:
            leaves[path] = shape
    comps, entry = _computations(hlo)
    callers = _callers(comps)
    params = {int(i[4]): i for n, i in comps.get(entry, {}).items() if n is not None and i[1] == "parameter"}
    found = []
    for comp, insts in comps.items():
        for name, (type_, opcode, operands, _, _) in insts.items():
            if name is None or opcode not in ("all-gather", "all-gather-start") or not operands:
                continue
            for number, sliced in _sources(comps, callers, entry, comp, operands[0]):
                param = params.get(number)
                path = _argument_name(param[3]) if param else None
                if path not in leaves:
                    continue
                shape, count = leaves[path], _count(type_)
                if sliced is None:
                    text = f"{path} {list(shape)}"
                    whole = count == math.prod(shape)
                else:  # a slice of the argument: whole when the gather holds the slice's every shard
                    per_chip = _count(param[0])
                    whole = bool(per_chip) and count * per_chip == sliced * math.prod(shape)
                    block = len(shape) >= 2 and sliced * shape[0] == per_chip
                    text = f"{path}[block] {list(shape[1:])}" if block else f"{path}[slice] {count} elements"
                if whole and count >= WHOLE_GATHER_MIN_ELEMENTS and text not in found:
                    found.append(text)
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
        f"{_ADVICE}")


# XLA:GPU's (jax 0.10.2) Triton GEMM emitter on some products, e.g. the Llava tower's MLP at 8 x 577 positions
_TRITON_GEMM_TILING = "Couldn't find output tile sizes"
_ADVICE = ("shard more (FSDP_TP, a larger model axis), use more chips, or pass fewer rows, a shorter sequence or a "
           "smaller sweep chunk")

