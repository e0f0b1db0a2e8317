"""Vision benchmarks against transformers (float32, same process, interleaved timings); each part prints a
markdown table of ratios (paste into docs/benchmarks.md).

tower: HF's default CLIPVisionConfig (12 blocks, 768 wide, 12 heads, intermediate 3072, 224-pixel images in
    32-pixel patches: 50 positions with the class token), batch 8; torch runs CLIPVisionModel with sdpa attention.
llava: a Llava 1.5 wrapper with a CLIP ViT-L/14-336-shaped tower (24 blocks, 1024 wide, 16 heads, MLP 4096,
    quick_gelu; 577 positions), the Llava MLP projector, and a 4-block Llama text model (2048 wide, 16 heads over
    16 kv heads, MLP 5632, vocab 8192); batch 2, one 336-pixel image per row (576 image tokens) in a 588-token
    prompt; torch runs AutoModelForImageTextToText with sdpa attention.
idefics3: an Idefics 3 wrapper with a SigLIP-shaped tower (27 blocks, 1152 wide, 16 heads, MLP 4304, 364-pixel
    tiles in 14-pixel patches: 676 per tile), scale_factor 2 (169 image tokens per tile), the same text model;
    batch 2, one tile per row.
sweep-tiny, sweep-small (or sweep: both): a patching sweep over a tiny / small Llava's tower blocks x patches (every block, every patch that feeds an image
    token) between a clean and a corrupted image: one jstd.patch_sweep call (one compile) against a loop of
    nnsight traces on the torch model, one per entry.
qwen-tower: the packed Qwen2.5-VL vision tower alone (8 blocks, 640 wide, 10 heads, SwiGLU MLP 1712 — Qwen's
    3420 / 1280 ratio —, blocks 3 and 7 over whole images, the others in windows of 112 pixels = 64 patches; the
    merger to 640), 4 images of 448 pixels packed in one row (4 x 1024 patches of 2 x 14 x 14 pixels, 1024 merged
    tokens); torch runs the tower with sdpa and with eager attention, jstd reads vision.merger.output (window order,
    compared with torch's pooler_output after ``restore``). Also: trace + compile time, the compiled program's
    temporary memory and largest array at 1, 2 and 4 images (memory_analysis: per-image attention, no [patches,
    patches] matrix), and the peak memory one forward adds in a fresh process at 1 and 4 images, each side. With
    --profile: the overhead of reading every block's layer_output, and one piece of each kind (patch embedding, a
    windowed block, a full-attention block, each block's attention alone, the merger) timed alone against torch's.

    python benchmarks/vision.py [--parts tower,llava,idefics3,sweep-tiny,sweep-small,qwen-tower] [--repeats 7]
        [--profile]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
from common import compare, forward_rows, print_table

BATCH = 8


def tower_folder(config, folder: Path) -> Path:
    from reference.vision import make_tower_checkpoint

    if not (folder / "config.json").exists():
        make_tower_checkpoint(config, folder)
    return folder


def compile_seconds(layers: int) -> float:
    """Trace + compile time of jit(run) on the skeleton of a tower with ``layers`` blocks (shapes only)."""
    import time

    import jax
    import jax.numpy as jnp
    from transformers import CLIPVisionConfig

    import jstd
    from jstd.vision.towers import CLIPVision

    hf = CLIPVisionConfig(num_hidden_layers=layers)
    skeleton = CLIPVision.skeleton(hf, jnp.float32)
    pixels = jax.ShapeDtypeStruct((BATCH, 3, hf.image_size, hf.image_size), jnp.float32)
    t = time.perf_counter()
    jax.jit(jstd.run).lower(skeleton, jstd.Inputs(images={"pixel_values": pixels})).compile()
    return time.perf_counter() - t


def tower_benchmark(args):
    import jax
    import numpy as np
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    import jstd

    config = CLIPVisionConfig()
    folder = tower_folder(config, Path(tempfile.gettempdir()) / "jstd-bench" / "clip-vision-default")
    pixels = np.random.default_rng(0).normal(size=(BATCH, 3, config.image_size, config.image_size)).astype(np.float32)

    ref = CLIPVisionModel.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    x = torch.from_numpy(pixels)

    def torch_forward():
        with torch.inference_mode():
            return ref(pixel_values=x).last_hidden_state

    model = jstd.load(folder)
    inputs = jstd.Inputs(images={"pixel_values": pixels})
    tower = jax.jit(jstd.run, static_argnames="reads")
    every_block = ("vision.layers.layer_output", "vision.layers.self_attn.attention_output",
                   "vision.layers.mlp.mlp_output")
    t = compare(torch_forward, lambda reads: jax.block_until_ready(tower(model, inputs, reads=("vision.tower_output",) + reads)),
                every_block, args.repeats)
    rows = forward_rows(t["torch"], t["jstd"], t["reads"], BATCH, "img", f"max |diff| {t['err']:.1e} of the max",
                        "every block's stream and contributions", (3, compile_seconds(3), 12, compile_seconds(12)))
    print_table(f"CLIPVisionConfig() batch {BATCH}: torch {torch.__version__} threads {torch.get_num_threads()}, "
                f"jax {jax.__version__}, {os.cpu_count()} cores", rows)


TEXT = dict(model_type="llama", vocab_size=8192, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096)
IMAGE_TOKEN = TEXT["vocab_size"] - 1
WRAPPER_BATCH = 2


def llava_config():
    from transformers import LlavaConfig

    tower = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                 num_attention_heads=16, image_size=336, patch_size=14, hidden_act="quick_gelu",
                 projection_dim=768)
    return LlavaConfig(vision_config=tower, text_config=dict(TEXT), image_token_index=IMAGE_TOKEN)


def idefics3_config():
    from transformers import Idefics3Config

    tower = dict(model_type="idefics3_vision", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                 num_attention_heads=16, image_size=364, patch_size=14)
    return Idefics3Config(vision_config=tower, text_config=dict(TEXT), image_token_id=IMAGE_TOKEN, scale_factor=2)


def wrapper_batch(image_tokens: int, image_size: int, tiles: bool, rng) -> dict:
    """``WRAPPER_BATCH`` rows of 4 text tokens, one image's ``image_tokens`` and 8 more text tokens."""
    row = lambda: [*rng.integers(0, IMAGE_TOKEN, 4), *[IMAGE_TOKEN] * image_tokens, *rng.integers(0, IMAGE_TOKEN, 8)]
    ids = np.array([row() for _ in range(WRAPPER_BATCH)], np.int64)
    shape = (WRAPPER_BATCH, 1, 3, image_size, image_size) if tiles else (WRAPPER_BATCH, 3, image_size, image_size)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "pixel_values": rng.normal(size=shape).astype(np.float32)}
    if tiles:
        batch["pixel_attention_mask"] = np.ones((WRAPPER_BATCH, 1, image_size, image_size), np.int64)
    return batch


