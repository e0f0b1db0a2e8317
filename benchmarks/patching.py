"""Residual-stream patching sweep: jstd's chunked, vmapped ``patch_sweep`` against a loop of nnsight traces.

The model: forward.py's 8-block, 512-wide Llama (8 heads over 4 kv heads,
intermediate 1408, vocab 8192), float32 on the CPU. One prompt of 64 tokens
and a corrupted copy (tokens 20 and 40 changed); the metric is the logit
difference of two tokens at the last position. The sweep patches
``layers.layer_output`` at every (block, position): 8 x 64 = 512 patched runs.

nnsight runs on the same torch model (transformers, sdpa attention) in the same
process: the clean block outputs are saved in one trace, then one trace per
entry sets ``model.layers[l].output[:, p]`` and saves the logits. Torch uses
whichever of 1 or all threads runs its forward faster here.

``patch_sweep`` resumes the corrupted run (``jstd.interventions.resume``):
each patched run starts at the patched block and computes only the positions
from the patched one on, against the corrupted run's keys and values, two
suffixes packed per row; the 20 positions before the first corrupted token are
shared by both prompts, so their 160 entries are the corrupted run's metric and
run nothing (``jstd.interventions.resume.shared_prefix``).

Peak memory: in a fresh process (glibc told to return large blocks at once),
RSS is sampled every 2 ms during a warm sweep under a budget, for two sweep
sizes; the peak above the RSS before the sweep is what the sweep used.

    python benchmarks/patching.py [--repeats 3] [--nnsight-entries 512] [--device cuda] [--no-memory]

``--family gpt2``: an IOI patching sweep on GPT-2 small's shape (12 blocks, 768
wide, 12 heads, vocab 50257; random weights, float32): an IOI-shaped prompt of
15 tokens ("When Mary and John went to the store, John gave a drink to") and its
ABC corruption (the three names replaced by three others), the metric the logit
difference of the indirect object over the subject at the last position, the
sweep ``layers.layer_output`` at every (block, position): 12 x 15 = 180 patched
runs. Against it, in the same process and on the same torch model (sdpa): the
nnsight loop (one trace per entry) and TransformerLens' way, ``run_with_hooks``
per patch (a forward hook on the patched block, added, run, removed; what
``HookedTransformer.run_with_hooks`` does around each forward). The number of
XLA compilations the cold sweep triggers is counted (``jax.monitoring``).

    python benchmarks/patching.py --family gpt2 [--repeats 3] [--device cuda]

``--family gptj`` / ``--family tinystories``: the same IOI sweep on GPT-J-6B's shape (28 blocks, 4096 wide, 16
heads, rotary on 64 of 256 dims, parallel blocks, vocab 50400: 6B float32 parameters, 24 GB in torch and as much
in jstd: a GPU's memory) or on TinyStories-33M's (GPT-Neo: 4 blocks, 768 wide, 16 heads, global and local
blocks, unscaled scores): 28 x 15 or 4 x 15 patched runs. ``--layers N`` keeps N blocks of the shape (a smoke
test: ``--layers 2``).

    python benchmarks/patching.py --family gptj --device cuda [--repeats 3]
    python benchmarks/patching.py --family tinystories [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

# "cold" means an empty persistent compilation cache: each run of this benchmark gets a fresh folder (its own
# subprocesses inherit it, and the second-process row reads what the first cold sweep wrote there)
if "JSTD_COMPILATION_CACHE" not in os.environ:
    os.environ["JSTD_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jstd-bench-cache-")

import jstd  # noqa: E402
from common import checkpoint, torch_causal_lm
from forward import SIZE, llama_config

SEQ = 64
SITE = "layers.layer_output"
TARGET, OTHER = 11, 42


def prompts():
    clean = np.random.default_rng(0).integers(0, SIZE["vocab_size"], (1, SEQ))
    corrupt = clean.copy()
    corrupt[0, [20, 40]] = [7, 8]
    return clean, corrupt


def jstd_sweep(model, clean, corrupt, budget, layers=None, progress=False):
    metric = jstd.logit_difference(TARGET, OTHER)
    return jstd.patch_sweep(model, clean, corrupt, SITE, metric, layers=layers, memory_budget=budget,
                            progress=progress).block_until_ready()


def nnsight_sweep(ref, clean, corrupt, entries, device="cpu"):
    """One nnsight trace per (block, position) entry; returns {entry: metric}."""
    import torch
    from nnsight import NNsight

    lm = NNsight(ref)
    clean_t, corrupt_t = torch.as_tensor(clean, device=device), torch.as_tensor(corrupt, device=device)
    saved = []
    with torch.no_grad(), lm.trace(input_ids=clean_t):
        for layer in range(len(ref.model.layers)):
            saved.append(lm.model.layers[layer].output.save())
    out = {}
    for layer, pos in entries:
        with torch.no_grad(), lm.trace(input_ids=corrupt_t):
            lm.model.layers[layer].output[:, pos] = saved[layer][:, pos]
            logits = lm.output.logits.save()
        last = logits[0, -1]
        out[layer, pos] = float(last[TARGET] - last[OTHER])
    return out


def second_process_cold(folder: Path, budget: int) -> float:
    """Seconds of a cold sweep in a fresh process (after its imports and load) that shares this run's persistent
    compilation cache (``JSTD_COMPILATION_CACHE``): what a user's second session pays."""
    code = f"""
import json, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import jstd
from patching import jstd_sweep, prompts
model = jstd.load({str(folder)!r})
clean, corrupt = prompts()
t = time.perf_counter()
jstd_sweep(model, clean, corrupt, {budget})
print(json.dumps(dict(cold=time.perf_counter() - t)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["cold"]


def peak_memory(folder: Path, budget: int, layers: int) -> dict:
    """Peak RSS above the level before a warm sweep over ``layers`` blocks x 64 positions, in a fresh process."""
    code = f"""
