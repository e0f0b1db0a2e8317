"""``jstd.generate``: jitted decoding with the same edits at every step, over a preallocated cache.

    gen = jstd.generate(model, inputs, edits, max_new_tokens=32)      # greedy
    gen.tokens                                                       # [batch, prompt + new]
    gen.logits                                                       # [batch, new, vocab]: each step's raw logits

One prefill (``jstd.run`` on the prompt, images included, reading what a cache
keeps) and then one token per step in a ``lax.while_loop``: each step is the
model's forward on the new token of every row with a ``jstd.Context`` holding
the prompt-plus-new-tokens cache, preallocated once (softmax blocks: keys and
values ``[blocks, batch, kv_heads, prompt + new, head_dim]``, written at the
step's position; DeltaNet blocks: the recurrent state and the convolution's
last inputs, replaced each step; the one-token step runs the recurrent
gated-delta kernel). Decoding never recomputes the prefix, and every step has
the same cost whatever its position: the cache has its final length from the
start (entries at or after the step's position are masked). On the CPU the
loop runs the blocks unrolled, each over views of its own rows of the stacked
weights (``_with_rows``), so a step reads every weight once, where it lies.

The contract: *each step's logits equal ``jstd.run`` on the whole sequence so
far with the same edits* (the prompt's padding mask followed by ones). An
edit's ``positions`` are absolute positions in the growing sequence (the
padded prompt's indices, then ``prompt + i`` for new token ``i``); an edit
without ``positions`` applies at every position, new ones included, so a
steering vector added at ``layers.layer_output`` steers every generated token.
Edits at the tower, the projector and the image features (``vision.*``,
``projector.*``) apply in the prefill (the image is only there).

``jax.jit`` and ``jax.vmap`` work: ``max_new_tokens`` and ``reads`` are
static; the edits' arrays (traced ``layer`` included), the sampling numbers,
the key and the EOS ids are values, so a sweep of steering strengths is one
``vmap`` over ``generate``.
"""

from __future__ import annotations

import functools
import sys
from typing import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from jstd.core.context import KEYS, MIXER_INPUTS, VALUES, POSITIONS, Context
from jstd.core.edits import as_edits, check_left_padded, site_axes
from jstd.core.inputs import Inputs, as_inputs, token_array, with_layout
from jstd.core.jit import combine, partition
from jstd.models.base import Model
from jstd.run import as_reads, check_sites, forward, run
from jstd.core.sites import SITES, SiteError, parse

STATE_OUTPUT = "layers.linear_attn.state_output"
_IMAGE_PREFIXES = ("vision.", "projector.")


