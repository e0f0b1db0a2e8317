"""The one progress display: a stderr line rewritten as work advances."""

from __future__ import annotations

import sys
import time


class Progress:
    """One stderr line rewritten as work advances (at most 5 times a second, and at the last step):
    ``label: i/n tensors, done/total MB, t s`` (``unit`` for ``tensors``; no ``/n`` without a ``count``, no MB
    without ``total_bytes``). ``update(n, nbytes)`` counts ``n`` more units and ``nbytes`` more bytes; the line
    ends at the ``count``-th unit, or at ``close()``. Nothing is printed unless ``enabled``.

    ``step(nbytes)`` is ``update(1, nbytes)``: one tensor written. ``over(iterable)`` yields its items, counting
    each and ending the line after the last. The one progress display of jstd: convert and export count tensors
    and bytes, collect tokens, a patching sweep its chunks.
    """

    def __init__(self, label: str, total_bytes: int | None = None, count: int | None = None, enabled: bool = True,
                 unit: str = "tensors"):
        self.label, self.total, self.count, self.enabled, self.unit = label, total_bytes, count, enabled, unit
        self.i, self.bytes, self.t0 = 0, 0, time.perf_counter()
        self.shown, self.ended = -1.0, False

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.i += n
        self.bytes += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self.shown >= 0.2 or self.i == self.count):
            self.shown = now
            self._show(self.i == self.count)

    def step(self, nbytes: int) -> None:
        self.update(1, nbytes)

    def close(self) -> None:
        """End the line (shown once more, with the final counts), if anything was shown and it is not ended."""
        if self.enabled and self.shown >= 0 and not self.ended:
            self._show(True)

    def _show(self, last: bool) -> None:
        count = "" if self.count is None else f"/{self.count}"
        size = "" if self.total is None else f", {self.bytes / 1e6:.0f}/{self.total / 1e6:.0f} MB"
        self.ended = last
        print(f"\r{self.label}: {self.i}{count} {self.unit}{size}, {time.perf_counter() - self.t0:.1f} s",
              end="\n" if last else "", file=sys.stderr, flush=True)

    def over(self, iterable):
        """The items of ``iterable``, each counted once it has been handled; the line ends after the last."""
        for item in iterable:
            yield item
            self.update(1)
        self.close()


def quiet_unless_terminal(enabled: bool) -> bool:
    """``enabled`` and stderr is a terminal: a progress line for a person watching, none in logs and pipes."""
    return enabled and sys.stderr.isatty()
