"""``jstd.run``: inputs (and edits) in, logits and the values read out."""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.core import compile_cache  # noqa: F401 (importing it turns on jax's persistent compilation cache)
from jstd.core.context import Context, check_context
from jstd.core.checks import check_message, checked, trusting
from jstd.core.edits import as_edits, check_left_padded
from jstd.core.inputs import Inputs, as_inputs, token_array, with_layout
from jstd.core.jit import combine, partition
from jstd.core.memo import per_model
from jstd.nn.model import Model
from jstd.core.sites import SITES, SiteError, near, parse
from jstd.core.tap import Tap


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
    """Raise SiteError for a name the model does not serve, saying why and listing near names.

    Names found served are remembered for the model (a repeated call costs a
    set lookup, not a walk over its blocks)."""
    served = _memo(model).served
    for name in names:
        if name in served:
            continue
        base, index = parse(name)
        if (SITES[base].parent or base) not in model.sites:  # a dictionary's site: where its parent is served
            base = SITES[base].parent or base
            hint = near(base, model.sites)
            raise SiteError(
                f"{what} {name!r} is unavailable on this {model.family} model: {model.unavailable(base)}."
                + (f" Nearest names it has: {', '.join(hint)}." if hint else "")
            )
        if index is not None:
            model.row_of(base, index, f"{what} {name!r}")
        served.add(name)


class _ModelMemo(NamedTuple):
    """What ``run`` keeps about one model object: the names ``check_sites`` passed, and the model split for the
    jit (``partition``), so a repeated call neither walks its blocks nor flattens it."""

    served: set[str]
    split: tuple


_memo = per_model(lambda model: _ModelMemo(set(), partition(model)))  # dropped with the model


