"""``generate``: its checks, then one jitted program: the prefill and a ``lax.while_loop`` of decoding steps
(``cache.decode``), each row's token chosen by ``sampling.next_token``, the reads kept at each step's position."""

from __future__ import annotations

import functools
from typing import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from jstd.core.checks import checked, is_traced, shown
from jstd.core.config import ModelConfig
from jstd.core.edits import as_edits, check_left_padded, site_axes
from jstd.core.inputs import Inputs, as_inputs, token_array, with_layout
from jstd.core.jit import combine, partition
from jstd.core.sites import SITES, SiteError, parse
from jstd.generate.budget import check_fits, check_max_new_tokens, check_positions
from jstd.generate.cache import IMAGE_PREFIXES, as_bits, decode, from_bits, prefill, stepper
from jstd.generate.sampling import Sampling, next_token
from jstd.nn.model import Model
from jstd.run import as_reads, check_sites, check_tokens


class Generation(eqx.Module):
    """What ``generate`` returns.

    tokens: the prompt then the new tokens ``[batch, prompt + new]``; a row that
        produced an EOS id holds the pad id after it (as transformers), and
        every row does after the loop stopped early (all rows done).
    logits: each step's raw logits ``[batch, new, vocab]`` (before sampling):
        ``logits[:, i]`` chose new token ``i``; zeros for steps not run (every
        row had stopped).
    values: ``values[site]`` for each site read, at each step's position (the
        position whose logits chose new token ``i``: the last prompt position
        for ``i = 0``, then ``prompt + i - 1``), the site's position axis
        dropped and a new-token axis put right after the batch axis
        (``layers.layer_output``: ``[blocks, batch, new, hidden]``); zeros for
        steps not run.
    """

    tokens: Int[Array, "batch total"]
    logits: Float[Array, "batch new vocab"]
    values: dict[str, Array]

    def __getitem__(self, site: str) -> Array:
        if site not in self.values:
            raise KeyError(f"{site!r} was not read on this call; pass reads=(..., {site!r}) to jstd.generate "
                           f"(read: {', '.join(self.values) or 'nothing'})")
        return self.values[site]

    def keys(self):
        return self.values.keys()


