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

The parts live in vision_tower.py (tower), vision_wrapper.py (llava, idefics3), vision_sweep.py (sweep-*),
qwen_tower.py and qwen_profile.py (qwen-tower); this file picks them by --parts and runs them in that order.
"""

from __future__ import annotations

import argparse

from qwen_profile import qwen_profile
from qwen_tower import qwen_tower_benchmark
from vision_sweep import sweep_benchmark
from vision_tower import tower_benchmark
from vision_wrapper import idefics3_config, llava_config, profile_pieces, wrapper_benchmark


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
        out = qwen_tower_benchmark(args)
        if args.profile:
            qwen_profile(*out)


if __name__ == "__main__":
    main()
