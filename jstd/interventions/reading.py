"""Reading sites (``jstd.run``, compiled and cached), picking one block's entry from a stacked value, and a
prompt's token strings."""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jstd.run import Outputs, run
from jstd.core.sites import SITES, SiteError, parse


def read(model, tokens, sites: Sequence[str], edits=(), attention_mask=None) -> Outputs:
    """``jstd.run`` reading ``sites`` (compiled once per set of sites, edit structure and shapes); the Outputs.

    ``tokens``: token ids (with ``attention_mask``), a ``jstd.Inputs`` or a processor output."""
    return run(model, tokens, edits, reads=tuple(sites), attention_mask=attention_mask)


def token_strings(tokenizer, text: str | Sequence[int] | Int[Array, "seq"], *,
                  add_special_tokens: bool = True) -> list[str]:
    """Each token of ``text`` (a string, tokenized as ``tokenizer(text)`` does, or one row of token ids) decoded
    alone: ``["<s>", "The", " capital", " of", " France", " is"]``.

    Shows the form a prompt holds — on BPE vocabularies a word after a space is
    its leading-space token (``" Paris"``), which
    ``jstd.get_first_tokens(word, tokenizer, space=True)`` picks — and labels
    positions in figures. ``tokenizer`` may be a processor (its ``.tokenizer``
    is used). Raises ValueError for a batch (pass one row).
    """
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    ids = np.asarray(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"] if isinstance(text, str)
                     else text)
    if ids.ndim != 1:
        raise ValueError(f"token_strings takes one text or one row of token ids, got shape {ids.shape}; "
                        "pass a single row (tokens[0])")
    return [tokenizer.decode([int(i)]) for i in ids]


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
