"""Parameter fields with logical axis names (for sharding rules), skeleton shapes, and the row constraint of the
residual stream under a mesh."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
from jax.sharding import PartitionSpec
from jaxtyping import Array

DATA, MODEL = "data", "model"  # the mesh axes of jstd.sharding's rules: rows of the batch, tensor parallelism


# every logical axis name a parameter of some jstd module declares (``param``): what a sharding rule may name
LOGICAL_NAMES: set[str] = {"layers"}


def param(*axes: str, items: tuple[str, ...] | None = None, **field):
    """A parameter field whose array carries logical axis names (for sharding rules).

    The names are the array's axes in order; blocks stacked for the scan get a
    leading ``layers`` axis (see ``logical_axes``). Each name joins ``LOGICAL_NAMES``.
    ``items``: the names of each array when the field holds a tuple of arrays of another layout (a cross-layer
    transcoder's decoders, one per block); None: the tuple's arrays take ``axes``.
    ``field``: passed to ``eqx.field`` (``default=None`` for an optional parameter after the static fields).
    """
    LOGICAL_NAMES.update(axes)
    LOGICAL_NAMES.update(items or ())
    return eqx.field(metadata={"axes": tuple(axes), "items": None if items is None else tuple(items)}, **field)


def stacked():
    """A field holding blocks stacked on a leading ``layers`` axis."""
    return eqx.field(metadata={"stacked": True})


def shape(*dims, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(dims), dtype)


def logical_axes(module: eqx.Module):
    """A pytree shaped like ``module`` whose leaves are ``PartitionSpec``s of logical axis names.

    ``("layers", "embed", "heads", "head_dim")`` for a stacked query projection,
    and so on. A sharding rule maps these names to mesh axes, so families never
    change when sharding is added.
    """
    def spec(path, leaf):
        node, prefix, axes, items = module, (), None, None
        for key in path:
            if isinstance(key, jax.tree_util.SequenceKey):
                node = node[key.idx]
                axes = items or axes
                continue
            field = {f.name: f for f in dataclasses.fields(node)}[key.name]
            if field.metadata.get("stacked"):
                prefix += ("layers",)
            axes, items = field.metadata.get("axes"), field.metadata.get("items")
            node = getattr(node, key.name)
        if axes is None:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} declares no logical axes")
        return PartitionSpec(*(prefix + axes))

    return jax.tree_util.tree_map_with_path(spec, module)


def with_fields(model: eqx.Module, **fields) -> eqx.Module:
    """``model`` with the static ``fields`` replaced (a shallow copy: the parameters are shared)."""
    new = object.__new__(type(model))
    new.__dict__.update(vars(model))
    for name, value in fields.items():
        object.__setattr__(new, name, value)
    return new


def constrain_rows(x: Array) -> Array:
    """``x`` (a ``[batch, ...]`` activation: the residual stream) constrained to rows split over the ``data`` axis
    of the mesh set with ``jax.set_mesh`` (``with jax.set_mesh(mesh): jax.jit(jstd.run)(...)``), so that under
    ``FSDP`` XLA gathers each block's weights rather than splitting the stream by hidden units. Without such a mesh,
    or with rows that ``data`` does not divide, ``x`` itself (no-op)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA not in mesh.axis_names or not x.ndim or x.shape[0] % dict(mesh.shape)[DATA]:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(DATA))