def wrapper_benchmark(name: str, config, image_tokens: int, image_size: int, tiles: bool, args):
    """jstd (jit) against transformers (sdpa) on one wrapper forward, logits only, interleaved."""
    import jax
    import torch
    from transformers import AutoModelForImageTextToText

    import jstd
    from common import time_interleaved
    from reference.wrapper import make_wrapper_checkpoint

    folder = Path(tempfile.gettempdir()) / "jstd-bench" / name
    if not (folder / "config.json").exists():
        make_wrapper_checkpoint(config, folder)
    batch = wrapper_batch(image_tokens, image_size, tiles, np.random.default_rng(0))
    ref = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}

    def torch_forward():
        with torch.inference_mode():
            return ref(**tensors).logits

    model = jstd.load(folder)
    inputs = jstd.Inputs.of(batch)
    forward = jax.jit(jstd.run)
    jstd_forward = lambda: jax.block_until_ready(forward(model, inputs).logits)
    t = time_interleaved({"torch": torch_forward, "jstd": jstd_forward}, args.repeats)
    want, got = torch_forward().numpy(), np.asarray(jstd_forward())
    err = float(np.abs(got - want).max() / np.abs(want).max())
    (tt, tt_best), (tj, tj_best) = t["torch"], t["jstd"]
    seq = batch["input_ids"].shape[1]
    print_table(f"{name}: batch {WRAPPER_BATCH} x {seq} tokens ({image_tokens} image tokens a row), torch "
                f"{torch.__version__} threads {torch.get_num_threads()}, jax {jax.__version__}, {os.cpu_count()} cores", [
        ("wrapper forward, logits only (jstd / torch), median", f"{tt / tj:.2f}x",
         f"jstd {tj * 1e3:,.0f} ms, torch {tt * 1e3:,.0f} ms; max |diff| {err:.1e} of the max"),
        ("the same, best run", f"{tt_best / tj_best:.2f}x", f"jstd {tj_best * 1e3:,.0f} ms, torch {tt_best * 1e3:,.0f} ms"),
    ])
    return model, inputs, forward


