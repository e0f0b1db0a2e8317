"""Phi-1, Phi-1.5 and Phi-2 (``model_type`` phi): parallel residual blocks with one LayerNorm, a partial rotary, biased
projections (``dense`` too), optional per-head q/k LayerNorms and a biased head.

    a      = input_layernorm(x)
    out    = attn(a) + mlp(a) + x                            # one norm, both sublayers read it (Block.parallel)
    logits = final_layernorm(out) @ lm_head + lm_head.bias

The quirks a port gets wrong silently:

* The block is parallel with a single norm: ``mlp_input`` is ``attention_norm_output``, ``layer_output =
  layer_input + attention_output + mlp_output``, and there is no ``layer_mid``.
* The rotary turns the first ``partial_rotary_factor · head_dim`` dims of each head (32 of Phi-2's 80), the halves
  of those dims paired (``rotate_half``); the rest pass through.
* Every projection has a bias, the output projection ``dense`` too, and so does the head (``CausalLM.lm_head_bias``,
  in ``lm_head_output``).
* ``qk_layernorm``: a LayerNorm (weight and bias) over each head of the queries and keys, before the rotary
  (``Attention.q_norm`` / ``k_norm`` one head wide).
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.models.family import TextFamily
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.nn.mlp import MLP
from jstd.nn.namemap import Entry, present
from jstd.nn.norms import LayerNorm

PHI_NAMES = {"attention_norm": "input_layernorm", "attn": "self_attn", "mlp": "mlp", "out": "dense"}


class LayerNormedQKAttention(Attention):
    """``Attention`` whose q/k norms are LayerNorms stored as ``q_layernorm`` / ``k_layernorm`` (Phi)."""

    def entries(self, names=None) -> list[Entry]:
        own = [e for e in super().entries(names) if not e.path.startswith(("q_norm.", "k_norm."))]
        return own + present(self, [Entry(f"{n}_layernorm.{p}", f"{n}_norm.{p}") for n in ("q", "k")
                                    for p in ("weight", "bias")])


class Phi(TextFamily):
    family = "phi"
    model_types = ("phi",)
    # resid_pdrop / embd_pdrop: dropout (training only)
    head_bias = True
    final_norm_name, block_names = "model.final_layernorm", PHI_NAMES
    handled = TextFamily.handled | {"layer_norm_eps", "qk_layernorm", "resid_pdrop", "embd_pdrop"}

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> LayerNorm:
        return LayerNorm.skeleton(c.hidden_size, hf.layer_norm_eps, dtype)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        attn = LayerNormedQKAttention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                               c.head_dim ** -0.5, True, True, dtype)
        if hf.qk_layernorm:
            head_norm = LayerNorm.skeleton(c.head_dim, hf.layer_norm_eps, dtype)
            attn = dataclasses.replace(attn, q_norm=head_norm, k_norm=head_norm)
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=attn,
            attention_post_norm=None,
            mlp_norm=None,
            mlp=MLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, dtype),
            mlp_post_norm=None,
            parallel=True,
        )

