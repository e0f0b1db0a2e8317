"""Attribution graphs on a mesh of devices: where the model, the transcoders, the sources and the targets live.

    mesh = jstd.sharding.mesh(model=4)                                    # ("data", "model") over every device
    graph = jstd.attribute(model, ids, tc, mesh=mesh, layout="FSDP_TP")   # the single-device graph

- The model and the transcoders are placed by one of ``jstd.sharding``'s layouts (``place``): the model as
  ``jstd.shard`` places it, the transcoders by their own logical axes (``Transcoders``: features ``mlp``, widths
  ``embed``), so under ``FSDP`` every encoder and decoder is split by its width over ``data`` and under ``TP`` by
  its features over ``model``, a cross-layer transcoder's decoders from block ``l`` each split like block ``l``'s
  encoder.
- Each batch of targets (``replacement.target_gradients``' ``layers``, ``positions``, ``vectors``: the rows being computed) is
  split over ``data`` (``place_targets``; ``batch_size`` rounded up to a multiple of ``data``), so each data
  shard backpropagates its own targets through the model (XLA gathers the weights FSDP splits, a block at a time).
- The sources laid out per (block, position) (``Sources``: per block the activation-scaled decoder vectors ``[n,
  K_l, d]``, the error vectors ``[L, n, d]``, the token embeddings ``[n, d]``) are placed once per prompt, whatever the
  layout, with their positions over ``data`` and their slots over ``model`` (``place_sources``; an axis the mesh's
  axis does not divide stays whole), each vector whole: the product of a batch's gradients ``[B, L, n, d]`` with
  them then needs the gradients moved to the positions' shards (an all-to-all of the batch's gradients) and no
  sum across chips, and its products ``[B, n, K_l]`` stay split by position and slot. (Split by width instead, as
  the transcoders are under FSDP, the product is a partial sum on every chip and each batch all-reduces its whole
  rows: 1 GiB a chip for Llama-3.1-8B at 64 tokens, docs/scale.md.)
- Each block's products then move to the rows' shards (an all-to-all: rows over ``data``, slots still over
  ``model``) and each chip gathers its features' columns from the slots it holds, summed over blocks as it goes;
  one all-reduce over ``model`` of ``[B / data, features]`` joins them (``replacement.source_columns``). A
  batch's rows ``[B, sources]`` come out split over ``data`` and reach the host once (one transfer a batch); the
  graph is assembled on the host as on one device.

Sharding changes where values live, never what they are: the graph equals the single-device graph to float32
rounding of reordered sums (tests/test_circuits_mesh.py: 8 simulated devices under FSDP, TP and FSDP_TP).
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float

from jstd.nn.params import DATA, MODEL
from jstd.sharding import LAYOUTS, Rules, fit, shard


class Sources(eqx.Module):
    """What the sources of a prompt write, as ``replacement.source_columns`` reads them: ``vectors``, per block
    ``l`` ``[n, K_l, d]`` (the activation-scaled decoder vectors by position and slot; each block its own slot
    count), ``errors [L, n, d]``, ``tokens [n, d]`` (the token embeddings)."""

    vectors: tuple[Float[Array, "seq slots d"], ...]
    errors: Float[Array, "layers seq d"]
    tokens: Float[Array, "seq d"]


def rules_of(layout: str | Rules) -> Rules:
    """The rule list of ``layout``: a name in ``jstd.sharding.LAYOUTS`` (``"FSDP"``, ``"TP"``, ``"FSDP_TP"``, ...)
    or a rule list itself. ValueError for an unknown name."""
    if isinstance(layout, str):
        if layout not in LAYOUTS:
            raise ValueError(f"attribute: unknown layout {layout!r}; pass one of {', '.join(LAYOUTS)} or a rule list")
        return LAYOUTS[layout]
    return layout


def place(model, transcoders, mesh: Mesh, layout: str | Rules = "FSDP"):
    """``(model, transcoders)`` placed on ``mesh`` under ``layout`` (``jstd.shard`` each; values unchanged)."""
    rules = rules_of(layout)
    return shard(model, mesh, rules), shard(transcoders, mesh, rules)


def axis_size(mesh: Mesh | None, axis: str) -> int:
    """The size of ``mesh``'s axis ``axis`` (1 without a mesh or without that axis)."""
    if mesh is None:
        return 1
    return mesh.shape.get(axis, 1)


def batch_for(batch_size: int, mesh: Mesh | None) -> int:
    """``batch_size`` rounded up to a multiple of the ``data`` axis (each data shard a whole share of targets)."""
    size = axis_size(mesh, DATA)
    return -(-batch_size // size) * size


def targets_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Targets (their leading axis) split over ``data``."""
    spec = PartitionSpec(DATA if DATA in mesh.axis_names else None, *([None] * (ndim - 1)))
    return NamedSharding(mesh, spec)


def place_targets(mesh: Mesh | None, *arrays):
    """Each of ``arrays`` (a batch of targets, leading axis a multiple of ``data``) split over ``data``; without a
    mesh, as host arrays (the compiled program's call moves them: no transfer of its own to wait on)."""
    if mesh is None:
        return tuple(np.asarray(a) for a in arrays)
    return tuple(jax.device_put(np.asarray(a), targets_sharding(mesh, np.ndim(a))) for a in arrays)


def sources_shardings(mesh: Mesh, sources: Sources) -> Sources:
    """The ``NamedSharding`` of each of ``sources``' arrays (or shapes) on ``mesh``: positions over ``data``, slots
    over ``model`` (module docstring), each axis whole where the mesh has no such axis or its size does not
    divide the axis'."""
    specs = Sources(tuple(PartitionSpec(DATA, MODEL) for _ in sources.vectors), PartitionSpec(None, DATA),
                    PartitionSpec(DATA))
    return jax.tree.map(lambda spec, a: fitted(mesh, tuple(a.shape), *spec), specs, sources,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def fitted(mesh: Mesh, shape: tuple[int, ...], *axes: str | None) -> NamedSharding:
    """The ``NamedSharding`` of an array of ``shape`` with dimension ``i`` over mesh axis ``axes[i]``: whole where
    it is None, the mesh has no such axis, or that axis' size does not divide the dimension."""
    return fit(NamedSharding(mesh, PartitionSpec(*(a if a in mesh.axis_names else None for a in axes))), shape)


def laid_out(mesh: Mesh | None, x: Array, *axes: str | None) -> Array:
    """``x`` constrained (inside a traced program) to lie as ``fitted(mesh, x.shape, *axes)`` says; without a mesh,
    ``x`` itself."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, fitted(mesh, tuple(x.shape), *axes))


def place_sources(mesh: Mesh | None, sources: Sources) -> Sources:
    """``sources`` placed on ``mesh`` (``sources_shardings``); without a mesh, as given."""
    if mesh is None:
        return sources
    return jax.device_put(sources, sources_shardings(mesh, sources))
