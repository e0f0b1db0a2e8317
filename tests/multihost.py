"""Real multi-process JAX programs on one machine: N processes on the loopback interface, collectives over gloo.

The parent side (a test):

    results = launch([sys.executable, "tests/multihost_check.py", "cases.pkl"], processes=2, devices=4)
    results[i]          # what process i returned (``child.finish(value)``), unpickled

starts ``processes`` copies of a program (``{coordinator}``, ``{process_id}`` and ``{processes}`` in its arguments
filled in for each), each with ``devices`` simulated CPU
devices and the coordinates of a ``jax.distributed`` job on a free port of
127.0.0.1 (and never another address) in its environment; waits for them all
within ``timeout`` seconds; on a failure (a child exiting non-zero, or the
deadline) kills every child still running and raises AssertionError with the
failed child's output (every child's, at the deadline). Each child's output goes
to a file, never a pipe, so a chatty child cannot block.

The child side, first thing in the program (before anything touches a device):

    import multihost
    multihost.join()      # jax.distributed over gloo, from the environment launch() set
    ...
    multihost.finish(value)   # value pickled for the parent; process 0's or each process's
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"  # the only address these jobs use
ENV_COORDINATOR = "JSTD_TEST_COORDINATOR"
ENV_PROCESSES = "JSTD_TEST_PROCESSES"
ENV_PROCESS_ID = "JSTD_TEST_PROCESS_ID"
ENV_RESULT = "JSTD_TEST_RESULT"
# XLA's CPU backend at its lowest optimization level (as tests/test_sharding.py's subprocess): compiles about twice
# as fast; and XLA's classic IR emitters for fusions rather than the MLIR fusion emitters: compiles these programs
# in half the CPU time again (measured: a DeltaNet model's gradient and generation, 10.1 s -> 5.0 s). The values
# move by a rounding at most
FAST = (" --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        " --xla_cpu_use_fusion_emitters=false")
# the persistent compilation cache on in a folder of the job's (every program kept): a later job given the same
# folder reads its programs from there; ``join`` also has each program compiled once a job (``share_compiles``)
CACHE_ENV = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def child_env(process_id: int, processes: int, devices: int, port: int, result: Path, cache: Path,
              extra: dict | None = None) -> dict:
    """The environment of child ``process_id``: simulated devices, the job's coordinates, where its result goes,
    the compilation cache the job shares (``cache``)."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if not f.startswith(("--xla_force_host_platform_device_count",
                                                                   "--xla_backend_optimization_level",
                                                                   "--xla_llvm_disable_expensive_passes",
                                                                   "--xla_cpu_use_fusion_emitters")))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}{FAST}".strip(),
           ENV_COORDINATOR: f"{LOOPBACK}:{port}", ENV_PROCESSES: str(processes), ENV_PROCESS_ID: str(process_id),
           ENV_RESULT: str(result), "JSTD_COMPILATION_CACHE": str(cache), **CACHE_ENV}
    return {**env, **(extra or {})}


class Child:
    """One started child: its process, its output file, its result file."""

    def __init__(self, argv, env: dict, log: Path, result: Path):
        self.log, self.result = log, result
        self.out = open(log, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def kill(self) -> None:
        """SIGKILL this child (and the session it leads: anything it started) if it still runs."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def output(self, tail: int = 6000) -> str:
        self.out.flush()
        text = self.log.read_text(errors="replace")
        return text[-tail:]


def start(argv, processes: int = 2, devices: int = 4, workdir: Path | None = None, env: dict | None = None,
          cache: Path | None = None) -> list[Child]:
    """``processes`` children running ``argv`` as one ``jax.distributed`` job on a free loopback port; ``cache``:
    the folder of the job's compiled programs (default: a new one in ``workdir``; jobs given one folder share
    them)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="multihost-"))
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    children = []
    try:
        for i in range(processes):
            result = workdir / f"result-{i}.pkl"
            result.unlink(missing_ok=True)
            argv_i = [a.format(coordinator=f"{LOOPBACK}:{port}", process_id=i, processes=processes) for a in argv]
            children.append(Child(argv_i, child_env(i, processes, devices, port, result, cache or workdir / "cache", env),
                                  workdir / f"log-{i}.txt", result))
    except BaseException:
        for c in children:
            c.kill()
        raise
    return children


