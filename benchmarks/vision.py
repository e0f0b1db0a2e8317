"""Vision tower forward against transformers: HF's default CLIPVisionConfig, batch 8, float32.

The tower: 12 blocks, 768 wide, 12 heads, intermediate 3072, 224-pixel images in 32-pixel patches (50 positions
with the class token), random weights; torch runs CLIPVisionModel with sdpa attention in the same process.
Prints a markdown table of ratios (paste into docs/benchmarks.md).

    python benchmarks/vision.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

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


if __name__ == "__main__":
    main()
