"""Qwen3-VL's text model (``qwen3_vl_text``): Qwen3's block — Llama's, with an RMSNorm over each query and key head
before the rotary — under interleaved multimodal RoPE.

    a   = input_layernorm(x)
    q   = rope(q_norm(q_proj(a)))                       # q_norm, k_norm: RMSNorm over head_dim, per head
    k   = rope(k_norm(k_proj(a)))
    h   = x + o_proj(attn(q, k, v_proj(a)))             # attention_queries / keys: normed, then rotated
    out = h + mlp(post_attention_layernorm(h))          # SwiGLU, no biases

Positions are three streams ``[3, batch, seq]`` (time, height, width), as on Qwen2-VL, but the rotary interleaves
them: of each head's ``head_dim / 2`` frequencies, ``j`` turns with the height when ``j % 3 == 1`` and
``j < 3 · mrope_section[1]``, with the width when ``j % 3 == 2`` and ``j < 3 · mrope_section[2]``, with the time
otherwise (``kernels.rope.mrope_streams``; transformers' rotary does this whatever the config's
``mrope_interleaved`` says). The wrapper (``vision.qwen3_vl``) computes the positions from the tokens and the
grids and adds its DeepStack features to the stream after the first blocks; alone, on text, the three streams are
equal and the rotation is the ordinary one.
"""

from __future__ import annotations

import equinox as eqx

from jstd.core.config import ModelConfig
from jstd.kernels.rope import Rotary
from jstd.kernels.rope_config import rotary_from_config
from jstd.nn.block import Block
from jstd.nn.norms import HeadNorm
from jstd.models.llama import Llama


class Qwen3VLText(Llama):
    family = "qwen3_vl_text"
    model_types = ("qwen3_vl_text",)
    handled = Llama.handled | {"attention_dropout"}

    @classmethod
    def rotary(cls, hf, c: ModelConfig) -> Rotary | None:
        return rotary_from_config(hf, c.head_dim, mrope_interleaved=True)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        block = super().block(hf, c, kind, dtype)
        norm = HeadNorm.skeleton(c.head_dim, hf.rms_norm_eps, dtype)
        return eqx.tree_at(lambda b: (b.attn.q_norm, b.attn.k_norm), block, (norm, norm),
                           is_leaf=lambda x: x is None)