class Sampling(eqx.Module):
    """How a token is drawn from a step's logits (``sampling=None`` in ``generate``: greedy, the argmax).

    As transformers' sampling: the logits divided by ``temperature``, then only
    the ``top_k`` largest kept (None: all), then only the smallest set of the
    largest whose probability reaches ``top_p`` (None: all; the most likely
    token is always kept), then one draw from the softmax with the step's key
    (``jax.random.fold_in(key, step)``: the same key gives the same tokens).
    ``temperature`` and ``top_p`` are values (traced and vmapped fine);
    ``top_k`` is static (an int).
    """

    temperature: Float[ArrayLike, ""] = 1.0
    top_k: int | None = eqx.field(static=True, default=None)
    top_p: Float[ArrayLike, ""] | None = None

    def __check_init__(self):
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"Sampling: top_k must be a positive int (or None: no top-k filter), got {self.top_k!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, jax.core.Tracer) and np.ndim(value) == 0:
                if not float(value) > 0 or (name == "top_p" and float(value) > 1):
                    span = "in (0, 1]" if name == "top_p" else "> 0 (greedy decoding: sampling=None)"
                    raise ValueError(f"Sampling: {name} must be {span}, got {value!r}")

    def filtered(self, logits: Float[Array, "batch vocab"]) -> Float[Array, "batch vocab"]:
        """The logits (float32) after temperature, top-k and top-p: removed tokens hold -inf."""
        x = logits.astype(jnp.float32) / jnp.asarray(self.temperature, jnp.float32)
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = jax.lax.top_k(x, self.top_k)[0][..., -1:]
            x = jnp.where(x < kth, -jnp.inf, x)
        if self.top_p is not None:
            ordered = jnp.sort(x, axis=-1)[..., ::-1]
            probs = jax.nn.softmax(ordered, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens more likely than each
            kept = before < jnp.asarray(self.top_p, jnp.float32)
            threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
            x = jnp.where(x < threshold, -jnp.inf, x)
        return x

    def choose(self, logits: Float[Array, "batch vocab"], key: PRNGKeyArray) -> Int[Array, "batch"]:
        return jax.random.categorical(key, self.filtered(logits), axis=-1).astype(jnp.int32)


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
    follows a row's EOS (None: the checkpoint's with its EOS ids, else the
    first EOS id).

    Returns a ``Generation``. Each step's logits equal ``jstd.run`` on the
    whole sequence so far (the prompt's mask then ones) with the same edits.
    ``max_new_tokens`` and ``reads`` are static under ``jax.jit``
    (``static_argnames``); everything else may be traced, and ``jax.vmap``
    over the edits' arrays (strengths, layers) runs a sweep in one call.

    Raises ValueError for a bad ``max_new_tokens``, a right-padded prompt, a
    prompt without tokens, sampling without a key; SiteError for reads and
    edits generation cannot serve (and everything ``jstd.run`` raises).
    """
    if not isinstance(model, Model):
        raise TypeError(f"generate takes a model from jstd.load, got {type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int (static under jit), got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if model.config.vocab_size is None:
        raise ValueError(f"a {model.family} model is a vision tower: it has no tokens to generate")
    inputs = with_layout(as_inputs(inputs, attention_mask))
    if inputs.tokens is None:
        raise ValueError("generate needs a prompt: token ids (jstd.Inputs.tokens)")
    tokens = token_array(inputs.tokens)
    mask = inputs.attention_mask
    if mask is not None:
        mask = check_left_padded(mask if isinstance(mask, jax.Array) else np.asarray(mask), "generate")
    inputs = Inputs(tokens, mask, inputs.images, inputs.layout)
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be None (greedy) or a jstd.Sampling, got {type(sampling).__name__}")
    if sampling is not None and key is None:
        raise ValueError("sampling draws tokens at random: pass key=jax.random.key(seed) (the same key gives the "
                         "same tokens)")
    reads = as_reads(reads)
    check_sites(model, reads, "read")
    for name in reads:
        _check_servable(name, "read")
    edits = as_edits(edits)
    total = tokens.shape[1] + max_new_tokens
    edits = tuple(_check_positions(e, total) for e in edits)
    for e in edits:
        if not e.site.startswith(_IMAGE_PREFIXES):
            _check_servable(e.site, f"{type(e).__name__} at")
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_ids
        pad_token_id = model.config.pad_token_id if pad_token_id is None else pad_token_id
    eos = jnp.asarray(eos_token_id, jnp.int32).reshape(-1)
    if pad_token_id is None:
        pad = eos[0] if eos.shape[0] else jnp.asarray(0, jnp.int32)
    else:
        pad = jnp.asarray(pad_token_id, jnp.int32)
    key = jax.random.key(0) if key is None else key
    tree = (model, _with_rows(model), inputs, edits, sampling, key, eos, pad)
    dynamic, fixed, treedef = partition(tree)
    return _jit_generate(dynamic, (treedef, fixed), (max_new_tokens, reads))


def _check_servable(name: str, what: str) -> None:
    base = parse(name)[0]
    if base.startswith(_IMAGE_PREFIXES) or base == "vision.image_token_mask":
        raise SiteError(f"{what} {name!r}: generate reads and edits text values at each step; the tower's values "
                        "exist in the prefill only: read them with jstd.run on the prompt and images")
    if "key" in SITES[base].layout:
        raise SiteError(f"{what} {name!r}: attention scores and probabilities span the cache, not the sequence, "
                        "while generating; read or edit them with jstd.run on Generation.tokens")


def _check_positions(edit, total: int):
    """``edit`` with its ``positions`` checked as absolute positions of a sequence of ``total`` (prompt + new)."""
    if edit.positions is None or edit.site.startswith(_IMAGE_PREFIXES):
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
    if isinstance(p, jax.core.Tracer):
        return eqx.tree_at(lambda e: e.positions, edit, eqx.error_if(p, ((p < 0) | (p >= total)).any(), f"{who} {fix}"))
    bad = np.asarray(p)[(np.asarray(p) < 0) | (np.asarray(p) >= total)]
    if bad.size:
        raise SiteError(f"{who}={int(bad.reshape(-1)[0])} is out of range: {fix}")
    return edit


def _edits_at(edits: tuple, start, length: int, prefill: bool) -> tuple:
    """The edits of the call computing positions ``start .. start + length - 1``: ``positions`` made a mask over
    them; the tower's and projector's edits in the prefill only."""
    out = []
    for e in edits:
        if e.site.startswith(_IMAGE_PREFIXES):
            if prefill:
                out.append(e)
            continue
        if e.positions is not None and site_axes(e.site)[0] is not None:
            p = e.positions
            if p.dtype == bool:
                chosen = jax.lax.dynamic_slice_in_dim(p, start, length)
            else:
                here = start + jnp.arange(length)
                chosen = (here[:, None] == p.reshape(-1)[None, :]).any(-1)
            e = eqx.tree_at(lambda e: e.positions, e, chosen)
        out.append(e)
    return tuple(out)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _jit_generate(dynamic: list, structure: tuple, static: tuple) -> Generation:
    treedef, fixed = structure
    return _generate(*combine(dynamic, fixed, treedef), *static)


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


class Cache(eqx.Module):
    """What decoding continues from, preallocated for the whole sequence (prompt + new): softmax blocks' keys and
    values (written at each step's position), DeltaNet blocks' state and last convolution inputs, the padding mask
    over every position, and a multimodal rotary's prompt position ids."""

    keys: Array | None
    values: Array | None
    states: Array | None
    conv: Array | None
    mask: Array
    rope: Array | None

    def context(self, at) -> Context:
        """The context of one new token per row at position ``at``."""
        batch = self.mask.shape[0]
        return Context(jnp.full((batch, 1), at, jnp.int32), self.keys, self.values, self.states, self.conv,
                       None, None, self.mask, self.rope)


def _cache_reads(model) -> tuple[str, ...]:
    reads = (KEYS, VALUES) if model.layers_with("self_attn") else ()
    reads += (STATE_OUTPUT, MIXER_INPUTS) if model.layers_with("linear_attn") else ()
    return reads + ((POSITIONS,) if POSITIONS in model.sites else ())


def _linear_rows(model) -> Array:
    return jnp.asarray([model.blocks_for(MIXER_INPUTS).index(i) for i in model.layers_with("linear_attn")])


def prefill(model, inputs: Inputs, edits: tuple, new: int, reads: tuple[str, ...] = ()):
    """``(outputs, cache)``: ``jstd.run`` on the prompt (images included) reading ``reads`` and what the cache
    keeps, and the cache of ``prompt + new`` positions it starts."""
    tokens, mask = inputs.tokens, inputs.attention_mask
    batch, prompt = np.shape(tokens)
    out = run(model, inputs, _edits_at(edits, 0, prompt, True), reads=tuple(dict.fromkeys(_cache_reads(model) + reads)))
    real = jnp.ones((batch, prompt), bool) if mask is None else jnp.asarray(mask, bool)
    keys = values = states = conv = None
    if model.layers_with("self_attn"):
        grow = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, new), (0, 0)))
        keys, values = grow(out[KEYS]), grow(out[VALUES])
    if model.layers_with("linear_attn"):
        states = out[STATE_OUTPUT].astype(jnp.float32)
        width = model.conv_width - 1
        mixed = jnp.where(real[None, :, :, None], out[MIXER_INPUTS][_linear_rows(model)], 0)  # the mixer zeroes padding
        mixed = jnp.pad(mixed, ((0, 0), (0, 0), (max(width - prompt, 0), 0), (0, 0)))
        conv = mixed[:, :, mixed.shape[2] - width:]
    full_mask = jnp.concatenate([real, jnp.ones((batch, new), bool)], axis=1)
    return out, Cache(keys, values, states, conv, full_mask, out[POSITIONS] if POSITIONS in model.sites else None)


