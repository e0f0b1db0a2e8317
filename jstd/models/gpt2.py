"""GPT-2 (``model_type`` gpt2): learned absolute positions, LayerNorm blocks, fused Conv1D projections, a tied head.

    x      = wte[ids] + wpe[positions]                      # token_embeddings + position_embeddings
    h      = x + attn(ln_1(x))                               # c_attn (fused q|k|v), c_proj
    out    = h + mlp(ln_2(h))                                # c_proj(gelu_new(c_fc(a)))
    logits = ln_f(out) @ wteᵀ                                # tied head

Conv1D stores its weight ``[in, out]`` (the transpose of a torch Linear's), so
the name map reads it as is and splits ``c_attn``'s output columns into the
query, key and value heads (``q | k | v``, each ``[heads, head_dim]``); export
writes the same tensors back. The positions are those transformers' generation
gives a padded batch (each token counts the real tokens before it), so a
left-padded row equals its prompt alone, and ``layers.0.layer_input`` is
``token_embeddings + position_embeddings`` exactly.

Refused, with the reason: ``scale_attn_by_inverse_layer_idx`` and
``reorder_and_upcast_attn`` (a score scale that differs by block, and scores
upcast to float32 under autocast: jstd's blocks share one scale and compute
scores in the model's dtype), and ``add_cross_attention`` (an encoder-decoder's
cross-attention).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
from jaxtyping import Array, Float

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.nn.params import shape
from jstd.nn.block import Block
from jstd.nn.causal_lm import CausalLM
from jstd.models.family import TextFamily, tied
from jstd.nn.mlp import MLP
from jstd.nn.namemap import Entry
from jstd.nn.norms import LayerNorm

GPT2_NAMES = {"attention_norm": "ln_1", "attn": "attn", "mlp_norm": "ln_2", "mlp": "mlp"}


def fused_columns(part: int, heads: int):
    """Conv1D ``c_attn`` ``[in, 3 * heads * dim]`` (columns ``q | k | v``) -> part ``part`` as ``[in, heads, dim]``;
    on its bias ``[3 * heads * dim]`` -> ``[heads, dim]``."""
    def take(w):
        w = w.reshape(*w.shape[:-1], 3, heads, -1)
        return w[..., part, :, :]
    return take


class Conv1DAttention(Attention):
    """``Attention`` whose checkpoint holds GPT-2's fused ``c_attn`` and ``c_proj`` (Conv1D, ``[in, out]``)."""

    def entries(self, names=None) -> list[Entry]:
        H = self.q.shape[-2]
        return [
            *(Entry("c_attn.weight", p, fused_columns(i, H)) for i, p in enumerate(("q", "k", "v"))),
            *(Entry("c_attn.bias", p, fused_columns(i, H)) for i, p in enumerate(("q_bias", "k_bias", "v_bias"))),
            Entry("c_proj.weight", "o", lambda w: w.reshape(H, -1, w.shape[-1])), Entry("c_proj.bias", "o_bias"),
        ]


class Conv1DMLP(MLP):
    """``MLP`` whose checkpoint holds GPT-2's ``c_fc`` / ``c_proj`` (Conv1D: stored ``[in, out]``, read as is)."""

    def entries(self, names=None) -> list[Entry]:
        return [Entry("c_fc.weight", "fc1"), Entry("c_fc.bias", "fc1_bias"),
                Entry("c_proj.weight", "fc2"), Entry("c_proj.bias", "fc2_bias")]


