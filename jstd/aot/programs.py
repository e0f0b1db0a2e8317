"""jstd's programs as functions of abstract arguments, ready to ``jax.jit(...).lower(*args)``.

Each builder returns ``(fn, args, in_shardings)``: ``fn(model, *rest)`` and abstract ``args`` (the model first, then
``jax.ShapeDtypeStruct`` inputs carrying their shardings). Inputs: ``batch`` rows of ``seq`` token ids, rows over
the mesh's ``batch`` axes as ``rules`` place them; a wrapper (Llava-style: ``pixel_values [images, 3, H, W]``)
also gets one image per row, the images split as the rows are.

- ``forward``: ``jstd.run`` with the logits and every block's ``layers.layer_output`` read.
- ``grad``: the gradient of the last position's log-probability of token 0 with respect to a steering vector
  ``Add``-ed at ``layers.layer_output`` of the middle block (a gradient through an edit).
- ``sweep``: what ``jstd.patch_sweep`` compiles for a sweep of ``layers.layer_output`` over every position, scored
  by the logit difference of tokens 0 and 1 at the last position. On a text model, the resumed form
  (``interventions.resume``): the clean run's values, the corrupted run's keys, values and states, and one chunk of
  ``entries`` packed rows (split over ``data``; on softmax attention each row holds two suffixes, about
  ``seq + 1`` tokens) resumed at a traced block — ``patch_sweep`` runs the reads once and the chunk once per chunk
  and block, so this program's memory bounds both. With images (no resuming), one chunk of ``entries``
  (block, position) pairs, each a whole run of the corrupted prompt with the patch (``vmap`` over the entries).
- ``generate``: ``jstd.generate`` of ``new`` tokens, greedy, with a steering vector added at the middle block at
  every step.
- ``attribute``: one batch of an attribution graph's rows, the two programs ``jstd.attribute`` runs for every
  batch of targets (``jstd.circuits.replacement.target_gradients``, the batched backward, at full depth and length,
  then ``source_columns``, their contraction with the sources on the device) for one prompt of ``seq`` tokens,
  through a cross-layer transcoder of ``features`` per block (``abstract.abstract_transcoders``; placed by the
  layout as ``jstd.attribute(..., mesh=)`` places it, and resident: its encoders and decoders count in the
  arguments though this program reads none of them). ``batch`` targets (their blocks, positions and vectors, split
  over ``data``), the prompt's MLP outputs (held in the backward; replicated), against every source: per block
  ``l`` the activation-scaled decoder vectors ``[seq, slots_l, d]`` (``slots_l``: the sources writing at block
  ``l`` and one position, default ``active · (l + 1)`` rounded up to a power of two, ``active`` features per block
  and position, as a CLT's decoders from every block up to ``l`` write there; or ``slots`` for every block), the
  errors and the token embeddings (``circuits.sharding.Sources``, float32, positions over ``data`` and slots over
  ``model``), and each feature's slot per block (``[L, active · L · seq]``, replicated); the rows come out split
  over ``data``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jstd.aot.abstract import abstract_transcoders
from jstd.circuits.replacement import source_columns, target_gradients
from jstd.circuits.sharding import Sources, batch_for, sources_shardings, targets_sharding
from jstd.core.edits import Add, Set
from jstd.core.inputs import Inputs
from jstd.generate import generate
from jstd.interventions.metrics import logit_difference
from jstd.interventions.resume import Rows, corrupted_run, pack, resumed_chunk
from jstd.run import run
from jstd.sharding import DATA, FSDP, batch_sharding, fit

PROGRAMS = ("forward", "grad", "sweep", "generate", "attribute")
SITE = "layers.layer_output"


def program(name: str, model, mesh, rules=FSDP, *, batch: int = 8, seq: int = 1024, entries: int | None = None,
            new: int = 16, features: int = 16384, active: int = 64, slots: int | None = None):
    """``(fn, args)`` of program ``name`` (one of ``PROGRAMS``) for the abstract ``model`` on ``mesh``.

    ``entries``: a sweep chunk's (block, position) pairs (default: the size of the ``data`` axis);
    ``new``: the tokens ``generate`` adds; ``features``, ``active``, ``slots``: ``attribute``'s transcoder width
    per block, active features per block and position, and source slots (module docstring). Raises ValueError for
    an unknown name or a wrapper whose images are not ``pixel_values [images, 3, H, W]``.
    """
    if name not in PROGRAMS:
        raise ValueError(f"unknown program {name!r}: pass one of {', '.join(PROGRAMS)}")
    if name == "attribute":
        return _attribute(model, mesh, rules, batch, seq, features, active, slots)
    replicated = NamedSharding(mesh, PartitionSpec())
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=fit(batch_sharding(mesh, rules), (batch, seq)))
    images = _images(model, batch, fit(batch_sharding(mesh, rules, 4), (batch, 1, 1, 1)))  # one image per row
    hidden, blocks = model.config.hidden_size, model.config.num_layers
    dtype = jax.tree.leaves(model)[0].dtype
    vector = jax.ShapeDtypeStruct((hidden,), dtype, sharding=replicated)
    middle = blocks // 2

    def inputs(t, im):
        return t if im is None else Inputs(t, None, im)

    if name == "forward":
        def fn(model, t, im):
            out = run(model, inputs(t, im), reads=(SITE,))
            return out.logits, out[SITE]
        return fn, (model, tokens, images)
    if name == "grad":
        def fn(model, t, im, v):
            def score(v):
                logits = run(model, inputs(t, im), (Add(SITE, v, layer=middle),)).logits[:, -1]
                return jax.nn.log_softmax(logits.astype(jnp.float32))[:, 0].sum()
            return jax.grad(score)(v)
        return fn, (model, tokens, images, vector)
    if name == "generate":
        def fn(model, t, im, v):
            out = generate(model, inputs(t, im), (Add(SITE, v, layer=middle),), max_new_tokens=new, eos_token_id=())
            return out.tokens
        return fn, (model, tokens, images, vector)
    size = dict(zip(mesh.axis_names, mesh.devices.shape)).get(DATA, 1)
    n = entries or size
    spread = NamedSharding(mesh, PartitionSpec(DATA)) if n % size == 0 else replicated
    if images is None:
        return _resumed_sweep(model, tokens, n, spread)
    layers = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=spread)
    positions = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=spread)

    def fn(model, clean, corrupt, im, layers, positions):
        values = run(model, inputs(clean, im), reads=(SITE,))[SITE]  # [blocks, batch, seq, hidden]

        def one(layer, position):
            patch = Set(SITE, values[layer], layer=layer, positions=position)
            logits = run(model, inputs(corrupt, im), (patch,)).logits[:, -1].astype(jnp.float32)
            return (logits[:, 0] - logits[:, 1]).mean()

        return jax.vmap(one)(layers, positions)
    return fn, (model, tokens, tokens, images, layers, positions)


def _resumed_sweep(model, tokens, n: int, spread):
    """The resumed sweep's program: reads of both runs and one chunk of ``n`` packed rows at a traced block."""
    seq = tokens.shape[1]
    packed = pack(np.arange(seq, dtype=np.int32), np.zeros(seq, np.int32), seq,
                  pair=not model.layers_with("linear_attn"))
    rows = Rows(*(jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype, sharding=spread) for a in packed))
    layer = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(spread.mesh, PartitionSpec()))
    metric = logit_difference(0, 1)

    def fn(model, clean, corrupt, rows, layer):
        clean_values = run(model, clean, reads=(SITE,))[SITE]
        corrupt_out = corrupted_run(model, corrupt, SITE)
        return resumed_chunk(model, corrupt, None, corrupt_out, clean_values, metric, rows, layer, SITE, False)
    return fn, (model, tokens, tokens, rows, layer)


