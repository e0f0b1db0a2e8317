"""Qwen2-VL's multimodal RoPE positions: three streams (time, height, width) per token, from the prompt's tokens
and its images' grids, exactly as transformers' ``get_rope_index`` computes them.

Along each row, over its real tokens only (padding takes 0 on every stream):

- a text token's three positions are equal: the count of text tokens before it plus, for each image before it,
  ``max(h, w)`` of that image's grid of merged tokens;
- an image's tokens all start at ``start``, the position the next text token would have had: token ``(t, r, c)``
  of its ``t × h × w`` grid of merged tokens (raster order) is at ``(start + t, start + r, start + c)``;
- so text after an image resumes at ``start + max(h, w)``, not ``start + t·h·w``.

The k-th image token of the batch (row-major) belongs to the image the k-th image feature comes from (the
scatter's order), so one static table over the images' tokens gives every image token its offsets; the rest is
cumulative sums over the (traced) tokens, so this jits, with the grids static (``Inputs.layout``).
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jaxtyping import Array, Int


def image_token_table(grids: tuple[tuple[int, int, int], ...], merge: int) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets [image tokens, 3], advance [image tokens])`` over the batch's image tokens in order: each
    token's (time, row, column) in its image's grid of merged tokens, and what the image advances the text
    positions by (``max(h, w)`` on its last token, 0 elsewhere). ``grids``: each image's (t, h, w) in patches."""
    offsets, advance = [], []
    for t, h, w in grids:
        hh, ww = h // merge, w // merge
        tt, rr, cc = np.meshgrid(np.arange(t), np.arange(hh), np.arange(ww), indexing="ij")
        offsets.append(np.stack([tt.ravel(), rr.ravel(), cc.ravel()], axis=-1))
        step = np.zeros(t * hh * ww, np.int64)
        step[-1] = max(hh, ww)
        advance.append(step)
    if not offsets:
        return np.zeros((0, 3), np.int64), np.zeros((0,), np.int64)
    return np.concatenate(offsets).astype(np.int32), np.concatenate(advance).astype(np.int32)


def mrope_positions(
    tokens: Int[Array, "batch seq"], attention_mask: Int[Array, "batch seq"] | None, image_token_id: int,
    grids: tuple[tuple[int, int, int], ...], merge: int,
) -> Int[Array, "3 batch seq"]:
    """The position ids ``[3, batch, seq]`` the text model's rotary reads (see the module docstring).

    ``grids``: each image's (t, h, w) in patches (``image_grid_thw``), in the batch's order; ``merge``: the
    tower's ``spatial_merge_size``. With no grids every token is text (three equal streams counting each row's
    real tokens). The image-token count must match the grids (the wrapper checks it before).
    """
    batch, seq = tokens.shape
    real = jnp.ones((batch, seq), bool) if attention_mask is None else attention_mask.astype(bool)
    offsets, advance = image_token_table(grids, merge)
    image = (tokens == image_token_id) & real if len(advance) else jnp.zeros((batch, seq), bool)
    text = real & ~image
    before = lambda x: jnp.cumsum(x, axis=1) - x  # exclusive sum along the row
    if len(advance):
        k = jnp.clip(jnp.cumsum(image.reshape(-1)) - 1, 0, len(advance) - 1).reshape(batch, seq)
        step = jnp.where(image, jnp.asarray(advance)[k], 0)
        offset = jnp.where(image[..., None], jnp.asarray(offsets)[k], 0)  # [batch, seq, 3]
    else:
        step = jnp.zeros((batch, seq), jnp.int32)
        offset = jnp.zeros((batch, seq, 3), jnp.int32)
    start = before(text.astype(jnp.int32)) + before(step)
    positions = jnp.where(real[..., None], start[..., None] + offset, 0)
    return jnp.moveaxis(positions, -1, 0).astype(jnp.int32)

