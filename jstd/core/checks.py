"""Checks of argument values that work both eagerly and under ``jit``: raise at once when the value is concrete,
fail the compiled call (an equinox runtime error) when it is traced. Every such check in jstd goes through
``checked``, so they all behave alike:

- concrete values are checked with numpy in their own dtype (an int64 id past 2**31 is out of range, not wrapped)
  and the error names the offending values;
- a traced check raises through a scalar: ``eqx.error_if`` put on the checked array itself returns it from a host
  callback's branch, which makes XLA gather a row-sharded array onto every device (an involuntary full
  rematerialization); a zero scalar carrying the check, added to the value, keeps its sharding;
- an eager ``jstd.run`` whose compiled check fails re-raises the check's own message as a ValueError
  (``check_message``);
- inside ``trusted()`` (jstd's own programs whose every argument was checked concretely before they were traced:
  a sweep's chunk) traced checks are left out: a check is a host callback, which costs a round trip per call and
  keeps the program out of jax's persistent compilation cache.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike

from jstd.core.sites import SiteError


def is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


_TRUST = threading.local()


@contextlib.contextmanager
def trusted():
    """Trace inside this block only programs whose arguments the caller has already checked with concrete values:
    ``checked`` then attaches nothing to traced values (concrete ones are still checked). A jit whose trace may be
    reused outside the block must key its cache on ``trusting()`` (``jstd.run`` does)."""
    before = trusting()
    _TRUST.on = True
    try:
        yield
    finally:
        _TRUST.on = before


def trusting() -> bool:
    """Whether traced checks are left out here (inside ``trusted()``)."""
    return getattr(_TRUST, "on", False)


def checked(x: ArrayLike, bad: Callable, message: str, *, concrete: Callable[[np.ndarray, np.ndarray], str] | None = None,
            error: type[Exception] = ValueError):
    """``x`` checked: ``bad(xp, x)`` (with ``xp`` numpy for a concrete ``x``, jax.numpy for a traced one) is a
    boolean array, True where ``x`` is bad.

    Concrete (or a concrete array spanning several processes, checked on its devices): raises ``error(concrete(values, flags))`` (``values``: ``x`` as numpy; ``flags``: the boolean array;
    default ``message``) when any flag is set, else returns ``x`` unchanged. Traced: returns ``x`` with the check
    attached through a scalar; the compiled call fails with ``message`` when any flag is set.
    """
    if not is_traced(x) and not spans_processes(x):
        values = np.asarray(x)
        flags = np.asarray(bad(np, values))
        if flags.any():
            raise error(message if concrete is None else concrete(values, flags))
        return x
    if trusting():
        return x
    flag = jnp.asarray(bad(jnp, x)).any()
    if not is_traced(flag):  # an array across processes, outside a trace: the check ran on the devices
        if bool(flag):  # (replicated: every process takes the same branch)
            values = host_value(x)
            raise error(message if concrete is None else concrete(values, np.asarray(bad(np, values))))
        return x
    return x + eqx.error_if(jnp.zeros((), x.dtype), flag, message)


def spans_processes(x) -> bool:
    """A ``jax.Array`` with shards on other processes' devices (``jax.distributed``): numpy cannot read it here."""
    return isinstance(x, jax.Array) and not is_traced(x) and not x.is_fully_addressable


def host_value(x: ArrayLike) -> np.ndarray:
    """``x`` whole as numpy. A ``jax.Array`` spanning several processes (``jax.distributed``) is gathered from all
    of them (``process_allgather``: a collective, so every process calls it, as SPMD programs do)."""
    if spans_processes(x):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def shown(bad: np.ndarray) -> str:
    """The first few bad values of an index, for a message: ``7`` or ``[7, 9]``."""
    values = [int(v) for v in np.asarray(bad).reshape(-1)[:5]]
    return str(values[0]) if len(values) == 1 else str(values)


def span(size: int) -> str:
    """The valid indices of an axis of ``size``, for a message."""
    return f"-{size}..{size - 1} (negatives count from the end)"


def block_ranges(blocks) -> str:
    """Block indices as a message shows them: ``"1..3"`` when consecutive, else the list."""
    return f"{blocks[0]}..{blocks[-1]}" if blocks and list(blocks) == list(range(blocks[0], blocks[-1] + 1)) else str(list(blocks))


# the message of a failed ``eqx.error_if`` check inside a runtime error
_CHECK_FAILED = re.compile(r"EquinoxRuntimeError: (.*?)(?:\n\s*\n|-{10}|$)", re.S)


def check_message(error: Exception) -> str | None:
    """The message of the failed check inside a runtime error of a compiled call; None when it is not one."""
    found = _CHECK_FAILED.search(str(error))
    return None if found is None else found.group(1).strip()


def check_kind(index, what: str, size: int | None, masks: bool = True) -> None:
    """SiteError unless ``index`` has an integer dtype (or, with ``masks``, is a bool mask of shape ``(size,)``;
    ``size`` None: not known yet, the shape is checked at the site)."""
    traced = is_traced(index)
    dtype, shape = (index.dtype if traced else np.asarray(index).dtype), np.shape(index)
    within = f" in {span(size)}" if size is not None else ""
    if dtype == bool and masks:
        if size is not None and shape != (size,):
            raise SiteError(f"{what}: a boolean mask must have the axis' shape ({size},), got shape {shape}; "
                            f"pass a mask of {size} entries or integer indices{within}")
        return
    if not jnp.issubdtype(dtype, jnp.integer) or dtype == bool:
        kind = "integer indices or a boolean mask" if masks else "an integer"
        got = "a traced value" if traced else repr(index)
        raise SiteError(f"{what} must be {kind}, got {got} of dtype {dtype}; pass integers{within}")
