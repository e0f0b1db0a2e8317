"""Gemma (``model_type`` gemma): Llama's block with zero-centred norms, a GeGLU MLP and scaled embeddings.

    x      = embed_tokens(ids) · normalizer                  # normalizer = sqrt(hidden_size), in the model dtype
    h      = x + self_attn(input_layernorm(x))
    out    = h + mlp(post_attention_layernorm(h))            # down(gelu_tanh(gate(a)) · up(a))
    logits = norm(out) @ embed_tokensᵀ                       # tied head

Every RMSNorm multiplies by ``1 + weight`` (the stored weight is zero-centred),
formed in float32 with the normed value and cast back once (transformers'
``GemmaRMSNorm``: ``RMSNorm(unit_offset=True)``). The embedding module itself
scales its rows by ``sqrt(hidden_size)`` rounded to the weights' dtype (a
buffer cast with ``.to(weight.dtype)``: 55.5 in bfloat16 for hidden 3072, not
55.43), so ``token_embeddings`` — the embedding module's output — is the scaled
lookup and equals ``layers.0.layer_input``. ``head_dim`` comes from the config
(256 on the released checkpoints, not ``hidden / heads``); the score scale is
its inverse square root. The classes here (``GemmaLM``, ``Gemma.norm``) serve
the later Gemma generations too.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from jstd.core.config import ModelConfig
from jstd.kernels.rounding import rounded
from jstd.nn.causal_lm import CausalLM
from jstd.models.family import TextFamily
from jstd.models.llama import Llama
from jstd.nn.norms import RMSNorm


class GemmaLM(CausalLM):
    """A ``CausalLM`` whose embedding module scales its rows by ``embed_scale`` rounded to the embedding's dtype."""

    embed_scale: float = eqx.field(static=True, default=1.0)

    def lookup(self, tokens) -> Float[Array, "batch seq embed"]:
        rows = self.embed[tokens]
        # rounded: the product is what the site holds and block 0 reads (XLA would keep it in float32 otherwise)
        return rounded(rows * jnp.asarray(self.embed_scale, jnp.float32).astype(rows.dtype))


class Gemma(Llama):
    family = "gemma"
    model_types = ("gemma",)
    model_class = GemmaLM
    # use_bidirectional_attention: refused in standard_config when set
    handled = TextFamily.handled | {"attention_bias", "attention_dropout", "use_bidirectional_attention"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        if getattr(hf, "use_bidirectional_attention", None):
            raise ValueError(f"{hf.model_type}: use_bidirectional_attention (an encoder's attention) is not "
                             "supported; jstd runs Gemma's causal decoder")
        return super().standard_config(hf)

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> RMSNorm:
        return RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype, unit_offset=True)

    @classmethod
    def extra(cls, hf) -> dict:
        return {"embed_scale": float(hf.hidden_size) ** 0.5}
