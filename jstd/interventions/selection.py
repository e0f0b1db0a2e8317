"""Edits restricted to positions and heads of a site, and reading a site's values.

``SetAt`` and ``AddAt`` are ``Set`` and ``Add`` that touch only the chosen
positions (the site's ``seq`` axis, or ``query`` on attention scores and
probabilities) and heads (``heads``, or ``kv_heads`` on keys and values). The
mask is built at the site from the value's own shape, so no sizes are needed up
front, and ``positions`` / ``heads`` may be traced integers: ``vmap`` over them
turns a sweep over positions or heads into one compiled call.

    jstd.run(model, tokens, [SetAt("layers.self_attn.attention_head_outputs", 0.0, layer=3, positions=-1, heads=[1, 2])])
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Int

from jstd.interventions.edits import Edit
from jstd.run import run
from jstd.sites import SITES, SiteError, parse

POSITION_AXES = ("seq", "query")
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
    """A boolean mask broadcasting against a value of ``shape`` at ``site``: True at the chosen positions and heads.

    None when neither is chosen. Raises SiteError if the site has no position
    (or head) axis to choose from.
    """
    pos_axis, head_axis = site_axes(site)
    mask = None
    for index, axis, what in ((positions, pos_axis, "position"), (heads, head_axis, "head")):
        if index is None:
            continue
        if axis is None:
            raise SiteError(f"{site} has no {what} axis (layout [{', '.join(SITES[parse(site)[0]].layout)}]); drop {what}s=")
        m = _axis_mask(index, shape[axis]).reshape([-1 if i == axis else 1 for i in range(len(shape))])
        mask = m if mask is None else mask & m
    return mask


class _Selected(Edit):
    """An edit whose op applies only at ``positions`` and ``heads`` (and ``where``); elsewhere the value is kept."""

    positions: Int[ArrayLike, "..."] | Bool[ArrayLike, "seq"] | None
    heads: Int[ArrayLike, "..."] | Bool[ArrayLike, "heads"] | None

    def _init_selection(self, site, layer, where, positions, heads):
        self._init_site(site, layer, where)
        pos_axis, head_axis = site_axes(self.site)
        if positions is not None and pos_axis is None:
            raise SiteError(f"{type(self).__name__}: {self.site} has no position axis; drop positions=")
        if heads is not None and head_axis is None:
            raise SiteError(f"{type(self).__name__}: {self.site} has no head axis; drop heads=")
        self.positions = None if positions is None else jnp.asarray(positions)
        self.heads = None if heads is None else jnp.asarray(heads)

    def __call__(self, value: Array) -> Array:
        new = super().__call__(value)
        mask = selection_mask(self.site, value.shape, self.positions, self.heads)
        return new if mask is None else jnp.where(mask, new, value)


class SetAt(_Selected):
    """Replace the site's value by ``value`` at ``positions`` and ``heads`` (zeros when ``value`` is None).

    ``value`` broadcasts against the site's per-block value (or is stacked over
    blocks, block axis first, when ``layer`` is None), as for ``jstd.Set``.
    ``positions`` index the site's ``seq`` (``query``) axis, ``heads`` its
    ``heads`` (``kv_heads``) axis: an int, a list or int array (traced is
    fine; negatives count from the end), or a boolean mask; None means all.
    """

    value: ArrayLike | None

    def __init__(self, site: str, value: ArrayLike | None = None, *, layer=None, positions=None, heads=None, where=None):
        self._init_selection(site, layer, where, positions, heads)
        self.value = value

    def op(self, value):
        return jnp.zeros_like(value) if self.value is None else jnp.asarray(self.value, value.dtype)


class AddAt(_Selected):
    """Add ``value`` to the site's value at ``positions`` and ``heads`` (as ``SetAt`` selects them)."""

    value: ArrayLike

    def __init__(self, site: str, value: ArrayLike, *, layer=None, positions=None, heads=None, where=None):
        self._init_selection(site, layer, where, positions, heads)
        self.value = value

    def op(self, value):
        return value + jnp.asarray(self.value, value.dtype)


# ---- reading values -----------------------------------------------------------

@functools.partial(jax.jit, static_argnames="reads")
def _read(model, tokens, edits, attention_mask, reads):
    return run(model, tokens, edits, reads=reads, attention_mask=attention_mask)


def read(model, tokens, sites: Sequence[str], edits=(), attention_mask=None):
    """``jax.jit(jstd.run)`` reading ``sites`` (one compile per set of sites and edit structure); returns the Outputs."""
    return _read(model, jnp.asarray(tokens), tuple(edits) if not isinstance(edits, Edit) else (edits,),
                 None if attention_mask is None else jnp.asarray(attention_mask), reads=tuple(sites))


def host_blocks(model, site: str) -> tuple[int, ...] | None:
    """The blocks whose stacked value ``"layers.X"`` holds (None for a site that is not per block)."""
    spec = SITES[parse(site)[0]]
    if not spec.per_block:
        return None
    return tuple(model.layers_with(spec.host.split(".", 1)[1] if "." in spec.host else ""))


def block_entry(model, site: str, stacked: Array, layer) -> Array:
    """The entry of a stacked ``"layers.X"`` value for block ``layer`` (an int or a traced int).

    On families where every block has the site's host (Llama) this is
    ``stacked[layer]``; on hybrids the stack holds only the blocks with the
    host and the entry is found by block index.
    """
    blocks = host_blocks(model, site)
    L = model.config.num_layers
    if isinstance(layer, (int, np.integer)):
        layer = int(layer) % L
        if layer not in blocks:
            raise SiteError(f"block {layer} has no {SITES[parse(site)[0]].host}; blocks with it: {list(blocks)}")
        return stacked[blocks.index(layer)]
    layer = jnp.where(layer < 0, layer + L, layer)
    if blocks == tuple(range(L)):
        return stacked[layer]
    return stacked[jnp.searchsorted(jnp.asarray(blocks), layer)]