def generate(
    model: Model,
    inputs: Int[ArrayLike, "batch prompt"] | Inputs,
    edits=(),
    *,
    max_new_tokens: int,
    reads: Sequence[str] = (),
    sampling: Sampling | None = None,
    key: PRNGKeyArray | None = None,
    eos_token_id: int | Sequence[int] | Int[ArrayLike, "ids"] | None = None,
    pad_token_id: int | Int[ArrayLike, ""] | None = None,
    attention_mask: Int[ArrayLike, "batch prompt"] | None = None,
) -> Generation:
    """Generate ``max_new_tokens`` tokens after ``inputs`` with ``edits`` applied at every step.

    ``inputs``: token ids ``[batch, prompt]`` (with ``attention_mask=``; rows
    padded on the LEFT, as ``jstd.load_processor`` pads), a ``jstd.Inputs``
    (images included: they enter the prefill), or outside jit a processor's
    output. ``edits``: as ``jstd.run``'s, with ``positions`` absolute in the
    growing sequence (non-negative; a boolean mask must cover
    ``prompt + max_new_tokens`` positions) and ``None`` meaning every position,
    new ones included; their value arrays broadcast against one position's
    value (a ``[hidden]`` vector, not a ``[seq, hidden]`` one). ``reads``: site
    names read at each step (see ``Generation.values``; not the tower's, the
    projector's or attention scores and probabilities: read those with
    ``jstd.run`` on ``Generation.tokens``). ``sampling``: None (greedy) or a
    ``Sampling``, which needs ``key``. ``eos_token_id``: the id or ids that end
    a row (None: the checkpoint's, ``model.config.eos_token_ids``, which
    ``jstd.load`` reads from its ``generation_config.json`` as transformers'
    ``generate`` does; ``()``: rows never end early). ``pad_token_id``: what
    follows a row's EOS (None: the checkpoint's, whether or not
    ``eos_token_id`` is given, as transformers pads with its generation
    config's; without one, the first EOS id). Ids passed must be token ids
    of the vocabulary (the checkpoint's are used as transformers uses them).

    Returns a ``Generation``. Each step's logits equal ``jstd.run`` on the
    whole sequence so far (the prompt's mask then ones) with the same edits.
    ``max_new_tokens`` and ``reads`` are static under ``jax.jit``
    (``static_argnames``); everything else may be traced, and ``jax.vmap``
    over the edits' arrays (strengths, layers) runs a sweep in one call.

    Raises ValueError for a bad ``max_new_tokens`` (one that runs a position past a learned position table, one
    whose preallocated
    cache and logits do not fit in the devices' free memory: before
    compiling, with the bytes it needs), a right-padded prompt, a prompt
    without tokens, prompt token ids outside the vocabulary (before compiling;
    traced ones fail the compiled call), sampling without a key, EOS or pad ids outside the
    vocabulary (a traced one fails the compiled call); SiteError for reads
    and edits generation cannot serve (and everything ``jstd.run`` raises).
    """
    if not isinstance(model, Model):
        raise TypeError(f"generate takes a model from jstd.load, got {type(model).__name__}")
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    if model.decoder is None:
        raise ValueError(f"a {model.family} model is a vision tower: it has no tokens to generate")
    inputs = _prompt(inputs, attention_mask)
    if model.config.vocab_size and not is_traced(inputs.tokens):  # before compiling (traced: the prefill's check)
        check_tokens(inputs.tokens, model.config.vocab_size)
    check_positions(model, np.shape(inputs.tokens)[1], max_new_tokens)
    check_fits(model, *np.shape(inputs.tokens), max_new_tokens)
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be None (greedy) or a jstd.Sampling, got {type(sampling).__name__}")
    if sampling is not None and key is None:
        raise ValueError("sampling draws tokens at random: pass key=jax.random.key(seed) (the same key gives the "
                         "same tokens)")
    reads = as_reads(reads)
    check_sites(model, reads, "read")
    for name in reads:
        _check_servable(name, "read")
    edits = _checked_edits(as_edits(edits), inputs.tokens.shape[1] + max_new_tokens)
    eos, pad = _eos_and_pad(model.config, eos_token_id, pad_token_id)
    key = jax.random.key(0) if key is None else key
    tree = (model, stepper(model), inputs, edits, sampling, key, eos, pad)
    dynamic, fixed, treedef = partition(tree)
    return _jit_generate(dynamic, (treedef, fixed), (max_new_tokens, reads))


def _prompt(inputs, attention_mask) -> Inputs:
    """``inputs`` as ``jstd.Inputs`` holding token ids and, if any, a left-padded mask (ValueError otherwise)."""
    inputs = with_layout(as_inputs(inputs, attention_mask))
    if inputs.tokens is None:
        raise ValueError("generate needs a prompt: token ids (jstd.Inputs.tokens)")
    tokens = token_array(inputs.tokens)
    mask = inputs.attention_mask
    if mask is not None:
        mask = check_left_padded(mask if isinstance(mask, jax.Array) else np.asarray(mask), "generate")
    return Inputs(tokens, mask, inputs.images, inputs.layout)


def _checked_edits(edits: tuple, total: int) -> tuple:
    """``edits`` with their positions checked against a sequence of ``total`` (``_check_positions``), each text
    edit at a site generation can serve (SiteError otherwise)."""
    edits = tuple(_check_positions(e, total) for e in edits)
    for e in edits:
        if not e.site.startswith(IMAGE_PREFIXES):
            _check_servable(e.site, f"{type(e).__name__} at")
    return edits


