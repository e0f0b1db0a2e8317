"""Collecting activations to disk: ``jstd.collect`` against the plain forward, nnsight and a TransformerLens-style
``run_with_cache``, and its peak memory against the corpus size.

The model: the Foundation benchmark's Llama (8 blocks, 512 wide, vocab 8192), batches of 4 x 256 random tokens,
float32 on the CPU. The site: ``layers.layer_output`` of every block (16 MiB a batch), written to disk as
``[tokens, blocks, hidden]`` rows.

- plain forward: ``jax.jit(jstd.run)`` on the same batches, logits only, each batch blocked on.
- ``jstd.collect``: the same batches as one pre-tokenized ``jstd.Inputs``, shards fsynced to disk (timed from
  the call to its return, after a warm-up collection compiled the step).
- nnsight: the transformers model (sdpa) in an ``nnsight.NNsight`` trace per batch, each block's output
  ``.save()``d, stacked to ``[tokens, blocks, hidden]`` and written with ``torch.save`` per batch.
- TransformerLens-style ``run_with_cache``: TransformerLens is not installed; its ``run_with_cache`` is
  emulated as it works, with transformers forward hooks that keep every block's output in a cache dict during
  the forward, stacked and written with ``torch.save`` per batch.
- memory: the peak resident memory (VmHWM) of a fresh process collecting N and 10 N batches (streamed as an
  iterable of ``jstd.Inputs``), above its resident memory after the model is loaded and the step compiled.

    python benchmarks/collect.py [--batches 24] [--torch-batches 6] [--memory-batches 8] [--no-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import checkpoint
from forward import llama_config

BATCH, SEQ, VOCAB = 4, 256, 8192
SITE = "layers.layer_output"


def batches(n: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, VOCAB, (n, BATCH, SEQ)).astype(np.int32)


def plain_forward(model, tokens) -> float:
    """Seconds for the jitted forward (logits only) over every batch of ``tokens``."""
    import jax

    import jstd

    run = jax.jit(jstd.run, static_argnames="reads")
    run(model, tokens[0]).logits.block_until_ready()
    t = time.perf_counter()
    for b in tokens:
        run(model, b).logits.block_until_ready()
    return time.perf_counter() - t


def read_only(model, tokens) -> float:
    """Seconds for the jitted read of ``SITE`` alone (no head, no disk) over every batch, each moved to the host."""
    import jax
    import numpy as np

    import jstd

    read = jax.jit(lambda m, t: jstd.run(m, t, reads=(SITE,))[SITE])
    np.asarray(read(model, tokens[0]))
    t = time.perf_counter()
    for b in tokens:
        np.asarray(read(model, b))
    return time.perf_counter() - t


def collect_seconds(model, tokens, folder: Path) -> float:
    import jstd

    inputs = jstd.Inputs(tokens.reshape(-1, SEQ))
    shutil.rmtree(folder, ignore_errors=True)
    t = time.perf_counter()
    jstd.collect(model, inputs, (SITE,), folder, batch_size=BATCH, progress=False)
    return time.perf_counter() - t


def nnsight_seconds(ref, tokens, folder: Path):
    """Seconds for nnsight traces saving every block's output, written with torch.save per batch; the first
    batch's values [tokens, blocks, hidden]."""
    import torch
    from nnsight import NNsight

    lm = NNsight(ref)
    folder.mkdir(parents=True, exist_ok=True)
    first = None
    t = time.perf_counter()
    for i, b in enumerate(tokens):
        saved = []  # (nnsight runs the block's body in its own frame: append to a list made outside)
        with torch.no_grad(), lm.trace(input_ids=torch.as_tensor(b)):
            for layer in range(len(ref.model.layers)):
                saved.append(lm.model.layers[layer].output.save())
        rows = torch.stack([s[0] if isinstance(s, tuple) else s for s in saved], 2).reshape(-1, len(saved), 512)
        torch.save(rows.clone(), folder / f"batch-{i}.pt")
        first = rows if first is None else first
    return time.perf_counter() - t, first.numpy()


def run_with_cache_seconds(ref, tokens, folder: Path):
    """TransformerLens's ``run_with_cache`` emulated: forward hooks cache every block's output during the
    forward; the residual stack is then written with torch.save per batch."""
    import torch

    cache = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: cache.__setitem__(k, (o[0] if isinstance(o, tuple)
                                                                                     else o).detach()))
             for k, layer in enumerate(ref.model.layers)]
    folder.mkdir(parents=True, exist_ok=True)
    first = None
    try:
        t = time.perf_counter()
        for i, b in enumerate(tokens):
            cache.clear()
            with torch.no_grad():
                ref(input_ids=torch.as_tensor(b))
            rows = torch.stack([cache[k] for k in range(len(ref.model.layers))], 2).reshape(-1, len(cache), 512)
            torch.save(rows.clone(), folder / f"batch-{i}.pt")
            first = rows if first is None else first
        return time.perf_counter() - t, first.numpy()
    finally:
        for h in hooks:
            h.remove()


MEMORY = """
import json, shutil, sys, time
import numpy as np, jax, jstd
sys.path.insert(0, {bench!r})
folder, n, out = {folder!r}, {n}, {out!r}
model = jstd.load(folder)
def stream(n):
    rng = np.random.default_rng(1)
    for _ in range(n):
        yield jstd.Inputs(rng.integers(0, {vocab}, ({batch}, {seq})).astype(np.int32))
jstd.collect(model, stream(1), ({site!r},), out + "-warm", progress=False, shard_bytes={shard})
shutil.rmtree(out + "-warm")
base = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024
t = time.perf_counter()
jstd.collect(model, stream(n), ({site!r},), out, progress=False, shard_bytes={shard})
seconds = time.perf_counter() - t
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(json.dumps(dict(base=base, peak=peak, seconds=seconds)))
"""


