import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
# The suite is mostly XLA compiles of tiny models: LLVM's backend optimizations (level 0 here, XLA's default 2 for
# users) cost a third of its CPU time. XLA's HLO passes, which decide what is computed and in which order, run as
# for users; what LLVM does differently (contracting a multiply-add, vectorizing a loop) moves a value by a rounding
# at most, which every comparison here allows for (float32 tolerance against torch; bf16 norms, which are bit-exact
# against torch's, pass at both levels).
# XLA:CPU's older fusion emitters compile these programs in about half the CPU time of the newer ones (the fusions
# are the same; the code inside them is emitted differently), again at most a rounding apart.
FAST_COMPILE = (" --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                " --xla_cpu_use_fusion_emitters=false")  # (tests/multihost.py's children compile with the same)
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += FAST_COMPILE
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# no persistent compilation cache (jstd turns jax's on by default): the suite compiles afresh and writes nothing home
os.environ.setdefault("JSTD_COMPILATION_CACHE", "0")
# the suite runs on the CPU even where the aot extra installs libtpu and the CUDA plugin (tests/test_aot.py compiles
# for their abstract devices, which needs no backend of theirs; with cpu named, the CUDA plugin skips its version
# check and registers its compiler)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Files that run first under xdist. `make test` deals whole files to its workers (`--dist loadfile`) in the order of
# the items; xdist's own order (most tests first) would start these last, though each holds a few tests of a minute or
# more (whole processes on 8 simulated devices, several processes, docs recipes that train, generation), and the run
# would end with one worker on them while the other idles. Longest first (CI's durations), then every other file by
# its number of tests.
FIRST = ("test_multihost.py", "test_interventions.py", "test_recipes.py", "test_context.py", "test_qwen2_moe_phimoe.py",
         "test_circuits_mesh.py", "test_sharding.py", "test_wrapper_tools.py", "test_qwen3_vl.py", "test_gpt_oss.py",
         "test_circuits_train.py", "test_circuits_qk.py", "test_loading.py", "test_compile_cache.py",
         "test_demo_model.py", "test_startup.py")


def pytest_collection_modifyitems(config, items):
    """Order the items file by file: ``FIRST``, then the other files by their number of tests (most first), each
    file's tests in their own order (Makefile: ``--no-loadscope-reorder`` keeps this order)."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    rank = {name: i for i, name in enumerate(FIRST)}
    order = sorted(files, key=lambda f: (rank.get(f.rsplit("/", 1)[-1], len(FIRST)), -len(files[f])))
    items[:] = [item for f in order for item in files[f]]


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every compiled program after each test module. Each XLA CPU executable holds memory mappings of its
    code, and one process compiling the whole suite's programs passes the kernel's map limit (vm.max_map_count,
    65530): the next compile then aborts or segfaults inside LLVM."""
    yield
    jax.clear_caches()


def assert_close(actual, expected, rtol=1e-5, name=""):
    """Elementwise |a - b| <= rtol·|b| + rtol·max|b| (relative to the value's own scale).

    Entries that the reference masks with the dtype's minimum compare as masked on both sides.
    """
    a = np.asarray(actual, np.float64)
    b = np.asarray(expected, np.float64)
    assert a.shape == b.shape, f"{name}: shape {a.shape} != reference {b.shape}"
    masked = b < -1e30
    if masked.any():
        assert (a[masked] < -1e30).all(), f"{name}: masked entries differ"
        a, b = np.where(masked, 0, a), np.where(masked, 0, b)
    scale = np.max(np.abs(b)) if b.size else 1.0
    err = np.abs(a - b) - (rtol * np.abs(b) + rtol * scale)
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    assert (err <= 0).all(), (
        f"{name}: max abs diff {np.max(np.abs(a - b)):.3g} at {worst} (value {b[worst]:.6g} vs {a[worst]:.6g}), "
        f"scale {scale:.3g}, rtol {rtol}"
    )


def relative_rms(actual, expected) -> float:
    """RMS of the difference over the RMS of the reference (for loose bf16 comparisons)."""
    a = np.asarray(actual, np.float32)
    b = np.asarray(expected, np.float32)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """zoo(case, dtype="float32") -> (name, folder, jstd model, torch reference, spec) for a case of
    ``families.CASES``, built once a session; zoo.every_value(case) -> (jstd output, torch values) on one batch."""
    import families
    from reference.cases import Zoo

    return Zoo(tmp_path_factory, families.CASES)


@pytest.fixture(scope="session")
def on_8_devices():
    """``run(code) -> float``: ``code`` run by this Python in a process of its own with 8 simulated CPU devices (the
    suite has one); the last line it prints, as a number. The process must succeed."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8" + FAST_COMPILE}

    def run(code: str) -> float:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return float(done.stdout.strip().splitlines()[-1])

    return run
