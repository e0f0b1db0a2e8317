"""gpt-oss (``model_type`` gpt_oss; gpt-oss-20b, gpt-oss-120b): Llama's block with attention sinks, sliding
blocks alternating with full ones, YaRN rotary and a mixture of experts with a biased router and clamped SwiGLU
experts.

    a   = input_layernorm(x)
    q, k, v = rope(q_proj(a)), rope(k_proj(a)), v_proj(a)                 # biases on q, k, v and o
    p   = softmax([q·kᵀ · head_dim^-0.5 + mask, sink_h])[:-1]            # the head's sink: one more column
    h   = x + o_proj(p @ v)
    y   = post_attention_layernorm(h)
    l   = router(y) (with its bias);  w, e = softmax(top_k(l))            # the top-k logits' softmax
    out = h + Σ_k w_k · (down_e(swiglu(gate_up_e(y))) )                   # each product with its bias
    swiglu(g, u) = (clamp(u, ±limit) + 1) · min(g, limit) · sigmoid(alpha · min(g, limit))

``config.layer_types`` alternates ``sliding_attention`` (the last ``sliding_window`` keys, 128 on the released
checkpoints) and ``full_attention`` blocks. Each RMSNorm multiplies its float32 normed value by the weight and casts
the product (``RMSNorm(weight_in_float32=True)``). The values: ``self_attn.attention_sinks`` (the sink logits),
``self_attn.sink_probability`` (each query's share to the sink, editable), ``attention_probabilities`` over the
real keys (rows sum to ``1 - sink_probability``), ``attention_scores`` without the sink column; the MoE values
of ``jstd.nn.moe`` with ``router_logits`` including the router's bias. The checkpoints' experts are fused and
input-major with gate and up columns interleaved (``experts.gate_up_proj`` ``[experts, hidden, 2 · mlp]``), split
at load. The released hub checkpoints store the experts MXFP4-quantised (``*_blocks`` / ``*_scales``): refused,
with the fix (a dequantised bfloat16 copy).
"""

from __future__ import annotations

from jstd.core.config import ModelConfig
from jstd.models.family import refuse_quantized as family_refuse_quantized
from jstd.models.llama import Llama
from jstd.models.qwen3 import layer_kinds
from jstd.nn.attention import Attention
from jstd.nn.block import LLAMA_NAMES, Block
from jstd.nn.moe import MoEMLP, with_experts
from jstd.nn.norms import RMSNorm

NAMES = {**LLAMA_NAMES, "experts": "interleaved"}


def refuse_quantized(hf, family: str) -> None:
    """ValueError naming an MXFP4-quantised checkpoint (``quantization_config``) and the fix."""
    family_refuse_quantized(hf, family, "its experts are stored as MXFP4 blocks and scales",
                            "use a dequantised copy (load it in transformers with Mxfp4Config(dequantize=True) and "
                            "save_pretrained it, or a published bfloat16 copy such as unsloth/gpt-oss-20b-BF16)")


class GptOss(Llama):
    family = "gpt_oss"
    block_names = NAMES
    model_types = ("gpt_oss",)
    handled = Llama.handled | {"attention_dropout", "sliding_window", "layer_types", "num_local_experts",
                               "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "router_aux_loss_coef",
                               "output_router_logits"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        refuse_quantized(hf, cls.family)
        return with_experts(super().standard_config(hf), hf.num_local_experts, hf.num_experts_per_tok)

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        return layer_kinds(hf, cls.family)

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> RMSNorm:
        return RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype, weight_in_float32=True)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        bias = bool(hf.attention_bias)
        attn = Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5, bias,
                                  bias, dtype, sliding_window=cls.window(hf, kind), sinks=True)
        mlp = MoEMLP.skeleton(c.hidden_size, hf.intermediate_size, hf.num_local_experts, hf.num_experts_per_tok,
                              hf.hidden_act, True, dtype, biases=True, routing="top_k_softmax",
                              swiglu=(hf.swiglu_limit, hf.swiglu_alpha))
        return Block(attention_norm=cls.norm(hf, c, dtype), attn=attn, attention_post_norm=None,
                     mlp_norm=cls.norm(hf, c, dtype), mlp=mlp, mlp_post_norm=None)
