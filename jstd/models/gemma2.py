"""Gemma 2 (``model_type`` gemma2): Gemma's block with a norm after each sublayer too, soft-capped attention
scores and logits, and local (sliding-window) blocks alternating with global ones.

    x      = embed_tokens(ids) · sqrt(hidden)                           # Gemma's scaled embedding
    a      = input_layernorm(x)
    h      = x + post_attention_layernorm(self_attn(a))                  # scores: tanh(s / cap) · cap, cap = 50
    out    = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))     # GeGLU
    logits = tanh(norm(out) @ embed_tokensᵀ / 30) · 30                  # final_logit_softcapping

Every norm is Gemma's ``(1 + w)`` RMSNorm. The score scale is
``query_pre_attn_scalar ** -0.5`` (not ``head_dim``'s). ``config.layer_types``
gives each block's kind: ``sliding_attention`` blocks (the even ones on the
released checkpoints) attend the last ``sliding_window`` keys, itself
included; ``full_attention`` blocks every earlier key.

The values, in the standard vocabulary: ``attention_output`` and
``mlp.mlp_output`` are the post-norms' outputs (what the stream receives);
``mlp_norm_output`` is ``pre_feedforward_layernorm``'s;
``self_attn.attention_scores`` the scores after the cap (and the mask);
``lm_head_output`` the head's output before the final cap and ``logits`` after it
(``project_on_vocab`` caps too; direct logit attribution decomposes the logits
before the cap and says so).
"""

from __future__ import annotations

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.models.family import TextFamily
from jstd.models.gemma import Gemma
from jstd.nn.mlp import GatedMLP
from jstd.models.qwen3 import layer_kinds

GEMMA2_NAMES = {"attention_norm": "input_layernorm", "attn": "self_attn",
                "attention_post_norm": "post_attention_layernorm", "mlp_norm": "pre_feedforward_layernorm",
                "mlp": "mlp", "mlp_post_norm": "post_feedforward_layernorm"}


class Gemma2(Gemma):
    family = "gemma2"
    block_names = GEMMA2_NAMES
    model_types = ("gemma2",)
    handled = (TextFamily.handled - {"hidden_act"}) | {
        "hidden_activation", "attention_bias", "attention_dropout", "query_pre_attn_scalar", "sliding_window",
        "layer_types", "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        return layer_kinds(hf, cls.family)

    @classmethod
    def attention(cls, hf, c: ModelConfig, kind: str, dtype) -> Attention:
        bias = bool(hf.attention_bias)
        return Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                  hf.query_pre_attn_scalar ** -0.5, bias, bias, dtype,
                                  sliding_window=cls.window(hf, kind), softcap=hf.attn_logit_softcapping)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        norm = lambda: cls.norm(hf, c, dtype)
        return Block(attention_norm=norm(), attn=cls.attention(hf, c, kind, dtype), attention_post_norm=norm(),
                     mlp_norm=norm(),
                     mlp=GatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_activation, False, dtype),
                     mlp_post_norm=norm())

    @classmethod
    def extra(cls, hf) -> dict:
        return {**super().extra(hf), "final_logit_softcapping": hf.final_logit_softcapping}
