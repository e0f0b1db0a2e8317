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


def checkpoint(config, folder, seed=0):
    from reference.checkpoints import make_checkpoint

    if not (Path(folder) / "config.json").exists():
        make_checkpoint(config, folder, seed=seed)
    return Path(folder)