def _attribute(model, mesh, rules, batch: int, seq: int, features: int, active: int, slots: int | None):
    """``target_gradients`` and ``source_columns`` of ``batch`` targets (rounded up to a multiple of ``data``) for
    one prompt of ``seq`` tokens through an abstract cross-layer transcoder of ``features`` per block."""
    if hasattr(model, "text"):
        raise ValueError("jstd.aot's attribute program covers text models (jstd.attribute's); not a wrapper")
    c = model.config
    L, d = c.num_layers, c.hidden_size
    dtype = jax.tree.leaves(model)[0].dtype
    tc = abstract_transcoders(L, features, d, mesh, rules, dtype=dtype)
    K = [slots or 1 << max(active * (lo + 1) - 1, 1).bit_length() for lo in range(L)]
    B = batch_for(batch, mesh)
    A = active * L * seq
    sources = jax.eval_shape(lambda: Sources(tuple(jnp.zeros((seq, k, d), jnp.float32) for k in K),
                                             jnp.zeros((L, seq, d), jnp.float32), jnp.zeros((seq, d), jnp.float32)))
    placed = sources_shardings(mesh, sources)
    sources = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), sources, placed)
    replicated = NamedSharding(mesh, PartitionSpec())
    tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=replicated)
    outputs = jax.ShapeDtypeStruct((L, 1, seq, d), dtype, sharding=replicated)
    columns = jax.ShapeDtypeStruct((L, A), jnp.int32, sharding=replicated)
    split = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=targets_sharding(mesh, len(shape)))

    def fn(model, tc, tokens, layers, positions, vectors, outputs, sources, columns):
        g_y, g_e = target_gradients(model, tokens, tc, layers, positions, vectors, outputs)
        return source_columns(g_y, g_e, sources.vectors, sources.errors, sources.tokens, columns, mesh=mesh)

    return fn, (model, tc, tokens, split((B,), jnp.int32), split((B,), jnp.int32), split((B, d), jnp.float32),
                outputs, sources, columns)


def _images(model, batch: int, sharding):
    """One abstract image per row for a wrapper (None for a text model)."""
    v = getattr(model.config, "vision", None)
    if v is None or not hasattr(model, "text"):
        return None
    size = v.image_size
    if not size:
        raise ValueError(f"jstd.aot builds images as pixel_values [images, 3, H, W] (Llava-style towers); the "
                         f"{model.family} tower cuts images into grids of its own: not covered")
    dtype = jax.tree.leaves(model)[0].dtype
    return {"pixel_values": jax.ShapeDtypeStruct((batch, v.num_channels, size, size), dtype, sharding=sharding)}


def abstract_leaves(args) -> list:
    """The abstract leaves of ``args`` (for a size summary)."""
    return [x for x in jax.tree.leaves(args) if isinstance(x, jax.ShapeDtypeStruct)]

