"""Patching sweeps that resume the corrupted run instead of recomputing it.

A patch at block ``l`` and position ``p`` changes nothing at earlier blocks or
earlier positions. So each patched run starts at block ``l`` (the blocks
before it are skipped with ``lax.cond``) from the corrupted run's stream, and
computes only the positions from ``p`` on, against the corrupted run's cached
keys, values and states (``jstd.Context``). On softmax-attention models two
such suffixes share one row — the suffix from ``p`` and a shorter one — so
every row has about ``seq + 1`` tokens and all rows one shape: one compile
for the whole sweep, the block index traced. A patch at a position the clean
and corrupted prompts share (``shared_prefix``: before their first difference
both runs hold the same values everywhere) or after the one position a metric
reads changes nothing: such entries are left out of the rows, their metric the
corrupted run's (which every chunk also returns). The clean run's values and
the corrupted run's caches come from one program over both prompts
(``both_runs``).

A metric that reads one position (``metrics.PositionMetric``) gets the logits
at that position alone; any other metric gets the full logits, the prefix's
taken from the corrupted run.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jstd.core.checks import host_value, spans_processes, trusted
from jstd.core.jit import device_array
from jstd.core.context import Context, as_cached
from jstd.interventions.chunking import fit
from jstd.core.edits import Set, site_axes
from jstd.interventions.metrics import PositionMetric
from jstd.interventions.reading import read
from jstd.run import check_tokens, run
from jstd.core.sites import SITES

STREAM_SITES = ("layers.layer_input", "layers.layer_output")


def resumable(site: str) -> bool:
    """Whether a sweep at ``site`` can resume the corrupted run: a block site with a ``seq`` axis."""
    pos_axis, _ = site_axes(site)
    return SITES[site].per_block and pos_axis is not None and SITES[site].layout[pos_axis] == "seq"


class Rows(NamedTuple):
    """The packed rows of a sweep (numpy; the same for every block).

    positions, first, heads: ``[rows, length]`` — each token's position, whether
        it is its segment's patched position, the head patched in its segment.
    starts, entries: ``[rows, slots]`` — each segment's patched position and its
        index in the entry list (-1: an empty slot), slots of a row in token order.
    offsets: ``[rows, slots]`` — the index of each segment's first token in its row.
    """

    positions: np.ndarray
    first: np.ndarray
    heads: np.ndarray
    starts: np.ndarray
    entries: np.ndarray
    offsets: np.ndarray


def pack(positions: np.ndarray, heads: np.ndarray, seq: int, pair: bool, *, end: int | None = None) -> Rows:
    """Rows holding the suffix of every entry ``(positions[i], heads[i])``: two per row when ``pair``.

    A suffix runs from its entry's position to ``end - 1`` (default ``seq``:
    the last position; a metric that reads one position needs no later one).
    The longest suffix shares a row with the shortest, and so on; rows are
    padded at the end with tokens at position ``seq - 1`` (each its own
    segment, or the continuation of one that ends at ``seq - 2``; they come
    after every real token, so they change nothing). No entries: one row of one
    padding token and no slots.
    """
    end = seq if end is None else end
    order = np.argsort(positions, kind="stable")
    n = len(order)
    groups = [[order[i], order[n - 1 - i]] if pair and i != n - 1 - i else [order[i]] for i in range((n + 1) // 2 if pair else n)]
    groups = groups or [[]]
    length = max(1, max(sum(end - positions[e] for e in g) for g in groups))
    slots = max(len(g) for g in groups)
    rows = len(groups)
    pos = np.full((rows, length), seq - 1, np.int32)
    first = np.zeros((rows, length), bool)
    head = np.zeros((rows, length), np.int32)
    starts = np.zeros((rows, slots), np.int32)
    entries = np.full((rows, slots), -1, np.int32)
    offsets = np.zeros((rows, slots), np.int32)
    for r, group in enumerate(groups):
        at = 0
        for k, e in enumerate(group):
            entries[r, k] = e
            p = int(positions[e])
            pos[r, at:at + end - p] = np.arange(p, end)
            first[r, at] = True
            head[r, at:at + end - p] = heads[e]
            starts[r, k], offsets[r, k] = p, at
            at += end - p
    return Rows(pos, first, head, starts, entries, offsets)


def shared_prefix(clean: np.ndarray, corrupt: np.ndarray, clean_mask=None, corrupt_mask=None) -> int:
    """How many leading positions the clean and corrupted inputs share in every row (tokens ``[batch, seq]`` and
    padding masks, None: no padding). The model is causal, so every site there holds the same value on both runs
    and a patch there changes nothing."""
    same = np.asarray(clean) == np.asarray(corrupt)
    if clean_mask is not None or corrupt_mask is not None:
        real = lambda m: np.ones(same.shape, bool) if m is None else np.asarray(m) != 0
        same &= real(clean_mask) == real(corrupt_mask)
    differs = np.flatnonzero(~same.all(axis=0))
    return int(differs[0]) if len(differs) else same.shape[1]


def bytes_per_row(model, batch: int, length: int, keys: int) -> int:
    """An upper estimate of one resumed run's working memory: ``length`` tokens attending to ``keys`` keys."""
    c = model.config
    item = max(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(model) if hasattr(x, "dtype"))
    per_token = 12 * c.hidden_size + 4 * c.intermediate_size + 3 * c.num_heads * keys + 2 * c.hidden_size
    return item * batch * length * per_token


