"""Edits: small equinox modules that replace a site's value.

An edit names a site (static), holds its arrays as dynamic leaves, and may
pick a block (``layer``: an int or a traced int array, so a sweep over blocks is
one ``vmap``), ``positions`` (the site's ``seq`` axis, ``query`` on attention
patterns) and ``heads`` (its ``heads`` or ``kv_heads`` axis) — each an int, a
list or int array (traced is fine; negatives count from the end) or a boolean
mask — and a boolean ``where`` mask that broadcasts against the site's value.
At the site, the value becomes ``where(mask, op(value), value)`` and everything
downstream computes from it. Edits compose in list order.

A value array broadcasts against the site's per-block value; for a block site
edited on every block (``layer=None``) it may instead be stacked over the
blocks, block axis first, so one edit can set a whole stored run.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from jstd.sites import SITES, SiteError, parse

# what ``positions=`` selects: text positions, patches, and the image-token rows a wrapper's projector returns
# (``projector.output``: one image's tokens; ``vision.image_features``: every image token of the batch, in order)
POSITION_AXES = ("seq", "query", "patches", "grid", "tokens", "image_tokens")
HEAD_AXES = ("heads", "kv_heads")


def site_axes(site: str) -> tuple[int | None, int | None]:
    """The (position axis, head axis) of ``site``'s per-block value, None where it has none."""
    layout = SITES[parse(site)[0]].layout
    pos = next((i for i, a in enumerate(layout) if a in POSITION_AXES), None)
    head = next((i for i, a in enumerate(layout) if a in HEAD_AXES), None)
    return pos, head


def _axis_mask(index, size: int) -> Bool[Array, "size"]:
    """A boolean [size] mask from an int, int array (traced allowed, negatives count from the end) or bool [size]."""
    index = jnp.asarray(index)
    if index.dtype == bool:
        if index.shape != (size,):
            raise SiteError(f"a boolean selection must have shape ({size},), got {index.shape}")
        return index
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise SiteError(f"positions and heads are integers or a boolean mask, got dtype {index.dtype}")
    index = jnp.where(index < 0, index + size, index).reshape(-1)
    return (jnp.arange(size)[:, None] == index[None, :]).any(-1)


def selection_mask(site: str, shape: Sequence[int], positions=None, heads=None) -> Bool[Array, "..."] | None:
    """A mask broadcasting against a value of ``shape`` at ``site``, True at the chosen positions and heads.

    None when neither is chosen.
    """
    pos_axis, head_axis = site_axes(site)
    mask = None
    for index, axis in ((positions, pos_axis), (heads, head_axis)):
        if index is None:
            continue
        m = _axis_mask(index, shape[axis]).reshape([-1 if i == axis else 1 for i in range(len(shape))])
        mask = m if mask is None else mask & m
    return mask


