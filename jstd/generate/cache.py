"""The decoding cache: what a prefill leaves (``prefill``), one step's forward over it (``decode``), the edits of
each call (``edits_at``) and the model as the decoding loop steps it (``stepper``).

The cache is preallocated once for the whole sequence (prompt + new): softmax
blocks' keys and values ``[blocks, batch, kv_heads, prompt + new, head_dim]`` (multi-head latent attention's
latent and shared rotary key instead: ``core.context.cache_layout``),
written at each step's position; DeltaNet blocks' recurrent state and their
convolution's last inputs, replaced each step. Every step has the same cost
whatever its position: entries at or after the step's position are masked.

Where the decoding loop runs the blocks unrolled (``stepper``), it holds the keys and values one array per block
(``Cache.per_block``) and a step moves nothing the size of the cache but the attention's read of it: each block's
attention reads its own array where it lies, the cached keys beside the step's own (not concatenated with them:
``kernels.attention.grouped``), and the step's keys and values are written into the arrays in place (``decode``;
tests/test_generate.py reads the compiled loop for copies).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int

from jstd.core.context import MIXER_INPUTS, POSITIONS, Context, as_cached, cache_layout
from jstd.core.edits import site_axes
from jstd.core.inputs import Inputs
from jstd.nn.model import Model
from jstd.run import Outputs, forward, run

STATE_OUTPUT = "layers.linear_attn.state_output"
IMAGE_PREFIXES = ("vision.", "projector.")  # the sites of the tower and the projector: the prefill's only


class Cache(eqx.Module):
    """What decoding continues from, preallocated for the whole sequence (prompt + new): softmax blocks' keys and
    values (written at each step's position), DeltaNet blocks' state and last convolution inputs, the padding mask
    over every position, and a multimodal rotary's prompt position ids.

    ``keys`` and ``values`` are stacked over the blocks ``[blocks, batch, heads, positions, width]`` as ``prefill``
    leaves them, or held one array per block (``per_block``: a tuple of ``[batch, heads, positions, width]``), as
    the decoding loop carries them when it runs the blocks unrolled: then each block's attention reads its own
    array where it lies (a block's slice of a stacked array is a copy on XLA:CPU) and each step writes its keys
    and values into them in place (``decode``).
    """

    keys: Array | tuple[Array, ...] | None
    values: Array | tuple[Array, ...] | None
    states: Array | None
    conv: Array | None
    mask: Array
    rope: Array | None
    dtype: str | None = eqx.field(static=True, default=None)  # per block: the keys' and values' dtype (as_bits)

    def context(self, at) -> Context:
        """The context of one new token per row at position ``at``."""
        batch = self.mask.shape[0]
        # held per block: XLA folds the stack away, each block's slice of it being that block's own array
        stacked = lambda a: jnp.stack([from_bits(x, self.dtype) for x in a]) if isinstance(a, tuple) else a
        return Context(jnp.full((batch, 1), at, jnp.int32), stacked(self.keys), stacked(self.values), self.states,
                       self.conv, None, None, self.mask, self.rope)

    def per_block(self) -> "Cache":
        """The cache with its keys and values held one array per block (``as_bits``; itself if they are already)."""
        if self.keys is None or isinstance(self.keys, tuple):
            return self
        split = lambda a: tuple(as_bits(a[i]) for i in range(a.shape[0]))
        return Cache(split(self.keys), split(self.values), self.states, self.conv, self.mask, self.rope,
                     jnp.dtype(self.keys.dtype).name)


def as_bits(x: Array) -> Array:
    """``x`` as a buffer XLA:CPU writes slices into in place: a 16-bit float's bits as uint16 (a slice written into
    a bfloat16 or float16 array converts the whole array to float32 and back, at every write), anything else as
    it is. ``from_bits`` undoes it (free: the same bytes)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_bits(x: Array, dtype) -> Array:
    """``x`` (``as_bits`` of an array of ``dtype``) as that array."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != jnp.dtype(dtype) else x


def edits_at(edits: tuple, start, length: int, prefill: bool) -> tuple:
    """The edits of the call computing positions ``start .. start + length - 1``: ``positions`` made a mask over
    them; the tower's and projector's edits in the prefill only."""
    out = []
    for e in edits:
        if e.site.startswith(IMAGE_PREFIXES):
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


def _cache_reads(model) -> tuple[str, ...]:
    reads = tuple(site for site, _ in cache_layout(model)) if model.layers_with("self_attn") else ()
    reads += (STATE_OUTPUT, MIXER_INPUTS) if model.layers_with("linear_attn") else ()
    return reads + ((POSITIONS,) if POSITIONS in model.sites else ())


def _linear_rows(model) -> Array:
    return jnp.asarray([model.blocks_for(MIXER_INPUTS).index(i) for i in model.layers_with("linear_attn")])


def prefill(model: Model, inputs: Inputs, edits: tuple, new: int,
            reads: tuple[str, ...] = ()) -> tuple[Outputs, Cache]:
    """``(outputs, cache)``: ``jstd.run`` on the prompt (images included) reading ``reads`` and what the cache
    keeps, and the cache of ``prompt + new`` positions it starts."""
    tokens, mask = inputs.tokens, inputs.attention_mask
    batch, prompt = np.shape(tokens)
    out = run(model, inputs, edits_at(edits, 0, prompt, True), reads=tuple(dict.fromkeys(_cache_reads(model) + reads)))
    real = jnp.ones((batch, prompt), bool) if mask is None else jnp.asarray(mask, bool)
    keys = values = states = conv = None
    if model.layers_with("self_attn"):
        grow = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, new), (0, 0)))
        keys, values = (grow(as_cached(out[site])) for site, _ in cache_layout(model))
    if model.layers_with("linear_attn"):
        states = out[STATE_OUTPUT].astype(jnp.float32)
        width = model.conv_width - 1
        mixed = jnp.where(real[None, :, :, None], out[MIXER_INPUTS][_linear_rows(model)], 0)  # the mixer zeroes padding
        mixed = jnp.pad(mixed, ((0, 0), (0, 0), (max(width - prompt, 0), 0), (0, 0)))
        conv = mixed[:, :, mixed.shape[2] - width:]
    full_mask = jnp.concatenate([real, jnp.ones((batch, new), bool)], axis=1)
    return out, Cache(keys, values, states, conv, full_mask, out[POSITIONS] if POSITIONS in model.sites else None)


def decode(model: Model, cache: Cache, token: Int[Array, "batch"], at: Int[ArrayLike, ""], edits: tuple,
           reads: tuple[str, ...] = ()) -> tuple[Outputs, Cache]:
    """``(outputs, cache)``: the forward of ``model.decoder`` (a wrapper's text model: the image is in the cache
    already) on one new ``token`` per row at position ``at`` (traced fine) with ``edits``, reading ``reads``, and
    the cache with the token's keys, values and state written in."""
    decoder = model.decoder
    all_reads = tuple(dict.fromkeys(_cache_reads(model) + reads))
    step = forward(decoder, Inputs(token[:, None], None), edits_at(edits, at, 1, False), cache.context(at), all_reads)
    keys, values, states, conv = cache.keys, cache.values, cache.states, cache.conv
    if keys is not None:
        (k_site, _), (v_site, _) = cache_layout(model)
        new_k, new_v = as_cached(step[k_site]), as_cached(step[v_site])
        if isinstance(keys, tuple):
            write = lambda arrays, rows: _written(arrays, rows, at, step.logits, cache.dtype)
            keys, values = write(keys, new_k), write(values, new_v)
        else:
            keys = jax.lax.dynamic_update_slice_in_dim(keys, new_k.astype(keys.dtype), at, axis=3)
            values = jax.lax.dynamic_update_slice_in_dim(values, new_v.astype(values.dtype), at, axis=3)
    if states is not None:
        states = step[STATE_OUTPUT].astype(jnp.float32)
        conv = jnp.concatenate([conv[:, :, 1:], step[MIXER_INPUTS][_linear_rows(model)].astype(conv.dtype)], axis=2)
    return step, Cache(keys, values, states, conv, cache.mask, cache.rope, cache.dtype)


def _written(arrays: tuple[Array, ...], rows: Array, at, logits: Array, dtype: str) -> tuple[Array, ...]:
    """Each block's array (``as_bits`` of ``dtype``) with its ``rows[block]`` (``[batch, heads, 1, width]``)
    written at position ``at``, in place: the write comes after every read of the arrays in the step.

    XLA writes an array in place only where it can order the write after each read of the old array, which it
    knows from the data alone. Block ``b``'s keys exist before its attention reads the cache, so a plain write may
    run first, and XLA then copies every written array each step. The rows written here pass through a select on
    the step's logits, which come after every block's attention: each row's ``argmax >= 0``, always true (the
    rows are exactly the step's), but XLA cannot fold it away."""
    after = jnp.argmax(logits[:, -1], axis=-1) >= 0  # [batch]
    rows = as_bits(jnp.where(after[None, :, None, None, None], rows, jnp.zeros((), rows.dtype)).astype(dtype))
    return tuple(jax.lax.dynamic_update_slice_in_dim(a, r, at, axis=2) for a, r in zip(arrays, rows))


def stepper(model: Model) -> Model:
    """``model.decoder`` as the decoding loop steps it: its stack's blocks held apart (``CausalLM.unstacked``) as
    views of the stacked arrays, so that the loop runs them unrolled and each block reads its weights where they
    lie; ``model.decoder`` itself where the stack's arrays are not concrete arrays on one CPU device (traced,
    sharded, on an accelerator).

    Run scanned, each step first copies every block's weights out of the stacked arrays (XLA:CPU hands a product
    a ``dynamic-slice`` of its operand as a buffer of its own), and a decoding step is memory-bound: the copies
    made it 1.4x slower on the benchmark model. The views cost nothing (the CPU device adopts an aligned host view
    without a copy); the price is a decoding step compiled per block instead of per period.
    """
    decoder = model.decoder
    leaves = jax.tree.leaves(decoder.stacks["layers"])
    on_cpu = lambda a: (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
                        and len(a.devices()) == 1 and next(iter(a.devices())).platform == "cpu")
    if not all(on_cpu(a) for a in leaves):
        return decoder
    with jax.ensure_compile_time_eval():  # under an outer jit too: device_put now, not staged into the program
        return decoder.unstacked(lambda a, j: jax.device_put(np.asarray(a)[j], next(iter(a.devices()))))
