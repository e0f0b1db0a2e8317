"""Tiny Qwen-ViT vision-language checkpoints: Qwen2-VL, Qwen2.5-VL and HyperCLOVA X Vision V2.

``CONFIGS[name]()`` is the transformers config of a case; ``make_qwen_checkpoint(config, folder)`` saves a random
float32 wrapper for it; ``qwen_images(model, rng, counts)`` is a batch in the processor's layout (``pixel_values``
[patches, C·T·p·p] of every image concatenated, ``image_grid_thw`` [images, 3] in patches), image ``k`` of the batch
cut into ``GRIDS[k % len(GRIDS)]``.

Sizes: the text model is 64 wide (4 heads of 16 over 2 key/value heads, 2 blocks, vocabulary 97 whose last id, 96,
is the image token; 95 the video token). The vision encoder is 32 wide (4 heads of 8, 3 blocks, MLP 48; Qwen2-VL's
96, as its config's ``mlp_ratio`` must be an int) on patches of
4 × 4 pixels × 2 frames, merged 2 × 2 into one image token. Qwen2.5-VL's windows are 16 pixels: 2 × 2 merge blocks,
16 patches; block 1 attends over whole images. HyperCLOVA X Vision V2's merger outputs 48 wide, so its linear
projector 48 → 64 is visible.
"""

from __future__ import annotations

import numpy as np
from transformers import HyperCLOVAXVisionV2Config, Qwen2_5_VLConfig, Qwen2VLConfig

from reference.wrapper import make_wrapper_checkpoint

IMAGE_TOKEN = 96
VIDEO_TOKEN = 95
HEAD_DIM = 16
TEXT = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
# M-RoPE: of the 8 rotary frequencies, 2 turn with the temporal position, 3 with the height, 3 with the width
QWEN_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
VISION = dict(depth=3, num_heads=4, in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
QWEN2_5_VISION = dict(**VISION, hidden_size=32, intermediate_size=48, hidden_act="silu", window_size=16,
                      fullatt_block_indexes=[1])
HYPERCLOVAX_TEXT = dict(use_post_norm=True, embedding_multiplier=2.0, residual_multiplier=0.5,
                        attention_multiplier=0.3, logits_scaling=0.5)
TOKENS = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN)


def qwen2_vl_config() -> Qwen2VLConfig:
    return Qwen2VLConfig(
        text_config=dict(model_type="qwen2_vl_text", **TEXT, rope_parameters=dict(QWEN_ROPE)),
        vision_config=dict(model_type="qwen2_vl_vision", **VISION, embed_dim=32, mlp_ratio=3,
                           hidden_act="quick_gelu", hidden_size=64),
        tie_word_embeddings=False, **TOKENS)


def qwen2_5_vl_config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config=dict(model_type="qwen2_5_vl_text", **TEXT, rope_parameters=dict(QWEN_ROPE)),
        vision_config=dict(model_type="qwen2_5_vl_vision", **QWEN2_5_VISION, out_hidden_size=64),
        tie_word_embeddings=False, **TOKENS)


def hyperclovax_vision_v2_config() -> HyperCLOVAXVisionV2Config:
    return HyperCLOVAXVisionV2Config(
        text_config=dict(model_type="hyperclovax", **TEXT, **HYPERCLOVAX_TEXT,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False),
        vision_config=dict(model_type="qwen2_5_vl_vision", **QWEN2_5_VISION, out_hidden_size=48),
        tie_word_embeddings=False, **TOKENS)


CONFIGS = {
    "qwen2_vl": qwen2_vl_config,
    "qwen2_5_vl": qwen2_5_vl_config,
    "hyperclovax_vision_v2": hyperclovax_vision_v2_config,
}

# image grids (t, h, w) in patches, image k of a batch taking GRIDS[k % len(GRIDS)]: a wide one (windows cut short on
# the right), a tall one, a single image token, and one of two whole windows
GRIDS = ((1, 4, 6), (1, 6, 4), (1, 2, 2), (1, 8, 4))


# the patch Conv3d to its fan-in, the merger's ln_q a norm's scale (see make_wrapper_checkpoint)
make_qwen_checkpoint = make_wrapper_checkpoint


def qwen_images(model, rng, counts) -> dict:
    """A batch for rows holding ``counts[r]`` images: ``input_ids``/``attention_mask`` from ``families.prompts``
    (t·h·w/4 image tokens per image, text between, the last row left-padded by two), ``pixel_values`` float32
    [patches of all images, 3·2·4·4] standard normal and ``image_grid_thw`` int64 [images, 3]. ``model`` is not
    read."""
    from families import prompts

    n = sum(counts)
    grids = np.array([GRIDS[k % len(GRIDS)] for k in range(n)], np.int64)
    patches = grids.prod(-1)
    arrays = prompts(model, rng, counts, [int(p) // 4 for p in patches])
    pixels = rng.standard_normal((int(patches.sum()), 3 * 2 * 4 * 4)).astype(np.float32)
    return {**arrays, "pixel_values": pixels, "image_grid_thw": grids}
