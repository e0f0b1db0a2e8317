"""Llama (``model_type`` llama): the family the standard vocabulary is taken from.

    h   = x + self_attn(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))

Grouped-query attention with queries and keys read after the rotary embedding
(every rope variant transformers has for llama), optional attention and MLP
biases, tied embeddings (``lm_head`` is None and the head is ``embed.T``: one
array), ``head_dim`` independent of ``hidden_size / heads``. Blocks are stacked
and run under ``lax.scan``. Families that differ by multipliers or post-norms
(HyperCLOVA X) subclass this one and override only what differs.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
from jaxtyping import Array, Float, Int

from jstd.config import ModelConfig
from jstd.io.namemap import Entry, linear, split, split_in, split_out
from jstd.context import Context, begin
from jstd.kernels.rope import Rotary, rotary_from_config
from jstd.models.base import Family, param, shape, stacked
from jstd.models.layers import Attention, GatedMLP, PreNormBlock, RMSNorm, stack
from jstd.models.stack import scan_blocks
from jstd.sites import SITES

TEXT_SITES = frozenset(
    n for n, s in SITES.items() if s.family is None and (s.host in ("model", "layers", "layers.self_attn", "layers.mlp"))
)


class Llama(Family):
    """A Llama causal LM. Arrays: ``embed`` [vocab, embed], ``blocks`` stacked [layers, ...],
    ``final_norm``, ``lm_head`` [embed, vocab] (None when tied to ``embed``)."""

    embed: Float[Array, "vocab embed"] = param("vocab", "embed")
    blocks: PreNormBlock = stacked()
    final_norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None = param("embed", "vocab")
    rotary: Rotary | None = eqx.field(static=True)

    family: ClassVar[str] = "llama"
    model_types: ClassVar[tuple[str, ...]] = ("llama",)
    sites: ClassVar[frozenset[str]] = TEXT_SITES

    # ---- the forward -------------------------------------------------------
    def embed_tokens(self, tokens):
        return self.embed[tokens]

    def enter_blocks(self, embeddings):
        """What block 0 reads, from the token embeddings (the identity on Llama)."""
        return embeddings

    def head(self, normed):
        return normed @ (self.embed.T if self.lm_head is None else self.lm_head)

    def finish_logits(self, head_output):
        """The logits from the head's output (the identity on Llama)."""
        return head_output

    def forward(self, tokens: Int[Array, "batch seq"], tap, attention_mask=None, context: Context | None = None):
        s = tap.scope()
        embed = lambda: self.enter_blocks(s("token_embeddings", self.embed_tokens(tokens)))
        positions, mask, h = begin(tokens, attention_mask, context, embed)
        cos_sin = None if self.rotary is None else self.rotary.cos_sin(positions, h.dtype)
        past = None if context is None or context.keys is None else (context.keys, context.values)
        h, block_reads = scan_blocks(self.blocks, h, tap, (cos_sin, mask), past=past,
                                     first=None if context is None else context.block)
        normed = s("final_norm_output", self.final_norm(h))
        logits = s("logits", self.finish_logits(s("lm_head_output", self.head(normed))))
        return logits, {**s.records, **block_reads}

    def logits_from_norm(self, normed: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        return self.finish_logits(self.head(normed))

    def layers_with(self, host: str) -> tuple[int, ...]:
        return tuple(range(self.config.num_layers)) if host in ("self_attn", "mlp", "") else ()

    # ---- loading -----------------------------------------------------------
    @classmethod
    def attention_scale(cls, hf, config: ModelConfig) -> float:
        return config.head_dim ** -0.5

    @classmethod
    def block_skeleton(cls, hf, c: ModelConfig, dtype):
        eps = hf.rms_norm_eps
        return PreNormBlock(
            RMSNorm.skeleton(c.hidden_size, eps, dtype),
            Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, cls.attention_scale(hf, c),
                               bool(getattr(hf, "attention_bias", False)), bool(getattr(hf, "attention_bias", False)), dtype),
            RMSNorm.skeleton(c.hidden_size, eps, dtype),
            GatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, bool(getattr(hf, "mlp_bias", False)), dtype),
        )

    @classmethod
    def skeleton(cls, hf, dtype):
        c = cls.standard_config(hf)
        return cls(
            config=c,
            embed=shape(c.vocab_size, c.hidden_size, dtype=dtype),
            blocks=stack(cls.block_skeleton(hf, c, dtype), c.num_layers),
            final_norm=RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype),
            lm_head=None if tied(hf) else shape(c.hidden_size, c.vocab_size, dtype=dtype),
            rotary=rotary_from_config(hf, c.head_dim),
            **cls.extra_fields(hf),
        )

    @classmethod
    def extra_fields(cls, hf) -> dict:
        return {}

    @classmethod
    def name_map(cls, hf) -> list[Entry]:
        c = cls.standard_config(hf)
        L = "model.layers.{i}."
        H, K = c.num_heads, c.num_kv_heads
        return [
            Entry("model.embed_tokens.weight", "embed"),
            Entry("model.norm.weight", "final_norm.weight"),
            Entry("lm_head.weight", "lm_head", linear),
            Entry(L + "input_layernorm.weight", "blocks.attention_norm.weight"),
            Entry(L + "post_attention_layernorm.weight", "blocks.mlp_norm.weight"),
            Entry(L + "self_attn.q_proj.weight", "blocks.attn.q", split_out(H)),
            Entry(L + "self_attn.k_proj.weight", "blocks.attn.k", split_out(K)),
            Entry(L + "self_attn.v_proj.weight", "blocks.attn.v", split_out(K)),
            Entry(L + "self_attn.o_proj.weight", "blocks.attn.o", split_in(H)),
            Entry(L + "self_attn.q_proj.bias", "blocks.attn.q_bias", split(H)),
            Entry(L + "self_attn.k_proj.bias", "blocks.attn.k_bias", split(K)),
            Entry(L + "self_attn.v_proj.bias", "blocks.attn.v_bias", split(K)),
            Entry(L + "self_attn.o_proj.bias", "blocks.attn.o_bias"),
            Entry(L + "mlp.gate_proj.weight", "blocks.mlp.gate", linear),
            Entry(L + "mlp.up_proj.weight", "blocks.mlp.up", linear),
            Entry(L + "mlp.down_proj.weight", "blocks.mlp.down", linear),
            Entry(L + "mlp.gate_proj.bias", "blocks.mlp.gate_bias"),
            Entry(L + "mlp.up_proj.bias", "blocks.mlp.up_bias"),
            Entry(L + "mlp.down_proj.bias", "blocks.mlp.down_bias"),
        ]

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # rotary buffers are recomputed; a tied head stored anyway is the embedding itself
        return ("*rotary_emb.inv_freq",) + (("lm_head.weight",) if tied(hf) else ())


def tied(hf) -> bool:
    return bool(getattr(hf, "tie_word_embeddings", False))