def _eos_and_pad(config: ModelConfig, eos_token_id, pad_token_id) -> tuple[Array, Array]:
    """``(eos ids [ids], pad id)``: ``eos_token_id`` (None: the checkpoint's EOS ids) and ``pad_token_id`` (None:
    the checkpoint's pad id, whether or not ``eos_token_id`` is given, as transformers takes the generation
    config's; without one, the first EOS id, 0 without any). The ids given are checked to be token ids of the
    vocabulary (ValueError when concrete, the compiled call's error when traced); the checkpoint's own are used
    as transformers uses them (an EOS id past the vocabulary never ends a row)."""
    given = {"eos_token_id": eos_token_id is not None, "pad_token_id": pad_token_id is not None}
    eos_token_id = config.eos_token_ids if eos_token_id is None else eos_token_id
    pad_token_id = config.pad_token_id if pad_token_id is None else pad_token_id
    eos = _token_ids(eos_token_id, "eos_token_id", given["eos_token_id"], config.vocab_size).reshape(-1)
    if pad_token_id is None:
        return eos, (eos[0] if eos.shape[0] else jnp.asarray(0, jnp.int32))
    return eos, _token_ids(pad_token_id, "pad_token_id", given["pad_token_id"], config.vocab_size)


def _token_ids(ids, name: str, given: bool, vocab: int | None) -> Array:
    """``ids`` as int32; when ``given`` (not the checkpoint's), checked to lie in the vocabulary ``0..vocab - 1``
    (ValueError naming ``name`` when concrete; the compiled call fails when traced)."""
    if not given:
        return jnp.asarray(ids, jnp.int32)
    where = f"{name}="
    fix = (f"pass {name}= a token id in 0..{vocab - 1}" + (" (eos_token_id=(): rows never end early)"
                                                           if name == "eos_token_id" else "")) if vocab else ""
    traced = is_traced(ids)
    x = ids if traced else np.asarray(ids)
    if not traced and x.size == 0:
        return jnp.asarray(x, jnp.int32)
    if not traced and x.dtype.kind not in "iu":
        raise ValueError(f"generate: {where}{ids!r} is not integer token ids; {fix}")
    if vocab:
        x = checked(x, lambda xp, i: (i < 0) | (i >= vocab), f"generate: {where}is outside the vocabulary; {fix}",
                    concrete=lambda v, bad: f"generate: {where}{shown(v[bad])} is outside the vocabulary of "
                                            f"{vocab} tokens; {fix}")
    return jnp.asarray(x, jnp.int32)


def _check_servable(name: str, what: str) -> None:
    base = parse(name)[0]
    if base.startswith(IMAGE_PREFIXES) or base == "vision.image_token_mask":
        raise SiteError(f"{what} {name!r}: generate reads and edits text values at each step; the tower's values "
                        "exist in the prefill only: read them with jstd.run on the prompt and images")
    if "key" in SITES[base].layout:
        raise SiteError(f"{what} {name!r}: attention scores and probabilities span the cache, not the sequence, "
                        "while generating; read or edit them with jstd.run on Generation.tokens")


def _check_positions(edit, total: int):
    """``edit`` with its ``positions`` checked as absolute positions of a sequence of ``total`` (prompt + new)."""
    if edit.positions is None or edit.site.startswith(IMAGE_PREFIXES):
        return edit
    who = f"{type(edit).__name__} at {edit.site}: positions"
    p = edit.positions
    if p.dtype == bool:
        if p.shape != (total,):
            raise SiteError(f"{who}: a boolean mask in generate covers the whole sequence (prompt + max_new_tokens "
                            f"= {total} positions), got shape {p.shape}")
        return edit
    fix = (f"generate takes absolute positions in the growing sequence, 0..{total - 1} (prompt + max_new_tokens; "
           "no negatives: the sequence's end moves)")
    checked_p = checked(p, lambda xp, i: (i < 0) | (i >= total), f"{who} {fix}", error=SiteError,
                        concrete=lambda i, bad: f"{who}={int(i[bad].reshape(-1)[0])} is out of range: {fix}")
    return edit if checked_p is p else eqx.tree_at(lambda e: e.positions, edit, checked_p)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _jit_generate(dynamic: list, structure: tuple, static: tuple) -> Generation:
    treedef, fixed = structure
    return _decoding_loop(*combine(dynamic, fixed, treedef), *static)


def _one_position(name: str, value: Array, at) -> Array:
    """``value`` of site ``name`` at position ``at`` of its position axis (that axis dropped; a site without one
    as it is)."""
    base, index = parse(name)
    offset = 1 if SITES[base].per_block and index is None else 0
    pos = site_axes(base)[0]
    if pos is None:
        return value
    return jnp.take(value, at, axis=offset + pos)


