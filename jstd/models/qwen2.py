"""Qwen2's text model as the Qwen2-VL line uses it (``qwen2_vl_text``, ``qwen2_5_vl_text``): Llama's block whose
q, k and v projections carry a bias (o_proj none), under multimodal RoPE.

    a   = input_layernorm(x)
    h   = x + o_proj(attn(rope(q_proj(a)), rope(k_proj(a)), v_proj(a)))
    out = h + mlp(post_attention_layernorm(h))          # SwiGLU, no biases

Positions are three streams ``[3, batch, seq]`` (time, height, width), folded
into one cos/sin by ``rope_parameters["mrope_section"]`` (``kernels.rope``);
the wrapper computes them from the tokens and the images' grids
(``vision.mrope``) and the model serves them read-only as ``positions``. On a
prompt with no image the three streams are equal and count each row's real
tokens, so the rotation is the ordinary one. The head width is
``hidden_size // num_attention_heads`` (transformers' Qwen2-VL attention
ignores any ``head_dim``) and the score scale its inverse square root.
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.nn.mlp import GatedMLP
from jstd.models.family import TextFamily
from jstd.models.llama import Llama
from jstd.models.qwen3 import layer_kinds


class Qwen2VLText(Llama):
    family = "qwen2_vl_text"
    model_types = ("qwen2_vl_text", "qwen2_5_vl_text")
    # sliding windows act through layer_types, which standard_config checks
    handled = Llama.handled | {"layer_types", "use_sliding_window", "sliding_window", "max_window_layers"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        kinds = set(getattr(hf, "layer_types", None) or ())
        if kinds - {"full_attention"}:
            raise ValueError(f"{hf.model_type}: layer types {sorted(kinds - {'full_attention'})} (use_sliding_window) "
                             "are not supported; jstd runs Qwen2-VL's full-attention blocks")
        c = super().standard_config(hf)
        head_dim = hf.hidden_size // hf.num_attention_heads
        return dataclasses.replace(c, head_dim=head_dim, qk_head_dim=head_dim)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5,
                                    True, False, dtype, sliding_window=cls.window(hf, kind)),
            attention_post_norm=None,
            mlp_norm=cls.norm(hf, c, dtype),
            mlp=GatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, False, dtype),
            mlp_post_norm=None,
        )


class Qwen2(Qwen2VLText):
    """Qwen2 and Qwen2.5 (``model_type`` qwen2): the same block under the ordinary 1-D rotary, whose blocks may be
    ``sliding_attention`` blocks (``config.layer_types``; transformers makes the blocks from
    ``max_window_layers`` on sliding when ``use_sliding_window``): each query then attends the last
    ``sliding_window`` keys, itself included. The released checkpoints have none."""

    family = "qwen2"
    model_types = ("qwen2",)
    handled = TextFamily.handled | {"layer_types", "use_sliding_window", "sliding_window", "max_window_layers"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return super(Qwen2VLText, cls).standard_config(hf)  # Llama's: any layer kind, head_dim as given

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        return layer_kinds(hf, cls.family)
