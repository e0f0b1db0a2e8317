"""Qwen3-MoE (``model_type`` qwen3_moe) and Qwen3-VL-MoE's text model (``qwen3_vl_moe_text``): Qwen3's block with
a mixture-of-experts MLP (``jstd.nn.moe``).

    a   = input_layernorm(x)
    h   = x + o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))   # q_norm, k_norm: RMSNorm over each head
    out = h + moe(post_attention_layernorm(h))                     # or a dense SwiGLU on the mlp_only blocks

The router's softmax is in float32; the top-k weights are renormalised only with ``norm_topk_prob`` on Qwen3-MoE
(always on Qwen3-VL-MoE) and cast to the logits' dtype. Block ``i`` has experts unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; those blocks (kind ``dense_mlp_…``) have Qwen3's
dense MLP ``intermediate_size`` wide, the experts are ``moe_intermediate_size`` wide. With
``use_sliding_window`` every block attends the last ``sliding_window`` keys, as transformers' Qwen3-MoE does.
Qwen3-VL-MoE's text model turns its keys with interleaved M-RoPE, as Qwen3-VL's (``jstd.models.qwen3_vl``).
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.kernels.rope import Rotary
from jstd.kernels.rope_config import rotary_from_config
from jstd.nn.block import Block
from jstd.nn.moe import MoEMLP, with_experts
from jstd.models.qwen3_vl import Qwen3VLText

FULL, SLIDING, DENSE = "full_attention", "sliding_attention", "dense_mlp_"
MOE_KEYS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
                      "router_aux_loss_coef"})


def has_experts(hf, i: int) -> bool:
    """Whether block ``i`` has the experts (transformers' rule for Qwen3-MoE and Qwen3-VL-MoE)."""
    step = getattr(hf, "decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{hf.model_type}: config.json's decoder_sparse_step={step!r} must be a positive int (every "
                         "decoder_sparse_step-th block has the experts; 1: every block); set it to the checkpoint's")
    return (i not in (getattr(hf, "mlp_only_layers", None) or ()) and hf.num_experts > 0 and (i + 1) % step == 0)


class Qwen3VLMoeText(Qwen3VLText):
    family = "qwen3_vl_moe_text"
    model_types = ("qwen3_vl_moe_text",)
    handled = Qwen3VLText.handled | MOE_KEYS
    always_normalize = True

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return with_experts(super().standard_config(hf), hf.num_experts, hf.num_experts_per_tok)

    @classmethod
    def window(cls, hf, kind: str) -> int | None:
        return cls.sliding_window(hf) if kind.endswith(SLIDING) else None

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        attention = SLIDING if getattr(hf, "sliding_window", None) is not None else FULL
        return tuple(attention if has_experts(hf, i) else DENSE + attention for i in range(hf.num_hidden_layers))

    @classmethod
    def moe(cls, hf, c: ModelConfig, dtype) -> MoEMLP:
        return MoEMLP.skeleton(c.hidden_size, hf.moe_intermediate_size, hf.num_experts, hf.num_experts_per_tok,
                               hf.hidden_act, cls.always_normalize or bool(hf.norm_topk_prob), dtype)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        # Qwen3's block (its attention windowed by ``window``), with the dense MLP intermediate_size wide
        block = super().block(hf, c, kind, dtype)
        return block if kind.startswith(DENSE) else dataclasses.replace(block, mlp=cls.moe(hf, c, dtype))


class Qwen3Moe(Qwen3VLMoeText):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
    handled = Qwen3VLMoeText.handled | {"use_sliding_window", "sliding_window"}
    always_normalize = False

    @classmethod
    def rotary(cls, hf, c: ModelConfig) -> Rotary | None:
        return rotary_from_config(hf, c.head_dim)
