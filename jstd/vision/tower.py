"""A ViT vision tower: patch embedding, positions, a stack of blocks, an optional final norm.

    x      = patches(pixel_values) @ patch_embedding (+ bias)      # vision.patch_embeddings [images, grid, hidden]
    x      = [class_embedding; x] + position_embedding              # CLIP prepends a class token
    h      = vision.layers(pre_norm(x))                             # vision.layers.0.layer_input is pre_norm's output
    out    = post_norm(h)                                           # vision.tower_output (no post_norm: h itself)

Values are served with the tower's prefix: ``vision.patch_embeddings``,
``vision.layers.X`` (the same blocks, attention and MLP as the text models,
over ``[images, patches, vision_hidden]`` with no mask: every patch sees every
patch), ``vision.tower_output``. ``VisionModel`` is the tower loaded alone: it
runs on ``Inputs.images["pixel_values"]`` and returns no logits; a
vision-language wrapper holds the same ``VisionTower``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jstd.nn.namemap import Entry
from jstd.nn.model import Model
from jstd.nn.params import param
from jstd.nn.norms import LayerNorm
from jstd.nn.stack import Stack


def resampled_positions(patch_mask: Bool[Array, "images rows columns"], side: int) -> Int[Array, "images grid"]:
    """Each patch's position id when an image's real patches (``patch_mask``) are resampled onto a ``side`` ×
    ``side`` position grid: fractional row and column coordinates bucketized (float32, as transformers does);
    padding patches take position 0. The boundaries are k / side rounded to float32 (torch builds them with
    ``arange``, whose last bits depend on its CPU kernel's vector width; a coordinate within an ulp of a boundary
    may land in the other bucket there)."""
    boundaries = jnp.asarray(np.arange(1, side) / side, jnp.float32)
    rows = patch_mask[:, :, 0].sum(axis=1).astype(jnp.float32)
    cols = patch_mask[:, 0, :].sum(axis=1).astype(jnp.float32)

    def bucket(count, n):
        frac = jnp.arange(n, dtype=jnp.float32)[None, :] * (1.0 / count)[:, None]
        return jnp.searchsorted(boundaries, jnp.minimum(frac, 1.0 - 1e-6), side="right")

    ids = bucket(rows, patch_mask.shape[1])[:, :, None] * side + bucket(cols, patch_mask.shape[2])[:, None, :]
    return jnp.where(patch_mask, ids, 0).reshape(patch_mask.shape[0], -1)


class VisionTower(eqx.Module):
    """Arrays: ``patch_embedding`` [channels·patch·patch, embed] (the conv as a matmul, input in (channel, row,
    column) order), ``patch_bias``, ``class_embedding`` (None without a class token), ``position_embedding``
    [positions, embed], ``pre_norm`` / ``post_norm`` (None where the tower has none), ``layers`` (a Stack)."""

    patch_embedding: Float[Array, "patch_in embed"] = param("patch_in", "embed")
    patch_bias: Float[Array, "embed"] | None = param("embed")
    class_embedding: Float[Array, "embed"] | None = param("embed")
    position_embedding: Float[Array, "positions embed"] = param("positions", "embed")
    pre_norm: LayerNorm | None
    layers: Stack
    post_norm: LayerNorm | None
    patch_size: int = eqx.field(static=True)

    sites: ClassVar[frozenset[str]] = frozenset({"vision.patch_embeddings", "vision.tower_output"})

    def patches(self, pixel_values: Float[Array, "images channels height width"]) -> Float[Array, "images grid patch_in"]:
        """Non-overlapping ``patch_size`` squares in raster order, each flattened as (channel, row, column)."""
        n, c, height, width = pixel_values.shape
        p = self.patch_size
        x = pixel_values.reshape(n, c, height // p, p, width // p, p).transpose(0, 2, 4, 1, 3, 5)
        return x.reshape(n, (height // p) * (width // p), c * p * p)

    def __call__(self, pixel_values: Float[Array, "images channels height width"], tap, streams: tuple[int, ...] = (),
                 patch_mask: Bool[Array, "images rows columns"] | None = None):
        """``(tower_output, [stream, ...], reads)`` for a batch of images: the hidden states ``streams`` names,
        in its order, and the reads by whole name.

        streams: indices into the tower's hidden states as transformers counts them (0: the stream entering
            block 0; k > 0: block k - 1's ``layer_output``, edits included; negative: from the end, -1 the last
            block's output), for projectors that read blocks before the last.
        patch_mask: which patches hold image (NaViT-style towers, Idefics 3): padding patches are masked as keys
            and each image's position ids are its real patch grid resampled onto the tower's (bucketized
            fractional coordinates, as transformers computes them); None: every patch is real.
        """
        s = tap.scope("vision.")
        dtype = self.patch_embedding.dtype
        x = self.patches(pixel_values.astype(dtype)) @ self.patch_embedding
        x = s("patch_embeddings", x if self.patch_bias is None else x + self.patch_bias)
        if self.class_embedding is not None:
            cls = jnp.broadcast_to(self.class_embedding, (x.shape[0], 1, x.shape[2]))
            x = jnp.concatenate([cls, x], axis=1)
        if patch_mask is None:
            x = x + self.position_embedding
            mask = None
        else:
            x = x + self.position_embedding[resampled_positions(patch_mask, self.grid_side)]
            mask = patch_mask.reshape(patch_mask.shape[0], 1, 1, -1)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        depth = self.layers.depth
        wanted = tuple(sorted({i % (depth + 1) for i in streams}))
        kept = tuple(i - 1 for i in wanted if i > 0)
        h, reads, *after = self.layers(x, tap, {"self_attn": (None, mask)}, keep=kept)
        out = s("tower_output", h if self.post_norm is None else self.post_norm(h))
        by_index = {0: x, **{i + 1: v for i, v in zip(kept, after[0] if after else [])}}
        return out, [by_index[i % (depth + 1)] for i in streams], {**s.records, **reads}

    @property
    def grid_side(self) -> int:
        """Patches per side of the square grid the position embedding covers."""
        return math.isqrt(self.position_embedding.shape[0] - (self.class_embedding is not None))

    def name_map(self, path: str, key: str, names: dict) -> list[Entry]:
        """The tower's entries under ``path`` in the model and ``key`` in the checkpoint; ``names``: the
        checkpoint's module names (``pre_norm``, ``post_norm``, ``layers`` and the block's, see ``Block.entries``)."""
        def conv(w):  # [embed, channels, patch, patch] -> [channels·patch·patch, embed]
            return w.reshape(w.shape[0], -1).T

        entries = [Entry("embeddings.patch_embedding.weight", "patch_embedding", conv),
                   Entry("embeddings.position_embedding.weight", "position_embedding")]
        if self.patch_bias is not None:
            entries.append(Entry("embeddings.patch_embedding.bias", "patch_bias"))
        if self.class_embedding is not None:
            entries.append(Entry("embeddings.class_embedding", "class_embedding"))
        for part in ("pre_norm", "post_norm"):
            if getattr(self, part) is not None:
                entries += [e.under(names[part] + ".", part + ".") for e in getattr(self, part).entries()]
        entries = [e.under(key, path + ".") for e in entries]
        return entries + self.layers.name_map(f"{path}.layers", f"{key}{names['layers']}.{{i}}.", lambda kind: names)


def check_pixels(pixels, want: tuple[int, ...], what: str) -> None:
    """Raise ValueError unless ``pixels`` is floating point of shape ``[images, *want]``."""
    if np.ndim(pixels) != len(want) + 1 or tuple(np.shape(pixels)[1:]) != want:
        raise ValueError(f"pixel_values has shape {tuple(np.shape(pixels))}; {what} takes "
                         f"[images, {', '.join(map(str, want))}] (its image processor makes them)")
    dtype = pixels.dtype if hasattr(pixels, "dtype") else np.asarray(pixels).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"pixel_values must be floating point (the processor's normalized pixels), got {dtype}")


class VisionModel(Model):
    """A vision tower loaded alone (``clip_vision_model``, ``siglip_vision_model``): every ``vision.*`` value,
    ``logits`` None."""

    vision: VisionTower

    model_sites: ClassVar[frozenset[str]] = VisionTower.sites

    @property
    def stacks(self) -> dict:
        return {"vision.layers": self.vision.layers}

    def check_inputs(self, inputs) -> None:
        v = self.config.vision
        if inputs.tokens is not None:
            raise ValueError(f"this {self.family} model is a vision tower alone: it takes images, not tokens "
                             "(jstd.Inputs.of(image_processor(images, return_tensors='np')))")
        pixels = None if inputs.images is None else inputs.images.get("pixel_values")
        if pixels is None:
            raise ValueError(f"this {self.family} model runs on images: pass jstd.Inputs(images={{'pixel_values': "
                             f"[images, {v.num_channels}, {v.image_size}, {v.image_size}]}}), e.g. "
                             "jstd.Inputs.of(image_processor(images, return_tensors='np'))")
        check_pixels(pixels, (v.num_channels, v.image_size, v.image_size), "this tower")

    def forward(self, inputs, tap, context=None):
        out, _, reads = self.vision(jnp.asarray(inputs.images["pixel_values"]), tap)
        return None, reads