def check_tokens(tokens, vocab_size: int):
    """Token ids outside [0, vocab_size) raise here, before the embedding gather clamps them.

    Concrete ids (checked in their own dtype: an int64 id past 2**31 is out of
    range, not wrapped) raise a ValueError at once; traced ids (under jit)
    raise an equinox runtime error when the compiled call runs.
    """
    msg = f"token ids must lie in [0, {vocab_size}) for this model's vocabulary; check the tokenizer matches the checkpoint"
    # in range, a concrete array is returned as it is: jit's cast of int64 ids to int32 then keeps every id
    return checked(tokens, lambda xp, t: (t < 0) | (t >= vocab_size), msg,
                   concrete=lambda t, bad: f"token id {int(t[bad].flat[0])} is out of range: {msg}")


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
    edits)`` works as written; ``reads`` (site names; None reads nothing) is
    static (``static_argnames="reads"``). Called eagerly, ``run`` checks its
    arguments at once and then runs through a jit cached on the call's
    structure (``reads``, the edits' sites and types, shapes), so a repeated
    call costs what a jitted one does and a loop over edit values compiles
    once. Only what is read is materialized. Edits apply in list order at their
    sites and everything downstream computes from the edited value.
    Left-padded rows with an attention mask (zeros are padding) give, at their
    real positions, the values of the unpadded prompt.

    ``context`` (``jstd.Context``): the tokens continue earlier positions (a
    cache of their keys, values and states) and may start at a later block
    from a given stream; ``positions`` then index the tokens' own seq axis.

    Raises SiteError for unknown, unavailable or read-only sites and edits that
    do not fit their site, ValueError for token ids outside the vocabulary,
    empty, ragged or non-integer tokens, inputs the model does not take, or a
    context that does not fit the model and tokens; TypeError for text and
    reads that are not site names.
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
    reads = as_reads(reads)
    edits = as_edits(edits)
    check_sites(model, reads, "read")
    check_sites(model, [e.site for e in edits], "edit at")
    edits = tuple(_check_layer(model, e) for e in edits)
    type(model).check_inputs(model, inputs)  # through the class: equinox's bound method costs ~0.1 ms a call
    if inputs.tokens is not None:
        tokens = token_array(inputs.tokens)
        mask = inputs.attention_mask
        if mask is not None:
            mask = mask if isinstance(mask, jax.Array) else np.asarray(mask)
            if mask.shape != tokens.shape:
                raise ValueError(f"attention_mask has shape {mask.shape}; it must match tokens' {tokens.shape}")
            if any(parse(r)[0] == "next_token_probs" for r in reads):
                mask = check_left_padded(mask, "reads=('next_token_probs',)")
        tokens = check_tokens(tokens, model.config.vocab_size)
        if tokens is not inputs.tokens or mask is not inputs.attention_mask:  # (an Inputs costs ~30 us to build)
            inputs = Inputs(tokens, mask, inputs.images, inputs.layout)
    if context is not None:
        if inputs.tokens is None:
            raise ValueError(f"a {model.family} model runs on images alone and has no cache to continue: drop context=")
        context = check_context(model, context, inputs.tokens.shape, inputs.attention_mask, reads)
    return _compiled(model, inputs, edits, context, reads)


def as_reads(reads) -> tuple[str, ...]:
    """``reads`` as a tuple of site names: one name, a sequence of names, or None (nothing read)."""
    if reads is None:
        return ()
    reads = (reads,) if isinstance(reads, str) else tuple(reads)
    for r in reads:
        if not isinstance(r, str):
            raise TypeError(f"reads are site names (strings), e.g. reads=('layers.layer_output',); got {r!r}")
    return reads


def _compiled(model: Model, inputs: Inputs, edits: tuple, context: Context | None, reads: tuple[str, ...]) -> Outputs:
    """``forward`` through one jit cached on the call's structure, so an eager ``run`` costs what a jitted one does.

    Every array-like leaf (arrays, numpy arrays, Python numbers: the weights,
    the inputs, the edits' values, layers and selections, the context) is a
    dynamic argument, as under ``jax.jit(jstd.run)``: a loop over edit values or
    layers compiles once. Everything else — the pytree structure with its
    static fields (sites, ``Inputs.layout``, an ``Apply``'s plain function) and
    ``reads`` — keys the cache; a new function object compiles anew (hold it,
    or give ``Apply`` an equinox module). Under an outer transformation
    (``jax.jit``, ``vmap``, ``grad``) the inner jit is traced into it.
    Unhashable static leaves run without the cache.
    """
    model_dynamic, model_fixed, model_def = _memo(model).split  # a model object is split once
    dynamic, fixed, treedef = partition((inputs, edits, context))
    structure = (model_def, model_fixed, treedef, fixed, trusting())  # a trace without checks is not reused with
    try:
        hash(structure)
    except TypeError:
        return forward(model, inputs, edits, context, reads)
    try:
        return _jit_forward(model_dynamic, dynamic, structure, reads)
    except jax.errors.JaxRuntimeError as error:  # an eager call's failed check: its own message as the first line
        message = check_message(error)
        if message is None:
            raise
        raise ValueError(message) from None


@functools.partial(jax.jit, static_argnums=(2, 3))
def _jit_forward(model_dynamic: list, dynamic: list, structure: tuple, reads: tuple[str, ...]) -> Outputs:
    model_def, model_fixed, treedef, fixed, _ = structure
    return forward(combine(model_dynamic, model_fixed, model_def), *combine(dynamic, fixed, treedef), reads)


def forward(model: Model, inputs: Inputs, edits: tuple, context: Context | None, reads: tuple[str, ...]) -> Outputs:
    """The forward of checked arguments (what ``run`` calls once it has checked them; no check here): taps for ``reads`` and ``edits``, the model's forward, the reads by name."""
    bases = frozenset(parse(r)[0] for r in reads) | ({"logits"} if "next_token_probs" in reads else frozenset())
    num_blocks = {s: len(model.blocks_for(s)) for s in model.sites if SITES[s].per_block}
    num_blocks.update({s: num_blocks[p.parent] for s, p in SITES.items() if p.parent in num_blocks})
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
    if left and SITES[left[0].site].parent:
        raise SiteError(f"edit at {left[0].site!r} was not applied: no dictionary is spliced at "
                        f"{SITES[left[0].site].parent} on this block; pass jstd.splice(model, sae, "
                        f"{SITES[left[0].site].parent!r}, layer=...) among the edits")
    if left:
        raise SiteError(f"edit at {left[0].site!r} was not applied: the {model.family} forward does not compute it on this call")

    values = {}
    for name in reads:
        base, index = parse(name)
        if base == "next_token_probs":
            values[name] = jax.nn.softmax(logits[:, -1].astype(jnp.float32), axis=-1)
        elif base not in recorded and SITES[base].parent:
            raise SiteError(f"read {name!r}: no dictionary is spliced at {SITES[base].parent} on this call; pass "
                            f"jstd.splice(model, sae, {SITES[base].parent!r}, layer=...) among the edits")
        elif index is None:
            values[name] = recorded[base]
        else:
            index %= depths[SITES[base].stack]
            if isinstance(recorded[base], dict):  # kept for the blocks read alone
                values[name] = recorded[base][index]
            else:
                values[name] = recorded[base][model.row_of(base, index)]
    return Outputs(logits, values)


def _check_layer(model: Model, edit):
    """``edit`` with its ``layer`` checked (``Model.check_block``); the caller uses the edit returned.

    A concrete bad layer (out of ``-L..L-1``, a block without the site's host,
    not one integer) raises SiteError now; a traced one (``jax.jit(jstd.run)``,
    a ``vmap`` over layers) raises an equinox runtime error when the call runs.
    """
    if edit.layer is None:
        return edit
    key = (edit.site, edit.layer) if type(edit.layer) is int else None  # a layer already checked on this model
    served = _memo(model).served
    if key is not None and key in served:
        return edit
    layer = model.check_block(edit.site, edit.layer, f"{type(edit).__name__} at {edit.site}")
    if key is not None:
        served.add(key)
    return edit if layer is edit.layer else eqx.tree_at(lambda e: e.layer, edit, layer)


def project_on_vocab(model: Model, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
    """The final norm, the head and whatever the family does after it: ``logit_lens`` exact at the last block."""
    return model.project_on_vocab(hidden)
