"""Reading sites with a cached jitted run, and picking one block's entry from a stacked value."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from jstd.edits import Edit
from jstd.inputs import as_inputs
from jstd.run import run
from jstd.sites import SITES, SiteError, parse


@functools.partial(jax.jit, static_argnames="reads")
def _read(model, inputs, edits, reads):
    return run(model, inputs, edits, reads=reads)


def read(model, tokens, sites: Sequence[str], edits=(), attention_mask=None):
    """``jax.jit(jstd.run)`` reading ``sites`` (one compile per set of sites and edit structure); returns the Outputs.

    ``tokens``: token ids (with ``attention_mask``), a ``jstd.Inputs`` or a processor output."""
    inputs = as_inputs(tokens, attention_mask)
    inputs = jax.tree.map(jnp.asarray, inputs)
    return _read(model, inputs, tuple(edits) if not isinstance(edits, Edit) else (edits,), reads=tuple(sites))


def block_entry(model, site: str, stacked: Array, layer) -> Array:
    """The entry of a stacked ``"layers.X"`` value for block ``layer`` (an int or a traced int).

    On families where every block has the site's host (Llama) this is
    ``stacked[layer]``; on hybrids the stack holds only the blocks with the
    host and the entry is found by block index.
    """
    blocks = model.blocks_for(parse(site)[0])
    L = model.depth(SITES[parse(site)[0]].stack)
    if isinstance(layer, (int, np.integer)):
        layer = int(layer) % L
        if layer not in blocks:
            raise SiteError(f"block {layer} has no {SITES[parse(site)[0]].host}; blocks with it: {list(blocks)}")
        return stacked[blocks.index(layer)]
    layer = jnp.where(layer < 0, layer + L, layer)
    if blocks == tuple(range(L)):
        return stacked[layer]
    return stacked[jnp.searchsorted(jnp.asarray(blocks), layer)]
