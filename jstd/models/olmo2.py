"""OLMo-2 (``model_type`` olmo2): post-norm blocks with whole-width q/k norms.

    h      = x + post_attention_layernorm(self_attn(x))     # no norm before the attention
    out    = h + post_feedforward_layernorm(mlp(h))         # nor before the MLP (SwiGLU)
    q, k   = rope(q_norm(q_proj(x))), rope(k_norm(k_proj(x)))   # q_norm, k_norm: over every head at once
    logits = lm_head(norm(out))

Unlike Llama, ``post_attention_layernorm`` is the norm *after* the attention:
its output is what the block adds (``self_attn.attention_output``), and
``post_feedforward_layernorm``'s is ``mlp.mlp_output``; the block has no
``attention_norm_output`` nor ``mlp_norm_output`` (the sublayers read the
stream itself), and ``layer_input + attention_output + mlp_output ==
layer_output`` holds exactly. Every RMSNorm multiplies its weight with the
float32 normed value before the cast back (``weight_in_float32``); the rotary's
cos/sin stay float32 whatever the dtype, and the rotated q/k are cast back
(``rotary_in_float32``). ``Olmo2.block`` serves OLMo-3's blocks too.
"""

from __future__ import annotations

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.models.family import TextFamily
from jstd.nn.mlp import GatedMLP
from jstd.nn.norms import RMSNorm

# a post-norm block's module names: post_attention_layernorm is the norm after the attention here
OLMO2_NAMES = {"attn": "self_attn", "attention_post_norm": "post_attention_layernorm", "mlp": "mlp",
               "mlp_post_norm": "post_feedforward_layernorm"}


class Olmo2(TextFamily):
    family = "olmo2"
    block_names = OLMO2_NAMES
    model_types = ("olmo2",)
    handled = TextFamily.handled | {"attention_bias", "attention_dropout"}

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> RMSNorm:
        return RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype, weight_in_float32=True)

    @classmethod
    def extra(cls, hf) -> dict:
        return {"rotary_in_float32": True}  # OLMo's rotary module returns float32 cos/sin whatever the dtype

    @classmethod
    def attention(cls, hf, c: ModelConfig, kind: str, dtype) -> Attention:
        """The attention of a block of ``kind``: whole-projection q/k norms, biases as ``attention_bias``."""
        bias = bool(getattr(hf, "attention_bias", False))
        return Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5,
                                  bias, bias, dtype, qk_norm_eps=hf.rms_norm_eps)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        return Block(attention_norm=None, attn=cls.attention(hf, c, kind, dtype),
                     attention_post_norm=cls.norm(hf, c, dtype), mlp_norm=None,
                     mlp=GatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, False, dtype),
                     mlp_post_norm=cls.norm(hf, c, dtype))
