"""Loading a real-size checkpoint: wall time and peak memory of ``jstd.load`` against transformers.

The checkpoint: a random Llama of SmolLM-135M's shape (hidden 576, 30 blocks,
9 heads over 3 kv heads, intermediate 1536, vocab 49152, tied embeddings),
float32 safetensors (about 540 MB), built once under
``tempfile.gettempdir()/jstd-bench``. Each measurement runs in a fresh process
(the parent stays small and imports neither jax nor torch): imports and
backend start-up first, then the load alone is timed, on four sides: jstd
with transformers already imported (as after ``jstd.load_processor``); jstd
in a process that imported only jstd (its first load imports transformers to
parse config.json, and transformers imports torch where it is installed);
the same with torch hidden (an install without it, ``make demo``); and
transformers' ``from_pretrained`` (torch and transformers imported first)
plus its first forward. jstd's side also times a warm un-jitted ``jstd.run``
on 5 tokens against ``jax.jit(jstd.run)`` (eager calls compile and cache
internally). Memory is the peak
resident set added by the load: the process's peak (``VmHWM``, reset just
before the load through ``/proc/self/clear_refs``; ``ru_maxrss`` where that is
unavailable) minus its resident set after the imports. The page cache is warm
(the file is read once before the runs). Prints a markdown table.

    python benchmarks/load.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common

SMOLLM_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                   intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, head_dim=64)
TOKENS = (1, 32)  # the first forward's batch: one row of 32 tokens

BUILD = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(**{size!r}, dtype=torch.float32)
model = LlamaForCausalLM(config)
model.save_pretrained(sys.argv[1])
"""

# shared by both sides: the process's peak and current resident set, and resetting the peak
MEMORY = """
import json, resource, sys, time
def status(field):
    try:
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) * 1024
    except (OSError, StopIteration):
        return None
def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
def peak():
    hwm = status("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def current():
    rss = status("VmRSS")
    return rss if rss is not None else peak()
"""

# torch hidden from the import system, as in an install without it (`make demo`): transformers then leaves it alone
NO_TORCH = """
import importlib.machinery, sys
class NoTorch(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] == "torch" else super().find_spec(name, path, target)
sys.meta_path = [NoTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""

# a fresh process's timed ``jstd.load({folder})``: ``base`` (memory before), ``model``, ``load`` (seconds);
# {imports}: what is imported before the baseline
TIMED_LOAD = MEMORY + """
import jstd, jax, jax.numpy as jnp, numpy as np
{imports}
jnp.ones(3).block_until_ready()
base = current() if reset_peak() else peak()
t = time.perf_counter()
model = jstd.load({folder!r})
jax.block_until_ready(model)
load = time.perf_counter() - t
"""

# {prelude}: NO_TORCH or nothing
JSTD = """{prelude}""" + TIMED_LOAD + """top = peak()
tokens = np.arange({n}).reshape({shape}) % 1000
t = time.perf_counter()
jax.block_until_ready(jax.jit(jstd.run)(model, tokens).logits)
first = time.perf_counter() - t
def best(f, n=7):  # warm: one call first, then the best of n
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - t)
    return min(times)
five = tokens[:, :5]
run = jax.jit(jstd.run)
eager = best(lambda: jstd.run(model, five).logits)
jitted = best(lambda: run(model, five).logits)
print(json.dumps(dict(load=load, added=top - base, first=first, eager=eager, jitted=jitted,
                      torch="torch" in sys.modules)))
"""
WARM = "from transformers import AutoConfig\nAutoConfig.from_pretrained({folder!r})"

TORCH = MEMORY + """
import sys, torch, transformers
from transformers import AutoModelForCausalLM
torch.ones(3) @ torch.ones(3)
base = current() if reset_peak() else peak()
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained({folder!r}, dtype=torch.float32).eval()
load = time.perf_counter() - t
top = peak()
tokens = torch.arange({n}).reshape({shape}) % 1000
t = time.perf_counter()
with torch.inference_mode():
    model(input_ids=tokens).logits
