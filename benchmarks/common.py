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
