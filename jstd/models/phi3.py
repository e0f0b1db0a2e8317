"""Phi-3 (``model_type`` phi3): Llama's block with fused projections and ``longrope`` scaling.

    a       = input_layernorm(x)
    q|k|v   = qkv_proj(a)                               # one matrix: q rows, then k rows, then v rows
    h       = x + o_proj(attn(rope(q), rope(k), v))
    gate|up = gate_up_proj(post_attention_layernorm(h)) # one matrix: gate rows, then up rows
    out     = h + down_proj(act(gate) · up)

The fused matrices are split when the checkpoint is read (``FusedAttention``,
``FusedGatedMLP``: their name maps take row ranges of the one stored tensor),
so the values are Llama's: ``attention_queries`` / ``keys`` / ``values`` per
head, ``mlp_activation`` = act(gate), ``mlp_neurons`` = act(gate) · up; export
writes the parts back into the one tensor. The rotary is ``default`` or
``longrope`` (Phi-3-*-128k): the ``short_factor`` frequencies while the
longest position is below ``original_max_position_embeddings`` (the config
attribute has priority over ``rope_parameters``), the ``long_factor`` ones
past it, both times the attention factor ``sqrt(1 + log(factor) /
log(original_max))``; ``partial_rotary_factor`` rotates the first dims of a
head only. With ``sliding_window`` set (Phi-3-mini-4k: 2047) every block
attends the last ``sliding_window`` keys, as transformers' Phi-3 mask does.
"""

from __future__ import annotations

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.models.family import TextFamily
from jstd.models.llama import Llama
from jstd.nn.mlp import GatedMLP
from jstd.nn.namemap import Entry, linear, present, split_in, split_out


def _rows(start: int, stop: int | None, then):
    """rows ``start:stop`` of a stored [rows, in] matrix, then ``then``."""
    return lambda w: then(w[start:stop])


class FusedAttention(Attention):
    """``Attention`` whose q, k and v projections are stored as one ``qkv_proj`` (q rows, k rows, v rows)."""

    def entries(self, names=None) -> list[Entry]:
        H, K, D = self.q.shape[-2], self.k.shape[-2], self.q.shape[-1]
        qkv = "qkv_proj.weight"
        return present(self, [
            Entry(qkv, "q", _rows(0, H * D, split_out(H))), Entry(qkv, "k", _rows(H * D, (H + K) * D, split_out(K))),
            Entry(qkv, "v", _rows((H + K) * D, None, split_out(K))), Entry("o_proj.weight", "o", split_in(H)),
        ])


class FusedGatedMLP(GatedMLP):
    """``GatedMLP`` whose gate and up projections are stored as one ``gate_up_proj`` (gate rows, then up rows)."""

    def entries(self, names=None) -> list[Entry]:
        mlp = self.gate.shape[-1]
        fused = "gate_up_proj.weight"
        return [Entry(fused, "gate", _rows(0, mlp, linear)), Entry(fused, "up", _rows(mlp, None, linear)),
                Entry("down_proj.weight", "down", linear)]


class Phi3(Llama):
    family = "phi3"
    model_types = ("phi3",)
    # embd_pdrop, resid_pdrop: dropouts (training only)
    handled = TextFamily.handled | {"attention_dropout", "sliding_window", "embd_pdrop", "resid_pdrop"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        kind = "full_attention" if getattr(hf, "sliding_window", None) is None else cls.SLIDING
        return (kind,) * hf.num_hidden_layers

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=FusedAttention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5,
                                         False, False, dtype, sliding_window=cls.window(hf, kind)),
            attention_post_norm=None,
            mlp_norm=cls.norm(hf, c, dtype),
            mlp=FusedGatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, False, dtype),
            mlp_post_norm=None,
        )
