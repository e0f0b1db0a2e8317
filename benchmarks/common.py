"""Shared benchmark helpers: timing, tiny random checkpoints, peak memory in a subprocess."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def timeit(fn, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds (``fn`` must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_interleaved(runs: dict, reps: int) -> dict:
    """Median and best wall time of each callable, runs interleaved so that machine noise hits all alike."""
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


def compare(torch_forward, jstd_forward, reads, repeats: int) -> dict:
    """The torch reference against jstd, both already built: ``torch_forward()`` returns the reference's output
    (a tensor), ``jstd_forward(reads)`` the blocked ``jax.jit(jstd.run)`` Outputs reading ``reads`` (``()``: the
    output only).

    Returns median seconds per forward: ``torch``; ``jstd`` (the output only) and ``reads`` (reading ``reads``
    too), those two interleaved over ``3 * repeats`` runs since the read overhead is a small difference of two
    noisy times; and ``err``, the outputs' max difference relative to their max.
    """
    import numpy as np

    t_torch = timeit(torch_forward, repeats)
    both = time_interleaved({"jstd": lambda: jstd_forward(()), "reads": lambda: jstd_forward(reads)}, 3 * repeats)
    want = torch_forward().numpy()
    out = jstd_forward(())
    got = np.asarray(out.logits if out.logits is not None else out["vision.tower_output"])
    err = float(np.abs(got - want).max() / np.abs(want).max())
    return dict(torch=t_torch, jstd=both["jstd"][0], reads=both["reads"][0], err=err)


def forward_callables(folder, tokens):
    """``(torch_forward, jstd_forward)`` for the causal LM in ``folder`` on ``tokens`` (as ``compare`` takes them):
    transformers' model with sdpa attention in float32, and the blocked ``jax.jit(jstd.run)``."""
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    import jstd

    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    ids = torch.as_tensor(tokens)

    def torch_forward():
        with torch.inference_mode():
            return ref(input_ids=ids).logits

    model = jstd.load(folder)
    run = jax.jit(jstd.run, static_argnames="reads")
    return torch_forward, lambda reads: jax.block_until_ready(run(model, tokens, reads=reads))


def forward_timings(folder, tokens, reads, repeats: int) -> dict:
    """``compare`` for the causal LM in ``folder`` (torch with sdpa, float32) on ``tokens``."""
    return compare(*forward_callables(folder, tokens), reads, repeats)


def forward_rows(t_torch: float, t_jstd: float, t_reads: float, per_call: int, unit: str, detail: str, read_what: str,
                 compiled: tuple[int, float, int, float]) -> list[tuple[str, str, str]]:
    """The three rows every forward benchmark reports: throughput against torch (``per_call`` ``unit`` per call,
    ``detail`` appended), the overhead of reading ``read_what``, and compile time at two depths
    ``(small, seconds, large, seconds)``."""
    rate = lambda t: f"{per_call / t:,.1f} {unit}/s"
    small, t_small, large, t_large = compiled
    return [
        ("forward throughput (jstd / torch)", f"{t_torch / t_jstd:.2f}x",
         f"jstd {rate(t_jstd)}, torch {rate(t_torch)}; {detail}"),
        (f"reading {read_what} (overhead over the output only)", f"{(t_reads / t_jstd - 1) * 100:+.1f}%",
         f"{t_reads * 1e3:.1f} ms vs {t_jstd * 1e3:.1f} ms"),
        (f"compile time, {large} blocks / {small} blocks", f"{t_large / t_small:.2f}x",
         f"{t_large:.2f} s vs {t_small:.2f} s"),
    ]


def print_table(heading: str, rows) -> None:
    """``heading``, then ``rows`` of (figure, ratio, detail) as a markdown table."""
    print(heading)
    print("| figure | ratio | detail |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


def checkpoint(config, folder, seed=0):
    from reference.checkpoints import make_checkpoint

    if not (Path(folder) / "config.json").exists():
        make_checkpoint(config, folder, seed=seed)
    return Path(folder)


def compile_seconds(family, hf_config, batch: int, seq: int) -> float:
    """Trace + compile time of jit(run) on ``family``'s skeleton for ``hf_config`` (shapes only, no weights)."""
    import jax
    import jax.numpy as jnp

    import jstd

    skeleton = family.skeleton(hf_config, jnp.float32)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    t = time.perf_counter()
    jax.jit(jstd.run).lower(skeleton, tokens).compile()
    return time.perf_counter() - t


def run_json(code: str) -> dict:
    """Run ``code`` in a fresh python process; return the JSON object its last output line prints."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"benchmark process failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
