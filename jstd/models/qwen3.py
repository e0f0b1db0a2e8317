"""Qwen3 (``model_type`` qwen3): Qwen3-VL's text block — Llama's, with an RMSNorm over each query and key head
before the rotary — under the ordinary 1-D rotary.

    a   = input_layernorm(x)
    q   = rope(q_norm(q_proj(a)))                       # q_norm, k_norm: RMSNorm over head_dim, per head
    k   = rope(k_norm(k_proj(a)))
    h   = x + o_proj(attn(q, k, v_proj(a)))             # biases on q, k, v and o only with attention_bias
    out = h + mlp(post_attention_layernorm(h))          # SwiGLU

``config.layer_types`` gives each block's kind: ``full_attention``, or
``sliding_attention`` (with ``use_sliding_window``, the blocks from
``max_window_layers`` on: each query attends the last ``sliding_window`` keys,
itself included). The released checkpoints have no sliding blocks.
``layer_kinds`` reads and checks such ``layer_types`` for the other families
that have them (SmolLM3).
"""

from __future__ import annotations

from jstd.core.config import ModelConfig
from jstd.kernels.rope import Rotary
from jstd.kernels.rope_config import rotary_from_config
from jstd.models.qwen3_vl import Qwen3VLText

FULL, SLIDING = "full_attention", Qwen3VLText.SLIDING


def layer_kinds(hf, family: str) -> tuple[str, ...]:
    """``config.layer_types`` (every block ``full_attention`` when absent); ValueError naming any other kind."""
    kinds = tuple(getattr(hf, "layer_types", None) or (FULL,) * hf.num_hidden_layers)
    unknown = set(kinds) - {FULL, SLIDING}
    if unknown:
        raise ValueError(f"{family} layer_types holds {sorted(unknown)}; supported: {FULL}, {SLIDING}")
    if len(kinds) != hf.num_hidden_layers:
        raise ValueError(f"{family}: layer_types has {len(kinds)} entries for {hf.num_hidden_layers} blocks; "
                         "give one per block")
    return kinds


class Qwen3(Qwen3VLText):
    family = "qwen3"
    model_types = ("qwen3",)
    # use_sliding_window and max_window_layers act through layer_types and sliding_window (transformers' config
    # derives them so)
    handled = Qwen3VLText.handled | {"layer_types", "use_sliding_window", "sliding_window", "max_window_layers"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        return layer_kinds(hf, cls.family)

    @classmethod
    def rotary(cls, hf, c: ModelConfig) -> Rotary | None:
        return rotary_from_config(hf, c.head_dim)
