"""Edits: small equinox modules that replace a site's value.

An edit names a site (static), holds its arrays as dynamic leaves, and may
pick a block (``layer``: an int or a traced int array, so a sweep over blocks is
one ``vmap``) and a boolean ``where`` mask that broadcasts against the site's
value. At the site, the value becomes ``where(mask, op(value), value)`` and
everything downstream computes from it. Edits compose in list order.

A value array broadcasts against the site's per-block value; for a block site
edited on every block (``layer=None``) it may instead be stacked over the
blocks, block axis first, so one edit can set a whole stored run.
"""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Int

from jstd.sites import SITES, SiteError, parse


class Edit(eqx.Module):
    """Base class of every edit. Subclasses define ``op(value) -> new value``."""

    site: str = eqx.field(static=True)
    layer: Int[ArrayLike, ""] | None
    where: Bool[ArrayLike, "..."] | None

    def _init_site(self, site: str, layer, where):
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
        self.site = base
        self.layer = index if index is not None else layer
        self.where = where

    def op(self, value: Array) -> Array:
        raise NotImplementedError

    def arrays(self) -> tuple[str, ...]:
        """The names of the fields holding the edit's own arrays (stackable over blocks)."""
        return tuple(f for f in ("value", "factor", "where") if getattr(self, f, None) is not None)

    def __call__(self, value: Array) -> Array:
        """The edited value, with ``where`` applied."""
        new = self.op(value)
        new = jnp.broadcast_to(jnp.asarray(new, value.dtype), value.shape)
        if self.where is None:
            return new
        return jnp.where(jnp.asarray(self.where, bool), new, value)


class Set(Edit):
    """Replace the site's value by ``value`` (broadcast to the site's shape)."""

    value: ArrayLike

    def __init__(self, site: str, value: ArrayLike, *, layer=None, where=None):
        self._init_site(site, layer, where)
        self.value = value

    def op(self, value):
        return jnp.asarray(self.value, value.dtype)


class Add(Edit):
    """Add ``value`` to the site's value (steering)."""

    value: ArrayLike

    def __init__(self, site: str, value: ArrayLike, *, layer=None, where=None):
        self._init_site(site, layer, where)
        self.value = value

    def op(self, value):
        return value + jnp.asarray(self.value, value.dtype)


class Scale(Edit):
    """Multiply the site's value by ``factor`` (a scalar or a broadcastable array)."""

    factor: ArrayLike

    def __init__(self, site: str, factor: ArrayLike, *, layer=None, where=None):
        self._init_site(site, layer, where)
        self.factor = factor

    def op(self, value):
        return value * jnp.asarray(self.factor, value.dtype)


class Zero(Edit):
    """Replace the site's value by zeros (zero ablation)."""

    def __init__(self, site: str, *, layer=None, where=None):
        self._init_site(site, layer, where)

    def op(self, value):
        return jnp.zeros_like(value)


class Apply(Edit):
    """Replace the site's value by ``fn(value)``.

    ``fn`` is an equinox module (its arrays are dynamic leaves, so gradients
    reach them) or any function of the value (held statically).
    """

    fn: Any

    def __init__(self, site: str, fn: Callable[[Array], Array], *, layer=None, where=None):
        self._init_site(site, layer, where)
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