first = time.perf_counter() - t
print(json.dumps(dict(load=load, added=top - base, first=first, torch=True)))
"""
SIDES = {
    # transformers (and torch) imported first, as after jstd.load_processor: the load alone
    "jstd": JSTD.replace("{prelude}", "").replace("{imports}", WARM),
    # a fresh process after `import jstd`: the load imports transformers for config.json, which imports torch
    "jstd, cold": JSTD.replace("{prelude}", "").replace("{imports}", ""),
    # the same without torch installed
    "jstd, cold, no torch": JSTD.replace("{prelude}", NO_TORCH).replace("{imports}", ""),
    "transformers": TORCH,
}


def checkpoint(folder: Path) -> Path:
    """The random SmolLM-135M-shaped checkpoint in ``folder``, built (in a subprocess) when absent."""
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, "-c", BUILD.format(size=SMOLLM_135M), str(folder)], check=True)
    return folder


def measure(code: str, folder: Path) -> dict:
    """One fresh process running ``code`` on ``folder``: its JSON line (``load``, ``added``, ``first``)."""
    script = code.replace("{folder!r}", repr(str(folder))).replace("{n}", str(TOKENS[0] * TOKENS[1])).replace(
        "{shape}", repr(TOKENS))
    return common.run_json(script)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per side (median reported)")
    args = parser.parse_args()

    folder = checkpoint(Path(tempfile.gettempdir()) / "jstd-bench" / "smollm-135m-shape")
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    for p in folder.glob("*.safetensors"):  # warm the page cache for both sides alike
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    runs = {side: [] for side in SIDES}
    for _ in range(args.repeats):  # interleaved, so that machine noise hits every side alike
        for side, code in SIDES.items():
            runs[side].append(measure(code, folder))
    med = {side: {k: statistics.median(float(r[k]) for r in rs) for k in rs[0]} for side, rs in runs.items()}
    t = med["transformers"]
    mib = lambda b: f"{b / 2**20:,.0f} MiB"
    rows = []
    for side in ("jstd", "jstd, cold", "jstd, cold, no torch"):
        j = med[side]
        rows.append((f"{side}: load time / transformers' from_pretrained + first forward", "≤ 1.0×",
                     f"{j['load'] / (t['load'] + t['first']):.2f}×",
                     f"{j['load']:.2f} s vs {t['load']:.2f} s + {t['first']:.2f} s"))
        rows.append((f"{side}: peak memory added / weights on disk", "≤ 1.15×", f"{j['added'] / weights:.2f}×",
                     f"{mib(j['added'])} for {mib(weights)}" + ("; torch imported" if j["torch"] else "")))
    rows += [
        ("transformers: peak memory added by from_pretrained / weights", "—", f"{t['added'] / weights:.2f}×",
         f"{mib(t['added'])} (the weights stay memory-mapped until the first forward reads them)"),
        ("first forward after loading", "—", f"jstd {med['jstd']['first']:.2f} s",
         f"transformers {t['first']:.2f} s; jstd's includes tracing and compiling; {TOKENS[0]} × {TOKENS[1]} tokens"),
        ("un-jitted `jstd.run` (warm, 1 × 5 tokens) / `jax.jit(jstd.run)`", "—",
         f"{med['jstd']['eager'] / med['jstd']['jitted']:.2f}×",
         f"{med['jstd']['eager'] * 1e3:.1f} ms vs {med['jstd']['jitted'] * 1e3:.1f} ms (eager runs compile and cache)"),
    ]
    import platform

    print(f"SmolLM-135M shape, float32, {mib(weights)} on disk; {os.cpu_count()} cores, {platform.machine()}; "
          f"medians of {args.repeats} fresh processes per side")
    print("| figure | target | measured | detail |\n| --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
