"""Compile targets without a device: abstract TPU slices (libtpu) and described NVIDIA GPUs (the CUDA plugin).

    t = target("v5e:16x16")            # 256 abstract v5e chips, 16 GiB each
    t = target("8xh200")               # 8 H200s in one host, 141 GB each, no driver needed
    mesh = jstd.sharding.mesh(data=64, model=4, devices=t.devices)

Nothing here runs a program: the devices are compile-only, so ``jax.jit(f).lower(...).compile()`` on a mesh of
them runs the real TPU compiler (or XLA:GPU with ptxas) and no more. The compilers come from the ``aot`` extra
(``pip install 'jstd[aot]'``: ``jax[tpu]``'s libtpu, ``jax-cuda12-plugin`` / ``-pjrt`` and
``nvidia-cuda-nvcc-cu12`` for ptxas, all of the installed jax's version); ``AotUnavailable`` says which is
missing. The CUDA plugin registers only when JAX's backends start with ``JAX_PLATFORMS`` set and not naming
cuda (``cpu``: what ``jstd aot`` sets) or with ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``; otherwise, on a machine
without CUDA, its version check fails and JAX leaves it out.
"""

from __future__ import annotations

import dataclasses
import re

GiB = 1 << 30

# per-chip high-bandwidth memory (bytes) of TPU generations, as Google documents them
TPU_MEMORY = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5litepod": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}

# A GpuTargetConfig (XLA's device_description.proto, text form) for an H200 SXM: Hopper (sm_90), 132 SMs, 232,448 B
# of opt-in shared memory per block, 141 GB of HBM3e at 4.8 TB/s, 50 MiB of L2.
H200 = """gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 8
}
device_description_str: "NVIDIA H200"
"""
GPUS = {"h200": (H200, 150754820096)}


class AotUnavailable(RuntimeError):
    """The compiler a target needs is not installed (or JAX could not register it)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A set of compile-only devices: ``name`` as given, ``platform`` (``"tpu"`` or ``"cuda"``), ``devices``
    (in the topology's order) and ``chip_memory`` (bytes one device holds)."""

    name: str
    platform: str
    devices: tuple
    chip_memory: int

    @property
    def chips(self) -> int:
        return len(self.devices)


def target(name: str) -> Target:
    """The compile-only devices of ``name``: a TPU topology (``"v5e:2x2"``, ``"v5e:16x16"``, ``"v5p:4x4x4"``,
    ``"v6e:8x8"``, ``"v4:2x2x1"``: generation, then chips per axis) or a described GPU host (``"h200"``,
    ``"8xh200"``: N GPUs of one host).

    Raises ValueError for a name of neither form (listing the forms) and AotUnavailable, naming the package, where
    the compiler is not installed.
    """
    gpu = re.fullmatch(r"(?:(\d+)\s*[x×]\s*)?(\w+)", name.strip().lower())
    if gpu and gpu.group(2) in GPUS:
        return _gpu(name, gpu.group(2), int(gpu.group(1) or 1))
    generation = name.split(":")[0].lower()
    if ":" in name and generation in TPU_MEMORY:
        return _tpu(name, generation)
    raise ValueError(f"unknown target {name!r}: pass a TPU topology (generation:chips per axis, e.g. v5e:2x2, "
                     f"v5e:16x16, v5p:4x4x4, v6e:8x8; generations {', '.join(TPU_MEMORY)}) or a GPU host "
                     f"([N x]{'|'.join(GPUS)}, e.g. 8xh200)")


def _tpu(name: str, generation: str) -> Target:
    import os

    from jax.experimental import topologies

    # libtpu locks /tmp/libtpu_lockfile against a second process using the TPU; compile-only devices use none, so
    # deviceless compiles in several processes at once (pytest workers, a CLI run) are allowed
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    try:
        topo = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except RuntimeError as e:
        if "not installed" in str(e):
            raise AotUnavailable(f"target {name!r} needs libtpu: pip install 'jstd[aot]' (jax[tpu] of the installed "
                                 "jax's version)") from None
        raise ValueError(f"libtpu does not know the topology {name!r} ({e}); pass generation:chips per axis, e.g. "
                         "v5e:2x2 or v5p:2x2x1") from None
    return Target(name, "tpu", tuple(topo.devices), TPU_MEMORY[generation])


def _gpu(name: str, kind: str, count: int) -> Target:
    from jax.experimental import topologies

    config, memory = GPUS[kind]
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=config, topology=f"1x1x{count}")
    except (NotImplementedError, RuntimeError) as e:
        raise AotUnavailable(
            f"target {name!r} needs the CUDA plugin registered: pip install 'jstd[aot]' (jax-cuda12-plugin and "
            "jax-cuda12-pjrt of the installed jax's version, nvidia-cuda-nvcc-cu12 for ptxas), and start JAX with "
            f"JAX_PLATFORMS=cpu (jstd aot does) or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 ({e})") from None
    return Target(name, "cuda", tuple(topo.devices), memory)