def decode(model, cache: Cache, token: Int[Array, "batch"], at, edits: tuple, reads: tuple[str, ...] = ()):
    """``(outputs, cache)``: the forward of one new ``token`` per row at position ``at`` (traced fine) with
    ``edits``, reading ``reads``, and the cache with the token's keys, values and state written in."""
    decoder = getattr(model, "text", model)  # a wrapper's text model: the image is in the cache already
    all_reads = tuple(dict.fromkeys(_cache_reads(model) + reads))
    step = forward(decoder, Inputs(token[:, None], None), _edits_at(edits, at, 1, False), cache.context(at), all_reads)
    keys, values, states, conv = cache.keys, cache.values, cache.states, cache.conv
    if keys is not None:
        keys = jax.lax.dynamic_update_slice_in_dim(keys, step[KEYS].astype(keys.dtype), at, axis=3)
        values = jax.lax.dynamic_update_slice_in_dim(values, step[VALUES].astype(values.dtype), at, axis=3)
    if states is not None:
        states = step[STATE_OUTPUT].astype(jnp.float32)
        conv = jnp.concatenate([conv[:, :, 1:], step[MIXER_INPUTS][_linear_rows(model)].astype(conv.dtype)], axis=2)
    return step, Cache(keys, values, states, conv, cache.mask, cache.rope)


