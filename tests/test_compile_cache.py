"""jax's persistent compilation cache, on by default for jstd (``jstd.core.compile_cache``): a second process's
patching sweep and eager forward read every program of note from disk; the switch turns it off; a folder the user
configured is kept. Each process is a subprocess (the suite itself runs with the cache off)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llama_cases import config
from reference.checkpoints import make_checkpoint

ROOT = str(Path(__file__).resolve().parents[1])

SESSION = """
import collections, json, sys
import jax, numpy as np
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
import jstd
from jstd.core import compile_cache
model = jstd.load(sys.argv[1])
clean = np.arange(12)[None] % 90
corrupt = clean.copy(); corrupt[0, 3] = 7
jstd.patch_sweep(model, clean, corrupt, "layers.layer_output", jstd.logit_difference(5, 6), progress=False)
jstd.run(model, clean, reads=("layers.layer_output",)).logits.block_until_ready()
print(json.dumps({"dir": compile_cache.directory(), "hits": events["/jax/compilation_cache/cache_hits"],
                  "misses": events["/jax/compilation_cache/cache_misses"]}))
"""


def session(folder, env):
    done = subprocess.run([sys.executable, "-c", SESSION, str(folder)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint(config("gqa"), tmp_path_factory.mktemp("gqa"), seed=1)


def test_a_second_session_reads_the_sweep_and_forward_from_disk(folder, tmp_path):
    """The first process writes the sweep's programs (the clean and corrupted runs side by side, and the resumed
    chunk: no host callback in either, their arguments checked before they are traced) and the eager forward's; the
    second reads them all (the programs are the same whatever the hash seed)."""
    cache = tmp_path / "cache"
    env = {"JSTD_COMPILATION_CACHE": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    first = session(folder, {**env, "PYTHONHASHSEED": "1"})
    assert first["dir"] == str(cache) and first["hits"] == 0
    written = sorted(p.name.rsplit("-", 2)[0] for p in cache.glob("*-cache"))
    assert "jit_resumed_chunk" in written and "jit__both_runs" in written and written.count("jit__jit_forward") == 1, \
        written
    second = session(folder, {**env, "PYTHONHASHSEED": "2"})
    assert second["hits"] >= len(written), (second, written)


def test_switched_off_and_the_users_own_folder_kept(tmp_path):
    """``JSTD_COMPILATION_CACHE=0`` leaves jax without a persistent cache; ``JAX_COMPILATION_CACHE_DIR`` set by the
    user is kept as it is."""
    code = ("import jax, jstd; from jstd.core import compile_cache; "
            "print(compile_cache.directory(), jax.config.jax_persistent_cache_min_compile_time_secs)")
    run = lambda env: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                                     env={**os.environ, "PYTHONPATH": ROOT, **env}).stdout.split()
    assert run({"JSTD_COMPILATION_CACHE": "0"}) == ["None", "1.0"]
    mine = str(tmp_path / "mine")
    assert run({"JSTD_COMPILATION_CACHE": "", "JAX_COMPILATION_CACHE_DIR": mine}) == [mine, "1.0"]
    assert run({"JSTD_COMPILATION_CACHE": str(tmp_path / "jstd")}) == [str(tmp_path / "jstd"), "0.2"]
