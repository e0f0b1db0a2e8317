"""A value computed once per live model object and dropped with it: ``per_model(compute)``.

Models are equinox modules, dataclasses that hash by their fields (a TypeError on their arrays), so they cannot key
a dict; a memo keyed by ``id(model)`` alone would hand a dead model's value to a new model that gets its address.
``per_model`` keys by ``id`` and keeps a weak reference beside each value: a look-up hits only when the reference
still points at this very object, and the entry is removed when the model is collected, so the memo never keeps a
model alive and a value lives no longer than its model.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, TypeVar

M = TypeVar("M")
V = TypeVar("V")


def per_model(compute: Callable[[M], V]) -> Callable[[M], V]:
    """``compute`` memoized per model object: ``get = per_model(compute)``; ``get(model)`` is ``compute(model)``.

    Contract:

    - ``compute(model)`` runs on the first call for a model object and again only for another object (identity,
      not equality: a copy of the same weights is another model); its value is returned as it is, not copied.
    - the entry (the weak reference and the value) is dropped when the model is garbage-collected; the value
      must not refer back to the model, or the model is never collected.
    - ``model`` must accept weak references (``jstd`` models do); a ``TypeError`` otherwise.
    - when ``compute`` raises, nothing is stored and the error propagates; the next call computes again.
    - not locked: two threads asking for a new model at once may both compute it; the last value stored stays.

    The entries lie in ``get.entries``: ``id(model) -> (weakref.ref(model), value)``, for tests and inspection.
    """
    entries: dict[int, tuple[weakref.ref, V]] = {}

    @functools.wraps(compute)
    def get(model: M) -> V:
        entry = entries.get(id(model))
        if entry is not None and entry[0]() is model:
            return entry[1]
        value = compute(model)
        entries[id(model)] = (weakref.ref(model, lambda _, k=id(model): entries.pop(k, None)), value)
        return value

    get.entries = entries  # type: ignore[attr-defined]
    return get
