"""Reading sites (``jstd.run``, compiled and cached) and a prompt's token strings."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jaxtyping import Array, Int

from jstd.run import Outputs, run


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
