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

    python benchmarks/vision.py [--parts tower,llava,idefics3,sweep-tiny,sweep-small] [--repeats 7] [--profile]
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="tower,llava,idefics3,sweep")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="time the wrapper's tower and text model apart")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if "tower" in parts:
        tower_benchmark(args)
    if "llava" in parts:
        out = wrapper_benchmark("llava-clip-l-336", llava_config(), 576, 336, False, args)
        if args.profile:
            profile_pieces(*out, args.repeats)
    if "idefics3" in parts:
        from jstd.models import FAMILIES

        if "idefics3" not in FAMILIES:
            print("idefics3: not measured (jstd has no idefics3 family in this checkout)")
        else:
            wrapper_benchmark("idefics3-siglip-364", idefics3_config(), 169, 364, True, args)
    for size in ("tiny", "small"):
        if f"sweep-{size}" in parts or "sweep" in parts:
            sweep_benchmark(args, size)


if __name__ == "__main__":
    main()
