"""The converted jstd checkpoint against the HuggingFace folder it came from: load time and peak memory.

The checkpoint: benchmarks/load.py's random Llama of SmolLM-135M's shape, float32 (about 540 MB), converted once
with ``jstd.convert`` (timed in its own process, with its peak memory). Each load runs in a fresh process, the
sides interleaved, page cache warm: imports and backend start-up first, then ``jstd.load`` alone is timed, on four
sides: the HF folder and the converted folder, each in a process that imported only jstd (the HF folder's first
load imports transformers to parse config.json; the converted one needs no transformers) and in one that imported
transformers first (as after ``jstd.load_processor``). Memory is the peak resident set added by the load (VmHWM
reset before it). Prints a markdown table.

    python benchmarks/convert.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from load import MEMORY, TIMED_LOAD, WARM, checkpoint  # noqa: E402

LOAD = TIMED_LOAD + """added = peak() - base
t = time.perf_counter()  # then one pass over every weight on the host (a mapped page faulted in would show here)
total = sum(float(np.asarray(x).sum(dtype=np.float64)) for x in jax.tree.leaves(model))
touch = time.perf_counter() - t
print(json.dumps(dict(load=load, added=added, touch=touch, transformers="transformers" in sys.modules)))
"""

CONVERT = MEMORY + """
import jstd, jax, jax.numpy as jnp, numpy as np
from transformers import AutoConfig
jnp.ones(3).block_until_ready()
base = current() if reset_peak() else peak()
t = time.perf_counter()
jstd.convert({src!r}, {dst!r}, progress=False, force=True)
took = time.perf_counter() - t
print(json.dumps(dict(took=took, added=peak() - base)))
"""


def run(code: str) -> dict:
    return common.run_json(code)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per side (median reported)")
    args = parser.parse_args()

    root = Path(tempfile.gettempdir()) / "jstd-bench"
    hf = checkpoint(root / "smollm-135m-shape")
    converted = root / "smollm-135m-shape-jstd"
    conversion = run(CONVERT.replace("{src!r}", repr(str(hf))).replace("{dst!r}", repr(str(converted))))
    weights = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    stored = sum(p.stat().st_size for p in converted.glob("*.safetensors"))
    for folder in (hf, converted):  # warm the page cache for every side alike
        for p in folder.glob("*.safetensors"):
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
    sides = {
        "HF folder, cold": (hf, ""), "converted, cold": (converted, ""),
        "HF folder, transformers imported": (hf, WARM.replace("{folder!r}", repr(str(hf)))),
        "converted, transformers imported": (converted, WARM.replace("{folder!r}", repr(str(hf)))),
    }
    runs = {side: [] for side in sides}
    for _ in range(args.repeats):  # interleaved, so that machine noise hits every side alike
        for side, (folder, imports) in sides.items():
            runs[side].append(run(LOAD.replace("{imports}", imports).replace("{folder!r}", repr(str(folder)))))
    med = {side: {k: statistics.median(float(r[k]) for r in rs) for k in ("load", "added", "touch")}
           for side, rs in runs.items()}
    imported = {side: any(r["transformers"] for r in rs) for side, rs in runs.items()}
    best = {side: min(float(r["load"]) for r in rs) for side, rs in runs.items()}
    mib = lambda b: f"{b / 2**20:,.0f} MiB"
    largest = 49152 * 576 * 4  # the embedding, the largest parameter
    rows = []
    for when in ("cold", "transformers imported"):
        h, c = med[f"HF folder, {when}"], med[f"converted, {when}"]
        rows.append((f"load time, HF folder / converted ({when})", "≥ 2×", f"**{h['load'] / c['load']:.1f}×**",
                     f"{h['load']:.2f} s vs {c['load']:.2f} s (best {best[f'HF folder, {when}']:.2f} vs "
                     f"{best[f'converted, {when}']:.2f} s); then one pass over every weight {h['touch']:.2f} s vs "
                     f"{c['touch']:.2f} s; transformers imported by the end: "
                     f"{imported[f'HF folder, {when}']} vs {imported[f'converted, {when}']}"))
        rows.append((f"peak memory added by the load / weights ({when})", "—",
                     f"HF {h['added'] / weights:.2f}×, converted {c['added'] / weights:.2f}×",
                     f"{mib(h['added'])} vs {mib(c['added'])} for {mib(weights)}"))
    rows.append(("`jstd.convert` time, peak memory added", "—", f"{conversion['took']:.2f} s",
                 f"{mib(conversion['added'])} (largest parameter {mib(largest)}, weights {mib(weights)}, "
                 f"converted {mib(stored)})"))
    import platform

    print(f"SmolLM-135M shape, float32, {mib(weights)} on disk; {os.cpu_count()} cores, {platform.machine()}; "
          f"medians of {args.repeats} fresh processes per side, interleaved")
    print("| figure | target | measured | detail |\n| --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if "--keep" not in sys.argv:
        shutil.rmtree(converted, ignore_errors=True)


if __name__ == "__main__":
    main()
