"""``Context``: where a run picks up — what earlier positions left for its tokens, and the block it starts at.

A plain run computes every block for positions ``0 .. seq-1``. A run with a
``Context`` computes its tokens at the ``positions`` the context gives, each
reading what the positions before it left in every block (softmax attention:
their keys and values; DeltaNet: the state after them and the mixer inputs its
convolutions still see), and may start at a later block from a given stream.
Generation (a cache grown token by token) and patching (resume a corrupted run
after the patched block and position) are both this one hook.

Segments. Along a row, a run of consecutive positions is a *segment*: it
continues the cached context from its first position ``start``. A token
attends to the cached positions before its segment's ``start`` and to the
tokens of its own segment up to itself. Cached entries at or after ``start``
are ignored, so the keys and values of one whole run serve every ``start``,
and one row may pack several segments (a new segment begins wherever a position
is not the previous one plus one). DeltaNet blocks carry one state per row, so
on models that have them each row is one segment.

Padding. With ``mask`` (the continued run's ``attention_mask`` over every
cached position), positions are indices into that run's sequence: padded
entries are never attended to, and a token's rotary position counts the real
tokens before it, as in the padded run itself.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from jstd.core.checks import checked, shown
from jstd.core.sites import SiteError
from jstd.kernels.attention import positions_and_mask


KEYS, VALUES = "layers.self_attn.attention_keys", "layers.self_attn.attention_values"
STATES, MIXER_INPUTS = "layers.linear_attn.states", "layers.attention_norm_output"
POSITIONS = "positions"  # multimodal RoPE's position ids


def cache_layout(model) -> tuple[tuple[str, tuple[int, int]], tuple[str, tuple[int, int]]]:
    """What each softmax-attention block caches per position, for ``Context.keys`` and ``Context.values``: ``((site,
    (heads, width)), (site, (heads, width)))``. The keys and values (``num_kv_heads`` heads of ``head_dim``) on
    every family but multi-head latent attention, whose blocks cache their latent and shared rotary key instead
    (``model.attention_cache``: ``kv_latent`` and ``rope_keys``, one "head" each)."""
    own = getattr(model, "attention_cache", None)
    if own is not None:
        return own
    c = model.config
    return (KEYS, (c.num_kv_heads, c.head_dim)), (VALUES, (c.num_kv_heads, c.head_dim))


def as_cached(value: Array) -> Array:
    """A cached site's value read over blocks in the cache's layout ``[blocks, batch, heads, seq, width]``
    (``[blocks, batch, seq, width]`` values, a latent's, get a heads axis of 1)."""
    return value if value.ndim == 5 else value[:, :, None]


class Context(eqx.Module):
    """What a run's tokens continue from. Every field but ``positions`` is optional.

    positions: each token's position ``[batch, seq]`` (the rotary angle, and
        which cached entries the token sees; see the module docstring).
    keys, values: the cached softmax-attention keys (after the rotary) and
        values ``[attention blocks, batch, kv_heads, cached, head_dim]``, as
        read at ``layers.self_attn.attention_keys`` / ``attention_values`` on the
        run being continued, stacked over the blocks that have ``self_attn``.
        On multi-head latent attention (DeepSeek) they hold what its blocks
        cache instead (``cache_layout``): ``kv_latent`` ``[blocks, batch, 1,
        cached, kv_lora_rank]`` and ``rope_keys`` ``[blocks, batch, 1, cached,
        qk_rope_head_dim]``.
    states: each DeltaNet block's state before the row's first position
        ``[linear blocks, batch, heads, key_dim, value_dim]`` (float32; what
        ``layers.linear_attn.states`` holds at that position minus one).
    conv_inputs: each DeltaNet block's mixer input (``attention_norm_output``)
        at the ``conv_width - 1`` positions before the row's first one
        ``[linear blocks, batch, conv_width - 1, embed]`` (zeros before position 0).
    mask: which cached positions hold real tokens ``[batch, cached]`` (the
        continued run's ``attention_mask``; None: all of them).
    block, stream: start at block ``block`` (an int or a traced int) whose
        ``layer_input`` is ``stream`` ``[batch, seq, embed]``; the embedding and
        the blocks before it do not run (their values read as zeros and edits
        there have no effect). ``block == num_layers`` runs no block.
    rope_positions: multimodal RoPE (Qwen2-VL): the continued run's position
        ids ``[3, batch, cached]`` (its ``positions``). A token at a cached
        position takes that position's three ids; a token past the run takes
        the row's largest id plus one plus its distance past the run (the rope
        delta), so text after an image keeps counting from where the image left
        the positions.
    """

    positions: Int[Array, "batch seq"]
    keys: Float[Array, "blocks batch kv_heads cached head_dim"] | None = None
    values: Float[Array, "blocks batch kv_heads cached head_dim"] | None = None
    states: Float[Array, "blocks batch heads key_dim value_dim"] | None = None
    conv_inputs: Float[Array, "blocks batch width embed"] | None = None
    block: Int[ArrayLike, ""] | None = None
    stream: Float[Array, "batch seq embed"] | None = None
    mask: Bool[Array, "batch cached"] | None = None
    rope_positions: Int[Array, "3 batch cached"] | None = None

    @staticmethod
    def sites_for(model) -> tuple[str, ...]:
        """The sites a run reads so that ``Context.continuing`` can build a context from its outputs."""
        reads = tuple(site for site, _ in cache_layout(model)) if model.layers_with("self_attn") else ()
        reads += (POSITIONS,) if POSITIONS in model.sites else ()
        return reads + ((STATES, MIXER_INPUTS) if model.layers_with("linear_attn") else ())

    @classmethod
    def continuing(cls, model, outputs, positions: Int[ArrayLike, "batch seq"], *, block=None, stream=None,
                   mask=None) -> "Context":
        """The context of tokens at ``positions`` continuing the run whose ``outputs`` read ``sites_for(model)``.

        The keys and values are the whole run's (each segment sees those before
        its start). On models with DeltaNet blocks each row is one segment
        starting at ``positions[:, 0]``: the states are the run's after the
        position before it (zeros at 0), the convolution inputs those of the
        positions before it (zeros before 0). Works with traced ``positions``
        (one ``vmap`` over starts). ``mask``: the run's ``attention_mask`` when it
        was padded.
        """
        positions = jnp.asarray(positions)
        keys = values = states = conv = None
        if model.layers_with("self_attn"):
            keys, values = (as_cached(outputs[site]) for site, _ in cache_layout(model))
        linear = model.layers_with("linear_attn")
        if linear:
            start = positions[:, 0]
            batch = jnp.arange(positions.shape[0])
            every = outputs[STATES]  # [blocks, batch, seq, heads, key_dim, value_dim]
            states = jnp.where((start > 0)[None, :, None, None, None], every[:, batch, jnp.maximum(start - 1, 0)], 0.0)
            rows = [model.blocks_for(MIXER_INPUTS).index(i) for i in linear]
            inputs = outputs[MIXER_INPUTS][jnp.asarray(rows)]  # [blocks, batch, seq, embed]
            before = start[:, None] - (model.conv_width - 1) + jnp.arange(model.conv_width - 1)  # [batch, width - 1]
            conv = inputs[:, batch[:, None], jnp.maximum(before, 0)]
            real = before >= 0
            if mask is not None:  # the mixer zeroes its input at padding
                real = real & jnp.asarray(mask, bool)[batch[:, None], jnp.maximum(before, 0)]
            conv = jnp.where(real[None, :, :, None], conv, 0.0).astype(inputs.dtype)
        return cls(positions, keys, values, states, conv, block, stream,
                   None if mask is None else jnp.asarray(mask, bool),
                   outputs[POSITIONS] if POSITIONS in model.sites else None)

    def segments(self) -> tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]:
        """Each token's segment (numbered along its row) and that segment's start position."""
        p = jnp.asarray(self.positions)
        index = jnp.arange(p.shape[1])
        new = jnp.concatenate([jnp.ones_like(p[:, :1], bool), p[:, 1:] != p[:, :-1] + 1], axis=1)
        first = jax.lax.cummax(jnp.where(new, index, 0), axis=1)
        return jnp.cumsum(new, axis=1), p - (index - first)

    def real(self) -> Bool[Array, "batch seq"] | None:
        """Whether each of the run's tokens is a real token (None without a ``mask``: all are; a token past the
        cached positions is real)."""
        if self.mask is None:
            return None
        p = jnp.asarray(self.positions)
        cached = self.mask.shape[1]
        return jnp.where(p < cached, jnp.take_along_axis(self.mask, jnp.clip(p, 0, cached - 1), axis=1), True)

    def rotary_positions(self) -> Int[Array, "batch seq"]:
        """Each token's rotary position: its position, or with a ``mask`` the count of real tokens before it
        (1 on padding, as ``kernels.attention.positions_and_mask``; past the cached positions, the cached real
        tokens plus the distance past them)."""
        p = jnp.asarray(self.positions)
        if self.mask is None:
            return p
        cached = self.mask.shape[1]
        count = jnp.cumsum(self.mask, axis=1)
        before = jnp.take_along_axis(count - 1, jnp.clip(p, 0, cached - 1), axis=1)
        before = jnp.where(p < cached, before, count[:, -1:] + p - cached)
        return jnp.where(self.real(), before, 1)

    def mrope_positions(self) -> Int[Array, "3 batch seq"]:
        """Each token's three multimodal-RoPE ids from ``rope_positions`` (see the field)."""
        p = jnp.asarray(self.positions)
        rope = jnp.asarray(self.rope_positions)
        cached = rope.shape[2]
        inside = jnp.take_along_axis(rope, jnp.clip(p, 0, cached - 1)[None], axis=2)
        real = jnp.ones(rope.shape[1:], bool) if self.mask is None else self.mask[:, :cached]
        top = jnp.max(jnp.where(real[None], rope, 0), axis=(0, 2)) + 1
        return jnp.where((p < cached)[None], inside, (top[:, None] + p - cached)[None])

    def attention_mask(self, cached: int) -> Bool[Array, "batch 1 seq keys"]:
        """True where a token attends: over ``cached`` cached positions, then the run's own tokens."""
        p = jnp.asarray(self.positions)
        segment, start = self.segments()
        seen = jnp.arange(cached)[None, None, :] < start[:, :, None]
        own = (segment[:, :, None] == segment[:, None, :]) & (p[:, None, :] <= p[:, :, None])
        if self.mask is not None:
            seen = seen & self.mask[:, None, :cached]
            own = own & self.real()[:, None, :]
        return jnp.concatenate([seen, own], axis=-1)[:, None]

    def indices(self, cached: int) -> tuple[Int[Array, "batch seq"], Int[Array, "batch keys"]]:
        """Each token's index and each key's (``cached`` cached positions, then the run's own tokens) in the
        sequence: what a sliding window counts (``kernels.attention.window_mask``)."""
        p = jnp.asarray(self.positions)
        before = jnp.broadcast_to(jnp.arange(cached, dtype=p.dtype), (p.shape[0], cached))
        return p, jnp.concatenate([before, p], axis=1)

