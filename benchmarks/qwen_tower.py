"""The packed Qwen2.5-VL vision tower against transformers (``python benchmarks/vision.py --parts qwen-tower``).

The tower alone: 8 blocks, 640 wide, 10 heads, SwiGLU MLP 1712 — Qwen's 3420 / 1280 ratio —, blocks 3 and 7 over
whole images, the others in windows of 112 pixels = 64 patches; the merger to 640. 4 images of 448 pixels packed
in one row (4 x 1024 patches of 2 x 14 x 14 pixels, 1024 merged tokens); torch runs the tower with sdpa and with
eager attention, jstd reads vision.merger.output (window order, compared with torch's pooler_output after
``restore``). Also: trace + compile time, the compiled program's temporary memory and largest array at 1, 2 and 4
images (memory_analysis: per-image attention, no [patches, patches] matrix), and the peak memory one forward adds
in a fresh process at 1 and 4 images, each side. ``qwen_profile`` (``--profile``) takes it further.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import WORK, print_table, time_interleaved, torch_call, versions

# a Qwen2.5-VL vision tower at 8 blocks x 640 (the 7B's is 32 x 1280, MLP 3420: the same ratio)
QWEN_TOWER = dict(depth=8, hidden_size=640, num_heads=10, intermediate_size=1712, out_hidden_size=640, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=112, fullatt_block_indexes=[3, 7],
                  hidden_act="silu")
QWEN_GRID = (1, 32, 32)        # one 448-pixel image: 32 x 32 patches (1024), 256 merged tokens
QWEN_IMAGES = 4
QWEN_MERGED = ("vision.merger.output",)


def qwen_tower_folder() -> Path:
    """The random Qwen2.5-VL tower checkpoint (saved once): transformers' init, the patch conv at std
    1/sqrt(fan-in) so that the stream stays O(1) on standard normal pixels."""
    folder = WORK / "qwen25-vision"
    if not (folder / "config.json").exists():
        import torch
        from transformers import AutoModel
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

        torch.manual_seed(0)
        model = AutoModel.from_config(Qwen2_5_VLVisionConfig(**QWEN_TOWER))
        with torch.no_grad():
            conv = model.patch_embed.proj.weight
            conv.normal_(0.0, conv[0].numel() ** -0.5)
        model.save_pretrained(folder)
    return folder


def qwen_batch(images: int) -> tuple[np.ndarray, np.ndarray]:
    """``images`` copies of QWEN_GRID and standard normal pixels for them, ``[images * 1024, 3 * 2 * 14 * 14]``."""
    grids = np.array([QWEN_GRID] * images, np.int64)
    t, h, w = QWEN_GRID
    unit = 3 * QWEN_TOWER["temporal_patch_size"] * QWEN_TOWER["patch_size"] ** 2
    return np.random.default_rng(0).standard_normal((images * t * h * w, unit), dtype=np.float32), grids


def qwen_compiled(model, images: int) -> dict:
    """Trace + compile time of jit(run) reading the merger's output at ``images`` images, the compiled program's
    temporary memory (``memory_analysis``) and its largest array (any instruction's result in the optimized HLO)."""
    import jax

    import jstd

    pixels, grids = qwen_batch(images)
    inputs = jstd.Inputs.of({"pixel_values": pixels, "image_grid_thw": grids})
    t = time.perf_counter()
    compiled = jax.jit(jstd.run, static_argnames="reads").lower(model, inputs, reads=QWEN_MERGED).compile()
    seconds = time.perf_counter() - t
    size = {"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}
    arrays = {(m[1], m[2]) for m in re.finditer(r"\b(f64|s64|f32|s32|u32|bf16|f16|pred|s8|u8)\[([\d,]+)\]",
                                                compiled.as_text())}
    dtype, dims = max(arrays, key=lambda a: size[a[0]] * int(np.prod([int(d) for d in a[1].split(",")])))
    largest = size[dtype] * int(np.prod([int(d) for d in dims.split(",")]))
    return dict(seconds=seconds, temp=compiled.memory_analysis().temp_size_in_bytes, largest=largest,
                largest_shape=f"{dtype}[{dims}]")


QWEN_PEAK = """
import json, sys
import numpy as np
side, folder, images = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, {benchmarks!r})
from qwen_tower import QWEN_MERGED, qwen_batch
rss = lambda key: next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024


def reset_peak():  # VmHWM back to the current VmRSS (ru_maxrss would also count the parent's pages at fork)
    open("/proc/self/clear_refs", "w").write("5")


pixels, grids = qwen_batch(images)
compiled = None
if side == "jstd":
    import jax, jstd
    model = jstd.load(folder)
    inputs = jstd.Inputs.of({{"pixel_values": pixels, "image_grid_thw": grids}})
    f = jax.jit(jstd.run, static_argnames="reads")
    jax.block_until_ready(model)
    reset_peak()
    before = rss("VmRSS:")
    f.lower(model, inputs, reads=QWEN_MERGED).compile()  # shares jit's cache: the call below runs it
    compiled = rss("VmHWM:") - before
    forward = lambda: f(model, inputs, reads=QWEN_MERGED).values[QWEN_MERGED[0]].block_until_ready()
else:
    import torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(folder, attn_implementation=side).eval()

    def forward():
        with torch.inference_mode():
            model(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids))
reset_peak()
ready = rss("VmRSS:")
forward()
print(json.dumps(dict(ready=ready, peak=rss("VmHWM:"), compiled=compiled)))
"""


def qwen_peak(side: str, folder: Path, images: int) -> dict:
    """Resident memory of a fresh process that loads the tower (and for jstd compiles the forward): ``ready`` once
    it has, ``peak`` its peak over one forward on ``images`` images (``side``: jstd or a torch attention
    implementation), ``compiled``: jstd's peak while compiling, over its memory before (None for torch)."""
    code = QWEN_PEAK.format(benchmarks=str(Path(__file__).resolve().parent))
    out = subprocess.run([sys.executable, "-c", code, side, str(folder), str(images)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def qwen_check(got, grids, refs: dict) -> None:
    """Print the merged tokens' max difference ``got`` (jstd, window order) against each torch reference in
    ``refs`` (attention implementation: forward callable); raise AssertionError past 1e-4 of the max."""
    from jstd.vision.qwen_vit import packing

    restore = packing(tuple(map(tuple, grids.tolist())), QWEN_TOWER["spatial_merge_size"],
                      QWEN_TOWER["window_size"] // QWEN_TOWER["spatial_merge_size"] // QWEN_TOWER["patch_size"]).restore
    errs = {}
    for impl, forward in refs.items():
        want = forward().numpy()
        errs[impl] = float(np.abs(got[restore] - want).max()), float(np.abs(want).max())
    print("qwen-tower: max |diff| of the merged tokens vs torch: " + ", ".join(
        f"{impl} {d:.1e} (max {m:.2f}, relative {d / m:.1e})" for impl, (d, m) in errs.items()), flush=True)
    if max(d / m for d, m in errs.values()) > 1e-4:
        raise AssertionError(f"jstd and transformers disagree: {errs}")


def qwen_rows(t: dict, reps: int, first: float, compiled: dict, peaks: dict) -> list[tuple[str, str, str]]:
    """The qwen-tower table: throughput against torch sdpa and eager from the interleaved timings ``t``, compile
    time (``first``: the first jit call's seconds) and memory from ``compiled`` (by images), peak memory from
    ``peaks`` (by (side, images))."""
    (tj, tj_best), (ts, ts_best), (te, te_best) = t["jstd"], t["torch sdpa"], t["torch eager"]
    rate = lambda s: f"{QWEN_IMAGES / s:.2f} img/s"
    mib = lambda b: f"{b / 2**20:,.0f} MiB"
    rows = [
        ("tower forward throughput (jstd / torch sdpa), median", f"{ts / tj:.2f}x",
         f"jstd {rate(tj)} ({tj:.2f} s), torch {rate(ts)} ({ts:.2f} s); {reps} interleaved runs"),
        ("the same, best run", f"{ts_best / tj_best:.2f}x", f"jstd {tj_best:.2f} s, torch {ts_best:.2f} s"),
        ("tower forward throughput (jstd / torch eager), median", f"{te / tj:.2f}x",
         f"torch eager {rate(te)} ({te:.2f} s, best {te_best:.2f} s)"),
        ("trace + compile, 4 images / 1 image", f"{(first - tj) / compiled[1]['seconds']:.2f}x",
         f"{first - tj:.2f} s (the first jit call, {first:.2f} s, less a median forward) vs "
         f"{compiled[1]['seconds']:.2f} s (lower + compile; 2 images {compiled[2]['seconds']:.2f} s)"),
        ("compiled temporary memory, 4 images / 1 image", f"{compiled[QWEN_IMAGES]['temp'] / compiled[1]['temp']:.2f}x",
         ", ".join(f"{n} img {mib(c['temp'])} (largest array {c['largest_shape']} {mib(c['largest'])})"
                   for n, c in compiled.items())),
    ]
    for n in (1, QWEN_IMAGES):
        j, s = peaks["jstd", n], peaks["sdpa", n]
        rows.append((f"peak memory a forward adds, {n} image{'s' * (n > 1)} (jstd / torch sdpa)",
                     f"{(j['peak'] - j['ready']) / (s['peak'] - s['ready']):.2f}x",
                     f"jstd {mib(j['peak'] - j['ready'])}, torch {mib(s['peak'] - s['ready'])} (VmHWM over VmRSS once "
                     f"loaded, fresh process); jstd's compile peaks {mib(j['compiled'])} higher, whole process "
                     f"{mib(j['peak'])} vs torch {mib(s['peak'])}"))
    return rows


def qwen_tower_benchmark(args):
    """jstd's packed Qwen2.5-VL tower against transformers' (sdpa and eager attention), interleaved; returns
    ``(model, inputs, merged, ref, x, thw, reps)`` for ``qwen_profile``: jstd's model and inputs, its blocked
    forward ``merged(reads)``, the sdpa torch tower and its inputs, the number of timed runs."""
    import jax
    import torch
    from transformers import AutoModel

    import jstd

    folder = qwen_tower_folder()
    pixels, grids = qwen_batch(QWEN_IMAGES)
    x, thw = torch.from_numpy(pixels), torch.from_numpy(grids)
    refs = {impl: AutoModel.from_pretrained(folder, attn_implementation=impl).eval() for impl in ("sdpa", "eager")}
    torch_forward = {impl: torch_call(ref, "pooler_output", x, grid_thw=thw) for impl, ref in refs.items()}

    model = jstd.load(folder)
    inputs = jstd.Inputs.of({"pixel_values": pixels, "image_grid_thw": grids})
    run = jax.jit(jstd.run, static_argnames="reads")
    merged = lambda reads=QWEN_MERGED: run(model, inputs, reads=reads).values[QWEN_MERGED[0]].block_until_ready()
    t0 = time.perf_counter()
    got = np.asarray(merged())
    first = time.perf_counter() - t0
    # after the first call: jax shares its compile cache with lower().compile(), so 4 images is not compiled again
    compiled = {n: qwen_compiled(model, n) for n in (1, 2, QWEN_IMAGES)}
    qwen_check(got, grids, torch_forward)

    reps = max(3, args.repeats // 2)
    load = os.getloadavg()[0]  # the timings mean little on a busy machine: the heading says how busy it was
    t = time_interleaved({"torch sdpa": torch_forward["sdpa"], "torch eager": torch_forward["eager"],
                          "jstd": merged}, reps)
    peaks = {(side, n): qwen_peak(side, folder, n) for n in (1, QWEN_IMAGES) for side in ("jstd", "sdpa")}
    print_table(f"qwen-tower: Qwen2.5-VL vision tower {QWEN_TOWER['depth']} x {QWEN_TOWER['hidden_size']}, "
                f"{QWEN_IMAGES} images x {np.prod(QWEN_GRID)} patches packed: {versions()}; load average {load:.1f} "
                f"before the timings, {os.getloadavg()[0]:.1f} after", qwen_rows(t, reps, first, compiled, peaks))
    return model, inputs, merged, refs["sdpa"], x, thw, reps
