"""Where a compiled forward's time goes, op by op: the shares of XLA:CPU's own trace (``jax.profiler``).

Runs ``jax.jit(jstd.run)`` (logits) on the benchmark's random checkpoint — ``moe`` (benchmarks/moe.py's
Qwen3-MoE 8×512, 16 experts top-2) or ``llama`` (benchmarks/forward.py's Llama 8×512) — at batch 4 × 256,
traces ``--runs`` forwards and prints each HLO op's *self* time (a loop's time less the ops inside it) as a share
of the total, by op (its shape and kind) and summed by the jstd source lines that made it (the optimised HLO's
stack frames: innermost jstd frame, then its caller). Also: the compiled program's optimised HLO is written to
``--hlo`` when given.

    python benchmarks/op_profile.py [--model moe|llama] [--runs 3] [--top 40] [--hlo out.txt]

Shares within one trace are comparable with each other even on a loaded machine (every op slows alike, roughly);
the absolute times are not figures. Read an op's rate against the LM head's (``CausalLM.head``: the program's
largest plain product) to see which products run below the machine's matrix rate and which time is not products
at all (copies of sliced weights, transposes, the softmax).
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile

from common import BATCH, SEQ, text_checkpoint


def source_labels(hlo: str) -> dict[str, tuple[str, str, str]]:
    """``{op name: (kind, shape, label)}`` for every instruction of the optimised HLO text ``hlo``, the label being
    the innermost two jstd frames of its stack (``kernels/attention.py:250 grouped < ...``) or ``?``."""
    section = lambda name: re.search(rf"^{name}\n(.*?)(?=^[A-Za-z])", hlo, re.S | re.M).group(1)
    files = dict(re.findall(r'^(\d+) "(.*)"$', section("FileNames"), re.M))
    functions = dict(re.findall(r'^(\d+) "(.*)"$', section("FunctionNames"), re.M))
    places = {m[0]: (files[m[1]], functions[m[2]], m[3]) for m in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", section("FileLocations"), re.M)}
    frames = {a: (b, c) for a, b, c in re.findall(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)",
                                                  section("StackFrames"), re.M)}

    def label(frame):
        out, seen = [], set()
        while frame in frames and frame not in seen and len(out) < 2:
            seen.add(frame)
            place, frame = frames[frame]
            path, function, line = places[place]
            if "/jstd/" in path:
                out.append(f"{path.split('/jstd/')[1]}:{line} {function}")
        return " < ".join(out) or "?"

    ops = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = (\S+) ([\w-]+)\(.*?op_name=\"[^\"]*\"(?: stack_frame_id=(\d+))?",
                         hlo, re.M):
        ops[m.group(1)] = (m.group(3), m.group(2), label(m.group(4)) if m.group(4) else "?")
    return ops


def self_times(trace_dir: str, ops: dict) -> collections.Counter:
    """Nanoseconds of each op of ``ops`` in the trace under ``trace_dir``, less the ops nested in it (a while
    loop's own time is its loop overhead)."""
    from jax._src.profiler import ProfileData

    data = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[-1])
    own = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            events = sorted(((e.start_ns, e.end_ns, e.name) for e in line.events if e.name in ops),
                            key=lambda e: (e[0], -e[1]))
            stack = []
            for start, end, name in events:
                while stack and stack[-1][1] <= start:
                    stack.pop()
                if stack:
                    own[stack[-1][2]] -= end - start
                own[name] += end - start
                stack.append((start, end, name))
    return own


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("moe", "llama"), default="moe")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--hlo", help="write the optimised HLO here")
    args = parser.parse_args()
    import jax

    import jstd

    if args.model == "moe":
        from moe import SIZE, qwen3_moe_config as make
        folder, tokens = text_checkpoint(make, "qwen3_moe-8x512x16", SIZE["vocab_size"])
    else:
        from forward import SIZE, llama_config as make
        folder, tokens = text_checkpoint(make, "llama-8x512", SIZE["vocab_size"])
    model = jstd.load(folder)
    compiled = jax.jit(lambda m, t: jstd.run(m, t).logits).lower(model, tokens).compile()
    hlo = compiled.as_text()
    if args.hlo:
        open(args.hlo, "w").write(hlo)
    forward = lambda: jax.block_until_ready(compiled(model, tokens))
    forward(), forward()
    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace)
        for _ in range(args.runs):
            forward()
        jax.profiler.stop_trace()
        ops = source_labels(hlo)
        own = self_times(trace, ops)
    total = sum(own.values())
    print(f"{args.model}, batch {BATCH} x {SEQ}: {total / args.runs / 1e6:.0f} ms of op time a forward (shares below)")
    by_source = collections.Counter()
    for name, t in own.items():
        by_source[ops[name][2]] += t
    print("\n| share | jstd source |\n| --- | --- |")
    for label, t in by_source.most_common(args.top):
        print(f"| {t / total:.1%} | {label} |")
    print("\n| share | op | shape | source |\n| --- | --- | --- | --- |")
    for name, t in own.most_common(args.top):
        kind, shape, label = ops[name]
        print(f"| {t / total:.1%} | {name} ({kind}) | {shape} | {label} |")


if __name__ == "__main__":
    main()
