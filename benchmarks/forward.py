"""Forward speed, read overhead, compile time versus depth, and loading memory, against transformers.

The model: an 8-block, 512-wide Llama (8 heads over 4 kv heads, intermediate
1408, vocab 8192), batch 4 x 256 tokens, float32 on the CPU; torch runs
transformers' model with sdpa attention (eager where the family refuses sdpa:
Gemma 2) in the same process. Prints a
markdown table of ratios (paste into docs/benchmarks.md), with each side's share of the dot peak measured at the
run's start (``common.forward_flops``: 61.2 GFLOP of matrix products a Llama forward here; at 200 GFLOP/s, 80% is
383 ms).

    python benchmarks/forward.py [--repeats 7] [--family llama]
    python benchmarks/forward.py --families mistral,qwen2,...   # throughput ratios only, each beside Llama's

``--family`` runs another text family (a ``model_type``: mistral, qwen2, gemma2, gemma3_text, olmo3, ...) at the
same sizes (head_dim 64), its other config values transformers' defaults (Gemma 2's soft-caps, the families'
sliding windows, which are longer than the 256 tokens here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import common
from common import forward_flops, forward_timings, peak_row, print_table, repeats_parser, text_checkpoint, versions

SIZE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
            max_position_embeddings=1024, rms_norm_eps=1e-5)
RESIDUAL = ("layers.layer_input", "layers.self_attn.attention_output", "layers.mlp.mlp_output", "layers.layer_output")


# what a family's defaults hold that the benchmark's sizes replace (head_dim 256 on the Gemmas; Phi-3's and SmolLM3's token ids, past the vocabulary here)
FAMILY_SIZES = {"gemma": dict(head_dim=64), "gemma2": dict(head_dim=64, query_pre_attn_scalar=64),
                "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64),
                "phi3": dict(pad_token_id=0, eos_token_id=2), "smollm3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)}


def llama_config(layers):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, **SIZE)


def family_config(family: str):
    """``layers -> config`` of ``family`` (a model_type) at the benchmark's sizes."""
    if family == "llama":
        return llama_config
    from transformers import AutoConfig

    return lambda layers: AutoConfig.for_model(family, num_hidden_layers=layers, **SIZE, **FAMILY_SIZES.get(family, {}))


def compile_seconds(layers: int, family: str = "llama") -> float:
    from jstd.families import FAMILIES

    return common.compile_seconds(FAMILIES[family], family_config(family)(layers))


def load_memory(folder: Path) -> dict:
    """Peak resident memory added while loading ``folder`` (float32), in a fresh process."""
    code = f"""
import jstd, json, psutil, jax, jax.numpy as jnp, transformers
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


def family_ratios(families: list[str], repeats: int) -> None:
    """Print each family's forward throughput against torch (logits only, the sizes above), torch and jstd timed
    run for run (medians of ``repeats`` interleaved pairs), and that ratio over Llama's (Llama runs first)."""
    from common import forward_callables, time_interleaved

    rows, base = [], None
    for family in ["llama"] + [f for f in families if f != "llama"]:
        folder, tokens = text_checkpoint(family_config(family), f"{family}-8x512", SIZE["vocab_size"])
        torch_forward, jstd_forward, attention = forward_callables(folder, tokens)
        t = time_interleaved({"torch": torch_forward, "jstd": lambda: jstd_forward(())}, repeats)
        ratio = t["torch"][0] / t["jstd"][0]
        base = ratio if base is None else base
        rows.append((f"{family} (torch {attention})", f"{ratio:.2f}x",
                     f"{ratio / base:.2f} of Llama's; jstd {t['jstd'][0] * 1e3:.0f} ms, torch {t['torch'][0] * 1e3:.0f} ms"))
    print_table(versions() + ", forward throughput by family (jstd / torch, interleaved medians)", rows)


def main():
    parser = repeats_parser()
    parser.add_argument("--family", default="llama", help="the text family (model_type) to run; default llama")
    parser.add_argument("--families", help="comma-separated model_types: only their throughput ratios, beside Llama's")
    args = parser.parse_args()
    if args.families:
        return family_ratios(args.families.split(","), args.repeats)
    make = family_config(args.family)
    folder, tokens = text_checkpoint(make, f"{args.family}-8x512", SIZE["vocab_size"])
    t = forward_timings(folder, tokens, RESIDUAL, args.repeats)
    t_torch, t_jstd, t_reads = t["torch"], t["jstd"], t["reads"]

    c4, c32 = compile_seconds(4, args.family), compile_seconds(32, args.family)
    mem = load_memory(folder)
    disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    added = mem["peak"] - mem["base"]

    tok_s = lambda t: 4 * 256 / t
    rows = [
        (f"forward throughput, logits only (jstd / torch {t['attention']})", f"{t_torch / t_jstd:.2f}x",
         f"jstd {tok_s(t_jstd):,.0f} tok/s, torch {tok_s(t_torch):,.0f} tok/s"),
        peak_row(forward_flops(make(8)), t_jstd, "jstd forward, logits only"),
        peak_row(forward_flops(make(8)), t_torch, "torch forward"),
        ("reading every residual-stream site of every block (overhead over logits only)",
         f"{(t_reads / t_jstd - 1) * 100:+.1f}%", f"{t_reads * 1e3:.1f} ms vs {t_jstd * 1e3:.1f} ms"),
        ("compile time, 32 blocks / 4 blocks", f"{c32 / c4:.2f}x", f"{c32:.2f} s vs {c4:.2f} s"),
        ("peak memory added while loading / checkpoint size on disk", f"{added / disk:.2f}x",
         f"{added / 2**20:.0f} MiB for {disk / 2**20:.0f} MiB"),
    ]
    print_table(versions() + ("" if args.family == "llama" else f", {args.family}"), rows)


if __name__ == "__main__":
    main()
