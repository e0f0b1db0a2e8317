"""A quiet start: with the aot extra installed (libtpu, the CUDA plugin), jstd on a machine without those devices
prints nothing it was not asked for — ``jstd --help``, an import, a computation — and the CUDA plugin still
registers for ``jstd aot``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jstd.core.startup import NOISE, accelerator_present, without_noise

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(accelerator_present(), reason="this machine has an accelerator: its runtimes are meant to start")
def test_jstd_starts_silently_without_an_accelerator():
    code = ("import sys\n"
            "from jstd.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "import jax, jax.numpy as jnp\n"
            "assert jax.default_backend() == 'cpu', jax.default_backend()\n"
            "print(float((jnp.ones(3) * 2).sum()))\n"
            "import jax._src.xla_bridge as xb\n"
            "print('cuda' in xb._backend_factories)\n")  # the CUDA plugin registered all the same (jstd aot needs it)
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[-2] == "6.0"
    cuda_installed = run_python("import importlib.util as u; print(u.find_spec('jax_plugins.xla_cuda12') is not None)")
    assert lines[-1] == cuda_installed.stdout.strip()


def test_a_users_platform_choice_is_kept():
    done = run_python("import os; os.environ['JAX_PLATFORMS'] = 'cpu,'\n"
                      "import jstd; print(os.environ['JAX_PLATFORMS'])")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu,"


def test_only_the_known_noise_is_dropped():
    noise = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
             "I0000 00:00:1796543891.184868    8296 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
             "GPU will not be used.\n")
    assert all(NOISE.fullmatch(line) for line in noise.splitlines())
    code = ("import os, sys\n"
            "from jstd.core.startup import without_noise\n"
            f"with without_noise():\n    os.write(2, {noise!r}.encode() + b'a real error\\n')\n"
            "try:\n"
            f"    with without_noise():\n        os.write(2, {noise!r}.encode())\n        raise ValueError\n"
            "except ValueError:\n    pass\n")
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "a real error"  # kept; the noise around it dropped
    assert lines[1:] == noise.splitlines()  # a block that raised: everything written back
    with without_noise():  # usable in-process too
        pass


@pytest.mark.skipif(accelerator_present(), reason="this machine has an accelerator: its runtimes are meant to start")
def test_jax_imported_first_still_starts_on_the_cpu_without_libtpu():
    done = run_python("import jax\nimport jstd\nimport jax.numpy as jnp\nprint(jax.default_backend(), "
                      "float(jnp.ones(2).sum()))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["cpu", "2.0"]
    assert "INVALID_ARGUMENT" not in done.stderr and "Unable to load CUDA" not in done.stderr, done.stderr
