"""``jstd.run``: tokens (and edits) in, logits and the values read out."""

from __future__ import annotations

from typing import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.context import Context
from jstd.interventions.edits import as_edits
from jstd.models.base import Family
from jstd.sites import SITES, SiteError, near, parse
from jstd.tap import Tap


class Outputs(eqx.Module):
    """What one call returns: ``logits`` always, ``out[site]`` for every site read.

    ``out["layers.X"]`` is stacked over the blocks that have X's host, block
    axis first; ``out["layers.5.X"]`` is block 5 alone.
    """

    logits: Float[Array, "batch seq vocab"]
    values: dict[str, Array]

    def __getitem__(self, site: str) -> Array:
        if site == "logits":
            return self.logits
        if site not in self.values:
            raise KeyError(
                f"{site!r} was not read on this call; pass reads=(..., {site!r}) to jstd.run "
                f"(read: {', '.join(self.values) or 'nothing'})"
            )
        return self.values[site]

    def __contains__(self, site: str) -> bool:
        return site == "logits" or site in self.values

    def keys(self):
        return self.values.keys()


def check_sites(model: Family, names: Sequence[str], what: str) -> None:
    """Raise SiteError for a name the model does not serve, saying why and listing near names."""
    for name in names:
        base, index = parse(name)
        if base not in model.sites:
            hint = near(base, model.sites)
            raise SiteError(
                f"{what} {name!r} is unavailable on this {model.family} model: {model.unavailable(base)}."
                + (f" Nearest names it has: {', '.join(hint)}." if hint else "")
            )
        if index is not None:
            _check_block(model, base, index, f"{what} {name!r}")


def _check_block(model: Family, site: str, index: int, what: str) -> None:
    blocks = model.blocks_for(site)
    L = model.config.num_layers
    if not -L <= index < L or index % L not in blocks:
        raise SiteError(f"{what}: block {index} does not exist or has no {SITES[site].host}; blocks with it: {_ranges(blocks)}")


def _ranges(blocks):
    return f"{blocks[0]}..{blocks[-1]}" if blocks and list(blocks) == list(range(blocks[0], blocks[-1] + 1)) else str(list(blocks))


def check_tokens(tokens, vocab_size: int):
    """Token ids outside [0, vocab_size) raise here, before the embedding gather clamps them.

    Concrete ids raise a ValueError at once; traced ids (under jit) raise an
    equinox runtime error when the compiled call runs.
    """
    msg = f"token ids must lie in [0, {vocab_size}) for this model's vocabulary; check the tokenizer matches the checkpoint"
    if not isinstance(tokens, jax.core.Tracer):
        t = np.asarray(tokens)
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            bad = t[(t < 0) | (t >= vocab_size)]
            raise ValueError(f"token id {int(bad.flat[0])} is out of range: {msg}")
        return jnp.asarray(tokens)
    return eqx.error_if(tokens, (tokens < 0) | (tokens >= vocab_size), msg)


