"""OLMoE (``model_type`` olmoe): Llama's block with OLMo's q/k norms over the whole projections and a
mixture-of-experts MLP (``jstd.nn.moe``) in every block.

    a   = input_layernorm(x)
    q   = rope(q_norm(q_proj(a)))        # q_norm over all heads at once (hidden_size wide), before the split
    k   = rope(k_norm(k_proj(a)))        # k_norm over all key heads at once
    h   = x + o_proj(attn(q, k, v_proj(a)))
    out = h + moe(post_attention_layernorm(h))

Every RMSNorm is Llama's (normed value cast to the dtype, then the weight). The router's softmax is in float32;
the top-k weights are renormalised only with ``norm_topk_prob`` (off on the released checkpoints) and cast to
the logits' dtype; experts are ``intermediate_size`` wide. ``clip_qkv`` (a clamp of q, k, v) is refused.
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.models.llama import Llama
from jstd.nn.moe import MoEMLP, with_experts
from jstd.nn.norms import RMSNorm


class Olmoe(Llama):
    family = "olmoe"
    model_types = ("olmoe",)
    handled = Llama.handled | {"attention_dropout", "clip_qkv", "num_experts", "num_local_experts",
                               "num_experts_per_tok", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return with_experts(super().standard_config(hf), hf.num_experts, hf.num_experts_per_tok)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        if getattr(hf, "clip_qkv", None) is not None:
            raise ValueError(f"olmoe: clip_qkv={hf.clip_qkv} (a clamp of the queries, keys and values) is not "
                             "supported; use a checkpoint whose config has clip_qkv null (the released OLMoE ones)")
        block = super().block(hf, c, kind, dtype)
        # transformers sizes q_norm hidden_size wide and k_norm (hidden_size // heads) · kv_heads wide
        q_norm = RMSNorm.skeleton(hf.hidden_size, hf.rms_norm_eps, dtype)
        k_norm = RMSNorm.skeleton(hf.hidden_size // hf.num_attention_heads * c.num_kv_heads, hf.rms_norm_eps, dtype)
        attn: Attention = dataclasses.replace(block.attn, q_norm=q_norm, k_norm=k_norm)
        mlp = MoEMLP.skeleton(c.hidden_size, hf.intermediate_size, hf.num_experts, hf.num_experts_per_tok,
                              hf.hidden_act, bool(hf.norm_topk_prob), dtype)
        return dataclasses.replace(block, attn=attn, mlp=mlp)
