"""A quiet start: on a machine without an accelerator, JAX starts on the CPU without touching TPU or GPU runtimes.

With the aot extra installed (libtpu, the CUDA plugin), a bare ``import jax`` on a machine with neither device
prints the CUDA stub's "Could not find cuda drivers" lines (once per plugin library loaded), and the first backend
JAX starts tries libtpu (``INVALID_ARGUMENT: unexpected worker hostname``) and the CUDA plugin (a version-check
traceback). A first-time user reads them as failures. ``quiet_start``, called by ``jstd/__init__.py`` before
anything imports JAX, does two things, only when ``JAX_PLATFORMS`` is unset and no accelerator device is present
(no ``/dev/nvidia*``, NVIDIA driver GPUs, ``/dev/dxg``, ``/dev/kfd``, ``/dev/accel*`` or ``/dev/vfio/<n>``, no
``TPU_NAME`` / ``TPU_ACCELERATOR_TYPE`` / ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` naming devices):

- sets ``JAX_PLATFORMS=cpu``, so JAX never starts a TPU or GPU client it cannot use;
- drops the CUDA stub's known "no driver" lines while JAX and the CUDA plugin load their libraries (the plugin
  still registers: ``jstd aot`` compiles for TPU and GPU targets without devices). Every other line written to
  the process's stderr meanwhile is written back unchanged, and nothing is dropped when the import fails.

A user's ``JAX_PLATFORMS`` (any value) is kept as is, and nothing changes on a machine with a device. When JAX was
imported before jstd, its import has already printed the stub's lines; if no backend has started yet (and no
platform was chosen), JAX is still set to the CPU, so libtpu and the CUDA client stay silent.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import sys
import tempfile
from contextlib import contextmanager

# what a CUDA or TPU runtime says at load time on a machine without its device (and nothing else)
NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|WARNING: Logging before InitGoogle\(\) is written to STDERR"
    r"|I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\.")

# erring towards "present": a machine wrongly taken for one without a device would run on its CPU
ACCELERATOR_FILES = ("/dev/nvidia[0-9]*", "/proc/driver/nvidia/gpus/*", "/dev/dxg", "/dev/kfd", "/dev/accel[0-9]*",
                     "/dev/vfio/[0-9]*")
ACCELERATOR_ENV = ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def accelerator_present() -> bool:
    """Whether this machine shows a GPU or TPU device (or a TPU's environment), without starting any runtime."""
    if any(glob.glob(pattern) for pattern in ACCELERATOR_FILES):
        return True
    if any(os.environ.get(name) for name in ACCELERATOR_ENV):
        return True
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    container = os.environ.get("NVIDIA_VISIBLE_DEVICES")
    return visible not in (None, "", "-1") or container not in (None, "", "void", "none")


@contextmanager
def without_noise():
    """Run a block with file descriptor 2 captured; afterwards write back every line that is not ``NOISE``
    (all of it, unfiltered, when the block raises)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr (a closed or replaced descriptor): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = text if failed else "".join(
                line for line in text.splitlines(keepends=True) if not NOISE.fullmatch(line.rstrip("\n")))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def quiet_start() -> bool:
    """Start JAX quietly when no accelerator is present (see the module's docstring); returns whether it did.
    Call before anything imports JAX."""
    if "JAX_PLATFORMS" in os.environ or accelerator_present():
        return False
    if "jax" in sys.modules:  # imported first: its import spoke already, but no backend need start yet
        return _cpu_if_not_started(sys.modules["jax"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    with without_noise():
        import jax  # noqa: F401 (loads jaxlib's GPU kernels from the CUDA plugin: the stub's lines)
        for name in CUDA_PLUGINS:  # registered when JAX's first backend starts: load its libraries quietly then
            try:
                plugin = importlib.import_module(name)
            except ImportError:
                continue
            initialize = getattr(plugin, "initialize", None)
            if callable(initialize):
                plugin.initialize = quietly(initialize)
    return True


def quietly(fn):
    """``fn`` run ``without_noise``."""
    def run(*args, **kwargs):
        with without_noise():
            return fn(*args, **kwargs)
    run.__wrapped__ = fn
    return run


def _cpu_if_not_started(jax) -> bool:
    """``jax_platforms`` set to cpu when JAX has no platform chosen and no backend started; whether it was."""
    from jax._src import xla_bridge  # noqa: PLC0415 (JAX's own record of started backends; absent: leave JAX be)
    started = getattr(xla_bridge, "backends_are_initialized", None)
    if started is None or started() or jax.config.jax_platforms:
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
