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

Only what differs from Llama is here: the embedding and logits multipliers
(``enter_blocks``, ``finish_logits``), the score scale (``attention_scale``),
and the block's ``contribution`` (raw output -> post-norm -> times
residual_multiplier). The values, in the standard vocabulary:

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

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from jstd.io.namemap import Entry
from jstd.kernels.rounding import rounded
from jstd.models.layers import PreNormBlock, RMSNorm
from jstd.models.llama import TEXT_SITES, Llama

RAW_OUTPUT = {
    "self_attn": "layers.self_attn.attention_raw_output",
    "mlp": "layers.mlp.mlp_raw_output",
}


def times(x: Float[Array, "..."], multiplier: float) -> Float[Array, "..."]:
    """``x * multiplier`` as torch computes a tensor times a Python float: in float32, cast back.

    (In bfloat16 torch keeps the scalar at float32 precision; rounding it to
    bfloat16 first, as ``x * multiplier`` would in JAX, differs for 0.3.)
    """
    return (x.astype(jnp.float32) * jnp.float32(multiplier)).astype(x.dtype)


class PeriNormBlock(PreNormBlock):
    """Llama's block whose sublayer outputs pass a post-norm (when present) and ``residual_multiplier``
    (HF's "Peri-Layer Normalization": a norm before and after each sublayer).

    ``attention_post_norm`` is HF's ``post_norm1`` and ``mlp_post_norm`` its
    ``post_norm2``; both are None when the config has ``use_post_norm`` false.
    The contribution is ``rounded`` before the block adds it, so the stream adds
    exactly the value read (and edited) at ``attention_output`` / ``mlp_output``:
    without it XLA fuses the last multiply into the residual add (an FMA).
    """

    attention_post_norm: RMSNorm | None
    mlp_post_norm: RMSNorm | None
    residual_multiplier: float = eqx.field(static=True)

    def contribution(self, sublayer: str, y, s):
        y = s(RAW_OUTPUT[sublayer], y)
        norm = self.attention_post_norm if sublayer == "self_attn" else self.mlp_post_norm
        if norm is None and self.residual_multiplier == 1.0:
            return y  # Llama's block: the sublayer's output is what the block adds
        if norm is not None:
            y = norm(y)
        return rounded(times(y, self.residual_multiplier))


class HyperCLOVAX(Llama):
    """A HyperCLOVA X causal LM: Llama's arrays, post-norms in the blocks, the multipliers as static floats."""

    embedding_multiplier: float = eqx.field(static=True)
    logits_scaling: float = eqx.field(static=True)

    family: ClassVar[str] = "hyperclovax"
    model_types: ClassVar[tuple[str, ...]] = ("hyperclovax",)
    sites: ClassVar[frozenset[str]] = TEXT_SITES | frozenset(RAW_OUTPUT.values())

    def enter_blocks(self, embeddings):
        return embeddings if self.embedding_multiplier == 1.0 else rounded(times(embeddings, self.embedding_multiplier))

    def finish_logits(self, head_output):
        return times(head_output, self.logits_scaling)

    @classmethod
    def attention_scale(cls, hf, config) -> float:
        return float(hf.attention_multiplier)

    @classmethod
    def block_skeleton(cls, hf, c, dtype):
        b = super().block_skeleton(hf, c, dtype)
        post = (lambda: RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype)) if hf.use_post_norm else (lambda: None)
        return PeriNormBlock(b.attention_norm, b.attn, b.mlp_norm, b.mlp, post(), post(), float(hf.residual_multiplier))

    @classmethod
    def extra_fields(cls, hf) -> dict:
        return {
            "embedding_multiplier": float(hf.embedding_multiplier),
            "logits_scaling": float(hf.logits_scaling),
        }

    @classmethod
    def name_map(cls, hf) -> list[Entry]:
        L = "model.layers.{i}."
        post = [
            Entry(L + "post_norm1.weight", "blocks.attention_post_norm.weight"),
            Entry(L + "post_norm2.weight", "blocks.mlp_post_norm.weight"),
        ]
        return super().name_map(hf) + (post if hf.use_post_norm else [])