class Edit(eqx.Module):
    """Base class of every edit. Subclasses define ``op(value) -> new value``."""

    site: str = eqx.field(static=True)
    layer: Int[ArrayLike, ""] | None
    where: Bool[ArrayLike, "..."] | None
    positions: Int[ArrayLike, "..."] | Bool[ArrayLike, "seq"] | None
    heads: Int[ArrayLike, "..."] | Bool[ArrayLike, "heads"] | None

    def _init_site(self, site: str, layer, where, positions=None, heads=None):
        base, index = parse(site)
        if not SITES[base].editable:
            raise SiteError(
                f"{type(self).__name__}: site {base!r} is read-only (derived from other values); "
                "edit the values it is derived from instead"
            )
        if index is not None and layer is not None:
            raise SiteError(
                f"{type(self).__name__}: {site!r} already names block {index}; drop layer={layer!r} or the index"
            )
        if index is None and layer is not None and not SITES[base].per_block:
            raise SiteError(f"{type(self).__name__}: {base!r} is not a block site; drop layer={layer!r}")
        pos_axis, head_axis = site_axes(base)
        for chosen, axis, what in ((positions, pos_axis, "position"), (heads, head_axis, "head")):
            if chosen is not None and axis is None:
                raise SiteError(
                    f"{type(self).__name__}: {base} has no {what} axis (layout [{', '.join(SITES[base].layout)}]); "
                    f"drop {what}s="
                )
        self.site = base
        self.layer = index if index is not None else layer
        self.where = where
        self.positions = None if positions is None else jnp.asarray(positions)
        self.heads = None if heads is None else jnp.asarray(heads)

    def op(self, value: Array) -> Array:
        raise NotImplementedError

    def arrays(self) -> tuple[str, ...]:
        """The names of the fields holding the edit's own arrays (stackable over blocks)."""
        return tuple(f for f in ("value", "factor", "where") if getattr(self, f, None) is not None)

    def __call__(self, value: Array) -> Array:
        """The edited value, kept only where ``where``, ``positions`` and ``heads`` select."""
        new = jnp.broadcast_to(jnp.asarray(self.op(value), value.dtype), value.shape)
        mask = selection_mask(self.site, value.shape, self.positions, self.heads)
        if self.where is not None:
            where = jnp.asarray(self.where, bool)
            mask = where if mask is None else mask & where
        return new if mask is None else jnp.where(mask, new, value)


class Set(Edit):
    """Replace the site's value by ``value`` (broadcast to the site's shape)."""

    value: ArrayLike

    def __init__(self, site: str, value: ArrayLike, *, layer=None, positions=None, heads=None, where=None):
        self._init_site(site, layer, where, positions, heads)
        self.value = value

    def op(self, value):
        return jnp.asarray(self.value, value.dtype)


class Add(Edit):
    """Add ``value`` to the site's value (steering)."""

    value: ArrayLike

    def __init__(self, site: str, value: ArrayLike, *, layer=None, positions=None, heads=None, where=None):
        self._init_site(site, layer, where, positions, heads)
        self.value = value

    def op(self, value):
        return value + jnp.asarray(self.value, value.dtype)


class Scale(Edit):
    """Multiply the site's value by ``factor`` (a scalar or a broadcastable array)."""

    factor: ArrayLike

    def __init__(self, site: str, factor: ArrayLike, *, layer=None, positions=None, heads=None, where=None):
        self._init_site(site, layer, where, positions, heads)
        self.factor = factor

    def op(self, value):
        return value * jnp.asarray(self.factor, value.dtype)


class Zero(Edit):
    """Replace the site's value by zeros (zero ablation)."""

    def __init__(self, site: str, *, layer=None, positions=None, heads=None, where=None):
        self._init_site(site, layer, where, positions, heads)

    def op(self, value):
        return jnp.zeros_like(value)


class Apply(Edit):
    """Replace the site's value by ``fn(value)``.

    ``fn`` is an equinox module (its arrays are dynamic leaves, so gradients
    reach them) or any function of the value (held statically).
    """

    fn: Any

    def __init__(self, site: str, fn: Callable[[Array], Array], *, layer=None, positions=None, heads=None, where=None):
        self._init_site(site, layer, where, positions, heads)
        if not callable(fn):
            raise TypeError(f"Apply: fn must be callable, got {type(fn).__name__}")
        self.fn = fn if isinstance(fn, eqx.Module) else jax.tree_util.Partial(fn)

    def op(self, value):
        return self.fn(value)


def as_edits(edits) -> tuple[Edit, ...]:
    """Normalize ``edits`` (an Edit, a sequence of Edits, or empty) to a tuple, checking types."""
    if edits is None:
        return ()
    if isinstance(edits, Edit):
        return (edits,)
    edits = tuple(edits)
    for e in edits:
        if not isinstance(e, Edit):
            raise TypeError(
                f"edits must be jstd edits (Set, Add, Scale, Zero, Apply), got {type(e).__name__}"
            )
    return edits
