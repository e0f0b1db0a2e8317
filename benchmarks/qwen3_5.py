"""Qwen3.5 text forward speed against transformers, and compile time versus depth.

The model: an 8-block, 512-wide Qwen3.5 text model (the released layout: three
gated DeltaNet blocks then one gated-attention block, twice; attention 8 query
heads over 2 key/value heads of 64, a quarter-width interleaved multimodal
rotary; DeltaNet 4 key heads and 8 value heads, 64 wide each; intermediate
1408, vocab 8192), batch 4 x 256 tokens, float32 on the CPU; torch runs
transformers' ``Qwen3_5ForCausalLM`` (sdpa attention, its pure-torch chunked
delta rule: the path without flash-linear-attention) with random weights in the
same process. Prints a markdown table of ratios.

    python benchmarks/qwen3_5.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import common
from common import checkpoint, compare, forward_callables, forward_rows, print_table, time_interleaved

SIZE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
            vocab_size=8192, max_position_embeddings=1024, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
            rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True))
BATCH, SEQ = 4, 256
STATES = ("layers.layer_output", "layers.linear_attn.state_output")


def qwen3_5_config(layers):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(num_hidden_layers=layers, **{**SIZE, "rope_parameters": dict(SIZE["rope_parameters"])})


def compile_seconds(layers: int) -> float:
    from jstd.models.qwen3_5 import Qwen3_5Text

    return common.compile_seconds(Qwen3_5Text, qwen3_5_config(layers), BATCH, SEQ)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="skip the compile-time rows")
    args = parser.parse_args()

    import jax
    import numpy as np
    import torch

    work = Path(tempfile.gettempdir()) / "jstd-bench"
    folder = checkpoint(qwen3_5_config(8), work / "qwen3_5-8x512")
    tokens = np.random.default_rng(0).integers(0, SIZE["vocab_size"], (BATCH, SEQ))
    torch_forward, jstd_forward = forward_callables(folder, tokens)
    t = compare(torch_forward, jstd_forward, STATES, args.repeats)
    # the two interleaved too, run for run, so that load from other processes hits both alike: median and best
    both = time_interleaved({"torch": torch_forward, "jstd": lambda: jstd_forward(())}, args.repeats)
    compiled = (16, float("nan"), 64, float("nan")) if args.no_compile else \
        (16, compile_seconds(16), 64, compile_seconds(64))
    rows = forward_rows(t["torch"], t["jstd"], t["reads"], BATCH * SEQ, "tok", f"logits max rel. diff {t['err']:.1e}",
                        "every block's layer_output and DeltaNet state_output", compiled)
    (tm, tb), (jm, jb) = both["torch"], both["jstd"]
    rows.insert(1, ("forward throughput, interleaved runs (median; best)", f"{tm / jm:.2f}x; {tb / jb:.2f}x",
                    f"jstd {jm * 1e3:.0f} / {jb * 1e3:.0f} ms, torch {tm * 1e3:.0f} / {tb * 1e3:.0f} ms"))
    print_table(f"torch {torch.__version__} threads {torch.get_num_threads()}, jax {jax.__version__}, "
                f"{os.cpu_count()} cores; batch {BATCH} x {SEQ} tokens, float32", rows)


if __name__ == "__main__":
    main()
