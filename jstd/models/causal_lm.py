"""The causal language model every text family assembles: embedding, a stack of blocks, final norm and head.

    x      = embed[tokens] · embedding_multiplier           # token_embeddings before the multiplier
    h      = layers(x)                                       # the Stack, scanned by period
    logits = lm_head(final_norm(h)) · logits_scaling         # lm_head_output before the scaling

A family declares its blocks (``TextFamily.block``), its checkpoint's module
names (``TextFamily.names``) and the few numbers that differ (multipliers, the
rotary's dtype); everything else is here, once.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from jstd.core.config import ModelConfig
from jstd.core.context import begin
from jstd.models.namemap import Entry, linear
from jstd.kernels.rope import Rotary
from jstd.kernels.rope_config import rotary_from_config
from jstd.kernels.rounding import rounded, times
from jstd.models.base import Family, Model, param, shape
from jstd.models.block import LLAMA_NAMES
from jstd.models.norms import RMSNorm
from jstd.models.stack import Stack
from jstd.kernels.mrope import mrope_positions

TEXT_MODEL_SITES = frozenset({"token_embeddings", "final_norm_output", "lm_head_output", "logits", "next_token_probs"})


class CausalLM(Model):
    """A causal LM. Arrays: ``embed`` [vocab, embed], ``layers`` (a ``Stack``), ``final_norm``,
    ``lm_head`` [embed, vocab] (None when tied to ``embed``: the head is ``embed.T``, one array)."""

    embed: Float[Array, "vocab embed"] = param("vocab", "embed")
    layers: Stack
    final_norm: RMSNorm
    lm_head: Float[Array, "embed vocab"] | None = param("embed", "vocab")
    rotary: Rotary | None = eqx.field(static=True)
    embedding_multiplier: float = eqx.field(static=True, default=1.0)
    logits_scaling: float = eqx.field(static=True, default=1.0)
    rotary_in_float32: bool = eqx.field(static=True, default=False)  # OLMo's rotary returns float32 cos/sin

    model_sites: ClassVar[frozenset[str]] = TEXT_MODEL_SITES

    @property
    def stacks(self) -> dict:
        return {"layers": self.layers}

    @property
    def decoder(self) -> "CausalLM":
        """The model itself: a causal LM decodes its own tokens."""
        return self

    def unstacked(self, take: Callable[[Array, int], Array]) -> "CausalLM":
        """The same model with its stack's blocks held one by one (``Stack.unstacked``) and run unrolled, not
        scanned: each block reads its own arrays. ``take(a, j)``: row ``j`` of a stacked array (a view, a copy)."""
        return eqx.tree_at(lambda m: m.layers, self, self.layers.unstacked(take))

    @property
    def mrope(self) -> bool:
        """Whether the rotary is multimodal (Qwen2-VL): positions are three streams, served as ``positions``."""
        return self.rotary is not None and self.rotary.mrope_section is not None

    @property
    def rope_sites(self) -> frozenset[str]:
        return frozenset({"positions"}) if self.mrope else frozenset()

    @property
    def sites(self) -> frozenset[str]:
        return super().sites | self.rope_sites

    @property
    def conv_width(self) -> int | None:
        """The DeltaNet convolutions' width (None without DeltaNet blocks)."""
        slot = self.layers.slot_with("linear_attn")
        return None if slot is None else slot.attn.conv_width

    def check_inputs(self, inputs) -> None:
        if inputs.tokens is None:
            raise ValueError(f"this {self.family} model is a text model: it runs on token ids (Inputs.tokens)")
        if inputs.images is not None:
            raise ValueError(f"this {self.family} model is a text model and takes no images; drop them from the inputs")

    # ---- the forward -------------------------------------------------------
    def enter_blocks(self, embeddings):
        """What block 0 reads, from the token embeddings (times the embedding multiplier, rounded once)."""
        return embeddings if self.embedding_multiplier == 1.0 else rounded(times(embeddings, self.embedding_multiplier))

    def head(self, normed: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        return normed @ (self.embed.T if self.lm_head is None else self.lm_head)

    def finish_logits(self, head_output: Float[Array, "... vocab"]) -> Float[Array, "... vocab"]:
        """The logits from the head's output (times ``logits_scaling``; the identity at 1)."""
        return head_output if self.logits_scaling == 1.0 else times(head_output, self.logits_scaling)

    def logits_from_norm(self, normed: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """The logits from ``final_norm_output``: the head and whatever the family does after it."""
        return self.finish_logits(self.head(normed))

    def readout(self):
        """``(final_norm, logits_from_norm)``: the final RMSNorm and the (linear) map from its output to the
        logits, for direct logit attribution."""
        return self.final_norm, self.logits_from_norm

    def project_on_vocab(self, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """Final norm, head and whatever follows the head: the logit lens (exact at the last block)."""
        return self.logits_from_norm(self.final_norm(hidden))

    def forward(self, inputs, tap, context=None, merge=None, rope_positions=None, after_block=None):
        """``(logits, reads)``; ``merge`` (a wrapper's): a function of the token embeddings that puts the image
        features in, before the embedding multiplier (None: text alone). ``rope_positions``: a multimodal rotary's
        position ids ``[3, batch, seq]`` (a wrapper's, from the images; None: from the tokens, as text).
        ``after_block``: ``(h, block) -> h`` on each block's output before the next block reads it (a wrapper's
        DeepStack features; ``Stack``'s ``after``)."""
        tokens, attention_mask = inputs.tokens, inputs.attention_mask
        s = tap.scope()
        merged = (lambda x: x) if merge is None else merge
        embed = lambda: self.enter_blocks(merged(s("token_embeddings", self.embed[tokens])))
        positions, mask, h = begin(tokens, attention_mask, context, embed)
        if self.mrope:
            if context is not None:
                rope = (jnp.broadcast_to(positions, (3, *positions.shape)) if context.rope_positions is None
                        else context.mrope_positions())
            elif rope_positions is not None:
                rope = rope_positions
            else:
                rope = mrope_positions(tokens, attention_mask, -1, (), 1)
            positions = s("positions", rope)
        dtype = jnp.float32 if self.rotary_in_float32 else h.dtype
        cos_sin = None if self.rotary is None else self.rotary.cos_sin(positions, dtype)
        padding = None if attention_mask is None else attention_mask.astype(bool)
        pasts = {}
        if context is not None:
            padding = context.real()
            if context.keys is not None:
                pasts["self_attn"] = (context.keys, context.values)
            if context.states is not None:
                pasts["linear_attn"] = (context.states, context.conv_inputs)
        h, block_reads = self.layers(h, tap, {"self_attn": (cos_sin, mask), "linear_attn": (None, padding)}, pasts,
                                     None if context is None else context.block, after=after_block)
        normed = s("final_norm_output", self.final_norm(h))
        logits = s("logits", self.finish_logits(s("lm_head_output", self.head(normed))))
        return logits, {**s.records, **block_reads}


class TextFamily(Family):
    """The declaration of a causal-LM family: override ``block`` (and, where they differ, ``names``,
    ``layer_types``, ``rotary``, ``extra``, ``norm``, ``ignored``)."""

    handled = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
                         "rope_parameters", "rope_theta", "partial_rotary_factor", "max_position_embeddings",
                         "original_max_position_embeddings"})

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        """The standard sizes from a transformers config with the usual attribute names."""
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return ModelConfig(
            model_type=hf.model_type, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim, qk_head_dim=head_dim, vocab_size=hf.vocab_size,
            intermediate_size=hf.intermediate_size, layer_types=cls.layer_types(hf),
        )

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        """Each block's kind; every block is ``full_attention`` unless the family says otherwise."""
        return ("full_attention",) * hf.num_hidden_layers

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype):
        """The skeleton of one block of ``kind`` (a ``block.Block``)."""
        raise NotImplementedError

    @classmethod
    def names(cls, hf, kind: str) -> dict:
        """A block's HuggingFace module names (``Block.entries``)."""
        return LLAMA_NAMES

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> RMSNorm:
        """The final norm (and, by default, every block norm's shape)."""
        return RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype)

    @classmethod
    def rotary(cls, hf, c: ModelConfig) -> Rotary | None:
        return rotary_from_config(hf, c.head_dim)

    @classmethod
    def extra(cls, hf) -> dict:
        """CausalLM's static numbers that differ from their defaults (multipliers)."""
        return {}

    @classmethod
    def skeleton(cls, hf, dtype) -> CausalLM:
        c = cls.standard_config(hf)
        return CausalLM(
            config=c, family=cls.family,
            embed=shape(c.vocab_size, c.hidden_size, dtype=dtype),
            layers=Stack.skeleton("layers", c.layer_types, lambda kind: cls.block(hf, c, kind, dtype)),
            final_norm=cls.norm(hf, c, dtype),
            lm_head=None if tied(hf) else shape(c.hidden_size, c.vocab_size, dtype=dtype),
            rotary=cls.rotary(hf, c),
            **cls.extra(hf),
        )

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        skeleton = skeleton if skeleton is not None else cls.skeleton(hf, jnp.float32)
        return [
            Entry("model.embed_tokens.weight", "embed"),
            Entry("model.norm.weight", "final_norm.weight"),
            *([] if skeleton.lm_head is None else [Entry("lm_head.weight", "lm_head", linear)]),
            *skeleton.layers.name_map("layers", "model.layers.{i}.", lambda kind: cls.names(hf, kind)),
        ]

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # rotary buffers are recomputed; a tied head stored anyway is the embedding itself
        return ("*rotary_emb.inv_freq",) + (("lm_head.weight",) if tied(hf) else ())


class HybridTextFamily(TextFamily):
    """A text family whose blocks are gated DeltaNet (``linear_attention``) or softmax attention
    (``full_attention``) blocks as ``config.layer_types`` says (OLMo-Hybrid, Qwen3.5)."""

    LINEAR, FULL = "linear_attention", "full_attention"
    handled = TextFamily.handled | {"layer_types", "linear_num_key_heads", "linear_num_value_heads",
                                    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        """``config.layer_types``; ValueError naming any kind but the two."""
        kinds = tuple(hf.layer_types)
        unknown = set(kinds) - {cls.LINEAR, cls.FULL}
        if unknown:
            raise ValueError(f"{cls.family} layer_types holds {sorted(unknown)}; supported: {cls.LINEAR}, {cls.FULL}")
        return kinds


def tied(hf) -> bool:
    return bool(getattr(hf, "tie_word_embeddings", False))
