"""Mistral (``model_type`` mistral): Llama's block where every block attends a sliding window.

    h   = x + self_attn(input_layernorm(x))         # each query attends the last sliding_window keys, itself included
    out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))

``config.sliding_window`` (4096 on Mistral-7B-v0.1; null from v0.2 on, which
is full attention) narrows every block's mask: the blocks are
``sliding_attention`` blocks (``layer_types``), and generation past the window
stops attending the keys older than it exactly as transformers' sliding cache.
"""

from __future__ import annotations

from jstd.models.family import TextFamily
from jstd.models.llama import Llama


class Mistral(Llama):
    family = "mistral"
    model_types = ("mistral",)
    handled = TextFamily.handled | {"sliding_window"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        kind = cls.SLIDING if getattr(hf, "sliding_window", None) is not None else "full_attention"
        return (kind,) * hf.num_hidden_layers
