"""Gemma 3's image-text model (``gemma3``) as a tiny conformance case: a SigLIP tower of 6 × 6 patches pooled 2 × 2
into 9 image tokens, a 2-block Gemma 3 text model (a sliding block with a window of 4, shorter than an image, then a
full one), and batches as the processor lays them out (``token_type_ids`` 1 at the image tokens)."""

from __future__ import annotations

import numpy as np
from transformers import Gemma3Config

from families import IMAGE_TOKEN, TOWER, prompts
from sliding_cases import GEMMA

WINDOW = 4
TEXT = dict(model_type="gemma3_text", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, **GEMMA,
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                             "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000.0)})
VISION = dict(model_type="siglip_vision_model", **{**TOWER, "image_size": 48})
TOKENS = 9  # image tokens an image: 36 patches averaged in 2 × 2 squares


def config(**changes) -> Gemma3Config:
    return Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=TOKENS,
                        image_token_index=IMAGE_TOKEN, boi_token_index=94, eoi_token_index=95, **changes)


def images(model, rng, counts) -> dict:
    """A Gemma 3 batch: one tower row per image, ``mm_tokens_per_image`` image tokens each, and the processor's
    ``token_type_ids`` (1 at the image tokens), which transformers needs for the image blocks."""
    v = model.config.vision
    n = sum(counts)
    pixels = rng.normal(size=(n, v.num_channels, v.image_size, v.image_size)).astype(np.float32)
    batch = prompts(model, rng, counts, [model.tokens_per_image] * n)
    return {**batch, "pixel_values": pixels, "token_type_ids": (batch["input_ids"] == IMAGE_TOKEN).astype(np.int64)}