def _choose(sampling, logits, key, step):
    if sampling is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sampling.choose(logits, jax.random.fold_in(key, step))


def _generate(model, stepper, inputs: Inputs, edits, sampling, key, eos, pad, new: int,
              reads: tuple[str, ...]) -> Generation:
    """``stepper``: ``model`` as the decoding loop runs it (``_with_rows``)."""
    tokens = jnp.asarray(inputs.tokens)
    batch, prompt = tokens.shape
    out, cache = prefill(model, inputs, edits, new, reads)
    stopped = lambda token: (token[:, None] == eos[None, :]).any(-1)

    logits0 = out.logits[:, -1]
    token0 = _choose(sampling, logits0, key, 0)
    sequence = jnp.concatenate([tokens.astype(jnp.int32), jnp.broadcast_to(pad, (batch, new)).astype(jnp.int32)], 1)
    sequence = sequence.at[:, prompt].set(token0)
    logits = jnp.zeros((new,) + logits0.shape, logits0.dtype).at[0].set(logits0)  # step-major: see the return
    kept = {}
    for r in reads:
        v = jnp.expand_dims(_one_position(r, out[r], prompt - 1), _b(r))
        buffer = jnp.zeros(v.shape[:_b(r)] + (new,) + v.shape[_b(r) + 1:], v.dtype)
        kept[r] = jax.lax.dynamic_update_slice_in_dim(buffer, v, 0, axis=_b(r))

    def body(carry):
        i, done, sequence, logits, kept, cache = carry
        at = prompt + i - 1  # the position of the token this step runs
        token = jax.lax.dynamic_index_in_dim(sequence, at, axis=1, keepdims=False)
        step, cache = decode(stepper, cache, token, at, edits, reads)
        now = step.logits[:, -1]
        chosen = jnp.where(done, pad, _choose(sampling, now, key, i))
        sequence = jax.lax.dynamic_update_slice_in_dim(sequence, chosen[:, None], prompt + i, axis=1)
        logits = jax.lax.dynamic_update_index_in_dim(logits, now.astype(logits.dtype), i, axis=0)
        kept = {r: jax.lax.dynamic_update_slice_in_dim(
                    buf, jnp.expand_dims(_one_position(r, step[r], 0), _b(r)).astype(buf.dtype), i, axis=_b(r))
                for r, buf in kept.items()}
        return i + 1, done | stopped(chosen), sequence, logits, kept, cache

    def going(carry):
        return (carry[0] < new) & ~carry[1].all()

    carry = (jnp.asarray(1, jnp.int32), stopped(token0), sequence, logits, kept, cache)
    _, _, sequence, logits, kept, _ = jax.lax.while_loop(going, body, carry)
    # the logits were kept step-major ([new, batch, vocab]): written batch-major, the loop rewrote the whole buffer
    # at every step on XLA:CPU instead of one row per row
    return Generation(sequence, jnp.swapaxes(logits, 0, 1), kept)


