"""Sharding on JAX's own engine: flax logical-axis rules from each parameter's logical axes to a device mesh.

    mesh = jstd.sharding.mesh(model=2)                        # 2-D mesh ("data", "model") over every device
    model = jstd.load(path, mesh=mesh, rules=jstd.sharding.FSDP_TP)   # each tensor placed on its shards as it streams
    inputs = jstd.sharding.shard_inputs(inputs, mesh)         # rows over "data"
    out = jax.jit(jstd.run)(model, inputs)                    # XLA partitions the computation

Every parameter carries logical axis names (``jstd.logical_axes``: ``embed``,
``heads``, ``kv_heads``, ``mlp``, ``vocab``, ``layers``, ...). A *rule list*
maps logical names to mesh axes, as flax's ``logical_axis_rules`` (the
convention MaxText uses); ``flax.linen.logical_to_mesh_sharding`` turns each
parameter's names into a ``NamedSharding``. Ready rule lists, over a mesh with
axes ``data`` and ``model``:

- ``DP``: parameters replicated, input rows (``batch``) over ``data``.
- ``FSDP``: ``DP`` plus every parameter's ``embed`` axis (and a wrapper
  projector's ``projector_in``) over ``data`` (each device holds 1/n of each
  large matrix; XLA gathers one block's weights at a time inside the scan).
- ``TP``: rows over ``data``; ``heads``, ``kv_heads``, DeltaNet heads, ``mlp``,
  ``vocab`` and a projector's ``projector_hidden`` over ``model``
  (Megatron-style column/row splits; a tower's blocks use the same names).
- ``FSDP_TP``: both, on a 2-D mesh.
- ``EP``: ``FSDP_TP`` with a mixture-of-experts' ``experts`` axis over ``model``
  (expert parallelism: each device holds whole experts; the router is replicated).

An axis whose size is not divisible by its mesh axes' size stays whole
(replicated on those axes): e.g. 2 key-value heads on a 4-way ``model`` axis,
as usual for grouped-query attention. Rules naming a mesh axis the mesh does
not have are ignored, with a warning naming it, so ``FSDP_TP`` runs on a 1-D
``("data",)`` mesh too; rules that would place nothing at all (no mesh axis
of theirs on the mesh, logical names no parameter has, none matching the
model) raise a ValueError naming them. The layers axis is never sharded (the
scan indexes it).

Sharding changes where values live, never what they are: a sharded run
returns the single-device values (to float32 rounding of reordered sums).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

from jstd.core.inputs import Inputs
from jstd.nn.params import DATA, MODEL, constrain_rows, logical_axes  # constrain_rows: also jstd.sharding's
from jstd.nn.params import LOGICAL_NAMES
from jstd.nn.namemap import at_path

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# logical names of the parameters (jstd.nn.params.param) split by tensor parallelism: attention and DeltaNet heads,
# MLP columns and the vocabulary
_TP_NAMES = ("heads", "kv_heads", "linear_heads", "linear_qk_heads", "mlp", "vocab", "projector_hidden")
# logical names split by FSDP: the width, and a wrapper projector's input width (the tower's)
_FSDP_NAMES = ("embed", "projector_in")

DP: tuple = (("batch", DATA),)
FSDP: tuple = (("batch", DATA),) + tuple((name, DATA) for name in _FSDP_NAMES)
TP: tuple = (("batch", DATA),) + tuple((name, MODEL) for name in _TP_NAMES)
FSDP_TP: tuple = FSDP + tuple((name, MODEL) for name in _TP_NAMES)
# expert parallelism: FSDP_TP with a mixture-of-experts' experts over ``model`` (each device holds whole experts;
# the expert weights' ``mlp`` axis then stays whole, as a mesh axis serves one axis of a parameter)
EP: tuple = FSDP + (("experts", MODEL),) + tuple((name, MODEL) for name in _TP_NAMES)

LAYOUTS = {"DP": DP, "FSDP": FSDP, "TP": TP, "FSDP_TP": FSDP_TP, "EP": EP}


def initialize(coordinator: str | None = None, processes: int | None = None, process_id: int | None = None, *,
               timeout: float = 120.0) -> None:
    """Join a multi-process job (one process per host: ``jax.distributed.initialize``), first thing, before
    anything touches a device; then ``jax.devices()`` lists every host's devices and ``mesh()`` spans them.

    ``coordinator`` (``"HOST:PORT"`` of process 0), ``processes`` and ``process_id``: as ``jax.distributed``
    takes them (all None on a TPU pod slice or under SLURM, where JAX finds them itself). A process other than
    0 first waits, up to ``timeout`` seconds, for the coordinator's port to accept a connection, and raises
    ConnectionError naming the address when it never does (JAX itself would abort the process with a gRPC
    deadline after its own timeout, or wait on); the job's other processes then have ``timeout`` seconds to
    join. On the CPU the collectives between processes go over gloo.
    """
    import socket
    import time

    if jax.config.jax_cpu_collectives_implementation in (None, "none", ""):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator is not None and process_id not in (None, 0):
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator {coordinator!r} is not HOST:PORT (process 0's address and a free port)")
        deadline, error = time.monotonic() + timeout, None
        while True:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout)).close()
                break
            except OSError as e:
                error = e
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"process {process_id} of {processes} could not reach the coordinator at {coordinator} within "
                    f"{timeout:.0f} s ({error}): start process 0 there (it listens on that port), check that this "
                    "host can reach that address and port (a firewall, the host's name), and pass every process "
                    "the same coordinator and process count") from None
            time.sleep(0.25)
    jax.distributed.initialize(coordinator, processes, process_id, initialization_timeout=int(max(timeout, 1)))


def mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A 2-D ``Mesh`` with axes ``("data", "model")`` over ``devices`` (default: every device, all hosts).

    ``data`` None takes the devices ``model`` leaves. Raises ValueError when
    ``data * model`` is not the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if data is None:
        data = len(devices) // model
    if data * model != len(devices) or data < 1:
        raise ValueError(f"a mesh of data={data} x model={model} needs {data * model} devices; there are "
                         f"{len(devices)}: pick sizes whose product is {len(devices)}")
    from jax.experimental import mesh_utils

    try:
        grid = mesh_utils.create_device_mesh((data, model), devices)
    except Exception:  # topologies mesh_utils does not know: plain order
        grid = np.asarray(devices).reshape(data, model)
    return Mesh(grid, (DATA, MODEL))


def _rules_for(mesh: Mesh, rules: Rules) -> list:
    """``rules`` less the mesh axes ``mesh`` does not have (a rule left with none maps to no axis)."""
    out = []
    for logical, axes in rules:
        if axes is None:
            out.append((logical, None))
            continue
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a in mesh.axis_names)
        out.append((logical, kept[0] if len(kept) == 1 else (kept or None)))
    return out


def _check_rules(rules: Rules) -> None:
    if isinstance(rules, str) or not all(isinstance(r, (tuple, list)) and len(r) == 2 for r in rules):
        raise TypeError(f"rules are a flax rule list of (logical name, mesh axes) pairs, e.g. jstd.sharding.FSDP; "
                        f"got {rules!r}")


def _check_effect(axes_tree, mesh: Mesh, rules: Rules) -> None:
    """Rules that would do nothing, refused: ValueError when none of their mesh axes is an axis of ``mesh``, when
    they name a logical axis no jstd parameter has (a misspelling), or when their parameter rules match no
    parameter of the model (everything would be replicated); a warning naming the mesh axes ``mesh`` lacks when
    only some are (a 1-D mesh drops the others: their rules place nothing)."""
    import warnings

    names = {n for spec in jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
             for n in spec if isinstance(n, str)}
    known = names | LOGICAL_NAMES | {name for layout in LAYOUTS.values() for name, _ in layout} | {"batch"}
    on = lambda axes: () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    wanted = {a for _, axes in rules for a in on(axes)}
    lacking = sorted(wanted - set(mesh.axis_names))
    if wanted and len(lacking) == len(wanted):
        raise ValueError(f"jstd.sharding: none of the rules' mesh axes ({', '.join(lacking)}) is an axis of the mesh "
                         f"{tuple(mesh.axis_names)}: every value would be replicated; build the mesh with "
                         "jstd.sharding.mesh() (axes data, model) or name the mesh's axes in the rules")
    unknown = sorted({logical for logical, _ in rules} - known)
    if unknown:
        raise ValueError("jstd.sharding: the rules name logical axes no parameter has: "
                         f"{', '.join(map(repr, unknown))} "
                         f"(this model's: {', '.join(sorted(names))}); fix the names (jstd.logical_axes(model) "
                         "shows each parameter's)")
    placing = [(logical, axes) for logical, axes in rules if logical != "batch" and on(axes)]
    if placing and not any(logical in names for logical, _ in placing):
        raise ValueError(f"jstd.sharding: no rule matches a logical axis of this model's parameters (rules for "
                         f"{', '.join(sorted({l for l, _ in placing}))}; its axes: {', '.join(sorted(names))}): "
                         "every parameter would be replicated; name its axes, or use jstd.sharding.DP to replicate")
    if lacking:
        idle = sorted({logical for logical, axes in rules if on(axes) and set(on(axes)) <= set(lacking)})
        warnings.warn(f"jstd.sharding: the mesh {tuple(mesh.axis_names)} has no axis {', '.join(lacking)}: the rules "
                      f"for {', '.join(idle)} place nothing (those values are replicated)", stacklevel=4)


def fit(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """``sharding`` with each dimension that its mesh axes do not divide evenly left whole (replicated)."""
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
    for d, axes in enumerate(spec):
        if axes is None:
            continue
        n = math.prod(sizes[a] for a in ((axes,) if isinstance(axes, str) else axes))
        if shape[d] % n:
            spec[d] = None
    while spec and spec[-1] is None:
        spec.pop()
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def shardings(model, mesh: Mesh, rules: Rules = FSDP):
    """A pytree shaped like ``model`` (a model or a skeleton of ``jax.ShapeDtypeStruct``) whose leaves are each
    parameter's ``NamedSharding`` on ``mesh`` under ``rules``: ``flax.linen.logical_to_mesh_sharding`` of
    ``jstd.logical_axes(model)``, then ``fit`` to each parameter's shape."""
    from flax import linen

    _check_rules(rules)
    _check_effect(logical_axes(model), mesh, rules)
    named = linen.logical_to_mesh_sharding(logical_axes(model), mesh, _rules_for(mesh, rules))
    return jax.tree.map(lambda s, leaf: fit(s, tuple(leaf.shape)), named, model,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def shard(model, mesh: Mesh, rules: Rules | None = None):
    """``model`` with every parameter placed on ``mesh`` as ``rules`` say (``shardings``); the values are the same.

    ``rules``: a flax rule list, e.g. ``jstd.sharding.DP``, ``FSDP`` (None: the
    default), ``TP``, ``FSDP_TP``. Raises TypeError for rules that are not a
    rule list.
    """
    return jax.device_put(model, shardings(model, mesh, FSDP if rules is None else rules))


def placer(skeleton, mesh: Mesh | None, rules: Rules | None = None) -> Callable[[str, np.ndarray], Array]:
    """``place(path, host_array) -> jax.Array``: a loaded parameter (``path`` as in the family's name map:
    ``"layers.slots.0.attn.q"``) placed on its shards of ``mesh`` under ``rules`` (default ``FSDP``), each device
    receiving only its part (``jax.make_array_from_callback``, so on several hosts each host places only its
    devices' parts); without a mesh, ``jax.device_put`` on the default device (the CPU adopts an aligned buffer
    without a copy). ``skeleton``: the model's tree of ``jax.ShapeDtypeStruct`` (``Family.skeleton``).

    On a mesh, ``place.shards(path, shape, part)`` builds the parameter from ``part(index)``, the host array of
    one device's part alone (``jstd.load`` reads a stacked parameter's parts block by block with it)."""
    if mesh is None:
        if rules is not None:
            raise ValueError("rules= places parameters on a mesh: pass mesh= too (jstd.sharding.mesh())")
        return lambda path, array: jax.device_put(array)
    tree = shardings(skeleton, mesh, FSDP if rules is None else rules)

    def place(path: str, array: np.ndarray) -> Array:
        sharding = at_path(tree, path)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    def shards(path: str, shape: tuple[int, ...], part: Callable[[tuple], np.ndarray]) -> Array:
        """The parameter ``path`` of ``shape`` built device by device: ``part(index)`` returns the host array of
        ``index`` (a tuple of slices) alone, so a loader can read a stacked parameter block by block and never
        hold it whole (devices that hold the same part share one call)."""
        last = {}

        def one(index):
            key = tuple((s.start, s.stop) for s in index)
            if key not in last:
                last.clear()
                last[key] = part(index)
            return last[key]

        return jax.make_array_from_callback(shape, at_path(tree, path), one)

    place.shards = shards
    return place


def batch_sharding(mesh: Mesh, rules: Rules = FSDP, ndim: int = 2) -> NamedSharding:
    """The sharding of an ``ndim``-array with a leading ``batch`` axis (token ids, masks) under ``rules``."""
    from flax import linen

    _check_rules(rules)
    spec = PartitionSpec("batch", *([None] * (ndim - 1)))
    return linen.logical_to_mesh_sharding(spec, mesh, _rules_for(mesh, rules))


def shard_inputs(inputs, mesh: Mesh, rules: Rules = FSDP):
    """``inputs`` (token ids or a ``jstd.Inputs``) with the token ids and mask split by rows as ``rules`` map
    ``batch`` (every ready rule list: over ``data``); images replicated. Rows that do not divide evenly stay
    whole."""
    def rows(x):
        if x is None:
            return None
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.device_put(x, fit(batch_sharding(mesh, rules, x.ndim), x.shape))

    if not isinstance(inputs, Inputs):
        return rows(inputs)
    replicated = NamedSharding(mesh, PartitionSpec())
    images = None if inputs.images is None else {k: jax.device_put(v, replicated) for k, v in inputs.images.items()}
    return Inputs(rows(inputs.tokens), rows(inputs.attention_mask), images, inputs.layout)


def sweep(fn: Callable, *entries, mesh: Mesh, axis: str = DATA):
    """``jax.vmap(fn)(*entries)`` with the entries spread over ``mesh``'s ``axis``: each device runs its share.

    ``entries``: arrays with the sweep axis first (layers, heads, positions of
    each run). They are padded to a multiple of the axis' size (with their last
    entry) and placed split over ``axis``; the result, split the same way, is
    cut back to the entries given. One compile per shape. Equal to the
    unsharded ``jax.vmap(fn)(*entries)``.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r} (axes: {mesh.axis_names}); pass axis= one of them")
    entries = [np.asarray(e) if not isinstance(e, jax.Array) else e for e in entries]
    n = entries[0].shape[0]
    if any(e.shape[0] != n for e in entries):
        raise ValueError(f"sweep entries must share their first axis; got {[e.shape[0] for e in entries]}")
    size = dict(zip(mesh.axis_names, mesh.devices.shape))[axis]
    pad = -n % size
    placed = [jax.device_put(spread(e, pad), NamedSharding(mesh, PartitionSpec(axis))) for e in entries]
    out = _sweep_jit(fn, NamedSharding(mesh, PartitionSpec(axis)))(*placed)
    return jax.tree.map(lambda x: x[:n], out)


def spread(entries, pad: int):
    """``entries`` padded along axis 0 with ``pad`` copies of its last entry."""
    import jax.numpy as jnp

    if not pad:
        return entries
    xp = np if isinstance(entries, np.ndarray) else jnp
    return xp.concatenate([entries, xp.repeat(entries[-1:], pad, axis=0)])


@functools.lru_cache(maxsize=64)
def _sweep_jit(fn, sharding):
    def run(*entries):
        out = jax.vmap(fn)(*entries)
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), out)

    return jax.jit(run)
