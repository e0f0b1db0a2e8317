"""Figures only from a quiet machine: a benchmark refuses to run when the 1-minute load average is above
``MAX_LOAD`` or another process uses ``BUSY_CORE`` of a core or more (it prints the load and those processes, and
exits with status 3), unless it is given ``--allow-busy``: then it runs and every table row it prints is marked
"busy" (a figure measured under load is not a figure: other work slows torch's threads more than XLA's).

``guard()`` runs once when a benchmark script starts (``common`` calls it on import, for the script named on the
command line only: a benchmark's own subprocesses and the tests that import these modules are not checked).
``--allow-busy`` is taken out of ``sys.argv`` before the script's own parser reads it. The first line a benchmark
prints is the machine's state and its dot peak (XLA's float32 2048³ product), which its figures are read against.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path

# the most 1-minute load average a figure is measured under: 0.5 on this project's 2-core machines; a quarter of the
# cores on larger ones (a 16-core GPU host still counts the benchmark's own just-finished processes for a minute)
MAX_LOAD = max(0.5, (os.cpu_count() or 1) / 4)
BUSY_CORE = 0.5       # the share of a core another process may not use while figures are measured
SAMPLE_SECONDS = 1.0  # how long other processes' CPU time is watched
FLAG = "--allow-busy"

BUSY = False          # True once guard() let a busy machine through (--allow-busy): every table row says so


def _cpu_ticks() -> dict[int, tuple[int, int, str]]:
    """pid -> (utime + stime in clock ticks, parent pid, command name) of every process readable in /proc."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(entry.name)] = (int(fields[11]) + int(fields[12]), int(fields[1]), name)
    return out


def _family(ticks: dict, pid: int) -> set[int]:
    """``pid``, its ancestors and its descendants (their CPU time is this benchmark's own)."""
    down, grew = {pid}, True
    while grew:
        children = {q for q, (_, parent, _) in ticks.items() if parent in down} - down
        down |= children
        grew = bool(children)
    up, p = set(), pid
    while p in ticks and ticks[p][1] > 0 and ticks[p][1] not in up:
        p = ticks[p][1]
        up.add(p)
    return down | up


def busy_processes(seconds: float = SAMPLE_SECONDS) -> list[tuple[int, str, float]]:
    """``[(pid, command, cores used)]`` of the other processes that used at least ``BUSY_CORE`` of a core over
    ``seconds`` (Linux /proc; empty where there is none)."""
    if not Path("/proc/self/stat").exists():
        return []
    hz = os.sysconf("SC_CLK_TCK")
    before = _cpu_ticks()
    time.sleep(seconds)
    after = _cpu_ticks()
    mine = _family(after, os.getpid())
    used = [(pid, name, (t - before[pid][0]) / hz / seconds) for pid, (t, _, name) in after.items()
            if pid in before and pid not in mine]
    return sorted((u for u in used if u[2] >= BUSY_CORE), key=lambda u: -u[2])


def load_average() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


class _Marked(io.TextIOBase):
    """A text stream that writes through to ``stream`` with every markdown table row (not the ``| --- |`` rule)
    marked "busy" in its first cell."""

    def __init__(self, stream):
        self.stream, self.pending = stream, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.stream.write(_mark(line) + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.stream.write(_mark(self.pending))
            self.pending = ""
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()


def _mark(line: str) -> str:
    if line.startswith("|") and set(line) - set("|-: "):
        return "| busy: " + line[1:].lstrip()
    return line


PEAK: float | None = None  # the dot peak guard() measured at the start of this run (FLOP/s), for the tables' "% of peak"


def measured_peak() -> float:
    """The dot peak measured at this run's start by ``guard`` (once more now if it did not run), in FLOP/s: what a
    benchmark's "% of the dot peak" divides by, so the share and the peak printed on the first line agree."""
    global PEAK
    if PEAK is None:
        PEAK = dot_peak()
    return PEAK


def dot_peak(n: int = 2048, repeats: int = 7) -> float:
    """XLA's float32 ``n``³ product on the default backend, in FLOP/s (best of ``repeats``): the machine's dot peak
    that every table's figures are read against."""
    import jax
    import jax.numpy as jnp

    with jax.default_matmul_precision("highest"):
        a = jnp.ones((n, n), jnp.float32)
        product = jax.jit(lambda a: a @ a)
        product(a).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            product(a).block_until_ready()
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def guard(argv: list[str] | None = None) -> bool:
    """Check the machine before a benchmark measures anything: quiet, return False; busy without ``--allow-busy``
    in ``argv`` (default ``sys.argv``, from which the flag is removed), print the load and the busy processes to
    stderr and exit (status 3); busy with it, say so, mark every table row printed from now on "busy" and return
    True."""
    global BUSY, PEAK
    argv = sys.argv if argv is None else argv
    allow = FLAG in argv
    while FLAG in argv:
        argv.remove(FLAG)
    load, others = load_average(), busy_processes()
    if load <= MAX_LOAD and not others:
        PEAK = dot_peak()
        print(f"quiet machine: 1-minute load average {load:.2f}, no other process on a core; XLA's float32 2048³ "
              f"dot peak {PEAK / 1e9:.0f} GFLOP/s")
        return False
    what = f"1-minute load average {load:.2f} (at most {MAX_LOAD})" + "".join(
        f"; pid {pid} ({name}) uses {cores:.2f} of a core" for pid, name, cores in others[:8])
    if not allow:
        print(f"the machine is busy: {what}. Benchmarks print figures only from a quiet machine; wait, or pass "
              f"{FLAG} to measure anyway with every row marked busy", file=sys.stderr)
        sys.exit(3)
    BUSY, PEAK = True, dot_peak()
    print(f"BUSY (measured with {FLAG}): {what}; every row below is marked busy and is not a figure; XLA's "
          f"float32 2048³ dot {PEAK / 1e9:.0f} GFLOP/s (busy)")
    sys.stdout.flush()
    sys.stdout = _Marked(sys.stdout)
    return True