def run(
    model: Family,
    tokens: Int[Array, "batch seq"],
    edits=(),
    *,
    reads: Sequence[str] = (),
    attention_mask: Int[Array, "batch seq"] | None = None,
    images=None,
    context: Context | None = None,
) -> Outputs:
    """Run ``model`` on ``tokens`` with ``edits`` applied; return logits and the sites in ``reads``.

    ``jax.jit(jstd.run)(model, tokens, edits)`` works as written; ``reads`` is
    static (``static_argnames="reads"``). Only what is read is materialized.
    Edits apply in list order at their sites and everything downstream computes
    from the edited value. Left-padded rows with ``attention_mask`` (zeros are
    padding) give, at their real positions, the values of the unpadded prompt.

    ``context`` (``jstd.Context``): the tokens continue earlier positions (a
    cache of their keys, values and states) and may start at a later block
    from a given stream; ``positions`` then index the tokens' own seq axis.

    Raises SiteError for unknown, unavailable or read-only sites and edits that
    do not fit their site, ValueError for token ids outside the vocabulary or
    a context that does not fit the model and tokens.
    """
    if not isinstance(model, Family):
        raise TypeError(f"run takes a model from jstd.load, got {type(model).__name__}")
    if images is not None:
        raise ValueError(f"this {model.family} model is a text model and takes no images; drop images=")
    if isinstance(reads, str):
        reads = (reads,)
    edits = as_edits(edits)
    check_sites(model, reads, "read")
    check_sites(model, [e.site for e in edits], "edit at")
    for e in edits:
        _check_layer(model, e)
    tokens = jnp.asarray(tokens) if not isinstance(tokens, jax.core.Tracer) else tokens
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq] token ids, got shape {tokens.shape}; add a batch axis with tokens[None]")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if attention_mask is not None:
        attention_mask = jnp.asarray(attention_mask)
        if attention_mask.shape != tokens.shape:
            raise ValueError(f"attention_mask has shape {attention_mask.shape}; it must match tokens' {tokens.shape}")
    tokens = check_tokens(tokens, model.config.vocab_size)
    if context is not None:
        check_context(model, context, tokens.shape, attention_mask, reads)

    bases = frozenset(parse(r)[0] for r in reads) | ({"logits"} if "next_token_probs" in reads else frozenset())
    num_blocks = {s.name: len(model.blocks_for(s.name)) for s in SITES.values() if s.per_block}
    L = model.config.num_layers
    whole = {parse(r)[0] for r in reads if parse(r)[1] is None}
    single = {}
    for r in reads:
        base, index = parse(r)
        if index is not None and base not in whole:
            single[base] = tuple(sorted(set(single.get(base, ())) | {index % L}))
    tap = Tap(bases - {"next_token_probs"}, edits, L, num_blocks, single)
    logits, recorded = model.forward(tokens, tap, attention_mask) if context is None else \
        model.forward(tokens, tap, attention_mask, context)
    left = tap.unapplied()
    if left:
        raise SiteError(f"edit at {left[0].site!r} was not applied: the {model.family} forward does not compute it on this call")

    values = {}
    for name in reads:
        base, index = parse(name)
        if base == "next_token_probs":
            values[name] = jax.nn.softmax(logits[:, -1].astype(jnp.float32), axis=-1)
        elif index is None:
            values[name] = recorded[base]
        elif isinstance(recorded[base], dict):  # kept for the blocks read alone
            values[name] = recorded[base][index % L]
        else:
            values[name] = recorded[base][model.blocks_for(base).index(index % L)]
    return Outputs(logits, values)


def check_context(model: Family, context: Context, shape: tuple[int, int], attention_mask, reads) -> None:
    """Raise ValueError where ``context`` does not fit ``model`` and tokens of ``shape`` (static checks)."""
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
        kv = (len(attention), batch, c.num_kv_heads, cached, c.head_dim)
        expected.update(keys=kv, values=kv)
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
    if context.block is not None and not isinstance(context.block, jax.core.Tracer):
        if np.ndim(context.block) != 0 or not 0 <= int(context.block) <= c.num_layers:
            raise ValueError(f"context.block must be one block index in [0, {c.num_layers}], got {context.block!r}")


def _check_layer(model: Family, edit) -> None:
    layer = edit.layer
    if layer is None or isinstance(layer, jax.core.Tracer):
        return
    if np.ndim(layer) != 0 or not np.issubdtype(np.asarray(layer).dtype, np.integer):
        raise SiteError(f"{type(edit).__name__} at {edit.site}: layer must be one integer block index, got {layer!r}")
    _check_block(model, edit.site, int(layer), f"{type(edit).__name__} at {edit.site}")


def project_on_vocab(model: Family, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
    """The final norm, the head and whatever the family does after it: ``logit_lens`` exact at the last block."""
    return model.project_on_vocab(hidden)
