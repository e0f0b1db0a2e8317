"""``jstd.run``: inputs (and edits) in, logits and the values read out."""

from __future__ import annotations

from typing import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.context import Context, check_context
from jstd.edits import as_edits
from jstd.inputs import Inputs, as_inputs, token_array, with_layout
from jstd.models.base import Model
from jstd.sites import SITES, SiteError, near, parse
from jstd.tap import Tap


class Outputs(eqx.Module):
    """What one call returns: ``logits`` (None on a vision tower alone) and ``out[site]`` for every site read.

    ``out["layers.X"]`` is stacked over the blocks that have X's host, block
    axis first; ``out["layers.5.X"]`` is block 5 alone (likewise ``vision.layers``).
    """

    logits: Float[Array, "batch seq vocab"] | None
    values: dict[str, Array]

    def __getitem__(self, site: str) -> Array:
        if site == "logits" and self.logits is not None:
            return self.logits
        if site not in self.values:
            raise KeyError(
                f"{site!r} was not read on this call; pass reads=(..., {site!r}) to jstd.run "
                f"(read: {', '.join(self.values) or 'nothing'})"
            )
        return self.values[site]

    def __contains__(self, site: str) -> bool:
        return (site == "logits" and self.logits is not None) or site in self.values

    def keys(self):
        return self.values.keys()


def check_sites(model: Model, names: Sequence[str], what: str) -> None:
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


def _check_block(model: Model, site: str, index: int, what: str) -> None:
    blocks = model.blocks_for(site)
    L = model.depth(SITES[site].stack)
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
    model: Model,
    inputs: Int[Array, "batch seq"] | Inputs,
    edits=(),
    *,
    reads: Sequence[str] = (),
    attention_mask: Int[Array, "batch seq"] | None = None,
    images=None,
    context: Context | None = None,
) -> Outputs:
    """Run ``model`` on ``inputs`` with ``edits`` applied; return logits and the sites in ``reads``.

    ``inputs``: token ids ``[batch, seq]`` (with ``attention_mask=`` and
    ``images=``: pixel values or a dict of the processor's image arrays), a
    ``jstd.Inputs`` (tokens, attention_mask, images), or, outside jit, a
    tokenizer's or processor's output. ``jax.jit(jstd.run)(model, inputs,
    edits)`` works as written; ``reads`` is static (``static_argnames="reads"``).
    Only what is read is materialized. Edits apply in list order at their
    sites and everything downstream computes from the edited value.
    Left-padded rows with an attention mask (zeros are padding) give, at their
    real positions, the values of the unpadded prompt.

    ``context`` (``jstd.Context``): the tokens continue earlier positions (a
    cache of their keys, values and states) and may start at a later block
    from a given stream; ``positions`` then index the tokens' own seq axis.

    Raises SiteError for unknown, unavailable or read-only sites and edits that
    do not fit their site, ValueError for token ids outside the vocabulary,
    inputs the model does not take, or a context that does not fit the model
    and tokens.
    """
    if not isinstance(model, Model):
        raise TypeError(f"run takes a model from jstd.load, got {type(model).__name__}")
    inputs = as_inputs(inputs, attention_mask)
    if images is not None:  # the keyword form: a pixel array or the processor's image arrays
        if inputs.images is not None:
            raise ValueError("images are given twice: inside the inputs and as images=")
        inputs = Inputs(inputs.tokens, inputs.attention_mask, images if isinstance(images, dict) else
                        {"pixel_values": images})
    inputs = with_layout(inputs)
    if isinstance(reads, str):
        reads = (reads,)
    edits = as_edits(edits)
    check_sites(model, reads, "read")
    check_sites(model, [e.site for e in edits], "edit at")
    for e in edits:
        _check_layer(model, e)
    model.check_inputs(inputs)
    if inputs.tokens is not None:
        tokens = token_array(inputs.tokens)
        mask = inputs.attention_mask
        if mask is not None:
            mask = jnp.asarray(mask) if not isinstance(mask, jax.core.Tracer) else mask
            if mask.shape != tokens.shape:
                raise ValueError(f"attention_mask has shape {mask.shape}; it must match tokens' {tokens.shape}")
        inputs = Inputs(check_tokens(tokens, model.config.vocab_size), mask, inputs.images, inputs.layout)
    if context is not None:
        if inputs.tokens is None:
            raise ValueError(f"a {model.family} model runs on images alone and has no cache to continue: drop context=")
        check_context(model, context, inputs.tokens.shape, inputs.attention_mask, reads)

    bases = frozenset(parse(r)[0] for r in reads) | ({"logits"} if "next_token_probs" in reads else frozenset())
    num_blocks = {s: len(model.blocks_for(s)) for s in model.sites if SITES[s].per_block}
    depths = {prefix: stack.depth for prefix, stack in model.stacks.items()}
    whole = {parse(r)[0] for r in reads if parse(r)[1] is None}
    single = {}
    for r in reads:
        base, index = parse(r)
        if index is not None and base not in whole:
            single[base] = tuple(sorted(set(single.get(base, ())) | {index % depths[SITES[base].stack]}))
    tap = Tap(bases - {"next_token_probs"}, edits, depths, num_blocks, single)
    logits, recorded = model.forward(inputs, tap, context)
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
        else:
            index %= depths[SITES[base].stack]
            if isinstance(recorded[base], dict):  # kept for the blocks read alone
                values[name] = recorded[base][index]
            else:
                values[name] = recorded[base][model.blocks_for(base).index(index)]
    return Outputs(logits, values)


def _check_layer(model: Model, edit) -> None:
    layer = edit.layer
    if layer is None or isinstance(layer, jax.core.Tracer):
        return
    if np.ndim(layer) != 0 or not np.issubdtype(np.asarray(layer).dtype, np.integer):
        raise SiteError(f"{type(edit).__name__} at {edit.site}: layer must be one integer block index, got {layer!r}")
    _check_block(model, edit.site, int(layer), f"{type(edit).__name__} at {edit.site}")


def project_on_vocab(model: Model, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
    """The final norm, the head and whatever the family does after it: ``logit_lens`` exact at the last block."""
    return model.project_on_vocab(hidden)
