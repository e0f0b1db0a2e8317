"""Which gated delta rule kernel runs: one place, picked by backend, overridable.

:func:`gated_delta_rule` is what the DeltaNet mixer calls; it runs the kernel that
:func:`select_gated_delta_kernel` names:

* ``"recurrent"`` (:func:`jstd.kernels.gated_delta.recurrent_gated_delta_rule`) for a
  single token (decoding one step), on every backend: one state update, no chunk padding;
* ``"pallas"`` (:func:`jstd.kernels.pallas.gated_delta.pallas_chunk_gated_delta_rule`)
  on GPU and TPU backends, when both head dims are powers of two of at least 16 (what the
  kernel's Triton tiles need);
* ``"chunk"`` (:func:`jstd.kernels.gated_delta.chunk_gated_delta_rule`, plain XLA)
  everywhere else, i.e. on the CPU, and on accelerators for head dims the kernel cannot tile.

Override, strongest first: the ``kernel=`` argument; the ``JSTD_GATED_DELTA_KERNEL``
environment variable; ``"auto"`` or neither means the choice above. The names are those
four plus ``"pallas_interpret"`` (the Pallas kernel run by the Pallas interpreter, any
backend: for tests). The choice is made when the call is traced: a function that is
already jitted keeps the kernel it was traced with, so set the variable before the first
call (or jit a new function).

All kernels take and return the same things (see :mod:`jstd.kernels.gated_delta`) and
agree to float32 rounding; all are differentiable (the Pallas one by a ``custom_vjp``
whose backward pass is the chunked form's).
"""

from __future__ import annotations

import os

from jaxtyping import Array, Float

from jstd.kernels import gated_delta as _gd
from jstd.kernels.platform import platform

__all__ = ["ENV_VAR", "KERNELS", "gated_delta_rule", "select_gated_delta_kernel"]

ENV_VAR = "JSTD_GATED_DELTA_KERNEL"
KERNELS = ("recurrent", "chunk", "pallas", "pallas_interpret")
_ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


def _tileable(d: int) -> bool:
    return d >= 16 and not d & (d - 1)


def select_gated_delta_kernel(
    seq_len: int,
    key_dim: int = 128,
    value_dim: int = 128,
    *,
    backend: str | None = None,
    kernel: str | None = None,
) -> str:
    """The name of the kernel :func:`gated_delta_rule` runs (one of :data:`KERNELS`).

    ``kernel`` (else the ``JSTD_GATED_DELTA_KERNEL`` environment variable), when given and
    not ``"auto"``, is returned as is after validation (``ValueError`` for an unknown name).
    Otherwise: ``"recurrent"`` if ``seq_len == 1``; ``"pallas"`` if ``backend`` (default
    ``jax.default_backend()``, or the platform of an enclosing
    ``jstd.kernels.platform.compiling_for``) is a GPU or TPU backend and ``key_dim`` and ``value_dim``
    are powers of two >= 16; ``"chunk"`` otherwise.
    """
    name = kernel if kernel is not None else os.environ.get(ENV_VAR, "auto")
    if name != "auto":
        if name not in KERNELS:
            raise ValueError(f"unknown gated delta rule kernel {name!r}; expected 'auto' or one of {KERNELS}")
        return name
    if seq_len == 1:
        return "recurrent"
    backend = platform() if backend is None else backend  # the default backend, or a deviceless compile's target
    if backend in _ACCELERATORS and _tileable(key_dim) and _tileable(value_dim):
        return "pallas"
    return "chunk"


def gated_delta_rule(
    q: Float[Array, "batch seq qk_heads key_dim"],
    k: Float[Array, "batch seq qk_heads key_dim"],
    v: Float[Array, "batch seq heads value_dim"],
    g: Float[Array, "batch seq heads"],
    beta: Float[Array, "batch seq heads"],
    *,
    initial_state: Float[Array, "batch heads key_dim value_dim"] | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int | None = None,
    return_states: bool = False,
    kernel: str | None = None,
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """The gated delta rule by the kernel :func:`select_gated_delta_kernel` picks for this
    call's sequence length, head dims and the default backend (or ``kernel``).

    Arguments, layouts, dtypes and returns as
    :func:`jstd.kernels.gated_delta.chunk_gated_delta_rule`; ``chunk_size`` is ignored by the
    recurrent form, and ``None`` means the chosen kernel's default.
    """
    name = select_gated_delta_kernel(q.shape[1], q.shape[-1], v.shape[-1], kernel=kernel)
    kw = dict(initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, return_states=return_states)
    if name == "recurrent":
        return _gd.recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    if chunk_size is not None:
        kw["chunk_size"] = chunk_size
    if name == "chunk":
        return _gd.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    from jstd.kernels.pallas.gated_delta import pallas_chunk_gated_delta_rule  # Pallas only when chosen

    return pallas_chunk_gated_delta_rule(q, k, v, g, beta, interpret=name == "pallas_interpret", **kw)
