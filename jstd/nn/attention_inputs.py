"""What each block kind's attention receives: its rotary's cos/sin and its mask.

Blocks of different kinds (``config.layer_types``) may attend differently: a
block whose ``Attention`` has a ``sliding_window`` gets the causal mask narrowed
to its window, and a kind may have its own rotary (Gemma 3's local blocks), so
a stack receives ``self_attn``'s arguments by block kind where they differ.
Bidirectional blocks of tokens (Gemma 3's images) widen the causal mask before
a window narrows it. An attention chunk (Llama 4's local blocks) narrows the mask
as a window does; a kind whose attention tunes its temperature (Llama 4's NoPE
blocks) also receives the tokens' positions.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jstd.kernels.attention import block_mask, chunk_mask, left_padding, window_mask
from jstd.kernels.rope import Rotary
from jstd.nn.stack import Stack


def attention_inputs(stack: Stack, rotary_for: Callable[[str], Rotary | None], positions, mask, context, seq: int,
                     dtype):
    """``self_attn``'s arguments ``(cos_sin, mask)`` for every block of ``stack``, or block kind -> them where kinds
    differ: a sliding window or an attention chunk narrows the mask (indices: the sequence's, ``Context.indices``
    on a continued run; a chunk counted from the row's first real token, ``kernels.attention.left_padding``), a
    kind's own rotary (``rotary_for(kind)``) gives its cos/sin, and a kind whose attention tunes its temperature
    gets the tokens' ``positions`` as a third element. One ``(cos_sin, mask)`` when every kind has the same (no
    window, no chunk, no temperature, one rotary)."""
    cos_sin = {}

    def angles(rotary):
        if rotary not in cos_sin:
            cos_sin[rotary] = None if rotary is None else rotary.cos_sin(positions, dtype)
        return cos_sin[rotary]

    shapes, rotaries = {}, {}
    for q, slot in enumerate(stack.slots):
        if slot.has("self_attn"):
            attn = slot.attn
            shapes.setdefault(stack.kinds[q], (attn.sliding_window, getattr(attn, "attention_chunk", None),
                                               getattr(attn, "temperature", None) is not None))
            rotaries.setdefault(stack.kinds[q], rotary_for(stack.kinds[q]))
    if all(shape == (None, None, False) for shape in shapes.values()) and len(set(rotaries.values())) <= 1:
        return angles(next(iter(rotaries.values()), None)), mask
    if context is None:
        index = jnp.arange(seq)[None]
        query_index, key_index = index, index
    else:
        query_index, key_index = context.indices(mask.shape[-1] - seq)
    by_kind = {}
    for kind, (window, chunk, tuned) in shapes.items():
        narrowed = mask if window is None else mask & window_mask(query_index, key_index, window)
        if chunk is not None:
            narrowed = narrowed & chunk_mask(query_index, key_index, chunk, left_padding(mask))
        by_kind[kind] = (angles(rotaries[kind]), narrowed) + ((positions,) if tuned else ())
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
