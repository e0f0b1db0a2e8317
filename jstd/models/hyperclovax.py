"""HyperCLOVA X (``model_type`` hyperclovax): Llama's blocks with four multipliers and optional post-norms.

    x      = embed_tokens(ids) * embedding_multiplier
    h      = x + post_norm1(self_attn(input_layernorm(x))) * residual_multiplier
    out    = h + post_norm2(mlp(post_attention_layernorm(h))) * residual_multiplier
    logits = lm_head(norm(out)) * logits_scaling

and the attention scales q·kᵀ by ``attention_multiplier`` in place of
``head_dim ** -0.5``. With ``use_post_norm`` false (the 32B text model) the
post-norms are identities. As on Llama, ``post_attention_layernorm`` is the
MLP's *input* norm; the norms after the sublayers are ``post_norm1`` (after the
attention) and ``post_norm2`` (after the MLP).

Only what differs from Llama is declared here: the multipliers (CausalLM's
``embedding_multiplier`` and ``logits_scaling``, the Block's
``residual_multiplier``), the score scale, and the post-norms. The values, in
the standard vocabulary:

- ``token_embeddings`` is the unscaled lookup; ``layers.0.layer_input`` is it
  times ``embedding_multiplier``.
- ``layers.self_attn.attention_raw_output`` / ``layers.mlp.mlp_raw_output``
  (family-specific) are the sublayers' own outputs, before the post-norms.
- ``layers.self_attn.attention_output`` / ``layers.mlp.mlp_output`` are what
  the block adds: the post-norm's output times ``residual_multiplier``. An
  edit there is what the block adds, exactly, for any multiplier: no round
  trip through the multiplier, so an edit at one position leaves every other
  position bit-identical (in bfloat16 too).
- ``attention_scores`` are after the multiplier and the causal mask.
- ``logits == lm_head_output * logits_scaling``; ``project_on_vocab`` scales
  too, so the logit lens at the last block equals ``logits``.
"""

from __future__ import annotations

import dataclasses

from jstd.nn.block import LLAMA_NAMES, Block
from jstd.models.llama import Llama


class HyperCLOVAX(Llama):
    family = "hyperclovax"
    model_types = ("hyperclovax",)
    handled = Llama.handled | {"attention_multiplier", "embedding_multiplier", "logits_scaling", "residual_multiplier",
                               "use_post_norm"}

    @classmethod
    def attention_scale(cls, hf, c) -> float:
        return float(hf.attention_multiplier)

    @classmethod
    def block(cls, hf, c, kind, dtype) -> Block:
        post = cls.norm(hf, c, dtype) if hf.use_post_norm else None
        return dataclasses.replace(super().block(hf, c, kind, dtype), attention_post_norm=post, mlp_post_norm=post,
                                   residual_multiplier=float(hf.residual_multiplier), raw_outputs=True)

    @classmethod
    def names(cls, hf, kind) -> dict:
        return {**LLAMA_NAMES, "attention_post_norm": "post_norm1", "mlp_post_norm": "post_norm2"}

    @classmethod
    def extra(cls, hf) -> dict:
        return {"embedding_multiplier": float(hf.embedding_multiplier), "logits_scaling": float(hf.logits_scaling)}
