"""The platform kernels are picked and laid out for: the default backend, or the one a compile targets.

A deviceless compile for a TPU slice or a GPU (``jstd.aot``) traces on a CPU host, where ``jax.default_backend()``
is ``"cpu"``; inside ``compiling_for("tpu")`` the kernels are chosen (``jstd.kernels.select``) and laid out
(``jstd.kernels.pallas``) as on that platform.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jstd_kernel_platform", default=None)
# the names ``jax.default_backend()`` uses, by the names a compile target may use
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def platform() -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the platform of the enclosing ``compiling_for``, else the default
    backend's."""
    return _TARGET.get() or _ALIASES.get(jax.default_backend(), jax.default_backend())


@contextlib.contextmanager
def compiling_for(name: str):
    """Within: kernels are picked and laid out for platform ``name`` (``"tpu"``, ``"gpu"``/``"cuda"``, ``"cpu"``)."""
    token = _TARGET.set(_ALIASES.get(name, name))
    try:
        yield
    finally:
        _TARGET.reset(token)