def begin(tokens: Int[Array, "batch seq"], attention_mask, context: Context | None, embed):
    """A forward's start: ``(positions, mask, h)`` — position ids, the attention mask, block 0's (or the
    context's start block's) input. ``embed()`` gives the stream from the tokens; it is not called when
    the context brings its own stream."""
    if context is None:
        positions, mask = positions_and_mask(tokens, attention_mask)
        return positions, mask, embed()
    cached = 0 if context.keys is None else context.keys.shape[3]
    h = embed() if context.stream is None else context.stream
    return context.rotary_positions(), context.attention_mask(cached), h


def check_context(model, context: Context, shape: tuple[int, int], attention_mask, reads) -> Context:
    """``context`` checked to fit ``model`` and tokens of ``shape``: ValueError (or SiteError, TypeError) at once
    for what the shapes show; a traced ``block`` outside ``[0, num_layers]`` fails the compiled call. Returns the
    context to run with (its block carrying the check when traced)."""
    if not isinstance(context, Context):
        raise TypeError(f"context must be a jstd.Context, got {type(context).__name__}")
    if attention_mask is not None:
        raise ValueError("a run with a context takes no attention_mask: the padding of the run it continues "
                         "goes in context.mask, each token's position in context.positions")
    batch, seq = shape
    c = model.config
    if np.shape(context.positions) != shape:
        raise ValueError(f"context.positions has shape {np.shape(context.positions)}; it must match tokens' {shape}")
    expected = {}
    attention, linear = model.layers_with("self_attn"), model.layers_with("linear_attn")
    if context.keys is not None or context.values is not None:
        cached = np.shape(context.keys)[3] if np.ndim(context.keys) == 5 else "cached"
        (_, (kh, kw)), (_, (vh, vw)) = cache_layout(model)
        expected.update(keys=(len(attention), batch, kh, cached, kw), values=(len(attention), batch, vh, cached, vw))
    if context.states is not None or context.conv_inputs is not None:
        states = np.shape(context.states)
        width = np.shape(context.conv_inputs)[2] if np.ndim(context.conv_inputs) == 4 else "conv_width - 1"
        expected.update(states=(len(linear), batch) + tuple(states[2:]) if len(states) == 5 else "5 axes",
                        conv_inputs=(len(linear), batch, width, c.hidden_size))
    for name, want in expected.items():
        got = np.shape(getattr(context, name)) if getattr(context, name) is not None else None
        if got != want:
            raise ValueError(f"context.{name} has shape {got}; this model and batch need {want} "
                             f"([blocks with the host, batch, ...]; see jstd.Context)")
    if context.mask is not None:
        cached = np.shape(context.keys)[3] if context.keys is not None else np.shape(context.mask)[1]
        if np.shape(context.mask) != (batch, cached):
            raise ValueError(f"context.mask has shape {np.shape(context.mask)}; it must be {(batch, cached)}: "
                             "the padding of every cached position of each row")
    if attention and linear and (context.keys is None) != (context.states is None):
        raise ValueError("this hybrid model needs both the attention cache (keys, values) and the DeltaNet "
                         "cache (states, conv_inputs) in its context, or neither")
    if context.stream is not None:
        if np.shape(context.stream) != (batch, seq, c.hidden_size):
            raise ValueError(f"context.stream has shape {np.shape(context.stream)}; it must be "
                             f"{(batch, seq, c.hidden_size)} (the start block's layer_input at the tokens)")
        if context.block is None:
            raise ValueError("context.stream needs context.block: the block whose layer_input it is")
        if "token_embeddings" in reads:
            raise SiteError("token_embeddings is not computed on a run that starts from context.stream")
    elif context.block is not None:
        raise ValueError("context.block needs context.stream: the layer_input of that block at the tokens")
    context = _checked_positions(model, context)
    if context.block is None:
        return context
    message = f"context.block must be one block index in [0, {c.num_layers}]"
    if np.ndim(context.block) != 0:
        raise ValueError(f"{message}, got {context.block!r}")
    block = checked(context.block, lambda xp, b: (b < 0) | (b > c.num_layers), message,
                    concrete=lambda b, _: f"{message}, got {context.block!r}")
    return context if block is context.block else eqx.tree_at(lambda x: x.block, context, block)


def _checked_positions(model, context: Context) -> Context:
    """``context`` with its positions checked: indices into the sequence (0 or more), and below a learned position
    table's size (``model.position_limit``; a gather past it would read the last row, a negative one a row from
    the end). ValueError when concrete; the compiled call fails when traced."""
    limit = model.position_limit
    top = "" if limit is None else f" .. {limit - 1}"
    why = "" if limit is None else (f" (this {model.family} model's learned position table holds {limit} "
                                    "positions: n_positions)")
    message = f"context.positions must be positions in the sequence, 0{top}{why}"
    bad = (lambda xp, p: p < 0) if limit is None else (lambda xp, p: (p < 0) | (p >= limit))
    p = checked(context.positions, bad, message, concrete=lambda v, flags: f"{message}; got {shown(v[flags])}")
    return context if p is context.positions else eqx.tree_at(lambda x: x.positions, context, p)
