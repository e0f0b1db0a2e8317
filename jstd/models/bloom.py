"""BLOOM (``model_type`` bloom: BLOOM-560M … 176B, BLOOMZ): no position embeddings but ALiBi slopes added to the
attention scores, a LayerNorm on the embeddings, and a fused per-head ``query_key_value``.

    e      = word_embeddings[ids]                            # token_embeddings
    x      = word_embeddings_layernorm(e)                    # block 0's layer_input
    h      = x + dense(attention(input_layernorm(x)))        # scores: q·kᵀ / sqrt(d) + slope_h · position(key)
    out    = h + dense_4h_to_h(gelu(dense_h_to_4h(post_attention_layernorm(h))))
    logits = ln_f(out) @ word_embeddingsᵀ                    # tied head

The quirks a port gets wrong silently:

* ALiBi (``Attention.alibi``, ``kernels.attention.alibi_bias``): head ``h`` adds ``slope_h · position(key)`` to its
  scaled scores, the slopes ``2^(-8i/n)`` (``kernels.attention.alibi_slopes``), a key's position counting the real
  tokens before it (left padding is not counted, as transformers' ``build_alibi_tensor`` from the mask: the same
  in a plain forward and in ``generate``). ``attention_scores`` holds that sum (torch's form; per query it differs
  from the paper's ``-slope_h · distance`` by a constant the softmax ignores), so what a head adds to its scores
  by distance is ``attention_scores - scale · q·kᵀ``; the bias itself is no separate site.
* The embeddings are normed before block 0 (``word_embeddings_layernorm``): ``layers.0.layer_input`` is that norm
  of ``token_embeddings``, not the embeddings themselves.
* ``query_key_value`` is interleaved per head (``[heads, 3, head_dim]`` on its output rows), as GPT-NeoX's
  (``FusedQKVAttention``), and the MLP's GELU is BLOOM's own tanh approximation (``bloom_gelu``).
* transformers' attention and MLP modules return the stream with their output added; ``attention_output`` and
  ``mlp_output`` are ``dense`` / ``dense_4h_to_h``'s outputs, what the block adds.

Refused, with the reason: ``apply_residual_connection_post_layernorm`` (a residual from the norm's output) and
``slow_but_exact`` with ``pretraining_tp > 1`` (the output projections summed in slices).
"""

from __future__ import annotations

import dataclasses
import math

from jaxtyping import Array, Float

from jstd.core.config import ModelConfig
from jstd.kernels.attention import alibi_slopes
from jstd.models.family import TextFamily, tied
from jstd.models.gpt_neox import FusedQKVAttention
from jstd.nn.block import Block
from jstd.nn.causal_lm import CausalLM
from jstd.nn.mlp import MLP
from jstd.nn.namemap import Entry
from jstd.nn.norms import LayerNorm

BLOOM_NAMES = {"attention_norm": "input_layernorm", "attn": "self_attention", "mlp_norm": "post_attention_layernorm",
               "mlp": "mlp", "fc1": "dense_h_to_4h", "fc2": "dense_4h_to_h"}


class BloomLM(CausalLM):
    """A ``CausalLM`` whose embeddings are normed before block 0 (``embed_norm``: BLOOM's
    ``word_embeddings_layernorm``)."""

    embed_norm: LayerNorm | None = None

    def enter_blocks(self, embeddings: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        return self.embed_norm(embeddings)


class Bloom(TextFamily):
    family = "bloom"
    model_types = ("bloom",)
    model_class = BloomLM
    embed_name, final_norm_name, blocks_name = "transformer.word_embeddings", "transformer.ln_f", "transformer.h.{i}"
    block_names = BLOOM_NAMES
    # hidden_dropout / attention_dropout: training only; pretraining_tp without slow_but_exact changes nothing
    handled = TextFamily.handled | {"n_layer", "n_head", "layer_norm_epsilon", "apply_residual_connection_post_layernorm",
                                    "hidden_dropout", "attention_dropout", "pretraining_tp", "slow_but_exact",
                                    "n_embed", "n_inner", "masked_softmax_fusion", "unk_token_id", "seq_length",
                                    "skip_bias_add", "skip_bias_add_qkv", "offset_alibi", "attention_softmax_in_fp32"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        if hf.apply_residual_connection_post_layernorm:
            raise ValueError("bloom: apply_residual_connection_post_layernorm=True (the residual taken from the "
                             "norm's output) is not supported; jstd runs BLOOM's blocks with the stream as residual")
        if hf.slow_but_exact and hf.pretraining_tp > 1:
            raise ValueError("bloom: slow_but_exact=True with pretraining_tp > 1 (output projections summed in "
                             "slices) is not supported; set slow_but_exact to false")
        head_dim = hf.hidden_size // hf.n_head
        return ModelConfig(
            model_type=hf.model_type, num_layers=hf.n_layer, hidden_size=hf.hidden_size, num_heads=hf.n_head,
            num_kv_heads=hf.n_head, head_dim=head_dim, qk_head_dim=head_dim, vocab_size=hf.vocab_size,
            intermediate_size=4 * hf.hidden_size, layer_types=cls.layer_types(hf))

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> LayerNorm:
        return LayerNorm.skeleton(c.hidden_size, hf.layer_norm_epsilon, dtype)

    @classmethod
    def rotary(cls, hf, c: ModelConfig):
        return None  # ALiBi: no positions enter the stream

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        attn = FusedQKVAttention.skeleton(c.hidden_size, c.num_heads, c.num_heads, c.head_dim,
                                          1.0 / math.sqrt(c.head_dim), True, True, dtype)
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=dataclasses.replace(attn, alibi=alibi_slopes(c.num_heads)),
            attention_post_norm=None,
            mlp_norm=cls.norm(hf, c, dtype),
            mlp=MLP.skeleton(c.hidden_size, c.intermediate_size, "bloom_gelu", dtype),
            mlp_post_norm=None,
        )

    @classmethod
    def skeleton(cls, hf, dtype) -> BloomLM:
        model = super().skeleton(hf, dtype)
        return dataclasses.replace(model, embed_norm=cls.norm(hf, model.config, dtype))

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        """TextFamily's, with the norm after the embedding."""
        return super().name_map(hf, skeleton) + [Entry(f"transformer.word_embeddings_layernorm.{p}", f"embed_norm.{p}")
                                                 for p in ("weight", "bias")]

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        # the hub's BLOOM checkpoints were saved from BloomModel: their tensors have no "transformer." prefix
        return {"transformer.": ("transformer.", "")}

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        return ("lm_head.weight",) if tied(hf) else ()