def wait(children: list[Child], timeout: float) -> list:
    """Every child's result once all exit 0 within ``timeout`` seconds; else every child killed and AssertionError
    with the failed child's output (each child's, on the deadline)."""
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [c.proc.poll() for c in children]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                time.sleep(0.5)  # let the others' last words reach their files
                for c in children:
                    c.kill()
                i = failed[0]
                others = "".join(f"\n--- process {j} (exit {children[j].proc.returncode}), last lines ---\n"
                                 f"{children[j].output(1500)}" for j in range(len(children)) if j != i)
                raise AssertionError(f"process {i} of {len(children)} exited with {codes[i]}; its output:\n"
                                     f"{children[i].output()}{others}")
            if all(code == 0 for code in codes):
                break
            if time.monotonic() > deadline:
                for c in children:
                    c.kill()
                outputs = "".join(f"\n--- process {j}, last lines ---\n{c.output(3000)}"
                                  for j, c in enumerate(children))
                raise AssertionError(f"the {len(children)} processes did not finish within {timeout:.0f} s (all "
                                     f"killed):{outputs}")
            time.sleep(0.05)
    finally:
        for c in children:
            c.kill()
            c.out.close()
    results = []
    for c in children:
        if c.result.exists():
            with open(c.result, "rb") as f:
                results.append(pickle.load(f))
        else:
            results.append(None)
    return results


def launch(argv, processes: int = 2, devices: int = 4, timeout: float = 120, workdir: Path | None = None,
           env: dict | None = None, cache: Path | None = None) -> list:
    """Start ``processes`` children running ``argv`` as one job and wait for them (``start``, ``wait``): each
    one's result (``finish``), or AssertionError with the failed child's output; every child is killed on a
    failure."""
    return wait(start(argv, processes, devices, workdir, env, cache), timeout)


# ---- the child side ------------------------------------------------------------------------------------------------

def share_compiles() -> bool:
    """Have process 0 compile each program of the job and hand it to the others (jax's
    ``share_binary_between_hosts``, through the coordinator): the other processes wait instead of compiling it too,
    which halves the job's compile time on a machine whose processes share the cores. Returns whether it is on.

    On the CPU, jax keys a program by the devices' topology fingerprint, which is each process's own: the
    processes would wait for programs under keys that no process shares. Keyed by the devices' ids instead (what
    jax hashes where a backend has no fingerprint), the same program has the same key in every process. Where jax
    no longer has the function replaced here, every process compiles as before."""
    import jax

    try:
        from jax._src import cache_key
    except ImportError:
        return False
    if not callable(getattr(cache_key, "_hash_accelerator_config", None)) or \
            not callable(getattr(cache_key, "_hash_devices", None)):
        return False
    cache_key._hash_accelerator_config = cache_key._hash_devices
    jax.config.update("jax_share_binary_between_hosts", True)
    jax.config.update("jax_share_binary_between_hosts_timeout_ms", 300_000)  # a mismatch fails, not hangs 20 min
    return True


def join(timeout: int = 60) -> None:
    """Join the job ``launch`` set up: gloo collectives on the CPU, ``jax.distributed.initialize`` on the loopback
    coordinator (``timeout`` seconds to find the other processes), each program compiled once (``share_compiles``).
    """
    import jax

    import jstd

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    share_compiles()
    jstd.sharding.initialize(os.environ[ENV_COORDINATOR], int(os.environ[ENV_PROCESSES]),
                             int(os.environ[ENV_PROCESS_ID]), timeout=timeout)


def finish(value) -> None:
    """Hand ``value`` (picklable) back to the parent as this process's result."""
    path = Path(os.environ[ENV_RESULT])
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, path)


if __name__ == "__main__":  # a smoke test of the harness: a sum across the processes
    if ENV_PROCESS_ID in os.environ:
        join()
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.experimental import multihost_utils

        x = multihost_utils.host_local_array_to_global_array(
            np.full((4,), jax.process_index() + 1.0), jax.sharding.Mesh(jax.devices(), ("d",)),
            jax.sharding.PartitionSpec("d"))
        finish(float(multihost_utils.process_allgather(jax.jit(jnp.sum)(x), tiled=True)))
    else:
        print(launch([sys.executable, __file__], timeout=60))
