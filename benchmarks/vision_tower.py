"""The CLIP vision tower against transformers (``python benchmarks/vision.py --parts tower``): HF's default
CLIPVisionConfig (12 blocks, 768 wide, 12 heads, intermediate 3072, 224-pixel images in 32-pixel patches: 50
positions with the class token), batch 8, float32; torch runs CLIPVisionModel with sdpa attention. Prints the
forward rows (throughput, the overhead of reading every block's stream and contributions, compile time at 3 and 12
blocks) as a markdown table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from common import WORK, compare, compile_time, forward_rows, jstd_call, print_table, torch_call, versions

BATCH = 8


def tower_folder(config, folder: Path) -> Path:
    """``folder``, holding a random tower checkpoint of ``config`` (saved once)."""
    from reference.vision import make_tower_checkpoint

    if not (folder / "config.json").exists():
        make_tower_checkpoint(config, folder)
    return folder


def compile_seconds(layers: int) -> float:
    """Trace + compile time of jit(run) on the skeleton of a tower with ``layers`` blocks (shapes only)."""
    import jax
    import jax.numpy as jnp
    from transformers import CLIPVisionConfig

    import jstd
    from jstd.vision.towers import CLIPVision

    hf = CLIPVisionConfig(num_hidden_layers=layers)
    pixels = jax.ShapeDtypeStruct((BATCH, 3, hf.image_size, hf.image_size), jnp.float32)
    return compile_time(CLIPVision.skeleton(hf, jnp.float32), jstd.Inputs(images={"pixel_values": pixels}))


def tower_benchmark(args):
    """jstd (jit) against transformers (sdpa) on the default CLIP tower, ``args.repeats`` runs a timing."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    import jstd

    config = CLIPVisionConfig()
    folder = tower_folder(config, WORK / "clip-vision-default")
    pixels = np.random.default_rng(0).normal(size=(BATCH, 3, config.image_size, config.image_size)).astype(np.float32)

    ref = CLIPVisionModel.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    torch_forward = torch_call(ref, "last_hidden_state", pixel_values=torch.from_numpy(pixels))
    model = jstd.load(folder)
    jstd_forward = jstd_call(model, jstd.Inputs(images={"pixel_values": pixels}), ("vision.tower_output",))
    every_block = ("vision.layers.layer_output", "vision.layers.self_attn.attention_output",
                   "vision.layers.mlp.mlp_output")
    t = compare(torch_forward, jstd_forward, every_block, args.repeats)
    rows = forward_rows(t["torch"], t["jstd"], t["reads"], BATCH, "img", f"max |diff| {t['err']:.1e} of the max",
                        "every block's stream and contributions", (3, compile_seconds(3), 12, compile_seconds(12)))
    print_table(f"CLIPVisionConfig() batch {BATCH}: {versions()}", rows)
