"""Llama (``model_type`` llama): the family the standard vocabulary is taken from.

    h   = x + self_attn(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))

Grouped-query attention with queries and keys read after the rotary embedding
(every rope variant transformers has for llama), optional attention and MLP
biases, tied embeddings (``lm_head`` is None and the head is ``embed.T``: one
array), ``head_dim`` independent of ``hidden_size / heads``. The model is a
``CausalLM``; this declaration gives its block.
"""

from __future__ import annotations

from jstd.core.config import ModelConfig
from jstd.models.family import TextFamily
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.nn.mlp import GatedMLP


class Llama(TextFamily):
    family = "llama"
    model_types = ("llama",)
    # pretraining_tp only split torch's matmuls (transformers 5 ignores it too)
    handled = TextFamily.handled | {"attention_bias", "mlp_bias", "pretraining_tp"}

    @classmethod
    def attention_scale(cls, hf, c: ModelConfig) -> float:
        return c.head_dim ** -0.5

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        bias = bool(getattr(hf, "attention_bias", False))
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                    cls.attention_scale(hf, c), bias, bias, dtype,
                                    sliding_window=cls.window(hf, kind)),
            attention_post_norm=None,
            mlp_norm=cls.norm(hf, c, dtype),
            mlp=GatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act,
                                  bool(getattr(hf, "mlp_bias", False)), dtype),
            mlp_post_norm=None,
        )
