"""Mixtral (``model_type`` mixtral): Llama's block with a mixture-of-experts MLP (``jstd.nn.moe``).

    h   = x + self_attn(input_layernorm(x))
    out = h + moe(post_attention_layernorm(h))      # experts intermediate_size wide

The router: softmax of the logits in float32, the top-k, renormalised (the softmax of the top-k logits), and kept
in float32: each expert's output is weighted in float32 and cast back. ``sliding_window`` (null on the released
v0.1 checkpoints) makes every block attend the last ``sliding_window`` keys. The hub checkpoints name the MLP
``block_sparse_moe`` and its experts ``experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5 saves
``mlp.experts.gate_up_proj`` / ``down_proj``. Both load. ``router_jitter_noise`` acts in training only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jstd.core.config import ModelConfig
from jstd.nn.block import LLAMA_NAMES, Block
from jstd.models.llama import Llama
from jstd.nn.moe import MoEMLP, with_experts
from jstd.nn.namemap import Entry

FULL, SLIDING = "full_attention", "sliding_attention"


class Mixtral(Llama):
    family = "mixtral"
    model_types = ("mixtral",)
    handled = Llama.handled | {"attention_dropout", "sliding_window", "num_experts_per_tok", "num_local_experts",
                               "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return with_experts(super().standard_config(hf), hf.num_local_experts, hf.num_experts_per_tok)

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        return (FULL if getattr(hf, "sliding_window", None) is None else SLIDING,) * hf.num_hidden_layers

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        mlp = MoEMLP.skeleton(c.hidden_size, hf.intermediate_size, hf.num_local_experts, hf.num_experts_per_tok,
                              hf.hidden_act, True, dtype, weights_in_float32=True)
        return dataclasses.replace(super().block(hf, c, kind, dtype), mlp=mlp)

    @classmethod
    def hub_names(cls, hf, kind: str) -> dict:
        """The block's module names as the hub checkpoints spell them (the MLP ``block_sparse_moe``, experts
        ``w1`` / ``w3`` / ``w2``)."""
        return {**LLAMA_NAMES, "mlp": "block_sparse_moe", "experts": "w"}

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        """Llama's, each MLP tensor also spelled as the hub stores it (``block_sparse_moe.``, ``w1`` / ``w3`` /
        ``w2`` per expert)."""
        entries = super().name_map(hf, skeleton)
        skeleton = skeleton if skeleton is not None else cls.skeleton(hf, np.float32)
        hub = {e.path: e for e in skeleton.layers.name_map("layers", "model.layers.{i}.",
                                                           lambda kind: cls.hub_names(hf, kind))}
        out = []
        for e in entries:
            h = hub.get(e.path)
            if h is None or ".mlp." not in e.path:
                out.append(e)
            else:  # the hub spelling of this tensor, and its per-expert spelling
                out.append(dataclasses.replace(e, alternatives=e.alternatives + h.spellings()))
        return out
