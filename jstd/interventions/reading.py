"""Reading sites with a cached jitted run, and picking one block's entry from a stacked value."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from jstd.interventions.edits import Edit
from jstd.run import run
from jstd.sites import SITES, SiteError, parse


@functools.partial(jax.jit, static_argnames="reads")
def _read(model, tokens, edits, attention_mask, reads):
    return run(model, tokens, edits, reads=reads, attention_mask=attention_mask)


def read(model, tokens, sites: Sequence[str], edits=(), attention_mask=None):
    """``jax.jit(jstd.run)`` reading ``sites`` (one compile per set of sites and edit structure); returns the Outputs."""
    return _read(model, jnp.asarray(tokens), tuple(edits) if not isinstance(edits, Edit) else (edits,),
                 None if attention_mask is None else jnp.asarray(attention_mask), reads=tuple(sites))


def block_entry(model, site: str, stacked: Array, layer) -> Array:
    """The entry of a stacked ``"layers.X"`` value for block ``layer`` (an int or a traced int).

    On families where every block has the site's host (Llama) this is
    ``stacked[layer]``; on hybrids the stack holds only the blocks with the
    host and the entry is found by block index.
    """
    blocks = model.blocks_for(parse(site)[0])
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
