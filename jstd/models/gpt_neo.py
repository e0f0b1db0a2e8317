"""GPT-Neo (``model_type`` gpt_neo: GPT-Neo 125M–2.7B, the TinyStories models): GPT-2's block with unscaled
attention scores and alternating global and local (windowed) attention.

    x      = wte[ids] + wpe[positions]                      # token_embeddings + position_embeddings
    h      = x + attn(ln_1(x))                               # q_proj, k_proj, v_proj (no bias), out_proj
    out    = h + mlp(ln_2(h))                                # c_proj(gelu_new(c_fc(a))), nn.Linear
    logits = ln_f(out) @ wteᵀ                                # tied head

The quirks a port gets wrong silently:

* Scores are **not** scaled by ``1/sqrt(head_dim)`` (``Attention`` with ``scale`` 1), and queries and keys are cast to
  float32 before the product (``Attention.float32_scores``: ``attention_scores`` is float32 in a bf16 model, the
  probabilities are cast back to the values' dtype after the softmax).
* ``config.attention_layers`` (from ``attention_types``) makes each block ``global`` (full causal attention) or
  ``local``: a query at index ``i`` sees keys at ``i - window_size + 1 .. i`` (torch's mask is ``tril`` minus
  ``tril(-window_size)``), indices counting every position of the sequence, padding included, as torch's mask
  buffer is sliced by the cache length. That is ``Attention.sliding_window`` (``window_size``) on the blocks of kind
  ``sliding_attention``; ``global`` blocks are ``full_attention``.

Positions are learned (``GPT2LM``): checked against ``max_position_embeddings`` before any gather, and those
transformers' generation gives a padded batch (each token counts the real tokens before it).
"""

from __future__ import annotations

import dataclasses

from jstd.core.config import ModelConfig
from jstd.models.family import TextFamily, tied
from jstd.models.gpt2 import GPT2
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.nn.mlp import MLP

GPT_NEO_NAMES = {"attention_norm": "ln_1", "attn": "attn.attention", "mlp_norm": "ln_2", "mlp": "mlp", "out": "out_proj",
                 "fc1": "c_fc", "fc2": "c_proj"}
KINDS = {"global": "full_attention", "local": "sliding_attention"}


class GPTNeo(GPT2):
    """GPT-2's declaration (learned positions, LayerNorms, the ``transformer.`` names) with GPT-Neo's blocks."""

    family = "gpt_neo"
    model_types = ("gpt_neo",)
    block_names = GPT_NEO_NAMES
    # attention_layers: what transformers expands attention_types into; the summary_* keys configure a
    # classification head a causal LM does not have
    handled = TextFamily.handled | {
        "num_layers", "num_heads", "attention_types", "attention_layers", "window_size", "activation_function",
        "layer_norm_epsilon", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
        "summary_first_dropout", "gradient_checkpointing"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        """``global`` -> ``full_attention``, ``local`` -> ``sliding_attention``; ValueError for any other kind."""
        unknown = set(hf.attention_layers) - set(KINDS)
        if unknown:
            raise ValueError(f"gpt_neo: attention_layers holds {sorted(unknown)}; GPT-Neo has global and local blocks")
        if len(hf.attention_layers) != hf.num_layers:
            raise ValueError(f"gpt_neo: attention_types gives {len(hf.attention_layers)} blocks but num_layers is "
                             f"{hf.num_layers}; make them agree")
        return tuple(KINDS[k] for k in hf.attention_layers)

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        head_dim = hf.hidden_size // hf.num_heads
        return ModelConfig(
            model_type=hf.model_type, num_layers=hf.num_layers, hidden_size=hf.hidden_size, num_heads=hf.num_heads,
            num_kv_heads=hf.num_heads, head_dim=head_dim, qk_head_dim=head_dim, vocab_size=hf.vocab_size,
            intermediate_size=hf.intermediate_size or 4 * hf.hidden_size, layer_types=cls.layer_types(hf))

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        window = hf.window_size if kind == cls.SLIDING else None
        attn = Attention.skeleton(c.hidden_size, c.num_heads, c.num_heads, c.head_dim, 1.0, False, True, dtype,
                                  sliding_window=window)
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=dataclasses.replace(attn, float32_scores=True),
            attention_post_norm=None,
            mlp_norm=cls.norm(hf, c, dtype),
            mlp=MLP.skeleton(c.hidden_size, c.intermediate_size, hf.activation_function, dtype),
            mlp_post_norm=None,
        )

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # the causal-mask buffers older checkpoints saved; a tied head stored anyway is the embedding itself
        return ("transformer.h.*.attn.attention.bias", "transformer.h.*.attn.attention.masked_bias") + (
            ("lm_head.weight",) if tied(hf) else ())