import json, sys, threading, time, psutil, jax
sys.path.insert(0, {str(Path(__file__).parent)!r})
import jstd
from patching import jstd_sweep, prompts
model = jstd.load({str(folder)!r})
clean, corrupt = prompts()
layers = list(range({layers}))
jstd_sweep(model, clean, corrupt, {budget}, layers)          # compile and warm
proc, peak, done = psutil.Process(), [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)
base = proc.memory_info().rss
t = threading.Thread(target=sample); t.start()
jstd_sweep(model, clean, corrupt, {budget}, layers)
done[0] = True; t.join()
print(json.dumps(dict(added=peak[0] - base)))
"""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


# GPT-2 small's, GPT-J-6B's and TinyStories-33M's shapes; the IOI prompt's token roles (ids are arbitrary: the
# weights are random)
GPT2_SMALL = dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)
GPTJ_6B = dict(vocab_size=50400, n_embd=4096, n_layer=28, n_head=16, n_positions=2048, rotary_dim=64)
TINYSTORIES_33M = dict(vocab_size=50257, hidden_size=768, num_layers=4, num_heads=16, max_position_embeddings=2048,
                       window_size=256, attention_types=[[["global", "local"], 2]])
IOI_SEQ, IO, S = 15, 1, 2  # positions 2 and 4 hold the names Mary (IO) and John (S); S again at 10
IOI_NAMES = {2: IO, 4: S, 10: S}


def ioi_prompts():
    """(clean, corrupt) ``[1, 15]``: an IOI-shaped prompt and its ABC corruption (every name replaced)."""
    rng = np.random.default_rng(0)
    clean = rng.integers(1000, GPT2_SMALL["vocab_size"], (1, IOI_SEQ))
    names = {IO: 3001, S: 3002}
    for p, role in IOI_NAMES.items():
        clean[0, p] = names[role]
    corrupt = clean.copy()
    corrupt[0, [2, 4, 10]] = [4001, 4002, 4003]
    return clean, corrupt


def hooks_sweep(ref, blocks, clean, corrupt, entries, io, s, device="cpu"):
    """TransformerLens' way: for each (block, position), a forward hook setting the block's output there to the
    clean run's, one forward (run_with_hooks), the hook removed; returns {entry: metric}."""
    import torch

    clean_t, corrupt_t = torch.as_tensor(clean, device=device), torch.as_tensor(corrupt, device=device)
    saved = {}
    stream = lambda o: o[0] if isinstance(o, tuple) else o  # GPT-Neo's blocks return (stream, attention weights)
    handles = [b.register_forward_hook(lambda m, a, o, l=l: saved.__setitem__(l, stream(o).clone())) for l, b in
               enumerate(blocks)]
    with torch.no_grad():
        ref(input_ids=clean_t)
    for h in handles:
        h.remove()
    out = {}
    for layer, pos in entries:
        def patch(module, args, output, layer=layer, pos=pos):
            patched = stream(output).clone()
            patched[:, pos] = saved[layer][:, pos]
            return (patched, *output[1:]) if isinstance(output, tuple) else patched
        handle = blocks[layer].register_forward_hook(patch)
        try:
            with torch.no_grad():
                last = ref(input_ids=corrupt_t).logits[0, -1]
        finally:
            handle.remove()
        out[layer, pos] = float(last[io] - last[s])
    return out


