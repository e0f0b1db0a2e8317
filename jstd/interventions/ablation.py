"""Ablations: zero, mean and resample, at any editable site, by block, position and head.

Each function returns one edit (a ``jstd.Set`` or ``jstd.Zero``) to pass to ``jstd.run`` with any
others; what it replaces is chosen by ``layer`` (one block, an int or a traced
int; None: every block that has the site), ``positions`` and ``heads`` (see
``jstd.Set``), and an optional boolean ``where``.

    edit = jstd.mean_ablation(model, "layers.mlp.mlp_output", reference_tokens, layer=2)
    out = jstd.run(model, tokens, [edit])

Position 0 is an attention sink with a very large residual norm on Llama-type
models (the family notes), so a mean over positions excludes it by default.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.core.edits import Set, Zero, site_axes
from jstd.core.inputs import as_inputs
from jstd.interventions.reading import read
from jstd.core.sites import SITES, SiteError, parse

IMAGE_SITES = ("vision.", "projector.")  # sites whose positions are patches or image tokens, not the prompt's


def zero_ablation(site: str, *, layer=None, positions=None, heads=None, where=None) -> Zero:
    """Replace ``site`` by zeros at ``layer`` (None: every block), ``positions`` and ``heads``.

    ``jstd.Zero`` itself, named for the ablation family.
    """
    return Zero(site, layer=layer, positions=positions, heads=heads, where=where)


def token_weights(tokens: Int[Array, "batch seq"], attention_mask=None, exclude_first: bool = True) -> Float[Array, "batch seq"]:
    """1 at the positions a mean over positions counts, 0 elsewhere.

    Padding (``attention_mask`` 0) never counts; with ``exclude_first`` the
    first real token of each row (position 0 without padding, the sink) does not
    either.
    """
    traced = any(isinstance(x, jax.core.Tracer) for x in (tokens, attention_mask))
    xp = jnp if traced else np  # concrete inputs: plain numpy, nothing to compile
    real = xp.ones(xp.shape(tokens), bool) if attention_mask is None else xp.asarray(attention_mask).astype(bool)
    if exclude_first:
        real = real & ~((xp.cumsum(real, axis=-1) == 1) & real)
    return real.astype(xp.float32)


def site_mean(
    model, site: str, tokens: Int[Array, "batch seq"], *, layer=None, per_position: bool = False,
    exclude_first: bool = True, attention_mask: Int[Array, "batch seq"] | None = None, edits=(),
) -> Array:
    """The mean of ``site``'s value over the rows (and positions) of a run on ``tokens`` (token ids with
    ``attention_mask``, or a ``jstd.Inputs``; at vision and projector sites every patch and image token counts).

    Returns an array that broadcasts against the site's per-block value (the
    batch and averaged axes kept with size 1), stacked over the blocks that have
    the site when ``layer`` is None and the site is per block.

    per_position False (default): the mean over rows and positions, excluding
    position 0 (the first real token) when ``exclude_first`` and padding always,
    so it broadcasts against any sequence length. per_position True: the mean
    over rows at each position (padding excluded), so position 0 gets the mean
    of position 0; the target's sequence length must then match.
    Sites without a position axis are averaged over rows only.
    Raises SiteError when every position is excluded.
    """
    base, index = parse(site)
    if index is not None:
        layer, site = index, base
    spec = SITES[site]
    if spec.per_block and layer is not None:
        layer = model.check_block(site, layer, f"site_mean at {site}")
    inputs = as_inputs(tokens, attention_mask)
    value = read(model, inputs, (site,), edits)[site]
    stacked = spec.per_block
    off = 1 if stacked else 0
    pos_axis, _ = site_axes(site)
    w = None  # images (a tower's or a wrapper's vision sites): every patch and image token counts
    if pos_axis is not None and inputs.tokens is not None and not site.startswith(IMAGE_SITES):
        w = token_weights(inputs.tokens, inputs.attention_mask, exclude_first and not per_position)
        if not isinstance(w, jax.core.Tracer) and float(w.sum()) == 0:
            raise SiteError(f"the mean of {site} counts no position: every position is padding or excluded (exclude_first)")
    mean = _weighted_mean(value, w, off, pos_axis, per_position)
    if stacked and layer is not None:
        return mean[model.row_of(site, layer)]
    return mean


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _weighted_mean(value, w, batch_axis: int, pos_axis: int | None, per_position: bool):
    """The mean over the batch axis (and the position axis, weighted by ``w`` [batch, seq] or unweighted when
    ``w`` is None), axes kept."""
    x = value.astype(jnp.float32)
    if pos_axis is None or w is None:  # unweighted: over the batch (and every position unless per_position)
        axes = {batch_axis} | ({batch_axis + pos_axis} if pos_axis is not None and not per_position else set())
        return jnp.mean(x, axis=tuple(sorted(axes)), keepdims=True).astype(value.dtype)
    shape = [1] * value.ndim
    shape[batch_axis], shape[batch_axis + pos_axis] = w.shape
    w = w.reshape(shape)
    axes = (batch_axis,) if per_position else (batch_axis, batch_axis + pos_axis)
    mean = jnp.sum(x * w, axis=axes, keepdims=True) / jnp.maximum(jnp.sum(w, axis=axes, keepdims=True), 1)
    return mean.astype(value.dtype)


def mean_ablation(
    model, site: str, reference: Int[Array, "batch seq"], *, layer=None, positions=None, heads=None,
    per_position: bool = False, exclude_first: bool = True, attention_mask: Int[Array, "batch seq"] | None = None,
    where=None,
) -> Set:
    """Replace ``site`` by its mean over a reference batch (``site_mean``), at ``layer``, ``positions``, ``heads``.

    The mean is over the reference rows and, unless ``per_position``, over their
    positions excluding position 0 (``exclude_first``) and padding
    (``attention_mask`` of the reference). With ``layer`` None every block gets
    its own mean.
    """
    value = site_mean(model, site, reference, layer=layer, per_position=per_position, exclude_first=exclude_first,
                      attention_mask=attention_mask)
    return Set(site, value, layer=layer, positions=positions, heads=heads, where=where)


def resample_ablation(
    model, site: str, source: Int[Array, "batch seq"], *, layer=None, positions=None, heads=None,
    key: jax.Array | None = None, attention_mask: Int[Array, "batch seq"] | None = None, where=None,
) -> Set:
    """Replace ``site`` by its value on other inputs (``source``), at ``layer``, ``positions``, ``heads``.

    Row i of the run gets row i of ``source``'s value (a single source row
    broadcasts); with ``key`` the source rows are first shuffled by
    ``jax.random.permutation(key, rows)`` (so pass the run's own tokens as
    ``source`` to resample within a batch). ``source`` must have the run's
    sequence length for sites with a position axis.
    """
    base, index = parse(site)
    if index is not None:
        layer, site = index, base
    stacked = SITES[site].per_block
    if stacked and layer is not None:
        layer = model.check_block(site, layer, f"resample_ablation at {site}")
    value = read(model, source, (site,), (), attention_mask)[site]
    if key is not None:
        axis = 1 if stacked else 0
        value = jnp.take(value, jax.random.permutation(key, value.shape[axis]), axis=axis)
    if stacked and layer is not None:
        value = value[model.row_of(site, layer)]
    return Set(site, value, layer=layer, positions=positions, heads=heads, where=where)
