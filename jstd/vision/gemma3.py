"""Gemma 3 (``gemma3``, transformers' ``Gemma3ForConditionalGeneration``): a SigLIP tower, a pooling projector, the
Gemma 3 text model, and bidirectional attention among each image's tokens.

    vision.tower_output = tower(pixel_values)             # SigLIP: post_layernorm on every patch, no class token
    projector.input     = vision.tower_output             # [images, patches, vision_hidden]
    pooled              = avg_pool(projector.input)       # the patch grid averaged in k × k squares to
                                                          #   mm_tokens_per_image tokens (row-major, as AvgPool2d)
    projector.output    = mm_soft_emb_norm(pooled) @ mm_input_projection_weight   # (1 + w) RMSNorm, bias-free
    vision.image_features = projector.output flattened over the images      # [images · mm_tokens_per_image, hidden]
    h0 = scatter(embed_tokens(ids), ids == image_token_id, vision.image_features)

``embed_tokens`` scales the text rows by ``sqrt(hidden)`` (Gemma's embedding module); the image features are
scattered *after* it, unscaled, as transformers does: ``token_embeddings`` is the scaled lookup at every position
and ``layers.0.layer_input`` holds the features themselves at the image tokens.

Bidirectional images. Each run of consecutive image tokens is one block (transformers numbers them from the
processor's ``token_type_ids``, which are 1 exactly at the image tokens, so jstd numbers the same runs from the
tokens). In every text block, full and sliding alike, a token of an image attends to every token of its own image,
later ones included, and causally to everything before; it never sees a later image or later text. A sliding window
still bounds the earlier keys (transformers: ``sliding AND (causal OR same image)``), so a window shorter than an
image hides the image's first tokens from its last ones but not the reverse. ``self_attn.attention_probabilities``
shows it. Left padding, ``jstd.Context`` (the blocks of the run's own segments; a cached position is earlier and
never reached by a later token's block) and ``jstd.generate`` (the images are in the prefill; decoded tokens attend
causally) keep it. Transformers run *without* ``token_type_ids`` attends causally among the image tokens, which is
not how the model was trained; jstd always applies the blocks, so it equals transformers run on the processor's
whole output.

Pan and scan (``do_pan_and_scan``): the processor's crops are extra images (rows of ``pixel_values``), each with
its own run of image tokens in the prompt, so each crop is its own block.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jstd.kernels.attention import bidirectional_blocks
from jstd.nn.params import param, shape
from jstd.nn.namemap import Entry
from jstd.nn.norms import RMSNorm
from jstd.vision.llava import LLAVA_KEYS, LLAVA_STORED
from jstd.vision.wrapper import VisionLanguageModel, WrapperFamily


class PooledProjector(eqx.Module):
    """Gemma 3's multimodal projector: the square patch grid averaged over ``kernel`` × ``kernel`` squares (in
    float32, cast back), a ``(1 + w)`` RMSNorm, and a bias-free linear stored ``[vision_hidden, hidden]``."""

    norm: RMSNorm
    weight: Float[Array, "projector_in hidden"] = param("projector_in", "projector_hidden")
    kernel: int = eqx.field(static=True)

    def pool(self, x: Float[Array, "images patches width"]) -> Float[Array, "images tokens width"]:
        n, patches, width = x.shape
        side = int(round(patches ** 0.5))
        k, out = self.kernel, side // self.kernel
        grid = x.astype(jnp.float32).reshape(n, out, k, out, k, width)
        return grid.mean(axis=(2, 4)).reshape(n, out * out, width).astype(x.dtype)

    def __call__(self, x: Float[Array, "images patches width"]) -> Float[Array, "images tokens hidden"]:
        return (self.norm(self.pool(x)) @ self.weight).astype(x.dtype)

    def entries(self, names=None) -> list[Entry]:
        return [Entry("mm_input_projection_weight", "weight"),
                *(e.under("mm_soft_emb_norm.", "norm.") for e in self.norm.entries())]

    @classmethod
    def skeleton(cls, width: int, hidden: int, kernel: int, eps: float, dtype) -> "PooledProjector":
        return cls(RMSNorm.skeleton(width, eps, dtype, unit_offset=True), shape(width, hidden, dtype=dtype), kernel)


class Gemma3Model(VisionLanguageModel):
    """``tokens`` image tokens an image (``mm_tokens_per_image``); each image's tokens one bidirectional block."""

    tokens: int = eqx.field(static=True, default=256)

    @property
    def tokens_per_image(self) -> int:
        return self.tokens

    def attention_blocks(self, image_mask: Bool[Array, "batch seq"]) -> Int[Array, "batch seq"]:
        return bidirectional_blocks(image_mask)


def pool_kernel(hf) -> int:
    """The projector's pooling square: patches per side over tokens per side; ValueError where the config's
    ``mm_tokens_per_image`` is no square that divides the patch grid."""
    side = hf.vision_config.image_size // hf.vision_config.patch_size
    tokens = hf.mm_tokens_per_image
    per_side = int(round(tokens ** 0.5))
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(f"gemma3: mm_tokens_per_image={tokens} must be a square whose side divides the tower's "
                         f"{side} × {side} patch grid (image_size // patch_size)")
    return side // per_side


class Gemma3(WrapperFamily):
    family = "gemma3"
    model_types = ("gemma3",)
    # boi/eoi: the processor's tokens around each image, ordinary text to the model
    handled = WrapperFamily.handled | {"mm_tokens_per_image", "boi_token_index", "eoi_token_index"}
    model_class = Gemma3Model
    keys = LLAVA_KEYS

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        return LLAVA_STORED  # transformers converts Gemma 3's hub layout as Llava's

    @classmethod
    def projector(cls, hf, dtype) -> PooledProjector:
        return PooledProjector.skeleton(hf.vision_config.hidden_size, hf.text_config.hidden_size, pool_kernel(hf),
                                        hf.vision_config.layer_norm_eps, dtype)

    @classmethod
    def projector_entries(cls, hf, projector) -> list[Entry]:
        return [e.under(cls.keys["projector"], "projector.") for e in projector.entries()]

    @classmethod
    def extra(cls, hf) -> dict:
        pool_kernel(hf)
        return {"tokens": hf.mm_tokens_per_image}