def profile_pieces(model, inputs, forward, repeats: int):
    """Where a wrapper forward's time goes: the whole forward against its text model alone on the same tokens
    (the rest is the tower, the projector and the scatter), interleaved."""
    import jax

    import jstd
    from common import time_interleaved

    text_only = jax.jit(lambda m, x: jstd.run(m.text, x).logits)
    text_inputs = jstd.Inputs(inputs.tokens, inputs.attention_mask)
    t = time_interleaved({"forward": lambda: jax.block_until_ready(forward(model, inputs).logits),
                          "text model alone": lambda: jax.block_until_ready(text_only(model, text_inputs))}, repeats)
    print("| piece | median ms |\n| --- | --- |")
    for k, (med, _) in t.items():
        print(f"| {k} | {med * 1e3:,.0f} |")


# the sweep's Llavas. small: a 4-block CLIP tower (256 wide, 4 heads, 112-pixel images in 14-pixel patches: 64
# patches and the class token), a 2-block Llama (256 wide), vocab 1024. tiny: a 4-block tower 64 wide on 56-pixel
# images (16 patches), a 2-block Llama 64 wide, vocab 1024
SWEEP_SIZES = {
    "small": (dict(hidden_size=256, intermediate_size=1024, image_size=112), dict(hidden_size=256, intermediate_size=704)),
    "tiny": (dict(hidden_size=64, intermediate_size=256, image_size=56), dict(hidden_size=64, intermediate_size=176)),
}
SWEEP_TOWER = dict(model_type="clip_vision_model", num_hidden_layers=4, num_attention_heads=4, patch_size=14,
                   hidden_act="quick_gelu")
SWEEP_TEXT = dict(model_type="llama", vocab_size=1024, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=512)
SWEEP_TARGET, SWEEP_OTHER = 11, 42


