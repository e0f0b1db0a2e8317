"""Chunks of a sweep sized to a memory budget by the compiler's own figure for the chunk.

A sweep runs its entries as chunks of one compiled ``vmap``. An estimate from
the model's sizes gives a first chunk size; the compiled chunk's working
memory (XLA's temporaries plus its outputs: ``memory_analysis``) decides. When
the first guess does not fit, a one-entry chunk is compiled too, and the size
follows from the two figures (working memory is affine in the chunk size).
Arguments — the model, the cached runs, the clean values — are outside the
budget: they exist once, whatever the sweep's size.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable


def balanced(total: int, most: int) -> int:
    """The size of near-equal chunks of ``total`` entries, none above ``most`` (at least 1)."""
    most = max(1, min(most, total))
    return math.ceil(total / math.ceil(total / most))


def working_memory(compiled) -> int | None:
    """Bytes of temporaries and outputs of a compiled equinox or jax function (None where the backend says nothing)."""
    compiled = getattr(compiled, "compiled", compiled)
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


def fit(lower: Callable[[int], object], total: int, guess: int, budget: int, size: int | None = None):
    """``(size, compiled)``: a chunk size for ``total`` entries and the chunk function compiled for it.

    ``lower(n)`` lowers the chunk function for chunks of ``n`` entries. With
    ``size`` given it is used as is; otherwise the chunk starts at ``guess``
    entries and shrinks until its working memory fits ``budget`` bytes. A
    budget below one entry's working memory runs one entry at a time, with a
    warning that says how much one needs.
    """
    if size is not None:
        size = balanced(total, size)
        return size, lower(size).compile()
    size = balanced(total, guess)
    compiled = lower(size).compile()
    used = working_memory(compiled)
    one = None
    while used is not None and used > budget and size > 1:
        if one is None:
            one = lower(1).compile()
            base = working_memory(one)
        per_entry = max(1, (used - base) // (size - 1))
        size = balanced(total, max(1, min((budget - base) // per_entry, size - 1)))
        compiled = one if size == 1 else lower(size).compile()
        used = working_memory(compiled)
    _warn_if_over(used, budget)
    return size, compiled


def _warn_if_over(used: int | None, budget: int) -> None:
    if used is not None and used > budget:
        warnings.warn(f"one patched run needs {used / 2**20:.1f} MiB of working memory, more than the "
                      f"memory_budget of {budget / 2**20:.1f} MiB; running one at a time", stacklevel=3)