def memory(folder: Path, n: int, out: Path, shard: int) -> dict:
    code = MEMORY.format(bench=str(Path(__file__).parent), folder=str(folder), n=n, out=str(out), vocab=VOCAB,
                         batch=BATCH, seq=SEQ, site=SITE, shard=shard)
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=24, help="batches of 4 x 256 for the jstd figures")
    parser.add_argument("--torch-batches", type=int, default=6, help="batches for nnsight and run_with_cache")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of forward and collect")
    parser.add_argument("--memory-batches", type=int, default=8, help="N of the N vs 10 N memory figure")
    parser.add_argument("--shard-mb", type=int, default=64, help="shard size in the memory figure")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()

    import jax
    import numpy as np

    import jstd

    work = Path(tempfile.gettempdir()) / "jstd-bench"
    folder = checkpoint(llama_config(8), work / "llama-8x512")
    scratch = Path(tempfile.mkdtemp(prefix="jstd-collect-"))
    model = jstd.load(folder)
    tokens = batches(args.batches)
    tokens_total = tokens.size
    try:
        collect_seconds(model, tokens[:2], scratch / "warm")  # compiles the step
        fw, co, ro = [], [], []
        for _ in range(args.repeats):
            fw.append(plain_forward(model, tokens))
            co.append(collect_seconds(model, tokens, scratch / "jstd"))
            ro.append(read_only(model, tokens))
        t_fw, t_co, t_ro = statistics.median(fw), statistics.median(co), statistics.median(ro)
        ds = jstd.ActivationDataset(scratch / "jstd")
        want = np.asarray(jax.jit(jstd.run, static_argnames="reads")(model, tokens[0], reads=(SITE,))[SITE])
        first = ds.read(SITE, slice(0, BATCH * SEQ))
        err = float(np.abs(first - want.transpose(1, 2, 0, 3).reshape(BATCH * SEQ, 8, 512)).max())
        disk = sum(p.stat().st_size for p in (scratch / "jstd").iterdir())
        rate = lambda t, n=tokens_total: n / t
        rows = [
            ("collect one residual site of every block / plain forward (tokens/s, disk write included)",
             "≥ 0.85x", f"{t_fw / t_co:.2f}x",
             f"collect {rate(t_co):,.0f} tok/s, forward {rate(t_fw):,.0f} tok/s; {args.batches} batches, "
             f"{disk / 2**20:,.0f} MiB written; medians of {args.repeats} interleaved; max |diff| vs run {err:.1e}"),
            ("collect / the same read with nothing written (the step alone: no head, values moved to the host)",
             "—", f"{t_ro / t_co:.2f}x", f"read alone {rate(t_ro):,.0f} tok/s: what writing to disk costs"),
        ]
        if not args.no_torch:
            import torch
            from transformers import AutoModelForCausalLM

            ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                       dtype=torch.float32).eval()
            few = tokens[:args.torch_batches]
            n = few.size
            run_with_cache_seconds(ref, few[:1], scratch / "warm-tl")
            nnsight_seconds(ref, few[:1], scratch / "warm-nnsight")
            t_nn, v_nn = nnsight_seconds(ref, few, scratch / "nnsight")
            t_tl, v_tl = run_with_cache_seconds(ref, few, scratch / "tl")
            e_nn = float(np.abs(v_nn - first).max())
            e_tl = float(np.abs(v_tl - first).max())
            rows += [
                ("jstd.collect / nnsight (.save() per block in a trace per batch, torch.save per batch)", "≥ 2x",
                 f"{rate(t_co) / rate(t_nn, n):.2f}x",
                 f"nnsight {rate(t_nn, n):,.0f} tok/s on {args.torch_batches} batches; max |diff| vs jstd {e_nn:.1e}"),
                ("jstd.collect / TransformerLens-style run_with_cache (hooks caching every block, torch.save per "
                 "batch)", "≥ 2x", f"{rate(t_co) / rate(t_tl, n):.2f}x",
                 f"run_with_cache {rate(t_tl, n):,.0f} tok/s on {args.torch_batches} batches; "
                 f"max |diff| vs jstd {e_tl:.1e}"),
            ]
        if not args.no_memory:
            n = args.memory_batches
            shard = args.shard_mb * 2**20
            small = memory(folder, n, scratch / "m1", shard)
            large = memory(folder, 10 * n, scratch / "m10", shard)
            added = lambda m: (m["peak"] - m["base"]) / 2**20
            rows.append((f"peak memory, {10 * n} vs {n} batches ({args.shard_mb} MiB shards)", "within 5%",
                         f"{(large['peak']) / small['peak']:.3f}x",
                         f"peak {large['peak'] / 2**20:,.0f} vs {small['peak'] / 2**20:,.0f} MiB; above the loaded "
                         f"model and compiled step: {added(large):,.0f} vs {added(small):,.0f} MiB; "
                         f"{10 * n * BATCH * SEQ / large['seconds']:,.0f} tok/s on the long run"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"jax {jax.__version__}, {os.cpu_count()} cores")
    print("| figure | target | measured | detail |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | **{r[2]}** | {r[3]} |")


if __name__ == "__main__":
    main()
