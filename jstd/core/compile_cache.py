"""jax's persistent compilation cache, on by default once jstd is imported: a program compiled in one session is
read back from disk in the next instead of compiled again (a cold ``patch_sweep``, ``generate`` or
``jax.jit(jstd.run)`` in a new process then pays no XLA compile for the shapes it has seen).

Where it lives: ``$JSTD_COMPILATION_CACHE`` when that names a folder, else
``$XDG_CACHE_HOME/jstd/jax-compilation-cache`` (``~/.cache/jstd/jax-compilation-cache``), at most 4 GiB (least
recently used entries evicted). Off: ``JSTD_COMPILATION_CACHE=0`` (or ``off``, ``false``, ``no``) before importing
jstd, or ``jax.config.update("jax_enable_compilation_cache", False)``.

jstd configures jax only where you have not: when ``jax_compilation_cache_dir`` is already set (by
``JAX_COMPILATION_CACHE_DIR`` or ``jax.config.update``), your folder and thresholds are used as they are. jax's cache
is one per process, so programs of yours compiled in the same process are cached there too (those taking at least
``jax_persistent_cache_min_compile_time_secs``, which jstd lowers from jax's 1 s to 0.2 s when it is at jax's
default: a 0.5 s compile paid in every session is worth a file read).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import jax

OFF = ("0", "off", "false", "no")
MAX_BYTES = 4 << 30
MIN_COMPILE_SECONDS = 0.2


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/jstd/jax-compilation-cache`` (``~/.cache/...`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jstd" / "jax-compilation-cache"


def configure() -> str | None:
    """Turn on jax's persistent compilation cache in jstd's folder unless it is off (``JSTD_COMPILATION_CACHE``)
    or already configured; returns the folder in use (None: no persistent cache)."""
    chosen = os.environ.get("JSTD_COMPILATION_CACHE")
    if jax.config.jax_compilation_cache_dir is not None:  # the user's own
        return jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    if chosen is not None and chosen.strip().lower() in OFF + ("",):
        return None
    folder = str(Path(chosen).expanduser() if chosen else default_directory())
    jax.config.update("jax_compilation_cache_dir", folder)
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # jax's default: not the user's choice
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if jax.config.jax_compilation_cache_max_size == -1 and importlib.util.find_spec("filelock") is not None:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)  # eviction needs filelock
    return folder if jax.config.jax_enable_compilation_cache else None


def directory() -> str | None:
    """The persistent compilation cache's folder in this process (None when it is off)."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir


configure()
