"""Forward speed, read overhead, compile time versus depth, and loading memory, against transformers.

The model: an 8-block, 512-wide Llama (8 heads over 4 kv heads, intermediate
1408, vocab 8192), batch 4 x 256 tokens, float32 on the CPU; torch runs
transformers' model with sdpa attention in the same process. Prints a
markdown table of ratios (paste into docs/benchmarks.md).

    python benchmarks/forward.py [--repeats 7]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import common
from common import forward_timings, print_table, repeats_parser, text_checkpoint, versions

SIZE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
            max_position_embeddings=1024, rms_norm_eps=1e-5)
RESIDUAL = ("layers.layer_input", "layers.self_attn.attention_output", "layers.mlp.mlp_output", "layers.layer_output")


def llama_config(layers):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, **SIZE)


def compile_seconds(layers: int) -> float:
    from jstd.models.llama import Llama

    return common.compile_seconds(Llama, llama_config(layers))


def load_memory(folder: Path) -> dict:
    """Peak resident memory added while loading ``folder`` (float32), in a fresh process."""
    code = f"""
import json, psutil, jax, jax.numpy as jnp, jstd, transformers
from transformers import AutoConfig
AutoConfig.from_pretrained({str(folder)!r})
jnp.ones(3).block_until_ready()
base = psutil.Process().memory_info().rss
m = jstd.load({str(folder)!r}, dtype=jnp.float32)
jax.block_until_ready(m)
# VmHWM: this process's own peak (ru_maxrss would count the parent's pages at fork)
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(json.dumps(dict(base=base, peak=peak)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    args = repeats_parser().parse_args()
    folder, tokens = text_checkpoint(llama_config, "llama-8x512", SIZE["vocab_size"])
    t = forward_timings(folder, tokens, RESIDUAL, args.repeats)
    t_torch, t_jstd, t_reads = t["torch"], t["jstd"], t["reads"]

    c4, c32 = compile_seconds(4), compile_seconds(32)
    mem = load_memory(folder)
    disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    added = mem["peak"] - mem["base"]

    tok_s = lambda t: 4 * 256 / t
    rows = [
        ("forward throughput, logits only (jstd / torch sdpa)", f"{t_torch / t_jstd:.2f}x",
         f"jstd {tok_s(t_jstd):,.0f} tok/s, torch {tok_s(t_torch):,.0f} tok/s"),
        ("reading every residual-stream site of every block (overhead over logits only)",
         f"{(t_reads / t_jstd - 1) * 100:+.1f}%", f"{t_reads * 1e3:.1f} ms vs {t_jstd * 1e3:.1f} ms"),
        ("compile time, 32 blocks / 4 blocks", f"{c32 / c4:.2f}x", f"{c32:.2f} s vs {c4:.2f} s"),
        ("peak memory added while loading / checkpoint size on disk", f"{added / disk:.2f}x",
         f"{added / 2**20:.0f} MiB for {disk / 2**20:.0f} MiB"),
    ]
    print_table(versions(), rows)


if __name__ == "__main__":
    main()
