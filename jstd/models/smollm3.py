"""SmolLM3 (``model_type`` smollm3): Llama's block, but every few blocks attend without a rotary (NoPE).

    a   = input_layernorm(x)
    q   = rope(q_proj(a)) if no_rope_layers[i] else q_proj(a)      # the same for k
    h   = x + o_proj(attn(q, k, v_proj(a)))
    out = h + mlp(post_attention_layernorm(h))

``config.no_rope_layers[i]`` is 1 where block ``i`` uses the rotary (the
default: every block but each ``no_rope_layer_interval``-th, 3 in 4 on
SmolLM3-3B); a NoPE block's queries and keys are the projections themselves
(``attention_queries`` unrotated). ``config.layer_types`` marks the sliding
blocks (with ``use_sliding_window``: the NoPE ones by default; none on the
released checkpoint). A block's kind says both: ``full_attention``,
``sliding_attention``, each with ``+nope`` where the block has no rotary, so
blocks of one structure stack together.
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.models.llama import Llama
from jstd.models.qwen3 import layer_kinds

NOPE = "+nope"


class NoRopeAttention(Attention):
    """``Attention`` that applies no rotary: the cos/sin its stack hands every block are not used."""

    def __call__(self, x, args, s, past=None):
        return super().__call__(x, (None, *args[1:]), s, past)


class SmolLM3(Llama):
    family = "smollm3"
    model_types = ("smollm3",)
    # use_sliding_window and no_rope_layer_interval act through layer_types and no_rope_layers (transformers'
    # config derives them so)
    handled = Llama.handled | {"attention_dropout", "layer_types", "use_sliding_window", "sliding_window",
                               "no_rope_layers", "no_rope_layer_interval"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        kinds = layer_kinds(hf, cls.family)
        rope = list(hf.no_rope_layers)
        if len(rope) < len(kinds):  # transformers reads entry i for block i (and ignores any past the last block)
            raise ValueError(f"{cls.family}: no_rope_layers has {len(rope)} entries for {len(kinds)} blocks; "
                             "give one per block")
        return tuple(kind if uses else kind + NOPE for kind, uses in zip(kinds, rope))

    @classmethod
    def window(cls, hf, kind: str) -> int | None:
        return super().window(hf, kind.removesuffix(NOPE))

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        block = super().block(hf, c, kind, dtype)
        if kind.endswith(NOPE):
            fields = {f.name: getattr(block.attn, f.name) for f in dataclasses.fields(block.attn)}
            block = dataclasses.replace(block, attn=NoRopeAttention(**fields))
        return block