def sweep_benchmark(args, size: str):
    """Tower blocks x patches: jstd.patch_sweep (one call) against a loop of nnsight traces, one per entry."""
    import time

    import jax
    import nnsight
    import torch
    from nnsight import NNsight
    from transformers import AutoModelForImageTextToText, LlavaConfig

    import jstd
    from reference.wrapper import make_wrapper_checkpoint

    jax.config.update("jax_default_matmul_precision", "highest")
    tower_size, text_size = SWEEP_SIZES[size]
    tower_config, text_config = {**SWEEP_TOWER, **tower_size}, {**SWEEP_TEXT, **text_size}
    folder = Path(tempfile.gettempdir()) / "jstd-bench" / f"llava-sweep-{size}"
    if not (folder / "config.json").exists():
        make_wrapper_checkpoint(LlavaConfig(vision_config=tower_config, text_config=text_config,
                                            image_token_index=text_config["vocab_size"] - 1), folder)
    rng = np.random.default_rng(0)
    patches = (tower_config["image_size"] // tower_config["patch_size"]) ** 2
    ids = np.array([[*rng.integers(0, 1000, 4), *[SWEEP_TEXT["vocab_size"] - 1] * patches, *rng.integers(0, 1000, 6)]])
    pixels = tower_config["image_size"]
    clean = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "pixel_values": rng.normal(size=(1, 3, pixels, pixels)).astype(np.float32)}
    corrupt = {**clean, "pixel_values": rng.normal(size=(1, 3, pixels, pixels)).astype(np.float32)}
    blocks = tower_config["num_hidden_layers"]
    positions = list(range(1, patches + 1))                 # the patches (position 0 is the class token)
    entries = [(l, p) for l in range(blocks) for p in positions]

    model = jstd.load(folder)
    metric = jstd.logit_difference(SWEEP_TARGET, SWEEP_OTHER)
    site = "vision.layers.layer_output"
    sweep = lambda: jstd.patch_sweep(model, jstd.Inputs.of(clean), jstd.Inputs.of(corrupt), site, metric,
                                     positions=positions, progress=False).block_until_ready()
    import logging

    compiled = []                                          # names of the programs XLA compiles in the cold call

    class Names(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Compiling "):
                compiled.append(msg.split()[1])

    handler = Names()
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    t0 = time.perf_counter()
    grid = np.asarray(sweep())
    cold = time.perf_counter() - t0
    jax.config.update("jax_log_compiles", False)
    logging.getLogger("jax").removeHandler(handler)
    warm = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        sweep()
        warm.append(time.perf_counter() - t0)
    t_jstd = float(np.median(warm))

    ref = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    lm = NNsight(ref)
    tower = lambda: lm.model.vision_tower.encoder.layers
    tc, tb = ({k: torch.from_numpy(v) for k, v in b.items()} for b in (clean, corrupt))
    t0 = time.perf_counter()
    saved = []
    with torch.no_grad(), lm.trace(**tc):
        for l in range(blocks):
            saved.append(tower()[l].output.save())
    values = {}
    for l, p in entries:
        with torch.no_grad(), lm.trace(**tb):
            tower()[l].output[:, p] = saved[l][:, p]
            logits = lm.output.logits.save()
        last = logits[0, -1]
        values[l, p] = float(last[SWEEP_TARGET] - last[SWEEP_OTHER])
    t_nnsight = time.perf_counter() - t0
    diff = max(abs(values[l, p] - grid[l, p - 1]) for l, p in entries)
    print(f"tower sweep ({size}: tower {tower_config['hidden_size']} wide, text {text_config['hidden_size']} wide): {blocks} blocks x {patches} patches = {len(entries)} patched runs; jax {jax.__version__}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), nnsight {nnsight.__version__}")
    print("| figure | ratio | detail |\n| --- | --- | --- |")
    print(f"| tower patching sweep: nnsight loop / jstd.patch_sweep (warm) | {t_nnsight / t_jstd:.1f}x "
          f"| jstd {t_jstd:.2f} s, nnsight {t_nnsight:.1f} s |")
    print(f"| the same, jstd including its compile | {t_nnsight / cold:.1f}x | jstd {cold:.2f} s cold, "
          f"compiled: {', '.join(compiled)} |")
    print(f"| max abs difference of the metric vs nnsight | {diff:.1e} | scale {np.abs(grid).max():.2f}; last block "
          f"(read by nothing) spread {np.ptp(grid[-1]):.1e} |")


# the qwen-tower part: a Qwen2.5-VL vision tower at 8 blocks x 640 (the 7B's is 32 x 1280, MLP 3420: the same ratio)
QWEN_TOWER = dict(depth=8, hidden_size=640, num_heads=10, intermediate_size=1712, out_hidden_size=640, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=112, fullatt_block_indexes=[3, 7],
                  hidden_act="silu")
QWEN_GRID = (1, 32, 32)        # one 448-pixel image: 32 x 32 patches (1024), 256 merged tokens
QWEN_IMAGES = 4
QWEN_MERGED = ("vision.merger.output",)


def qwen_tower_folder() -> Path:
    """The random Qwen2.5-VL tower checkpoint (saved once): transformers' init, the patch conv at std
    1/sqrt(fan-in) so that the stream stays O(1) on standard normal pixels."""
    folder = Path(tempfile.gettempdir()) / "jstd-bench" / "qwen25-vision"
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
    import re
    import time

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
from vision import QWEN_MERGED, qwen_batch
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
    import json
    import subprocess
    import sys

    code = QWEN_PEAK.format(benchmarks=str(Path(__file__).resolve().parent))
    out = subprocess.run([sys.executable, "-c", code, side, str(folder), str(images)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def qwen_tower_benchmark(args):
    """jstd's packed Qwen2.5-VL tower against transformers' (sdpa and eager attention), interleaved."""
    import time

    import jax
    import torch
    from transformers import AutoModel

    import jstd
    from common import time_interleaved
    from jstd.vision.qwen_vit import packing

    folder = qwen_tower_folder()
    pixels, grids = qwen_batch(QWEN_IMAGES)
    x, thw = torch.from_numpy(pixels), torch.from_numpy(grids)
    refs = {impl: AutoModel.from_pretrained(folder, attn_implementation=impl).eval() for impl in ("sdpa", "eager")}

    def torch_forward(ref):
        def forward():
            with torch.inference_mode():
                return ref(x, grid_thw=thw).pooler_output
        return forward

    model = jstd.load(folder)
    inputs = jstd.Inputs.of({"pixel_values": pixels, "image_grid_thw": grids})
    run = jax.jit(jstd.run, static_argnames="reads")
    merged = lambda reads=QWEN_MERGED: run(model, inputs, reads=reads).values[QWEN_MERGED[0]].block_until_ready()
    t0 = time.perf_counter()
    got = np.asarray(merged())
    first = time.perf_counter() - t0
    # after the first call: jax shares its compile cache with lower().compile(), so 4 images is not compiled again
    compiled = {n: qwen_compiled(model, n) for n in (1, 2, QWEN_IMAGES)}
    restore = packing(tuple(map(tuple, grids.tolist())), QWEN_TOWER["spatial_merge_size"],
                      QWEN_TOWER["window_size"] // QWEN_TOWER["spatial_merge_size"] // QWEN_TOWER["patch_size"]).restore
    errs = {}
    for impl, ref in refs.items():
        want = torch_forward(ref)().numpy()
        errs[impl] = float(np.abs(got[restore] - want).max()), float(np.abs(want).max())
    print(f"qwen-tower: max |diff| of the merged tokens vs torch: " + ", ".join(
        f"{impl} {d:.1e} (max {m:.2f}, relative {d / m:.1e})" for impl, (d, m) in errs.items()), flush=True)
    if max(d / m for d, m in errs.values()) > 1e-4:
        raise AssertionError(f"jstd and transformers disagree: {errs}")

    reps = max(3, args.repeats // 2)
    load = os.getloadavg()[0]  # the timings mean little on a busy machine: the heading says how busy it was
    t = time_interleaved({"torch sdpa": torch_forward(refs["sdpa"]), "torch eager": torch_forward(refs["eager"]),
                          "jstd": merged}, reps)
    (tj, tj_best), (ts, ts_best), (te, te_best) = t["jstd"], t["torch sdpa"], t["torch eager"]
    rate = lambda s: f"{QWEN_IMAGES / s:.2f} img/s"
    peaks = {(side, n): qwen_peak(side, folder, n) for n in (1, QWEN_IMAGES) for side in ("jstd", "sdpa")}
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
    print_table(f"qwen-tower: Qwen2.5-VL vision tower {QWEN_TOWER['depth']} x {QWEN_TOWER['hidden_size']}, "
                f"{QWEN_IMAGES} images x {np.prod(QWEN_GRID)} patches packed: torch {torch.__version__} threads "
                f"{torch.get_num_threads()}, jax {jax.__version__}, {os.cpu_count()} cores; load average {load:.1f} "
                f"before the timings, {os.getloadavg()[0]:.1f} after", rows)
    if args.profile:
        qwen_profile(model, inputs, merged, refs["sdpa"], x, thw, reps)


def qwen_profile(model, inputs, merged, ref, x, thw, reps: int):
    """The overhead of reading every block's layer_output, then one piece of each kind alone, jstd against torch
    (torch's pieces on the arguments its own forward passes them, captured by hooks; jstd's on a random stream)."""
    import jax
    import torch

    from common import time_interleaved
    from jstd.core.tap import Tap
    from jstd.vision.qwen_vit import packing

    every_block = QWEN_MERGED + ("vision.layers.layer_output",)
    t = time_interleaved({"merged tokens": merged, "and every block's layer_output": lambda: merged(every_block)}, reps)
    (plain, _), (every, _) = t["merged tokens"], t["and every block's layer_output"]
    print(f"\nreading every block's layer_output: {(every / plain - 1) * 100:+.1f}% ({every:.2f} s vs {plain:.2f} s)\n")

    captured = {}

    def grab(name):
        def hook(module, a, kw):
            captured[name] = (module, a, kw)
        return hook

    full = QWEN_TOWER["fullatt_block_indexes"][0]
    modules = {"patch embedding": ref.patch_embed, "windowed block": ref.blocks[0],
               "full-attention block": ref.blocks[full], "windowed attention": ref.blocks[0].attn,
               "full attention": ref.blocks[full].attn, "merger": ref.merger}
    hooks = [m.register_forward_pre_hook(grab(name), with_kwargs=True) for name, m in modules.items()]
    with torch.inference_mode():
        ref(x, grid_thw=thw)
    for h in hooks:
        h.remove()

    def torch_piece(name):
        module, a, kw = captured[name]

        def piece():
            with torch.inference_mode():
                return module(*a, **kw)
        return piece

    v = model.vision
    layout = packing(tuple(map(tuple, inputs.static("image_grid_thw"))), v.merge, v.window)
    args = (v.rotary(layout.positions), {"full": layout.full, "window": layout.window})
    s = Tap(frozenset(), (), {}, {}).scope()
    block = lambda i: jax.tree.map(lambda a: a[i // v.layers.period], v.layers.slots[i % v.layers.period])
    windowed, full_block = block(0), block(full)
    h = jax.numpy.asarray(np.random.default_rng(1).standard_normal((1, x.shape[0], v.patch_embedding.shape[1]),
                                                                   dtype=np.float32))
    pixels = jax.numpy.asarray(x.numpy())
    ready = lambda f, *a: (lambda g: lambda: jax.block_until_ready(g(*a)))(jax.jit(f))
    jstd_pieces = {
        "patch embedding": ready(lambda w, p: p @ w, v.patch_embedding, pixels),
        "windowed block": ready(lambda b, h: b(h, args, s), windowed, h),
        "full-attention block": ready(lambda b, h: b(h, args, s), full_block, h),
        "windowed attention": ready(lambda b, h: b.attn(h, args, s), windowed, h),
        "full attention": ready(lambda b, h: b.attn(h, args, s), full_block, h),
        "merger": ready(lambda m, h: m(h[0]), v.merger, h),
    }
    runs = {}
    for name in modules:
        runs[name, "torch"], runs[name, "jstd"] = torch_piece(name), jstd_pieces[name]
    t = time_interleaved(runs, reps)
    print("| piece (one call, 4 images) | torch sdpa ms | jstd ms | jstd / torch time |\n| --- | --- | --- | --- |")
    for name in modules:
        tt, tj = t[name, "torch"][0], t[name, "jstd"][0]
        print(f"| {name} | {tt * 1e3:,.0f} | {tj * 1e3:,.0f} | {tj / tt:.2f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="tower,llava,idefics3,sweep")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true",
                        help="time the wrapper's tower and text model apart; the Qwen tower's reads and pieces")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "tower" in parts:
        tower_benchmark(args)
    if "llava" in parts:
        out = wrapper_benchmark("llava-clip-l-336", llava_config(), 576, 336, False, args)
        if args.profile:
            profile_pieces(*out, args.repeats)
    if "idefics3" in parts:
        from jstd.families import FAMILIES

        if "idefics3" not in FAMILIES:
            print("idefics3: not measured (jstd has no idefics3 family in this checkout)")
        else:
            wrapper_benchmark("idefics3-siglip-364", idefics3_config(), 169, 364, True, args)
    for size in ("tiny", "small"):
        if f"sweep-{size}" in parts or "sweep" in parts:
            sweep_benchmark(args, size)
    if "qwen-tower" in parts:
        qwen_tower_benchmark(args)


if __name__ == "__main__":
    main()
