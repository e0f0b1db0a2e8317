"""Benchmark the gated delta rule kernels on the CPU (float32, B=1, H=8, dk=dv=128).

    .venv/bin/python benchmarks/gated_delta.py [--reps 7] [--lengths 2048 8192]

Times (median, and best, of ``--reps`` interleaved runs after a compile / warm-up run):

* jstd's chunked form vs jstd's recurrent scan at T=2048;
* jstd's chunked form vs transformers' ``torch_chunk_gated_delta_rule`` (torch with its
  default threads) at T=2048 and T=8192, in the same process, runs interleaved;

and reports the chunked form's compiled memory (``memory_analysis``) at several T,
without and with per-token states, to show linear growth. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jstd.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule

B, H, D = 1, 8, 128


def inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
    g = (-np.exp(rng.uniform(-1.5, 0.5, (1, 1, H))) * np.log1p(np.exp(rng.standard_normal((B, T, H)) - 1.0))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    return q, k, v, g, beta


def jax_fn(form):
    fn = {"chunk": chunk_gated_delta_rule, "recurrent": recurrent_gated_delta_rule}[form]
    f = jax.jit(lambda q, k, v, g, b: fn(q, k, v, g, b, use_qk_l2norm=True))
    return lambda *a: jax.block_until_ready(f(*a))


def torch_fn():
    import torch
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import torch_chunk_gated_delta_rule

    def run(*a):
        with torch.no_grad():
            return torch_chunk_gated_delta_rule(*a, output_final_state=True, use_qk_l2norm_in_kernel=True)

    return run, torch


def time_interleaved(runs: dict, reps: int) -> dict:
    """Median wall time of each callable, runs interleaved so that machine noise hits all alike."""
    for f in runs.values():  # compile / warm up
        f()
        f()
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def memory(T, return_states=False):
    sd = jax.ShapeDtypeStruct
    args = (sd((B, T, H, D), jnp.float32),) * 3 + (sd((B, T, H), jnp.float32),) * 2
    f = jax.jit(lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm=True, return_states=return_states))
    m = f.lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes, m.output_size_in_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--torch-one-thread", action="store_true", help="also time torch on one thread")
    args = ap.parse_args()

    tfn, torch = torch_fn()
    nthreads = torch.get_num_threads()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__} with {nthreads} threads")
    print(f"float32, B={B}, H={H}, dk=dv={D}, use_qk_l2norm=True; median of {args.reps} interleaved runs (ms)\n")

    rows = []
    chunk, rec = jax_fn("chunk"), jax_fn("recurrent")
    for T in args.lengths:
        x = inputs(T)
        tx = [torch.from_numpy(a) for a in x]
        jx = [jnp.asarray(a) for a in x]
        runs = {"chunk": lambda: chunk(*jx), "torch": lambda: tfn(*tx)}
        if T == 2048:
            runs["recurrent"] = lambda: rec(*jx)
        t = time_interleaved(runs, args.reps)
        if "recurrent" in t:
            rows.append((f"jstd recurrent scan / jstd chunked, T={T}", t["recurrent"], t["chunk"], 10.0))
        rows.append((f"torch chunked ({nthreads} threads) / jstd chunked, T={T}", t["torch"], t["chunk"], 1.5))
        if args.torch_one_thread:  # informational: torch's threads suffer most on a busy machine
            torch.set_num_threads(1)
            t1 = time_interleaved({"chunk": lambda: chunk(*jx), "torch": lambda: tfn(*tx)}, args.reps)
            torch.set_num_threads(nthreads)
            rows.append((f"torch chunked (1 thread) / jstd chunked, T={T}", t1["torch"], t1["chunk"], None))

    print("| comparison | other (ms) | jstd chunked (ms) | speed-up (median) | speed-up (best runs) | target |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (other, other_min), (ours, ours_min), target in rows:
        goal = "-" if target is None else f">= {target:g}x ({'met' if other / ours >= target else 'NOT met'})"
        print(f"| {name} | {other * 1e3:.1f} | {ours * 1e3:.1f} | {other / ours:.2f}x | {other_min / ours_min:.2f}x | {goal} |")
    print(f"\n(load average after timing: {os.getloadavg()[0]:.1f})")

    print("\nCompiled memory of the chunked form (memory_analysis, MiB):\n")
    print("| T | temp | output (out + final state) | total | total / T (KiB per token) | temp with states | output with states |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for T in (1024, 2048, 4096, 8192, 16384, 32768):
        tmp, out = memory(T)
        row = f"| {T} | {tmp / 2**20:.2f} | {out / 2**20:.2f} | {(tmp + out) / 2**20:.2f} | {(tmp + out) / T / 1024:.2f} |"
        if T <= 4096:
            tmp_s, out_s = memory(T, True)
            row += f" {tmp_s / 2**20:.1f} | {out_s / 2**20:.1f} |"
        else:
            row += " - | - |"
        print(row)
    print("\n(per-token states alone are T x 8 heads x 128 x 128 x 4 B = 512 KiB per token)")


if __name__ == "__main__":
    main()