def _with_rows(model):
    """``model`` with its text stack's blocks held apart (``Stack.unstacked``) as views of the stacked arrays, so
    that the decoding loop runs them unrolled and each block reads its weights where they lie; ``model`` itself
    where its arrays are not concrete arrays on one CPU device (traced, sharded, on an accelerator).

    Run scanned, each step first copies every block's weights out of the stacked arrays (XLA:CPU hands a product
    a ``dynamic-slice`` of its operand as a buffer of its own), and a decoding step is memory-bound: the copies
    made it 1.4x slower on the benchmark model. The views cost nothing (the CPU device adopts an aligned host view
    without a copy); the price is a decoding step compiled per block instead of per period.
    """
    wrapped = hasattr(model, "text")
    decoder = model.text if wrapped else model
    leaves = jax.tree.leaves(decoder.layers)
    on_cpu = lambda a: (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
                        and len(a.devices()) == 1 and next(iter(a.devices())).platform == "cpu")
    if not all(on_cpu(a) for a in leaves):
        return model
    with jax.ensure_compile_time_eval():  # under an outer jit too: device_put now, not staged into the program
        rows = decoder.layers.unstacked(lambda a, j: jax.device_put(np.asarray(a)[j], next(iter(a.devices()))))
    decoder = eqx.tree_at(lambda m: m.layers, decoder, rows)
    return eqx.tree_at(lambda m: m.text, model, decoder) if wrapped else decoder


def _b(name: str) -> int:
    """Where a read's new-token axis goes: right after its batch axis (first when it has none)."""
    b = _batch_axis(name)
    return b + 1 if b >= 0 else 0


def stream(model, inputs, *, max_new_tokens: int, sampling=None, key=None, eos_token_id=None):
    """Yield row 0's new tokens so far (a list of ids) after each step, stopping after an EOS id: the tokens
    ``generate`` gives without edits, one jitted step per call so they can be shown as they come (``eos_token_id``
    as ``generate``'s: None is the checkpoint's)."""
    inputs = with_layout(as_inputs(inputs))
    prompt = np.shape(inputs.tokens)[1]
    eos_token_id = model.config.eos_token_ids if eos_token_id is None else eos_token_id
    eos = set(np.asarray(eos_token_id, np.int64).reshape(-1).tolist())
    key = jax.random.key(0) if key is None else key
    token, cache = _stream_start(model, inputs, sampling, key, max_new_tokens)
    stepper = _with_rows(model)
    out = []
    for i in range(max_new_tokens):
        if i:
            token, cache = _stream_next(stepper, cache, token, jnp.asarray(prompt + i - 1), sampling, key, jnp.asarray(i))
        out.append(int(np.asarray(token)[0]))
        yield list(out)
        if out[-1] in eos:
            return


@eqx.filter_jit
def _stream_start(model, inputs, sampling, key, new):
    out, cache = prefill(model, inputs, (), new)
    return _choose(sampling, out.logits[:, -1], key, 0), cache


@eqx.filter_jit
def _stream_next(model, cache, token, at, sampling, key, i):
    step, cache = decode(model, cache, token, at, ())
    return _choose(sampling, step.logits[:, -1], key, i), cache
