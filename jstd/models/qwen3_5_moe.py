"""Qwen3.5-MoE's text model (``model_type`` qwen3_5_moe_text): Qwen3.5's hybrid (gated DeltaNet and gated
attention blocks, ``jstd.models.qwen3_5``) with a mixture-of-experts MLP in every block and a shared expert.

    y   = moe(post_attention_layernorm(h))                  # the routed experts' weighted sum
    out = h + y + sigmoid(shared_expert_gate(x)) · shared_expert(x)       # x: the MLP's input

The router's softmax is in float32; the top-k weights are always renormalised and cast to the logits' dtype. The
experts are ``moe_intermediate_size`` wide (``config.intermediate_size`` reports it: the config has no dense
width), the shared expert ``shared_expert_intermediate_size``; ``mlp.shared_expert_output`` is the shared
expert's output after its gate.
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.nn.block import Block
from jstd.nn.moe import MoEMLP, with_experts
from jstd.models.qwen3_5 import Qwen3_5Text


class Qwen3_5MoeText(Qwen3_5Text):
    family = "qwen3_5_moe_text"
    model_types = ("qwen3_5_moe_text",)
    handled = (Qwen3_5Text.handled - {"intermediate_size"}) | {
        "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
        "output_router_logits", "router_aux_loss_coef"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        hf.intermediate_size = hf.moe_intermediate_size  # what TextFamily reads; the experts' width
        try:
            return with_experts(super().standard_config(hf), hf.num_experts, hf.num_experts_per_tok)
        finally:
            del hf.intermediate_size

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        mlp = MoEMLP.skeleton(c.hidden_size, hf.moe_intermediate_size, hf.num_experts, hf.num_experts_per_tok,
                              hf.hidden_act, True, dtype, shared_mlp=hf.shared_expert_intermediate_size)
        return dataclasses.replace(super().block(hf, c, kind, dtype), mlp=mlp)
