"""OLMo-3 (``model_type`` olmo3): OLMo-2's post-norm block, with sliding-window blocks among full ones.

    h      = x + post_attention_layernorm(self_attn(x))    # q_norm / k_norm over every head at once
    out    = h + post_feedforward_layernorm(mlp(h))
    logits = lm_head(norm(out))

``config.layer_types`` gives each block's kind (three ``sliding_attention``
blocks to one ``full_attention`` block on the released checkpoints): sliding
blocks attend the last ``sliding_window`` keys, itself included. The
``rope_parameters`` are nested by kind (each kind its own rotary; the scaling,
``yarn`` on the long-context checkpoints, is the full blocks').
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.models.family import rotaries
from jstd.models.olmo2 import Olmo2
from jstd.models.qwen3 import layer_kinds


class Olmo3(Olmo2):
    family = "olmo3"
    model_types = ("olmo3",)
    handled = Olmo2.handled | {"sliding_window", "layer_types"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        return layer_kinds(hf, cls.family)

    @classmethod
    def attention(cls, hf, c: ModelConfig, kind: str, dtype) -> Attention:
        return dataclasses.replace(super().attention(hf, c, kind, dtype), sliding_window=cls.window(hf, kind))

    @classmethod
    def rotary(cls, hf, c: ModelConfig):
        return rotaries(hf, c.head_dim, c.layer_types)[0]

    @classmethod
    def extra(cls, hf) -> dict:
        c = cls.standard_config(hf)
        return {**super().extra(hf), "kind_rotary": rotaries(hf, c.head_dim, c.layer_types)[1]}
