"""Tiny gpt-oss checkpoints and their torch reference (attention sinks, the biased router, clamped SwiGLU experts).

Sizes: 64 wide (4 heads of 16 over 2 key/value heads), 3 blocks alternating sliding (window 4, shorter than the
suite's 11 tokens) and full attention, vocabulary 97, 8 experts 32 wide, top-2, YaRN rotary. ``gpt_oss`` has
``swiglu_limit`` 1.5 (the clamps bite on about a third of the gate and up values) and sink logits of O(1)
(a sink takes a visible share of each row); ``gpt_oss-released`` the released numbers (limit 7, alpha 1.702)
and a tied head.

``GptOssReference`` is ``MoEReference`` (the MoE values from transformers' own router and experts loop); the
harness' capturing attention takes gpt-oss' sink column where the attention module has ``sinks``
(``reference.harness.sunk``): it taps ``attention_sinks``, the scores without the sink column,
``sink_probability`` (an edited one re-normalises the keys: the softmax over the keys alone times
``1 - sink_probability``, jstd's definition) and the probabilities over the keys.
"""

from __future__ import annotations

import torch
from transformers import GptOssConfig

from reference.checkpoints import make_checkpoint
from reference.moe import PLAN, MoEReference

BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
            max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                 truncate=False, original_max_position_embeddings=64))
CASES = {
    "": dict(swiglu_limit=1.5),
    "released": dict(tie_word_embeddings=True),
}
SINK_SITES = ("layers.self_attn.attention_sinks", "layers.self_attn.sink_probability")
# gpt-oss' MLP returns (output, router scores)
GPT_OSS_PLAN = {**PLAN, "layers.mlp.mlp_output": ("model.layers.{i}.mlp", "out0")}


def config(case: str = "") -> GptOssConfig:
    return GptOssConfig(**BASE, **CASES[case])


def make(config, folder, seed: int = 0):
    """``make_checkpoint`` with sink logits of O(1) (``randomize`` gives vectors 0.1 · normal)."""
    def adjust(model):
        for layer in model.model.layers:
            layer.self_attn.sinks.mul_(15.0)
    return make_checkpoint(config, folder, seed, adjust=adjust)


class GptOssReference(MoEReference):
    """transformers' gpt-oss (eager attention and experts) with every value jstd serves, sinks included."""

    def __init__(self, folder, dtype=torch.float32, plan=GPT_OSS_PLAN):
        super().__init__(folder, dtype, plan)

    def sites(self):
        return super().sites() + SINK_SITES
