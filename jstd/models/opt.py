"""OPT (``model_type`` opt: OPT-125M … 66B): GPT-2's pre-norm block with separate projections, learned positions
offset by 2 and taken from the attention mask, and optional projections between the embedding width and the
model's.

    e      = embed_tokens[ids]                               # token_embeddings, word_embed_proj_dim wide
    x      = project_in(e) + embed_positions[positions + 2]  # project_in only where word_embed_proj_dim differs
    h      = x + self_attn(self_attn_layer_norm(x))          # q_proj, k_proj, v_proj, out_proj (biased)
    out    = h + fc2(relu(fc1(final_layer_norm(h))))         # fc1 / fc2 sit in the block itself
    logits = project_out(decoder.final_layer_norm(out)) @ embed_tokensᵀ

The quirks a port gets wrong silently:

* The position table has ``max_position_embeddings + 2`` rows and position ``p`` reads row ``p + 2``
  (``GPT2LM.position_offset``); a position past ``max_position_embeddings`` fails the call (never clamped).
* Positions come from the attention mask (``cumsum(mask) · mask - 1``): a left-padded row's tokens count its real
  tokens, as in every plain forward (not only in ``generate``).
* ``word_embed_proj_dim`` (OPT-350M: 512 beside 1024): ``token_embeddings`` are that wide, ``project_in`` widens them
  before the positions are added and ``project_out`` narrows the final norm's output before the tied head (the
  head's product, ``lm_head_output``, includes it; the logit lens too).
* OPT scales the queries by ``1/sqrt(head_dim)`` as they leave ``q_proj``; jstd's ``attention_queries`` are
  ``q_proj``'s output before that scale (as on every other family) and ``attention_scores`` are the scaled
  products, equal to torch's: the queries are scaled before the product (``Attention.scaled_queries``), so a
  bfloat16 run rounds as torch's where the scale is no power of two (OPT-2.7B's head_dim 80, 6.7B's 128).

* ``do_layer_norm_before=False`` (OPT-350M): post-norm blocks, ``mid = self_attn_layer_norm(x + attn(x))``,
  ``out = final_layer_norm(mid + mlp(mid))`` (``Block.norm_after_add``), and no final norm: ``layer_mid`` is the
  normed stream the MLP reads, there is no ``attention_norm_output``, ``mlp_norm_output`` or
  ``final_norm_output``, the head reads the last ``layer_output``, and direct logit attribution is refused (the
  stream is no sum of contributions).

Refused, with the reason: ``enable_bias=False`` and ``layer_norm_elementwise_affine=False``.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
from jaxtyping import Array, Float

from jstd.core.config import ModelConfig
from jstd.models.family import TextFamily, tied
from jstd.models.gpt2 import GPT2LM
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.nn.mlp import MLP
from jstd.nn.namemap import Entry, linear
from jstd.nn.norms import LayerNorm
from jstd.nn.params import shape

OPT_NAMES = {"attention_norm": "self_attn_layer_norm", "attn": "self_attn", "mlp_norm": "final_layer_norm",
             "mlp": "", "out": "out_proj"}
PREFIX = "model.decoder."


def final_norm(hf) -> bool:
    """Whether the decoder ends with ``final_layer_norm`` (transformers: pre-norm blocks, unless
    ``_remove_final_layer_norm``)."""
    return bool(hf.do_layer_norm_before) and not getattr(hf, "_remove_final_layer_norm", False)


class OPTLM(GPT2LM):
    """``GPT2LM`` with OPT's projections between the embedding width and the model's: ``project_in`` ``[embed_proj,
    embed]`` after the lookup, ``project_out`` ``[embed, embed_proj]`` before the head (None where the widths agree)."""

    project_in: Float[Array, "embed_proj embed"] | None = eqx.field(default=None,
                                                                     metadata={"axes": ("embed_proj", "embed")})
    project_out: Float[Array, "embed embed_proj"] | None = eqx.field(default=None,
                                                                      metadata={"axes": ("embed", "embed_proj")})

    def enter_blocks(self, embeddings):
        return embeddings if self.project_in is None else embeddings @ self.project_in

    def head(self, normed):
        return super().head(normed if self.project_out is None else normed @ self.project_out)


class OPT(TextFamily):
    family = "opt"
    model_types = ("opt",)
    model_class = OPTLM
    embed_name, final_norm_name, blocks_name = (PREFIX + "embed_tokens", PREFIX + "final_layer_norm",
                                                PREFIX + "layers.{i}")
    # dropout, attention_dropout, layerdrop (training), init_std; prefix: the hub configs' note of the BOS text
    handled = TextFamily.handled | {"ffn_dim", "do_layer_norm_before", "_remove_final_layer_norm",
                                    "word_embed_proj_dim", "activation_function", "enable_bias",
                                    "layer_norm_elementwise_affine", "layerdrop", "init_std", "prefix"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        for key, bad, why in (
                ("enable_bias", False, "projections without biases"),
                ("layer_norm_elementwise_affine", False, "LayerNorms without weights")):
            if getattr(hf, key, not bad) == bad:
                raise ValueError(f"opt: {key}={bad} ({why}) is not supported; jstd runs OPT's pre-norm blocks with "
                                 "biases and affine LayerNorms (OPT-125M, 1.3B … 66B)")
        head_dim = hf.hidden_size // hf.num_attention_heads
        return ModelConfig(
            model_type=hf.model_type, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads, num_kv_heads=hf.num_attention_heads, head_dim=head_dim,
            qk_head_dim=head_dim, vocab_size=hf.vocab_size, intermediate_size=hf.ffn_dim,
            layer_types=cls.layer_types(hf))

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> LayerNorm:
        return LayerNorm.skeleton(c.hidden_size, 1e-5, dtype)  # torch's nn.LayerNorm default

    @classmethod
    def rotary(cls, hf, c: ModelConfig):
        return None  # learned absolute positions

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        pre = bool(hf.do_layer_norm_before)  # False: OPT-350M's post-norm blocks, each sum normed after the add
        norm = cls.norm(hf, c, dtype)
        return Block(
            attention_norm=norm if pre else None,
            attn=dataclasses.replace(Attention.skeleton(c.hidden_size, c.num_heads, c.num_heads, c.head_dim,
                                                        c.head_dim ** -0.5, True, True, dtype), scaled_queries=True),
            attention_post_norm=None if pre else norm,
            mlp_norm=norm if pre else None,
            mlp=MLP.skeleton(c.hidden_size, c.intermediate_size, hf.activation_function, dtype),
            mlp_post_norm=None if pre else norm,
            norm_after_add=not pre,
        )

    @classmethod
    def names(cls, hf, kind: str) -> dict:
        if hf.do_layer_norm_before:
            return OPT_NAMES
        return {**{k: v for k, v in OPT_NAMES.items() if k not in ("attention_norm", "mlp_norm")},
                "attention_post_norm": "self_attn_layer_norm", "mlp_post_norm": "final_layer_norm"}

    @classmethod
    def skeleton(cls, hf, dtype) -> OPTLM:
        c = cls.standard_config(hf)
        model = super().skeleton(hf, dtype)
        proj = hf.word_embed_proj_dim
        projected = proj != c.hidden_size
        return dataclasses.replace(
            model, embed=shape(c.vocab_size, proj, dtype=dtype),
            lm_head=None if model.lm_head is None else shape(proj, c.vocab_size, dtype=dtype),
            final_norm=model.final_norm if final_norm(hf) else None,
            position_embed=shape(hf.max_position_embeddings + 2, c.hidden_size, dtype=dtype), position_offset=2,
            project_in=shape(proj, c.hidden_size, dtype=dtype) if projected else None,
            project_out=shape(c.hidden_size, proj, dtype=dtype) if projected else None)

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        """TextFamily's (no final norm after post-norm blocks), with the learned position table and the
        projections in and out of a narrower embedding."""
        skeleton = skeleton if skeleton is not None else cls.skeleton(hf, "float32")
        return super().name_map(hf, skeleton) + [
            Entry(PREFIX + "embed_positions.weight", "position_embed"),
            *([] if skeleton.project_in is None else [Entry(PREFIX + "project_in.weight", "project_in", linear),
                                                      Entry(PREFIX + "project_out.weight", "project_out", linear)])]

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        # the hub's OPT checkpoints were saved from OPTModel: their tensors start with "decoder."
        return {"model.": ("model.", "")}

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        return ("lm_head.weight",) if tied(hf) else ()
