"""Qwen3.5's text model (``model_type`` qwen3_5_text): gated DeltaNet and gated softmax attention blocks.

    # every block: pre-norm, as Llama; the mixer by config.layer_types
    h   = x + mixer(input_layernorm(x))         # linear_attn (gated DeltaNet) or self_attn (gated attention)
    out = h + mlp(post_attention_layernorm(h))  # SwiGLU
    logits = lm_head(norm(out))

``config.layer_types`` gives each block's kind (``linear_attention`` on three
blocks in four, ``full_attention`` on every fourth on the released
checkpoints); the stack scans one period of kinds per step
(``jstd.nn.stack``). What differs from OLMo-Hybrid:

- Every RMSNorm of the stream and the attention's ``q_norm`` / ``k_norm`` is
  zero-centred: it multiplies by ``1 + weight`` (formed in float32 and applied
  before the cast back). The DeltaNet's gated output norm is not (``weight``,
  ones at init, applied after the cast, with ``rms_norm_eps``).
- The DeltaNet's projections are fused in the checkpoint (``in_proj_qkv``,
  ``in_proj_z`` the output gate, ``in_proj_a``, ``in_proj_b``, one ``conv1d``;
  ``GatedDeltaNet``'s ``fused`` layout). Betas are ``sigmoid(b)`` in (0, 1).
  With fewer key heads than value heads each query/key head serves
  ``value_heads // key_heads`` consecutive value heads; ``attention_queries``
  and ``attention_keys`` hold the key heads.
- The attention is ``GatedAttention``: ``q_proj`` emits each head's query and
  output gate side by side; ``q_norm`` / ``k_norm`` norm each head
  (``head_dim`` wide); ``attention_head_outputs`` is before the gate,
  ``attention_premix`` after it (what ``o_proj`` receives). No site holds the
  gate itself.
- The rotary turns the first ``partial_rotary_factor · head_dim`` channels of
  each head (a quarter on the released checkpoints) and is multimodal with
  interleaved streams (``rope_parameters["mrope_section"]``; transformers
  interleaves whatever ``mrope_interleaved`` says). A text prompt's three
  streams are equal, so the rotation is the ordinary one; the model serves
  them as ``positions``.

Mixture-of-experts Qwen3.5 (``qwen3_5_moe_text``) is ``jstd.models.qwen3_5_moe``.
"""

from __future__ import annotations

from jstd.kernels.rope_config import rotary_from_config
from jstd.models.family import HybridTextFamily
from jstd.nn.deltanet import GatedDeltaNet
from jstd.nn.gated_attention import GatedAttention
from jstd.nn.block import LLAMA_NAMES, Block
from jstd.nn.mlp import GatedMLP
from jstd.nn.norms import RMSNorm

LINEAR, FULL = HybridTextFamily.LINEAR, HybridTextFamily.FULL


class Qwen3_5Text(HybridTextFamily):
    family = "qwen3_5_text"
    model_types = ("qwen3_5_text",)
    handled = HybridTextFamily.handled | {"attention_bias", "attention_dropout"}  # dropout: none at inference

    @classmethod
    def rotary(cls, hf, c):
        return rotary_from_config(hf, c.head_dim, mrope_interleaved=True)

    @classmethod
    def norm(cls, hf, c, dtype) -> RMSNorm:
        return RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype, unit_offset=True)

    @classmethod
    def block(cls, hf, c, kind, dtype) -> Block:
        if kind == LINEAR:
            mixer = GatedDeltaNet.skeleton(
                c.hidden_size, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                hf.linear_value_head_dim, hf.linear_conv_kernel_dim, hf.hidden_act, False, hf.rms_norm_eps, dtype)
        else:
            mixer = GatedAttention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                            c.head_dim ** -0.5, bool(hf.attention_bias), dtype, hf.rms_norm_eps, True)
        mlp = GatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, False, dtype)
        return Block(attention_norm=cls.norm(hf, c, dtype), attn=mixer, attention_post_norm=None,
                     mlp_norm=cls.norm(hf, c, dtype), mlp=mlp, mlp_post_norm=None)

    @classmethod
    def names(cls, hf, kind) -> dict:
        if kind == LINEAR:
            return {**LLAMA_NAMES, "attn": "linear_attn", "linear_attn_layout": "fused"}
        return LLAMA_NAMES

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # multi-token-prediction heads (transformers ignores them too)
        return ("mtp.*",) + super().ignored(hf)