class GPT2LM(CausalLM):
    """A ``CausalLM`` with learned absolute positions: ``position_embed`` ``[max positions, embed]``; block 0 reads
    ``token_embeddings + position_embeddings``. Position ``p`` reads row ``p + position_offset`` (OPT's 2). A position
    past the table (``position_limit``) is refused before the gather and never clamped: by ``check_inputs`` (more
    tokens than the table), by ``jstd.run``'s context check (a continued run's ``Context.positions``, also traced)
    and by ``jstd.generate`` before it compiles (its decoding steps)."""

    position_embed: Float[Array, "positions embed"] = eqx.field(default=None, metadata={"axes": ("positions", "embed")})
    position_offset: int = eqx.field(static=True, default=0)

    def enter_positions(self, h, positions, s):
        return h + s("position_embeddings", self.position_embed[positions + self.position_offset].astype(h.dtype))

    @property
    def sites(self) -> frozenset[str]:
        return super().sites | {"position_embeddings"}

    @property
    def position_limit(self) -> int:
        return self.position_embed.shape[0] - self.position_offset

    def check_inputs(self, inputs) -> None:
        super().check_inputs(inputs)
        seq, most = inputs.tokens.shape[-1], self.position_limit
        if seq > most:
            raise ValueError(f"{seq} tokens are more than this {self.family} model's {most} learned positions "
                             f"(n_positions / max_position_embeddings); pass at most {most} tokens a row")


class GPT2(TextFamily):
    family = "gpt2"
    model_types = ("gpt2",)
    model_class = GPT2LM
    embed_name, final_norm_name, blocks_name = "transformer.wte", "transformer.ln_f", "transformer.h.{i}"
    block_names = GPT2_NAMES
    # the summary_* keys configure GPT2DoubleHeadsModel's classification head, which a causal LM does not have;
    # n_ctx: the context of the first hub configs (n_positions is what transformers reads)
    handled = TextFamily.handled | {
        "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "n_ctx", "activation_function",
        "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
        "add_cross_attention", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
        "summary_first_dropout"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        for key, why in (("scale_attn_by_inverse_layer_idx", "a score scale that differs by block (1 / (layer + 1))"),
                         ("reorder_and_upcast_attn", "scores computed in float32 outside autocast"),
                         ("add_cross_attention", "cross-attention blocks (an encoder-decoder's)")):
            if getattr(hf, key, False):
                raise ValueError(f"gpt2: {key}=True ({why}) is not supported; jstd runs GPT-2's causal blocks "
                                 f"with one scale for every block; set {key} to false only if the checkpoint was "
                                 "trained without it")
        head_dim = hf.hidden_size // hf.num_attention_heads
        return ModelConfig(
            model_type=hf.model_type, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads, num_kv_heads=hf.num_attention_heads, head_dim=head_dim,
            qk_head_dim=head_dim, vocab_size=hf.vocab_size, intermediate_size=hf.n_inner or 4 * hf.hidden_size,
            layer_types=cls.layer_types(hf))

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> LayerNorm:
        return LayerNorm.skeleton(c.hidden_size, hf.layer_norm_epsilon, dtype)

    @classmethod
    def rotary(cls, hf, c: ModelConfig):
        return None  # learned absolute positions

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        scale = c.head_dim ** -0.5 if hf.scale_attn_weights else 1.0
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=Conv1DAttention.skeleton(c.hidden_size, c.num_heads, c.num_heads, c.head_dim, scale, True, True,
                                          dtype),
            attention_post_norm=None,
            mlp_norm=cls.norm(hf, c, dtype),
            mlp=Conv1DMLP.skeleton(c.hidden_size, c.intermediate_size, hf.activation_function, dtype),
            mlp_post_norm=None,
        )

    @classmethod
    def skeleton(cls, hf, dtype) -> GPT2LM:
        model = super().skeleton(hf, dtype)
        return dataclasses.replace(model, position_embed=shape(hf.max_position_embeddings, hf.hidden_size,
                                                               dtype=dtype))  # GPT-2's n_positions

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        """TextFamily's, with the learned position table."""
        return super().name_map(hf, skeleton) + [Entry("transformer.wpe.weight", "position_embed")]

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        # the hub's GPT-2 checkpoints store the base model's tensors without the "transformer." prefix
        return {"transformer.": ("transformer.", "")}

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # the causal-mask buffers older checkpoints saved; a tied head stored anyway is the embedding itself
        return ("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias") + (
            ("lm_head.weight",) if tied(hf) else ())
