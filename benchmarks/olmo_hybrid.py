"""OLMo-Hybrid forward speed against transformers, and compile time versus depth.

The model: an 8-block, 512-wide OLMo-Hybrid (the released layout: three
DeltaNet blocks then one attention block, twice; 8 heads, DeltaNet keys 48 and
values 96 wide per head as the config derives them, intermediate 1408, vocab
8192, no rotary), batch 4 x 256 tokens, float32 on the CPU; torch runs
transformers' model (sdpa attention, its pure-torch chunked delta rule: the
path without flash-linear-attention) in the same process, runs interleaved.
Prints a markdown table of ratios.

    python benchmarks/olmo_hybrid.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import common
from common import checkpoint, forward_rows, forward_timings, print_table

SIZE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=8, vocab_size=8192,
            max_position_embeddings=1024, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
            rope_parameters=dict(rope_type="default", rope_theta=None))
BATCH, SEQ = 4, 256
STATES = ("layers.layer_output", "layers.linear_attn.state_output")


def olmo_config(layers):
    from transformers import OlmoHybridConfig

    return OlmoHybridConfig(num_hidden_layers=layers, **{**SIZE, "rope_parameters": dict(SIZE["rope_parameters"])})


def compile_seconds(layers: int) -> float:
    from jstd.models.olmo_hybrid import OlmoHybrid

    return common.compile_seconds(OlmoHybrid, olmo_config(layers), BATCH, SEQ)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import jax
    import numpy as np
    import torch

    work = Path(tempfile.gettempdir()) / "jstd-bench"
    folder = checkpoint(olmo_config(8), work / "olmo-hybrid-8x512")
    tokens = np.random.default_rng(0).integers(0, SIZE["vocab_size"], (BATCH, SEQ))
    t = forward_timings(folder, tokens, STATES, args.repeats)
    err = t["err"]

    # depths not compiled above (no cache hit)
    rows = forward_rows(t["torch"], t["jstd"], t["reads"], BATCH * SEQ, "tok", f"logits max rel. diff {err:.1e}",
                        "every block's layer_output and DeltaNet state_output",
                        (16, compile_seconds(16), 64, compile_seconds(64)))
    print_table(f"torch {torch.__version__} threads {torch.get_num_threads()}, jax {jax.__version__}, "
                f"{os.cpu_count()} cores; batch {BATCH} x {SEQ} tokens, float32", rows)


if __name__ == "__main__":
    main()
