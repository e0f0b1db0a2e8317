"""The causal language model every text family assembles: embedding, a stack of blocks, final norm and head.

    x      = embed[tokens] · embedding_multiplier           # token_embeddings before the multiplier
    h      = layers(x)                                       # the Stack, scanned by period
    logits = lm_head(final_norm(h)) · logits_scaling         # lm_head_output before the scaling
    logits = tanh(logits / cap) · cap                        # final_logit_softcapping (Gemma 2), when set

Blocks of different kinds (``config.layer_types``) may attend differently:
a block whose ``Attention`` has a ``sliding_window`` gets the causal mask
narrowed to its window, and a kind may have its own rotary (``kind_rotary``:
Gemma 3's local layers), so the stack receives the attention's arguments by
block kind where they differ (``attention_args``).

A family declares its blocks (``TextFamily.block``), its checkpoint's module
names (``TextFamily.names``) and the few numbers that differ (multipliers, the
rotary's dtype); everything else is here, once.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jstd.core.config import ModelConfig
from jstd.core.context import begin
from jstd.models.namemap import Entry, linear
from jstd.kernels.attention import block_mask, window_mask
from jstd.kernels.rope import Rotary
from jstd.kernels.softcap import softcap
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
    final_logit_softcapping: float | None = eqx.field(static=True, default=None)
    kind_rotary: tuple[tuple[str, Rotary | None], ...] = eqx.field(static=True, default=())  # block kind -> rotary

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
    def lookup(self, tokens) -> Float[Array, "batch seq embed"]:
        """The embedding module's output (``token_embeddings``): the rows of ``embed`` (Gemma's scales them)."""
        return self.embed[tokens]

    def enter_blocks(self, embeddings):
        """What block 0 reads, from the token embeddings (times the embedding multiplier, rounded once)."""
        return embeddings if self.embedding_multiplier == 1.0 else rounded(times(embeddings, self.embedding_multiplier))

    def enter_positions(self, h: Float[Array, "batch seq embed"], positions, s) -> Float[Array, "batch seq embed"]:
        """Block 0's input from the embedded stream ``h`` and the tokens' ``positions``: ``h`` itself here (a rotary
        turns positions inside attention); learned absolute positions add their rows (GPT-2)."""
        return h

    def head(self, normed: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        return normed @ (self.embed.T if self.lm_head is None else self.lm_head)

    def scaled_logits(self, head_output: Float[Array, "... vocab"]) -> Float[Array, "... vocab"]:
        """The head's output times ``logits_scaling`` (the identity at 1): the logits before any soft-cap."""
        return head_output if self.logits_scaling == 1.0 else times(head_output, self.logits_scaling)

    def finish_logits(self, head_output: Float[Array, "... vocab"]) -> Float[Array, "... vocab"]:
        """The logits from the head's output: scaled, then soft-capped (``final_logit_softcapping``)."""
        return softcap(self.scaled_logits(head_output), self.final_logit_softcapping)

    def logits_from_norm(self, normed: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """The logits from ``final_norm_output``: the head and whatever the family does after it (the cap too)."""
        return self.finish_logits(self.head(normed))

    @property
    def logit_softcap(self) -> float | None:
        """The final logits' soft-cap (``tanh(x / cap) · cap``), None without one."""
        return self.final_logit_softcapping

    def readout(self):
        """``(final_norm, linear)``: the final RMSNorm and the linear map from its output to the logits *before*
        the final soft-cap (``logit_softcap``; the logits themselves without one), for direct logit attribution."""
        return self.final_norm, lambda normed: self.scaled_logits(self.head(normed))

    def rotary_for(self, kind: str) -> Rotary | None:
        """The rotary of blocks of ``kind``: its own (``kind_rotary``) or the model's."""
        return dict(self.kind_rotary).get(kind, self.rotary)

    def attention_args(self, positions, mask, context, seq: int, dtype):
        """``self_attn``'s arguments ``(cos_sin, mask)``, or block kind -> them where kinds differ: a sliding
        window narrows the mask (indices: the sequence's, ``Context.indices`` on a continued run), a kind's
        own rotary gives its cos/sin."""
        cos_sin = {}

        def angles(rotary):
            if rotary not in cos_sin:
                cos_sin[rotary] = None if rotary is None else rotary.cos_sin(positions, dtype)
            return cos_sin[rotary]

        stack = self.layers
        windows = {}
        for q, slot in enumerate(stack.slots):
            if slot.has("self_attn"):
                windows.setdefault(stack.kinds[q], slot.attn.sliding_window)
        if all(w is None for w in windows.values()) and not self.kind_rotary:
            return angles(self.rotary), mask
        if context is None:
            index = jnp.arange(seq)[None]
            query_index, key_index = index, index
        else:
            query_index, key_index = context.indices(mask.shape[-1] - seq)
        by_kind = {}
        for kind, window in windows.items():
            narrowed = mask if window is None else mask & window_mask(query_index, key_index, window)
            by_kind[kind] = (angles(self.rotary_for(kind)), narrowed)
        return by_kind

    @staticmethod
    def block_overlay(blocks: Int[Array, "batch seq"], context, keys: int) -> Bool[Array, "batch 1 seq keys"]:
        """Where the tokens' bidirectional ``blocks`` let a token see a key ``[batch, 1, seq, keys]`` (the keys: a
        context's cached positions, which no block reaches, then the tokens; a block never spans two segments)."""
        same = block_mask(blocks, blocks)
        if context is None:
            return same
        segment, _ = context.segments()
        same = same & (segment[:, :, None] == segment[:, None, :])[:, None]
        return jnp.pad(same, ((0, 0), (0, 0), (0, 0), (keys - blocks.shape[1], 0)))

    def project_on_vocab(self, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """Final norm, head and whatever follows the head: the logit lens (exact at the last block)."""
        return self.logits_from_norm(self.final_norm(hidden))

    def forward(self, inputs, tap, context=None, merge=None, rope_positions=None, after_block=None, blocks=None):
        """``(logits, reads)``; ``merge`` (a wrapper's): a function of the token embeddings that puts the image
        features in, before the embedding multiplier (None: text alone). ``rope_positions``: a multimodal rotary's
        position ids ``[3, batch, seq]`` (a wrapper's, from the images; None: from the tokens, as text).
        ``after_block``: ``(h, block) -> h`` on each block's output before the next block reads it (a wrapper's
        DeepStack features; ``Stack``'s ``after``). ``blocks``: each token's bidirectional block ``[batch, seq]``
        (``kernels.attention.bidirectional_blocks``; a wrapper's: Gemma 3's images), -1 for none: the tokens of a
        block see each other, later ones too, in every block kind (OR-ed into the causal mask, then narrowed by a
        sliding window); on a continued run, within the run's own segments only."""
        tokens, attention_mask = inputs.tokens, inputs.attention_mask
        s = tap.scope()
        merged = (lambda x: x) if merge is None else merge
        embed = lambda: self.enter_blocks(merged(s("token_embeddings", self.lookup(tokens))))
        positions, mask, h = begin(tokens, attention_mask, context, embed)
        if context is None or context.stream is None:  # the run embeds its tokens (no stream handed in)
            h = self.enter_positions(h, positions, s)
        if self.mrope:
            if context is not None:
                rope = (jnp.broadcast_to(positions, (3, *positions.shape)) if context.rope_positions is None
                        else context.mrope_positions())
            elif rope_positions is not None:
                rope = rope_positions
            else:
                rope = mrope_positions(tokens, attention_mask, -1, (), 1)
            positions = s("positions", rope)
        if blocks is not None:  # padding never joins a block (transformers: (causal | block) & padding)
            real = attention_mask.astype(bool) if attention_mask is not None else (
                None if context is None else context.real())
            blocks = blocks if real is None else jnp.where(real, blocks, -1)
            mask = mask | self.block_overlay(blocks, context, mask.shape[-1])
        dtype = jnp.float32 if self.rotary_in_float32 else h.dtype
        attention = self.attention_args(positions, mask, context, tokens.shape[1], dtype)
        padding = None if attention_mask is None else attention_mask.astype(bool)
        pasts = {}
        if context is not None:
            padding = context.real()
            if context.keys is not None:
                pasts["self_attn"] = (context.keys, context.values)
            if context.states is not None:
                pasts["linear_attn"] = (context.states, context.conv_inputs)
        h, block_reads = self.layers(h, tap, {"self_attn": attention, "linear_attn": (None, padding)}, pasts,
                                     None if context is None else context.block, after=after_block)
        normed = s("final_norm_output", self.final_norm(h))
        logits = s("logits", self.finish_logits(s("lm_head_output", self.head(normed))))
        return logits, {**s.records, **block_reads}


class TextFamily(Family):
    """The declaration of a causal-LM family: override ``block`` (and, where they differ, ``names``,
    ``layer_types``, ``rotary``, ``extra``, ``norm``, ``ignored``; ``model_class``: a ``CausalLM`` subclass)."""

    model_class: ClassVar[type] = CausalLM
    SLIDING = "sliding_attention"  # the block kind whose attention has config.sliding_window

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
    def window(cls, hf, kind: str) -> int | None:
        """The sliding window of blocks of ``kind``: ``config.sliding_window`` on ``sliding_attention`` blocks,
        None (full attention) on every other kind."""
        return getattr(hf, "sliding_window", None) if kind == cls.SLIDING else None

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
        return cls.model_class(
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
