"""Reading a compiled ``jstd.generate``'s decoding loop from its optimized HLO text (``compiled.as_text()``): the
loop's instructions, and the buffers a decoding step makes beside its products (tests/test_generate.py,
benchmarks/generate.py)."""

from __future__ import annotations

import re

import numpy as np

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8}
_LINE = re.compile(r"\s+(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*)$")
_FREE = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant")  # no buffer of their own


def computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's name -> its instruction lines (fused computations included)."""
    blocks, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.endswith("{"):
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            blocks[name] = []
        elif name and line.startswith("  "):
            blocks[name].append(line)
    return blocks


def decoding_loop(hlo: str, carried: str) -> list[str]:
    """The instructions of the optimized program's decoding loop (the ENTRY ``while`` whose state holds
    ``carried``, a shape like ``f32[6,2,512]``) and of the loops inside it, fusions' insides excluded."""
    blocks = computations(hlo)
    entry = next(n for n in blocks if any(" while(" in l for l in blocks[n]) and hlo.find("ENTRY %" + n) >= 0)
    loop = next(l for l in blocks[entry] if " while(" in l and carried in l)
    found, todo = [], [loop.split("body=%")[1].split(",")[0].split()[0]]
    while todo:
        body = blocks[todo.pop()]
        found += body
        todo += [l.split("body=%")[1].split(",")[0].split()[0] for l in body if " while(" in l]
    return found


def shape_bytes(shape: str) -> int:
    """The bytes of an HLO shape (``f32[4,8]{1,0}``, or a tuple of shapes: their sum)."""
    return sum(int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _BYTES[t]
               for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape) if t in _BYTES)


def step_buffers(hlo: str, carried: str) -> list[tuple[int, str, str]]:
    """``(bytes, kind, instruction)`` for each buffer the decoding loop (``decoding_loop``) makes at each step.
    ``kind``: ``"product"`` (a dot's output), ``"in place"`` (a fusion whose root writes a slice into an operand:
    a cache or logits write, counted as the slice it writes), ``"copy"``, or ``"made"`` (everything else: what
    an elementwise, concatenating or slicing fusion writes)."""
    blocks = computations(hlo)
    out = []
    for line in decoding_loop(hlo, carried):
        m = _LINE.match(line)
        if not m or m.group(3) in _FREE:
            continue
        name, shape, op, rest = m.groups()
        size, kind = shape_bytes(shape), "made"
        called = re.search(r"calls=%([\w.\-]+)", rest)
        root = next((l for l in blocks.get(called.group(1), ()) if l.strip().startswith("ROOT")), "") if called else ""
        if op == "dot" or "kind=kCustom" in rest:
            kind = "product"
        elif op == "copy":
            kind = "copy"
        elif " dynamic-update-slice(" in root or op == "dynamic-update-slice":
            inside = {l.group(1): l.group(2) for l in map(_LINE.match, blocks[called.group(1)]) if l} if called else {}
            update = re.findall(r"%([\w.\-]+)", (root or line).split("dynamic-update-slice(")[1])[1]
            size, kind = shape_bytes(inside.get(update, "")) if called else size, "in place"
        out.append((size, kind, line.strip()[:200]))
    return out
