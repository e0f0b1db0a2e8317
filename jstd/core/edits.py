"""Edits: small equinox modules that replace a site's value.

An edit names a site (static), holds its arrays as dynamic leaves, and may
pick a block (``layer``: an int or a traced int array, so a sweep over blocks is
one ``vmap``), ``positions`` (the site's ``seq`` axis, ``query`` on attention
patterns) and ``heads`` (its ``heads`` or ``kv_heads`` axis) — each an int, a
list or int array (traced is fine) or a boolean mask — and a boolean ``where``
mask that broadcasts against the site's value. At the site, the value becomes
``where(mask, op(value), value)`` and everything downstream computes from it.
Edits compose in list order.

Indices are checked, never skipped or clamped: a ``layer`` lies in ``-L..L-1``
for a stack of ``L`` blocks and names a block that has the site's host; a
position or head lies in ``-n..n-1`` for the site's axis of size ``n``.
Negative indices count from the end, as in ``"layers.-1.X"``. A bad index
known before the call runs (a concrete layer, in ``jstd.run``; positions and
heads in the tools, which know the axes' sizes) raises SiteError naming it;
one that is a value of the compiled call (positions and heads inside
``jstd.run``, any index under ``jax.jit`` or ``vmap``) raises an equinox
runtime error with the same explanation when the call runs. Kinds, mask
shapes and an ``Apply``'s result are checked when the call is traced.

A value array broadcasts against the site's per-block value; for a block site
edited on every block (``layer=None``) it may instead be stacked over the
blocks, block axis first, so one edit can set a whole stored run.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int

from jstd.core.checks import check_kind, checked, shown, span
from jstd.core.sites import SITES, SiteError, parse

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


def check_index(index, size: int, what: str, axis: str) -> Array:
    """``index`` (an int, an int array — traced allowed — or a bool mask ``[size]``) checked against an axis of ``size``.

    what: the argument as the error names it (``"Zero at layers.layer_output: positions"``);
    axis: the axis' name (``"seq"``). A concrete index outside ``-size..size-1``
    raises SiteError now, naming the bad values; a traced one raises an equinox
    runtime error when the compiled call runs (under ``jit`` and ``vmap``).
    Returns the index as an array (the error check attached when traced).
    """
    check_kind(index, what, size)
    index = jnp.asarray(index)
    if index.dtype == bool:
        return index
    fix = f"is out of range for the {axis} axis of size {size}; pass indices in {span(size)}"
    return checked(index, lambda xp, i: (i < -size) | (i >= size), f"{what} {fix}",
                   concrete=lambda i, bad: f"{what}={shown(i[bad])} {fix}", error=SiteError)


def check_left_padded(attention_mask, reader: str):
    """``attention_mask`` checked to end each row with a real token (left padding or none), for ``reader``, which
    reads positions counted from the end (the last: the next-token prediction).

    A right-padded row's last position is padding, so a metric, lens or
    next-token read there would read a pad. Concrete masks raise ValueError
    now; traced ones an equinox runtime error when the compiled call runs.
    Returns the mask (the check attached when traced); None passes.
    """
    if attention_mask is None:
        return None
    fix = (f"{reader} reads each row's last position, which is padding on a row padded on the right; "
           "pad on the left (tokenizer.padding_side = 'left'; jstd.load_processor does this for causal LMs)")
    return checked(attention_mask, lambda xp, m: ~m[:, -1].astype(bool), f"a row of attention_mask ends in padding: {fix}",
                   concrete=lambda m, rows: f"attention_mask row {int(np.flatnonzero(rows)[0])} ends in padding: {fix}")


def selection_mask(site: str, shape: Sequence[int], positions=None, heads=None, who: str | None = None
                   ) -> Bool[Array, "..."] | None:
    """A mask broadcasting against a value of ``shape`` at ``site``, True at the chosen positions and heads.

    None when neither is chosen. ``positions`` / ``heads``: ints, int arrays
    (traced allowed) or bool masks, checked against the site's axes
    (``check_index``: SiteError, or a runtime error when traced); ``who`` names
    the caller in errors (default: the site).
    """
    pos_axis, head_axis = site_axes(site)
    layout = SITES[site].layout
    mask = None
    for index, axis, arg in ((positions, pos_axis, "positions"), (heads, head_axis, "heads")):
        if index is None:
            continue
        index = check_index(index, shape[axis], f"{who or site}: {arg}", layout[axis])
        if index.dtype != bool:
            index = jnp.where(index < 0, index + shape[axis], index).reshape(-1)
            index = (jnp.arange(shape[axis])[:, None] == index[None, :]).any(-1)
        m = index.reshape([-1 if i == axis else 1 for i in range(len(shape))])
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
            if chosen is not None:  # the kind now; the range at the site, where the axis' size is known
                check_kind(chosen, f"{type(self).__name__} at {base}: {what}s", None)
        if layer is not None:  # the range in jstd.run, where the model's depth is known
            check_kind(layer, f"{type(self).__name__} at {base}: layer", None, masks=False)
        self.site = base
        self.layer = index if index is not None else layer
        self.where = where
        self.positions = None if positions is None else jnp.asarray(positions)
        self.heads = None if heads is None else jnp.asarray(heads)

    def op(self, value: Array) -> Array:
        raise NotImplementedError

    def within(self, value: Array, scope) -> Array:
        """The edited value at ``scope`` (the tap's ``Scope`` the site is computed in): ``self(value)``. An edit
        that taps values of its own under the site (a spliced dictionary's ``X.sae.latents``) overrides it."""
        return self(value)

    def arrays(self) -> tuple[str, ...]:
        """The names of the fields holding the edit's own arrays (stackable over blocks)."""
        return tuple(f for f in ("value", "factor", "where") if getattr(self, f, None) is not None)

    def __call__(self, value: Array) -> Array:
        """The edited value, kept only where ``where``, ``positions`` and ``heads`` select."""
        new = jnp.broadcast_to(jnp.asarray(self.op(value), value.dtype), value.shape)
        mask = selection_mask(self.site, value.shape, self.positions, self.heads, f"{type(self).__name__} at {self.site}")
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
        new = self.fn(value)
        fn = self.fn.func if isinstance(self.fn, jax.tree_util.Partial) else self.fn
        who = f"Apply at {self.site}: fn {getattr(fn, '__name__', type(fn).__name__)}"
        want = f"the site's value, shape {value.shape} [{', '.join(SITES[self.site].layout)}] of dtype {value.dtype}"
        if not hasattr(new, "shape") or not hasattr(new, "dtype"):
            raise SiteError(f"{who} returned a {type(new).__name__}; it must return an array like {want}")
        if new.shape != value.shape:
            raise SiteError(f"{who} returned shape {tuple(new.shape)}; it must return {want}")
        if _kind(new.dtype) != _kind(value.dtype):
            raise SiteError(f"{who} returned dtype {new.dtype} ({_kind(new.dtype)}); it must return {want} "
                            f"(a {_kind(value.dtype)} dtype)")
        return new


def _kind(dtype) -> str:
    """A dtype's kind: bool, integer, floating or complex (bfloat16 is floating)."""
    for kind, name in ((jnp.bool_, "bool"), (jnp.integer, "integer"), (jnp.floating, "floating"),
                       (jnp.complexfloating, "complex")):
        if jnp.issubdtype(dtype, kind):
            return name
    return str(dtype)


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