def nnsight_gpt2_sweep(ref, clean, corrupt, entries, io, s, device="cpu", tuple_output=False):
    """One nnsight trace per (block, position) entry on a GPT-2-style model (``transformer.h``: GPT-2, GPT-J,
    GPT-Neo; ``tuple_output``: the blocks return (stream, …), GPT-Neo's); returns {entry: metric}."""
    import torch
    from nnsight import NNsight

    lm = NNsight(ref)
    clean_t, corrupt_t = torch.as_tensor(clean, device=device), torch.as_tensor(corrupt, device=device)
    stream = (lambda o: o[0]) if tuple_output else (lambda o: o)
    saved = []
    with torch.no_grad(), lm.trace(input_ids=clean_t):
        for layer in range(len(ref.transformer.h)):
            saved.append(stream(lm.transformer.h[layer].output).save())
    out = {}
    for layer, pos in entries:
        with torch.no_grad(), lm.trace(input_ids=corrupt_t):
            stream(lm.transformer.h[layer].output)[:, pos] = saved[layer][:, pos]
            logits = lm.output.logits.save()
        last = logits[0, -1]
        out[layer, pos] = float(last[io] - last[s])
    return out


# --family -> (transformers config class, the published shape, its depth key, the shape's name, blocks return tuples)
IOI_FAMILIES = {
    "gpt2": ("GPT2Config", GPT2_SMALL, "n_layer", "GPT-2 small", False),
    "gptj": ("GPTJConfig", GPTJ_6B, "n_layer", "GPT-J-6B", False),
    "tinystories": ("GPTNeoConfig", TINYSTORIES_33M, "num_layers", "TinyStories-33M", True),
}


