"""Qwen1.5-MoE and Qwen2-MoE (``model_type`` qwen2_moe; Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's block (q, k, v
biases with ``qkv_bias``) with a mixture-of-experts MLP and a shared expert behind a sigmoid gate.

    a   = input_layernorm(x)
    h   = x + o_proj(attn(rope(q_proj(a)), rope(k_proj(a)), v_proj(a)))
    y   = post_attention_layernorm(h)
    out = h + Σ_k w_k · expert_e(y) + sigmoid(shared_expert_gate(y)) · shared_expert(y)

The router's softmax is in float32; the top-k weights are renormalised only with ``norm_topk_prob`` (off on the
released checkpoints: the weights are the chosen experts' softmax probabilities, summing to less than 1) and cast to
the logits' dtype. The experts are ``moe_intermediate_size`` wide, the shared expert
``shared_expert_intermediate_size``; ``mlp.shared_expert_output`` is the shared expert's output after its gate.
Block ``i`` has experts unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (Qwen3-MoE's
rule); those blocks (kind ``dense_mlp_…``) have Qwen2's dense MLP ``intermediate_size`` wide. ``layer_types`` marks
the sliding blocks (with ``use_sliding_window``; none on the released checkpoints).
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.models.qwen2 import Qwen2
from jstd.models.qwen3 import layer_kinds
from jstd.models.qwen3_moe import DENSE, MOE_KEYS, has_experts
from jstd.nn.block import Block
from jstd.nn.moe import MoEMLP, with_experts


class Qwen2Moe(Qwen2):
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)
    handled = Qwen2.handled | MOE_KEYS | {"shared_expert_intermediate_size", "qkv_bias", "attention_dropout"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return with_experts(super().standard_config(hf), hf.num_experts, hf.num_experts_per_tok)

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        return tuple(kind if has_experts(hf, i) else DENSE + kind for i, kind in enumerate(layer_kinds(hf, cls.family)))

    @classmethod
    def window(cls, hf, kind: str) -> int | None:
        return super().window(hf, kind.removeprefix(DENSE))

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        block = super().block(hf, c, kind, dtype)
        if not hf.qkv_bias:
            block = dataclasses.replace(block, attn=dataclasses.replace(block.attn, q_bias=None, k_bias=None,
                                                                        v_bias=None))
        if kind.startswith(DENSE):
            return block
        mlp = MoEMLP.skeleton(c.hidden_size, hf.moe_intermediate_size, hf.num_experts, hf.num_experts_per_tok,
                              hf.hidden_act, bool(hf.norm_topk_prob), dtype,
                              shared_mlp=hf.shared_expert_intermediate_size)
        return dataclasses.replace(block, mlp=mlp)
