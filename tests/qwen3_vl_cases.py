"""A tiny Qwen3-VL checkpoint: ``config()`` is its transformers config; checkpoints, batches and the torch reference
are the Qwen ViT line's (``qwen_vl_cases.make_qwen_checkpoint``, ``qwen_vl_cases.qwen_images``,
``reference.qwen_vl.QwenVLReference``).

Sizes: the text model is ``qwen_vl_cases.TEXT`` with 3 blocks and q_norm / k_norm over each 16-wide head, under
interleaved M-RoPE (``mrope_section`` [2, 3, 3] of the 8 frequencies: 0, 3, 6 turn with the time, 1, 4, 7 with the
height, 2, 5 with the width). The vision encoder is 32 wide (4 heads of 8, 3 blocks, MLP 48, GELU tanh) on patches
of 4 × 4 pixels × 2 frames, merged 2 × 2; its learned position table is 4 × 4, so the batch's grids (up to 8
patches a side, down to 2) resample it both up and down. DeepStack reads tower blocks 2 and 0 — listed out of
order, so block 0's output goes through ``deepstack_merger_list.1`` and is added after text block 0, block 2's
through ``deepstack_merger_list.0`` after text block 1; text block 2 takes none.
"""

from __future__ import annotations

from transformers import Qwen3_5Config, Qwen3VLConfig

import qwen3_5_cases
import qwen_vl_cases

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
TEXT = dict(qwen_vl_cases.TEXT, num_hidden_layers=3, head_dim=qwen_vl_cases.HEAD_DIM)
VISION = dict(qwen_vl_cases.VISION, hidden_size=32, intermediate_size=48, hidden_act="gelu_pytorch_tanh",
              out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[2, 0])
# Qwen3.5's tower: the same without DeepStack, merged into the Qwen3.5 text model's 32-wide stream
QWEN3_5_VISION = dict({k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}, out_hidden_size=32)


def config() -> Qwen3VLConfig:
    return Qwen3VLConfig(text_config=dict(model_type="qwen3_vl_text", **TEXT, rope_parameters=dict(ROPE)),
                         vision_config=dict(model_type="qwen3_vl", **VISION), tie_word_embeddings=False,
                         **qwen_vl_cases.TOKENS)


def qwen3_5_config() -> Qwen3_5Config:
    """A tiny Qwen3.5 wrapper: ``QWEN3_5_VISION`` and ``qwen3_5_cases``' ``released`` text model cut to one period
    (blocks 0-2 gated DeltaNet, block 3 gated attention; interleaved M-RoPE sections [3, 3, 2] of 8 frequencies)."""
    text = qwen3_5_cases.config("released", num_hidden_layers=4, tie_word_embeddings=False).to_dict()
    return Qwen3_5Config(text_config=text, vision_config=dict(model_type="qwen3_5_vision", **QWEN3_5_VISION),
                         tie_word_embeddings=False, **qwen_vl_cases.TOKENS)


def make_qwen3_5_checkpoint(config, folder, seed: int = 0):
    """``qwen_vl_cases.make_qwen_checkpoint`` with the text model's zero-centred norms and branches set as
    ``qwen3_5_cases.make_checkpoint`` sets them."""
    return qwen_vl_cases.make_qwen_checkpoint(config, folder, seed,
                                              adjust=lambda m: qwen3_5_cases.adjust(m.model.language_model))
