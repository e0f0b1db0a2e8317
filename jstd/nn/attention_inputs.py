"""What each block kind's attention receives: its rotary's cos/sin and its mask.

Blocks of different kinds (``config.layer_types``) may attend differently: a
block whose ``Attention`` has a ``sliding_window`` gets the causal mask narrowed
to its window, and a kind may have its own rotary (Gemma 3's local blocks), so
a stack receives ``self_attn``'s arguments by block kind where they differ.
Bidirectional blocks of tokens (Gemma 3's images) widen the causal mask before
a window narrows it.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jstd.kernels.attention import block_mask, window_mask
from jstd.kernels.rope import Rotary
from jstd.nn.stack import Stack


def attention_inputs(stack: Stack, rotary_for: Callable[[str], Rotary | None], positions, mask, context, seq: int,
                     dtype):
    """``self_attn``'s arguments ``(cos_sin, mask)`` for every block of ``stack``, or block kind -> them where kinds
    differ: a sliding window narrows the mask (indices: the sequence's, ``Context.indices`` on a continued run), a
    kind's own rotary (``rotary_for(kind)``) gives its cos/sin. One ``(cos_sin, mask)`` when every kind has the
    same (no window, one rotary)."""
    cos_sin = {}

    def angles(rotary):
        if rotary not in cos_sin:
            cos_sin[rotary] = None if rotary is None else rotary.cos_sin(positions, dtype)
        return cos_sin[rotary]

    windows, rotaries = {}, {}
    for q, slot in enumerate(stack.slots):
        if slot.has("self_attn"):
            windows.setdefault(stack.kinds[q], slot.attn.sliding_window)
            rotaries.setdefault(stack.kinds[q], rotary_for(stack.kinds[q]))
    if all(w is None for w in windows.values()) and len(set(rotaries.values())) <= 1:
        return angles(next(iter(rotaries.values()), None)), mask
    if context is None:
        index = jnp.arange(seq)[None]
        query_index, key_index = index, index
    else:
        query_index, key_index = context.indices(mask.shape[-1] - seq)
    by_kind = {}
    for kind, window in windows.items():
        narrowed = mask if window is None else mask & window_mask(query_index, key_index, window)
        by_kind[kind] = (angles(rotaries[kind]), narrowed)
    return by_kind


def bidirectional_overlay(blocks: Int[Array, "batch seq"], context, keys: int) -> Bool[Array, "batch 1 seq keys"]:
    """Where the tokens' bidirectional ``blocks`` let a token see a key ``[batch, 1, seq, keys]`` (the keys: a
    context's cached positions, which no block reaches, then the tokens; a block never spans two segments)."""
    same = block_mask(blocks, blocks)
    if context is None:
        return same
    segment, _ = context.segments()
    same = same & (segment[:, :, None] == segment[:, None, :])[:, None]
    return jnp.pad(same, ((0, 0), (0, 0), (0, 0), (keys - blocks.shape[1], 0)))
