"""Gemma 3's text model (``model_type`` gemma3_text): Gemma 2's block with per-head q/k norms, local blocks under
their own rotary, and no soft-capped scores.

    q, k   = rope_kind(q_norm(q_proj(a))), rope_kind(k_norm(k_proj(a)))    # (1 + w) RMSNorms over each head
    h      = x + post_attention_layernorm(self_attn(a))
    out    = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    logits = norm(out) @ embed_tokensᵀ                                    # capped only with final_logit_softcapping

``config.layer_types`` gives each block's kind (five ``sliding_attention``
blocks to one ``full_attention`` block on the released checkpoints). The
``rope_parameters`` are nested by kind: local blocks rotate with
``rope_local_base_freq`` (10 000), global ones with ``rope_theta`` (1 000 000)
and the global scaling (``linear``, factor 8, on the 4B-27B checkpoints).
transformers' Gemma 3 attention does not soft-cap its scores, whatever
``attn_logit_softcapping`` says, and neither does jstd.
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.models.gemma2 import Gemma2
from jstd.models.family import rotaries
from jstd.nn.norms import HeadNorm


class Gemma3Text(Gemma2):
    family = "gemma3_text"
    model_types = ("gemma3_text",)

    @classmethod
    def attention(cls, hf, c: ModelConfig, kind: str, dtype) -> Attention:
        norm = lambda: HeadNorm.skeleton(c.head_dim, hf.rms_norm_eps, dtype, unit_offset=True)
        return dataclasses.replace(super().attention(hf, c, kind, dtype), softcap=None, q_norm=norm(), k_norm=norm())

    @classmethod
    def rotary(cls, hf, c: ModelConfig):
        return rotaries(hf, c.head_dim, c.layer_types)[0]

    @classmethod
    def extra(cls, hf) -> dict:
        c = cls.standard_config(hf)
        return {**super().extra(hf), "kind_rotary": rotaries(hf, c.head_dim, c.layer_types)[1]}
