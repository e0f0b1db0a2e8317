"""Phi-3.5-MoE (``model_type`` phimoe): Mixtral's block with LayerNorms, biased attention projections, a biased
head and sparsemixer routing.

    a      = input_layernorm(x)                                  # LayerNorm (weight and bias), eps rms_norm_eps
    h      = x + o_proj(attn(rope(q_proj(a)), rope(k_proj(a)), v_proj(a)))       # biases with attention_bias
    y      = post_attention_layernorm(h)
    w, e   = sparsemixer(router(y))                              # two experts a token (kernels.moe.sparsemixer)
    out    = h + Σ_k w_k · expert_e(y)                           # SwiGLU experts intermediate_size wide
    logits = norm(out) @ lm_head + lm_head_bias                  # with lm_head_bias

The routing is what transformers' ``sparsemixer`` does at inference (``training`` False; the Gumbel sampling and
Heun's-method gradient are training only): the top expert by argmax, weighted by its softmax probability over the
experts within ``2 · router_jitter_noise`` (relative) of the top; then the best of the rest, weighted the same way
among the experts near it, the first excluded. The weights are not renormalised (they sum to less than 1) and are
cast to the logits' dtype. ``input_jitter_noise`` acts in training only. ``sliding_window`` (131072 on the released
checkpoint) makes every block attend the last ``sliding_window`` keys. The rotary: transformers' Phi-MoE rotary
always takes the ``short_factor`` frequencies of a ``longrope`` config and scales cos/sin by ``short_mscale`` (by
``long_mscale`` past ``original_max_position_embeddings``: equal on the released checkpoint; a config where they
differ is refused). Hub checkpoints spell the MLP ``block_sparse_moe`` with ``gate.weight`` and experts
``w1`` / ``w3`` / ``w2``; transformers 5's in-memory names (``mlp.router``, ``mlp.experts.gate_up_proj``) load too.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx

from jstd.core.config import ModelConfig
from jstd.kernels.rope import Rotary
from jstd.models.mixtral import FULL, SLIDING, Mixtral
from jstd.nn.attention import Attention
from jstd.nn.block import LLAMA_NAMES, Block
from jstd.nn.causal_lm import CausalLM
from jstd.nn.moe import MoEMLP
from jstd.nn.namemap import Entry
from jstd.nn.norms import LayerNorm
from jstd.nn.params import shape


class Phimoe(Mixtral):
    family = "phimoe"
    model_types = ("phimoe",)
    handled = Mixtral.handled | {"attention_bias", "lm_head_bias", "input_jitter_noise"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        return (FULL if getattr(hf, "sliding_window", None) is None else SLIDING,) * hf.num_hidden_layers

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> LayerNorm:
        return LayerNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype)

    @classmethod
    def rotary(cls, hf, c: ModelConfig) -> Rotary | None:
        rotary = super().rotary(hf, c)
        params = getattr(hf, "rope_parameters", None) or {}
        if params.get("rope_type", "default") == "default":
            return rotary
        short, long = params.get("short_mscale"), params.get("long_mscale")
        if short != long:
            raise ValueError(f"phimoe: rope short_mscale={short} and long_mscale={long} differ (transformers switches "
                             "between them at original_max_position_embeddings); jstd serves Phi-MoE configs whose "
                             "two are equal (the released Phi-3.5-MoE's)")
        # transformers' Phi-MoE rotary recomputes the short_factor frequencies on every call (no long ones)
        return dataclasses.replace(rotary, rope_type="default", long_inv_freq=None, attention_scaling=float(short))

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        bias = bool(hf.attention_bias)
        attn = Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5, bias,
                                  bias, dtype, sliding_window=cls.window(hf, kind))
        mlp = MoEMLP.skeleton(c.hidden_size, hf.intermediate_size, hf.num_local_experts, hf.num_experts_per_tok,
                              hf.hidden_act, False, dtype, routing="sparsemixer", jitter_eps=hf.router_jitter_noise)
        return Block(attention_norm=cls.norm(hf, c, dtype), attn=attn, attention_post_norm=None,
                     mlp_norm=cls.norm(hf, c, dtype), mlp=mlp, mlp_post_norm=None)

    @classmethod
    def names(cls, hf, kind: str) -> dict:
        return {**LLAMA_NAMES, "router": "router"}

    @classmethod
    def hub_names(cls, hf, kind: str) -> dict:
        return {**super().hub_names(hf, kind), "router": "gate"}

    @classmethod
    def skeleton(cls, hf, dtype) -> CausalLM:
        """Mixtral's, with ``CausalLM.lm_head_bias`` where the config has ``lm_head_bias``."""
        model = super().skeleton(hf, dtype)
        if not getattr(hf, "lm_head_bias", False):
            return model
        return eqx.tree_at(lambda m: m.lm_head_bias, model, shape(model.config.vocab_size, dtype=dtype),
                           is_leaf=lambda x: x is None)

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        """Mixtral's (the final LayerNorm's weight and bias), with the head's bias."""
        bias = [Entry("lm_head.bias", "lm_head_bias")] if getattr(hf, "lm_head_bias", False) else []
        return super().name_map(hf, skeleton) + bias