def _batch_axis(name: str) -> int:
    base, index = parse(name)
    offset = 1 if SITES[base].per_block and index is None else 0
    layout = SITES[base].layout
    return offset + layout.index("batch") if "batch" in layout else -1


def _b(name: str) -> int:
    """Where a read's new-token axis goes: right after its batch axis (first when it has none)."""
    b = _batch_axis(name)
    return b + 1 if b >= 0 else 0


def _decoding_loop(model, stepper, inputs: Inputs, edits, sampling, key, eos, pad, new: int,
              reads: tuple[str, ...]) -> Generation:
    """The prefill, then one ``decode`` per new token in a ``lax.while_loop`` until every row stopped or
    ``new`` tokens came; ``stepper``: ``model`` as the decoding loop steps it (``cache.stepper``)."""
    tokens = jnp.asarray(inputs.tokens)
    batch, prompt = tokens.shape
    out, cache = prefill(model, inputs, edits, new, reads)
    if stepper is not model.decoder:  # the blocks unrolled: each reads its own cache arrays (Cache)
        cache = cache.per_block()
    stopped = lambda token: (token[:, None] == eos[None, :]).any(-1)

    logits0 = out.logits[:, -1]
    token0 = next_token(sampling, logits0, key, 0)
    sequence = jnp.concatenate([tokens.astype(jnp.int32), jnp.broadcast_to(pad, (batch, new)).astype(jnp.int32)], 1)
    sequence = sequence.at[:, prompt].set(token0)
    # the buffers written a row per step are held as_bits (a bfloat16 one: each write would convert it whole)
    logits = as_bits(jnp.zeros((new,) + logits0.shape, logits0.dtype).at[0].set(logits0))  # step-major: the return
    kept, dtypes = {}, {}
    for r in reads:
        v = jnp.expand_dims(_one_position(r, out[r], prompt - 1), _b(r))
        buffer = jnp.zeros(v.shape[:_b(r)] + (new,) + v.shape[_b(r) + 1:], v.dtype)
        kept[r], dtypes[r] = as_bits(jax.lax.dynamic_update_slice_in_dim(buffer, v, 0, axis=_b(r))), v.dtype

    def body(carry):
        i, done, sequence, logits, kept, cache = carry
        at = prompt + i - 1  # the position of the token this step runs
        token = jax.lax.dynamic_index_in_dim(sequence, at, axis=1, keepdims=False)
        step, cache = decode(stepper, cache, token, at, edits, reads)
        now = step.logits[:, -1]
        chosen = jnp.where(done, pad, next_token(sampling, now, key, i))
        sequence = jax.lax.dynamic_update_slice_in_dim(sequence, chosen[:, None], prompt + i, axis=1)
        logits = jax.lax.dynamic_update_index_in_dim(logits, as_bits(now.astype(logits0.dtype)), i, axis=0)
        kept = {r: jax.lax.dynamic_update_slice_in_dim(
                    buf, as_bits(jnp.expand_dims(_one_position(r, step[r], 0), _b(r)).astype(dtypes[r])), i, axis=_b(r))
                for r, buf in kept.items()}
        return i + 1, done | stopped(chosen), sequence, logits, kept, cache

    def going(carry):
        # no EOS id: no row stops, and the step count alone decides, so that under jax.vmap (a sweep) the loop's
        # predicate is not batched: a batched one makes every step select each row's whole carry (the logits
        # buffer, the cache) between its new and old value
        return carry[0] < new if eos.shape[0] == 0 else (carry[0] < new) & ~carry[1].all()

    carry = (jnp.asarray(1, jnp.int32), stopped(token0), sequence, logits, kept, cache)
    _, _, sequence, logits, kept, _ = jax.lax.while_loop(going, body, carry)
    # the logits were kept step-major ([new, batch, vocab]): written batch-major, the loop rewrote the whole buffer
    # at every step on XLA:CPU instead of one row per row
    return Generation(sequence, jnp.swapaxes(from_bits(logits, logits0.dtype), 0, 1),
                      {r: from_bits(v, dtypes[r]) for r, v in kept.items()})