def resumed_sweep(model, clean_values, corrupt, attention_mask, site: str, metric, layers, positions, heads,
                  split_heads: bool, memory_budget: int, chunk_size: int | None, progress, spread=None,
                  shared: int = 0, corrupt_out=None) -> np.ndarray:
    """The sweep of ``patch_sweep`` through resumed runs: ``[layers, positions x heads, *metric]``.

    ``clean_values``: the clean run's value of ``site`` (stacked over blocks);
    ``heads``: the heads patched one at a time (``[0]`` when ``split_heads`` is
    False: all heads together); ``chunk_size``: rows per chunk (default: as
    many as fit ``memory_budget``, ``chunking.fit`` from the guess of
    ``bytes_per_row``); ``progress`` wraps the iterable of blocks; ``spread``
    (``patching.Spread``) places each chunk's rows, split over a mesh axis;
    ``shared``: the leading positions the clean and corrupted inputs share
    (``shared_prefix``); ``corrupt_out``: ``corrupted_run``'s outputs when the
    caller has them (``both_runs``). Entries whose patch cannot change the metric — at a
    shared position, or after the position a ``PositionMetric`` reads — are
    left out of the rows (no tokens) and get the corrupted run's metric.
    """
    seq = corrupt.shape[1]
    if corrupt_out is None:
        corrupt_out = corrupted_run(model, corrupt, site, attention_mask)

    entry_p = np.repeat(np.asarray(positions, np.int32), len(heads))
    entry_h = np.tile(np.asarray(heads, np.int32), len(positions))
    entry_p = np.where(entry_p < 0, entry_p + seq, entry_p)
    end = metric.position % seq + 1 if isinstance(metric, PositionMetric) else seq
    live = np.flatnonzero((entry_p >= shared) & (entry_p < end))  # the rest cannot change the metric
    rows = pack(entry_p[live], entry_h[live], seq, pair=not model.layers_with("linear_attn"), end=end)
    n_rows, length = rows.positions.shape
    keys = length + (as_cached(corrupt_out[Context.sites_for(model)[0]]).shape[3] if model.layers_with("self_attn") else 0)
    place = (lambda a, size: device_array(a)) if spread is None else spread.place
    chunk_rows = lambda rows, start, size: Rows(*(place(a[start:start + size], size) for a in rows))
    lower = lambda size: resumed_chunk.lower(model, corrupt, attention_mask, corrupt_out, clean_values, metric, chunk_rows(rows, 0, size),
                                      device_array(np.int32(layers[0])), site, split_heads)
    guess = int(memory_budget // bytes_per_row(model, corrupt.shape[0], length, keys))
    with trusted():  # every argument was checked concretely above: no host callback, cacheable across sessions
        size, chunk = (fit if spread is None else spread.fit)(lower, n_rows, guess, memory_budget, chunk_size)
    chunks = math.ceil(n_rows / size)
    pad = chunks * size - n_rows
    padded = Rows(*(np.concatenate([a, np.repeat(a[-1:], pad, 0)]) for a in rows))

    out = []
    for layer in progress(layers):
        per_layer = []
        for c in range(chunks):
            values, corrupted = chunk(model, corrupt, attention_mask, corrupt_out, clean_values, metric,
                                      chunk_rows(padded, c * size, size), device_array(np.int32(layer)), site,
                                      split_heads)
            per_layer.append(host_value(values))
        values = np.concatenate(per_layer)[:n_rows]  # [rows, slots, *metric]
        grid = np.empty((len(entry_p),) + values.shape[2:], values.dtype)
        grid[:] = host_value(corrupted)  # the entries left out; the rows' entries overwrite theirs
        mask = rows.entries >= 0
        grid[live[rows.entries[mask]]] = values[mask]
        out.append(grid)
    return np.stack(out)


def both_runs(model, clean, corrupt, site: str, memory_budget: int) -> tuple | None:
    """``(clean_values, corrupt_out)``: the clean run's ``site`` (stacked over blocks) and ``corrupted_run``'s
    outputs, from one compiled run over both batches side by side (``jstd.Inputs`` of tokens, images None), so a
    sweep compiles one forward, not two; each row runs alone, so the values are each run's own. None when the
    corrupted run's outputs alone pass ``memory_budget`` bytes (``corrupted_run_bytes``; the program is traced
    once for that figure and the run). Inputs spread over several processes run apart (``corrupt_out`` None:
    ``resumed_sweep`` reads it)."""
    inputs = [x for pair in (clean, corrupt) for x in (pair.tokens, pair.attention_mask) if x is not None]
    if any(spans_processes(x) for x in inputs):
        if corrupted_run_bytes(model, corrupt.tokens, site, corrupt.attention_mask) > memory_budget:
            return None
        return read(model, clean, (site,), ())[site], None
    tokens = [host_value(x.tokens) for x in (clean, corrupt)]
    mask = None
    if clean.attention_mask is not None or corrupt.attention_mask is not None:
        mask = device_array(np.concatenate([
            np.ones(t.shape, np.int32) if x.attention_mask is None else host_value(x.attention_mask)
            for t, x in zip(tokens, (clean, corrupt))]).astype(np.int32))
    tokens = device_array(check_tokens(np.concatenate(tokens), model.config.vocab_size))  # checked: trusted below
    program = lambda: _both_runs(model, tokens, mask, site, len(tokens) // 2)
    with trusted():
        if nbytes(jax.eval_shape(program)[1]) > memory_budget:  # (corrupted_run_bytes; the trace is reused)
            return None
        return program()


@eqx.filter_jit
def _both_runs(model, tokens, mask, site: str, batch: int):
    """``both_runs``' program: one run over ``[clean; corrupt]`` (``batch`` rows each), its reads split in two."""
    corrupted = corrupted_sites(model, site)
    out = run(model, tokens, reads=tuple(sorted({site, *corrupted})), attention_mask=mask)

    def half(name, second):
        axis = SITES[name].layout.index("batch") + SITES[name].per_block
        return jax.lax.slice_in_dim(out[name], batch if second else 0, 2 * batch if second else batch, axis=axis)

    return half(site, False), {name: half(name, True) for name in corrupted}


def corrupted_sites(model, site: str) -> tuple[str, ...]:
    """The sites ``corrupted_run`` reads."""
    return Context.sites_for(model) + (_stream_site(site), "final_norm_output")


def corrupted_run_bytes(model, corrupt, site: str, attention_mask=None) -> int:
    """The bytes of the sites ``corrupted_run`` reads, what a resumed sweep keeps (from its shapes; nothing runs):
    on DeltaNet models the state at every position dominates, ``key_dim · value_dim`` floats per head, block and
    token."""
    out = jax.eval_shape(lambda: corrupted_run(model, corrupt, site, attention_mask))
    return nbytes([out[name] for name in corrupted_sites(model, site)])


def nbytes(tree) -> int:
    """The bytes of every array (or shape) in ``tree``."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def corrupted_run(model, corrupt, site: str, attention_mask=None):
    """What the resumed runs of a sweep at ``site`` continue: the corrupted run's cached keys, values and states
    (``Context.sites_for``), the stream at ``site``'s block and the final norm's output."""
    return read(model, corrupt, corrupted_sites(model, site), (), attention_mask)


@eqx.filter_jit
def resumed_chunk(model, corrupt, attention_mask, corrupt_out, clean_values, metric, rows: Rows, layer, site: str,
                  split_heads: bool):
    """``(the metric of every segment of a chunk of rows at block ``layer`` [rows, slots, *metric], the corrupted
    run's own metric [*metric])`` (the latter what a patch that cannot change the metric gives).

    ``corrupt_out``: ``corrupted_run``'s outputs; ``clean_values``: the clean run's ``site`` over every block;
    ``rows``: a chunk of ``pack``'s rows. One compiled program serves every chunk and block (``layer`` is traced)."""
    seq = corrupt.shape[1]
    corrupt_stream = corrupt_out[_stream_site(site)]
    clean_value = clean_values[model.row_of(site, layer)]
    normed_before = corrupt_out["final_norm_output"]

    def one(positions, first, heads, starts, entries, offsets):
        tokens = corrupt[:, positions]
        edits = ()
        if site in STREAM_SITES:
            # the patch is the start block's input itself: layer_output at l is layer_input at l + 1
            stream = jnp.where(first[None, :, None], clean_value[:, positions], corrupt_stream[layer][:, positions])
            block = layer + 1 if site == "layers.layer_output" else layer
        else:
            stream, block = corrupt_stream[layer][:, positions], layer
            edits = (Set(site, _rows_of(site, clean_value, positions), layer=layer,
                         where=_patch_mask(site, clean_value.shape, first, heads if split_heads else None)),)
        context = Context.continuing(model, corrupt_out, jnp.broadcast_to(positions, tokens.shape), block=block,
                                     stream=stream, mask=attention_mask)
        normed = run(model, tokens, edits, reads=("final_norm_output",), context=context)["final_norm_output"]
        return jax.vmap(lambda start, offset: _segment_metric(model, metric, normed, normed_before, start, offset, seq))(
            starts, offsets)

    # a segment starting at seq is the corrupted run's, whole
    return jax.vmap(one)(*rows), _segment_metric(model, metric, normed_before, normed_before, seq, 0, seq)


def _stream_site(site: str) -> str:
    """The corrupted run's stream a resumed run starts from: ``layer_output`` for patches there (the run
    starts at the next block), ``layer_input`` of the patched block otherwise."""
    return "layers.layer_output" if site == "layers.layer_output" else "layers.layer_input"


def _rows_of(site: str, value, positions):
    """``value`` (one block's, over the prompt) at each token of a row, along the site's seq axis."""
    return jnp.take(value, positions, axis=site_axes(site)[0])


def _patch_mask(site: str, shape, first, heads):
    """True at each segment's patched position (and its head, when ``heads`` is given): a mask of the
    site's rank with the row's tokens on its seq axis (and the heads on its head axis)."""
    pos_axis, head_axis = site_axes(site)
    if heads is None:
        return first.reshape([-1 if i == pos_axis else 1 for i in range(len(shape))])
    mask = first[:, None] & (heads[:, None] == jnp.arange(shape[head_axis])[None, :])  # [tokens, heads]
    if head_axis < pos_axis:
        mask = mask.T
    return mask.reshape([mask.shape[0] if i == min(pos_axis, head_axis) else mask.shape[1] if i == max(pos_axis, head_axis)
                         else 1 for i in range(len(shape))])


def _segment_metric(model, metric, normed, normed_before, start, offset, seq):
    """The metric of one segment: its suffix's final-norm outputs after ``start``, the corrupted run's before."""
    if isinstance(metric, PositionMetric):
        q = metric.position % seq
        at = jnp.where(q >= start, jnp.take(normed, jnp.clip(offset + q - start, 0, normed.shape[1] - 1), axis=1),
                       normed_before[:, q])
        return metric.at(model.logits_from_norm(at))
    t = jnp.arange(seq)
    mine = jnp.take(normed, jnp.clip(offset + t - start, 0, normed.shape[1] - 1), axis=1)
    full = jnp.where((t >= start)[None, :, None], mine, normed_before)
    return metric(model.logits_from_norm(full))