def main_gpt2(args):
    """The IOI sweep on a GPT-2-style model's shape (``--family`` gpt2, gptj, tinystories): jstd's one
    ``patch_sweep`` against nnsight and run_with_hooks."""
    import torch
    import transformers
    from gpt2_neox_cases import make_checkpoint

    config_class, shape, depth_key, shape_name, tuple_output = IOI_FAMILIES[args.family]
    shape = {**shape, **({depth_key: args.layers} if args.layers else {})}
    depth = shape[depth_key]
    if "attention_types" in shape:  # GPT-Neo: global and local blocks alternate over however many there are
        shape["attention_types"] = [[["global", "local"], depth // 2]] + ([[["global"], 1]] if depth % 2 else [])
    folder = Path(tempfile.gettempdir()) / "jstd-bench" / f"{args.family}-{depth}-random"
    if not (folder / "config.json").exists():
        make_checkpoint(getattr(transformers, config_class)(**shape), folder, seed=0)
    ref = torch_causal_lm(folder).to(args.device)  # sdpa, or eager where the family refuses it (GPT-Neo)
    model = jstd.load(folder)
    clean, corrupt = ioi_prompts()
    if args.device == "cpu":  # torch gets its faster thread setting on this machine (1 or all)
        def forward_time():
            ids = torch.as_tensor(corrupt)
            with torch.inference_mode():
                ref(input_ids=ids)
                t = time.perf_counter()
                for _ in range(3):
                    ref(input_ids=ids)
            return time.perf_counter() - t

        threads = {}
        for n in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(n)
            threads[n] = forward_time()
        torch.set_num_threads(min(threads, key=threads.get))
        print(f"torch forward, 3 runs: {threads}", file=sys.stderr, flush=True)
    io_id, s_id = 3001, 3002
    metric = jstd.logit_difference(io_id, s_id)

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(secs) if event == "/jax/core/compile/backend_compile_duration" else None)
    sweep = lambda: jstd.patch_sweep(model, clean, corrupt, SITE, metric, progress=False).block_until_ready()
    say = lambda line: print(line, file=sys.stderr, flush=True)
    t = time.perf_counter()
    grid = np.asarray(sweep())
    cold, n_compiles = time.perf_counter() - t, len(compiles)
    say(f"jstd cold {cold:.1f} s, {n_compiles} compilations")
    warm = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        sweep()
        warm.append(time.perf_counter() - t)
    t_jstd, recompiled = float(np.median(warm)), len(compiles) - n_compiles
    say(f"jstd warm {t_jstd:.2f} s")

    every = [(l, p) for l in range(depth) for p in range(IOI_SEQ)]
    n = min(args.torch_entries, len(every))  # torch's loops on evenly spread entries, their time scaled to all
    entries = [every[i] for i in np.linspace(0, len(every) - 1, n).round().astype(int)]
    blocks = list(ref.transformer.h)
    hooks_sweep(ref, blocks, clean, corrupt, entries[:3], io_id, s_id, args.device)  # warm torch
    t = time.perf_counter()
    hooked = hooks_sweep(ref, blocks, clean, corrupt, entries, io_id, s_id, args.device)
    t_hooks = (time.perf_counter() - t) * len(every) / n
    say(f"hooks {t_hooks:.1f} s (scaled from {n} entries)")
    t = time.perf_counter()
    traced = nnsight_gpt2_sweep(ref, clean, corrupt, entries, io_id, s_id, args.device, tuple_output)
    t_nnsight = (time.perf_counter() - t) * len(every) / n
    say(f"nnsight {t_nnsight:.1f} s (scaled from {n} entries)")
    diff = max(max(abs(hooked[e] - grid[e]) for e in entries), max(abs(traced[e] - grid[e]) for e in entries))

    import nnsight
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} ({args.device}, "
          f"{torch.get_num_threads()} threads, {ref.config._attn_implementation} attention), nnsight {nnsight.__version__}, {os.cpu_count()} cores; torch's loops "
          f"timed on {n} of the {len(every)} entries, scaled to all")
    print("| figure | ratio | detail |\n| --- | --- | --- |")
    print(f"| IOI residual sweep on {shape_name}'s shape, {depth} blocks x {IOI_SEQ} positions: nnsight loop / "
          f"jstd.patch_sweep (warm) | {t_nnsight / t_jstd:.1f}x | jstd {t_jstd:.2f} s, nnsight {t_nnsight:.1f} s |")
    print(f"| the same: run_with_hooks per patch / jstd.patch_sweep (warm) | {t_hooks / t_jstd:.1f}x "
          f"| hooks {t_hooks:.1f} s |")
    print(f"| the same, jstd including its compiles | {t_nnsight / cold:.1f}x (nnsight), {t_hooks / cold:.1f}x "
          f"(hooks) | jstd {cold:.2f} s cold: {n_compiles} XLA compilations, {recompiled} on the warm repeats |")
    print(f"| max abs difference of the metric vs torch | {diff:.1e} | logit difference (scale "
          f"{np.abs(grid).max():.2f}) |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama", choices=("llama", *IOI_FAMILIES),
                        help="llama: the 8x512 Llama sweep; gpt2, gptj, tinystories: the IOI sweep on GPT-2 small's, "
                             "GPT-J-6B's or TinyStories-33M's shape")
    parser.add_argument("--layers", type=int, default=None,
                        help="gpt2/gptj/tinystories: blocks of the shape to keep (default: all; a smoke test: 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-entries", type=int, default=180,
                        help="gpt2: entries timed with nnsight and with hooks (all: 180), their times scaled to 180")
    parser.add_argument("--nnsight-entries", type=int, default=512, help="entries timed with nnsight (all: 512)")
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--device", default="cpu", help="torch device (jax uses its default backend): cpu or cuda")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory rows (CPU only)")
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 matmuls as torch does them (GPU: no TF32)
    if args.family in IOI_FAMILIES:
        return main_gpt2(args)

    import nnsight
    import torch
    from transformers import AutoModelForCausalLM

    folder = checkpoint(llama_config(8), Path(tempfile.gettempdir()) / "jstd-bench" / "llama-8x512")
    clean, corrupt = prompts()
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    ref = ref.to(args.device)

    if args.device == "cpu":  # torch gets its faster thread setting on this machine
        def forward_time():
            ids = torch.as_tensor(corrupt)
            with torch.inference_mode():
                ref(input_ids=ids)
                t = time.perf_counter()
                for _ in range(5):
                    ref(input_ids=ids)
            return time.perf_counter() - t

        threads = {}
        for n in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(n)
            threads[n] = forward_time()
        torch.set_num_threads(min(threads, key=threads.get))

    model = jstd.load(folder)
    budget = args.budget_mib << 20

    def timed(fn):
        t = time.perf_counter()
        result = np.asarray(fn())
        cold = time.perf_counter() - t
        warm = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - t)
        return result, cold, float(np.median(warm))

    grid, cold, t_jstd = timed(lambda: jstd_sweep(model, clean, corrupt, budget))
    second = second_process_cold(folder, budget)

    entries = [(l, p) for l in range(8) for p in range(SEQ)]
    if args.nnsight_entries < len(entries):
        entries = [entries[i] for i in np.linspace(0, len(entries) - 1, args.nnsight_entries).round().astype(int)]
    with torch.device(args.device):
        t = time.perf_counter()
        ref_values = nnsight_sweep(ref, clean, corrupt, entries, args.device)
        t_nnsight = (time.perf_counter() - t) * 512 / len(entries)
    diff = max(abs(ref_values[e] - grid[e]) for e in entries)

    mem = {}
    if jax.default_backend() == "cpu" and not args.no_memory:
        mem = {(b, l): peak_memory(folder, b << 20, l) for b in (32, 64, 256) for l in (2, 8)}

    some = f"{len(entries)} of 512 entries run with nnsight, its time scaled to 512" if len(entries) < 512 else "all 512 entries run with nnsight"
    print(f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} ({args.device}, "
          f"{torch.get_num_threads()} threads, {ref.config._attn_implementation} attention), nnsight {nnsight.__version__}, {os.cpu_count()} cores; {some}")
    print("| figure | ratio | detail |\n| --- | --- | --- |")
    print(f"| residual patching sweep, 8 blocks x 64 positions: nnsight loop / jstd.patch_sweep (warm) "
          f"| {t_nnsight / t_jstd:.1f}x | jstd {t_jstd:.2f} s, nnsight {t_nnsight:.1f} s |")
    print(f"| the same, jstd including its compiles (empty compilation cache) | {t_nnsight / cold:.1f}x "
          f"| jstd {cold:.2f} s cold |")
    print(f"| the same, a second process's cold sweep (programs from jax's persistent cache) | "
          f"{t_nnsight / second:.1f}x | jstd {second:.2f} s |")
    print(f"| max abs difference of the metric vs nnsight | {diff:.1e} | logit difference (scale {np.abs(grid).max():.2f}) |")
    for (b, l), m in mem.items():
        print(f"| peak memory of a {l * 64}-entry sweep / its budget of {b} MiB | {m['added'] / (b << 20):.2f} "
              f"| {m['added'] / 2**20:.0f} MiB used |")


if __name__ == "__main__":
    main()
