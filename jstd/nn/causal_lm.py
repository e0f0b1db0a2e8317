"""The causal language model every text family assembles: embedding, a stack of blocks, final norm and head.

    x      = embed[tokens] · embedding_multiplier           # token_embeddings before the multiplier
    h      = layers(x)                                       # the Stack, scanned by period
    logits = lm_head(final_norm(h)) · logits_scaling         # lm_head_output before the scaling
    logits = tanh(logits / cap) · cap                        # final_logit_softcapping (Gemma 2), when set

Blocks of different kinds (``config.layer_types``) may attend differently (a
sliding window, a rotary of their own: ``kind_rotary``); ``attention_inputs``
gives each kind its mask and cos/sin.

A family declares its blocks, its checkpoint's module names and the few numbers
that differ (``jstd.models.family.TextFamily``); the model is this one class.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from jstd.core.context import begin
from jstd.kernels.mrope import mrope_positions
from jstd.kernels.projection import add_bias
from jstd.kernels.rope import Rotary
from jstd.kernels.rounding import rounded, times
from jstd.kernels.softcap import softcap
from jstd.nn.attention_inputs import attention_inputs, bidirectional_overlay
from jstd.nn.model import Model
from jstd.nn.norms import RMSNorm
from jstd.nn.params import param
from jstd.nn.stack import Stack

TEXT_MODEL_SITES = frozenset({"token_embeddings", "final_norm_output", "lm_head_output", "logits", "next_token_probs"})


class CausalLM(Model):
    """A causal LM. Arrays: ``embed`` [vocab, embed], ``layers`` (a ``Stack``), ``final_norm`` (None where the
    blocks end normed: OPT-350M; then no ``final_norm_output``),
    ``lm_head`` [embed, vocab] (None when tied to ``embed``: the head is ``embed.T``, one array)."""

    embed: Float[Array, "vocab embed"] = param("vocab", "embed")
    layers: Stack
    final_norm: RMSNorm | None
    lm_head: Float[Array, "embed vocab"] | None = param("embed", "vocab")
    rotary: Rotary | None = eqx.field(static=True)
    embedding_multiplier: float = eqx.field(static=True, default=1.0)
    logits_scaling: float = eqx.field(static=True, default=1.0)
    rotary_in_float32: bool = eqx.field(static=True, default=False)  # OLMo's rotary returns float32 cos/sin
    final_logit_softcapping: float | None = eqx.field(static=True, default=None)
    kind_rotary: tuple[tuple[str, Rotary | None], ...] = eqx.field(static=True, default=())  # block kind -> rotary
    # the head's bias (GPT-J, Phi; None elsewhere)
    lm_head_bias: Float[Array, "vocab"] | None = eqx.field(default=None, metadata={"axes": ("vocab",)})

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
        # a model without a final norm (OPT-350M's post-norm blocks end normed) has no final_norm_output
        return (super().sites | self.rope_sites) - ({"final_norm_output"} if self.final_norm is None else set())

    @property
    def conv_width(self) -> int | None:
        """The DeltaNet convolutions' width (None without DeltaNet blocks)."""
        slot = self.layers.slot_with("linear_attn")
        return None if slot is None else slot.attn.conv_width

    @property
    def attention_cache(self):
        """What a softmax-attention block caches per position where its attention says so itself (multi-head latent
        attention: ``LatentAttention.cache_layout``); None: its keys and values (``core.context.cache_layout``)."""
        slot = self.layers.slot_with("self_attn")
        layout = getattr(getattr(slot, "attn", None), "cache_layout", None)
        return None if layout is None else layout()

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
        """The head's product (``lm_head_output``), plus its bias where it has one (GPT-J, Phi)."""
        return add_bias(normed @ (self.embed.T if self.lm_head is None else self.lm_head), self.lm_head_bias)

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
        if self.final_norm is None or any(getattr(slot, "norm_after_add", False) for slot in self.layers.slots):
            raise NotImplementedError(
                f"direct logit attribution needs the stream to be the sum of the blocks' contributions; this "
                f"{self.family} model's post-norm blocks norm it after every add (do_layer_norm_before=False), so no "
                "block's part of the logits is linear in its output: patch or ablate instead")
        return self.final_norm, lambda normed: self.scaled_logits(self.head(normed))

    def unavailable(self, site: str) -> str:
        if site == "final_norm_output" and self.final_norm is None:
            return (f"{self.family} has no final norm: its post-norm blocks end normed (do_layer_norm_before=False); "
                    "the head reads the last layer_output")
        return super().unavailable(site)

    def rotary_for(self, kind: str) -> Rotary | None:
        """The rotary of blocks of ``kind``: its own (``kind_rotary``) or the model's."""
        return dict(self.kind_rotary).get(kind, self.rotary)

    def project_on_vocab(self, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """Final norm, head and whatever follows the head: the logit lens (exact at the last block)."""
        return self.logits_from_norm(hidden if self.final_norm is None else self.final_norm(hidden))

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
            mask = mask | bidirectional_overlay(blocks, context, mask.shape[-1])
        dtype = jnp.float32 if self.rotary_in_float32 else h.dtype
        attention = attention_inputs(self.layers, self.rotary_for, positions, mask, context, tokens.shape[1], dtype)
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
        normed = h if self.final_norm is None else s("final_norm_output", self.final_norm(h))
        logits = s("logits", self.finish_logits(s("lm_head_output", self.head(normed))))
        return logits, {**s.records, **block_reads}
