"""Activation patching: a clean run's values into a corrupted run, one patch or a whole sweep.

    m = jstd.patch(model, clean, corrupt, "layers.layer_output", layer=3, positions=5, metric=metric)
    grid = jstd.patch_sweep(model, clean, corrupt, "layers.layer_output", metric)   # [layers, positions]

A sweep patches every (block, position[, head]) entry one at a time and
evaluates ``metric(logits)`` on each patched run. The entries run as one jitted
``vmap`` over chunks whose size keeps the chunk's working memory within
``memory_budget``; one compile serves every chunk (the last is padded).

A patch at block ``l`` and position ``p`` changes nothing before either, so
sweeps at sites with a ``seq`` axis resume the corrupted run
(``jstd.interventions.resume``): each patched run starts at block ``l`` and
computes the positions from ``p`` on against the corrupted run's cached keys,
values and states. Entries whose patch cannot change the metric cost nothing:
positions the clean and corrupted prompts share (every value there is the
same on both runs), and positions after the one a ``PositionMetric`` reads.
Other sites (attention patterns, states, prompt-wide
values) recompute every block and position.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.interventions.chunking import balanced, fit
from jstd.core.checks import host_value, trusted
from jstd.core.jit import device_array
from jstd.core.edits import Set, check_index, selection_mask, site_axes
from jstd.core.progress import Progress, quiet_unless_terminal
from jstd.core.inputs import Inputs, as_inputs
from jstd.interventions.metrics import check_metric
from jstd.interventions.reading import read
from jstd.interventions.resume import both_runs, resumable, resumed_sweep, shared_prefix
from jstd.run import run
from jstd.sharding import spread
from jstd.core.sites import SITES, SiteError, parse

Metric = Callable[[Float[Array, "batch seq vocab"]], Array]
DEFAULT_BUDGET = 1 << 30


def _split(site: str, layer):
    base, index = parse(site)
    if index is not None:
        if layer is not None:
            raise SiteError(f"{site!r} already names block {index}; drop layer=")
        return base, index
    return base, layer


def patch(
    model, clean: Int[Array, "batch seq"] | Inputs, corrupt: Int[Array, "batch seq"] | Inputs, site: str, *, layer=None,
    positions=None, heads=None, metric: Metric | None = None, attention_mask: Int[Array, "batch seq"] | None = None,
):
    """Run ``corrupt`` with ``site`` replaced by its value on ``clean`` at ``layer``, ``positions``, ``heads``.

    ``layer`` None patches every block that has the site (or name one block as
    ``"layers.5.X"``); ``positions`` / ``heads`` select as on ``jstd.Set`` (None:
    all). ``clean`` and ``corrupt`` are token ids of the same shape (sharing
    ``attention_mask``) or ``jstd.Inputs``. Returns ``metric(logits)`` when a
    metric is given, the patched run's ``Outputs`` otherwise.
    """
    site, layer = _split(site, layer)
    clean, corrupt = pair_inputs(clean, corrupt, attention_mask)
    who = f"patch at {site}"
    if metric is not None:
        corrupt = checked_metric(metric, corrupt, model, who)
    if SITES[site].per_block and layer is not None:
        layer = model.check_block(site, layer, who)
    value = read(model, clean, (site,), ())[site]
    if SITES[site].per_block and layer is not None:
        value = value[model.row_of(site, layer)]
    selection_mask(site, value.shape[1:] if SITES[site].per_block and layer is None else value.shape, positions, heads,
                   who)  # positions and heads in range, before the run
    edit = Set(site, value, layer=layer, positions=positions, heads=heads)
    out = read(model, corrupt, (), (edit,))
    return out if metric is None else metric(out.logits)


def pair_inputs(clean, corrupt, attention_mask) -> tuple[Inputs, Inputs]:
    """Both runs' inputs (token arrays share ``attention_mask``); ValueError unless their shapes agree."""
    clean, corrupt = (jax.tree.map(device_array, as_inputs(x, attention_mask)) for x in (clean, corrupt))
    shapes = [jax.tree.map(np.shape, x) for x in (clean, corrupt)]
    if shapes[0] != shapes[1]:
        raise ValueError(f"clean {np.shape(clean.tokens)} and corrupt {np.shape(corrupt.tokens)} inputs must have "
                         "the same shape (patching is position by position)")
    return clean, corrupt


def checked_metric(metric, corrupt: Inputs, model, who: str) -> Inputs:
    """``corrupt`` once ``metric`` passes its checks on logits of the run's shape (``metrics.check_metric``: token
    ids, positions; left padding for a metric read from the end), its mask checked when traced."""
    tokens = corrupt.tokens
    mask = check_metric(metric, (*np.shape(tokens), model.config.vocab_size), corrupt.attention_mask, who)
    return Inputs(tokens, mask, corrupt.images, corrupt.layout)


class SweepGrid(eqx.Module):
    """The entries of a sweep: one (block, position, head) triple per entry (unused axes hold zeros)."""

    layers: Int[Array, "n"]
    positions: Int[Array, "n"]
    heads: Int[Array, "n"]


def bytes_per_run(model, batch: int, seq: int) -> int:
    """An upper estimate of the working memory of one forward pass on ``[batch, seq]`` tokens.

    One block's activations at a time (blocks are scanned): the residual
    stream and its normed copies, queries, keys, values, the scores, the MLP's
    hidden activations, and the logits with their softmax.
    """
    c = model.config
    item = max(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(model) if hasattr(x, "dtype"))
    per_token = 12 * c.hidden_size + 4 * c.intermediate_size + 3 * c.num_heads * seq + 3 * c.vocab_size
    return item * batch * seq * per_token


def chunk_size_for(model, batch: int, seq: int, entries: int, memory_budget: int) -> int:
    """The largest chunk of patched runs whose working memory fits ``memory_budget`` (at least 1),
    balanced so the chunks are of near-equal size."""
    return balanced(entries, int(memory_budget // bytes_per_run(model, batch, seq)))


def patch_sweep(
    model, clean: Int[Array, "batch seq"], corrupt: Int[Array, "batch seq"], site: str, metric: Metric, *,
    layers: Sequence[int] | None = None, positions: Sequence[int] | None = None, heads: Sequence[int] | bool | None = None,
    attention_mask: Int[Array, "batch seq"] | None = None, memory_budget: int = DEFAULT_BUDGET,
    chunk_size: int | None = None, progress: bool = True, mesh=None, mesh_axis: str = "data",
) -> Float[Array, "*grid"]:
    """``metric`` of the corrupted run with one entry of ``site`` patched from the clean run, for every entry.

    The grid's axes, in order: blocks (``layers``, default every block with
    the site; absent for a site that is not per block), positions
    (``positions``, default all; absent for a site without a position axis),
    heads (``heads``: default all heads where the site has a head axis,
    ``False`` to patch all heads together), then the metric's own shape.
    Entry ``[i, j, k]`` equals ``patch(model, clean, corrupt, site,
    layer=layers[i], positions=positions[j], heads=heads[k], metric=metric)``.

    Chunks of ``chunk_size`` entries (default: as many as fit
    ``memory_budget`` bytes of working memory by the compiled chunk's own
    figure, ``jstd.interventions.chunking``; the model, the clean and
    corrupted runs' values and the results are outside the budget) run as one
    compiled ``vmap`` each, on a progress line (to a terminal) with
    ``progress``. A resumed sweep's chunks are packed rows, each holding
    up to two entries; an entry at a position the clean and corrupted inputs
    share (a shared prefix: the runs agree there at every site), or after the
    position a ``PositionMetric`` reads, is the corrupted run's metric and
    runs nothing. It keeps the corrupted run's caches (keys and values;
    on DeltaNet models the state at every position: 48 MiB a token at
    Qwen3.5-4B's size); where those alone pass ``memory_budget``, each patched
    run is computed whole instead (the same grid, more FLOPs).

    ``mesh`` (a ``jax.sharding.Mesh``): each chunk's entries are split over
    its ``mesh_axis`` axis, each device running its share (the chunk size
    rounded up to a multiple of the axis' size); the model may be sharded on
    the same mesh (``jstd.shard``). The grid is the same as without a mesh.
    """
    site, _ = _split(site, None)
    spread = Spread(mesh, mesh_axis)
    clean, corrupt = pair_inputs(clean, corrupt, attention_mask)
    who = f"patch_sweep at {site}"
    corrupt = checked_metric(metric, corrupt, model, who)
    # the clean run's values and the corrupted run's caches from one program, where those fit the budget
    both = both_runs(model, clean, corrupt, site, memory_budget) if resumable(site) and corrupt.images is None else None
    resumed = both is not None
    clean_values, corrupt_out = both if resumed else (read(model, clean, (site,), ())[site], None)
    pos_axis, _ = site_axes(site)
    per_block = SITES[site].per_block
    axes, split_heads = _grid_axes(model, site, clean_values.shape[1 if per_block else 0:], layers, positions, heads,
                                   who)
    shape = tuple(len(a) for a in axes)
    mesh = np.meshgrid(*[np.asarray(a, np.int32) for a in axes], indexing="ij")
    columns = iter([m.reshape(-1) for m in mesh])
    n = int(np.prod(shape))
    zeros = np.zeros(n, np.int32)
    grid_l = next(columns) if per_block else zeros
    grid_p = next(columns) if pos_axis is not None else zeros
    grid_h = next(columns) if split_heads else zeros

    if resumed:
        out = resumed_sweep(model, clean_values, corrupt.tokens, corrupt.attention_mask, site, metric, axes[0], axes[1],
                            axes[2] if split_heads else [0], split_heads, memory_budget, chunk_size,
                            lambda blocks: _progress(blocks, progress, f"patching {site}"), spread,
                            shared_prefix(*(host_value(x) for x in (clean.tokens, corrupt.tokens)),
                                          *(None if m is None else host_value(m)
                                            for m in (clean.attention_mask, corrupt.attention_mask))),
                            corrupt_out)
        return device_array(out.reshape(shape + out.shape[2:]))

    what = (per_block, pos_axis is not None, split_heads)
    entries_of = lambda g, start, size: SweepGrid(*(spread.place(a[start:start + size], size) for a in g))
    lower = lambda size: _sweep_chunk.lower(model, corrupt, clean_values, metric,
                                            entries_of((grid_l, grid_p, grid_h), 0, size), site, what)
    guess = chunk_size_for(model, *corrupt.tokens.shape, n, memory_budget)
    with trusted():  # the grid, inputs and metric were checked concretely above: no host callback in the chunk
        size, chunk = spread.fit(lower, n, guess, memory_budget, chunk_size)
    chunks = math.ceil(n / size)
    pad = chunks * size - n
    padded = [np.concatenate([g, np.repeat(g[-1:], pad)]) for g in (grid_l, grid_p, grid_h)]

    results = []
    for i in _progress(range(chunks), progress, f"patching {site}"):
        results.append(jax.block_until_ready(
            chunk(model, corrupt, clean_values, metric, entries_of(padded, i * size, size), site, what)))
    out = jnp.concatenate(results)[:n]
    return out.reshape(shape + out.shape[1:])


def _grid_axes(model, site: str, shape: tuple[int, ...], layers, positions, heads, who: str
               ) -> tuple[list[list[int]], bool]:
    """The entries of each axis of ``patch_sweep``'s grid (blocks, positions, heads: those the site has and the
    call keeps) for a site whose per-block value has ``shape``, each checked and counted from the start (negatives
    count from the end) so the grid is in range; and whether heads are patched one by one."""
    spec = SITES[site]
    pos_axis, head_axis = site_axes(site)
    axes = []
    if spec.per_block:
        L = model.depth(spec.stack)
        axes.append(list(model.blocks_for(site)) if layers is None else
                    [int(model.check_block(site, layer, who)) % L for layer in layers])
    entries = lambda given, axis, arg: _entries(given, shape[axis], f"{who}: {arg}", spec.layout[axis])
    if pos_axis is not None:
        axes.append(list(range(shape[pos_axis])) if positions is None else entries(positions, pos_axis, "positions"))
    elif positions is not None:
        raise SiteError(f"{site} has no position axis; drop positions=")
    split_heads = head_axis is not None and heads is not False
    if split_heads:
        axes.append(list(range(shape[head_axis])) if heads in (None, True) else entries(heads, head_axis, "heads"))
    elif heads not in (None, False):
        raise SiteError(f"{site} has no head axis; drop heads=")
    return axes, split_heads


class Spread:
    """How a sweep's chunks are placed: on the default device (``mesh`` None), or split over ``mesh``'s ``axis``."""

    def __init__(self, mesh=None, axis: str = "data"):
        self.mesh, self.axis, self.size = mesh, axis, 1
        if mesh is not None:
            if axis not in mesh.axis_names:
                raise ValueError(f"mesh has no axis {axis!r} (axes: {mesh.axis_names}); pass mesh_axis= one of them")
            self.size = dict(zip(mesh.axis_names, mesh.devices.shape))[axis]

    def place(self, entries: np.ndarray, size: int):
        """``entries`` (a chunk, at most ``size`` long: the grid's end) padded to ``size`` with its last entry, then
        placed."""
        entries = spread(np.asarray(entries), size - len(entries))
        if self.mesh is None:
            return device_array(entries)
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(entries, NamedSharding(self.mesh, PartitionSpec(self.axis)))

    def rounded(self, size: int) -> int:
        """``size`` rounded up to a multiple of the axis' size."""
        return size + -size % self.size

    def fit(self, lower, total: int, guess: int, budget: int, size: int | None) -> tuple:
        """``chunking.fit`` with every chunk size rounded up to a multiple of the axis' size (the chunk's working
        memory is measured at the rounded size, so it may pass the budget by less than one entry per device)."""
        size, chunk = fit(lambda size: lower(self.rounded(size)), total, guess, budget, size)
        return self.rounded(size), chunk


def _entries(given, size: int, what: str, axis: str) -> list[int]:
    """A sweep axis' entries (ints, or a boolean mask: its True entries) checked (``check_index``) and counted
    from the start."""
    given = np.atleast_1d(np.asarray(given))
    given = check_index(given if given.size else given.astype(int), size, what, axis)
    given = np.flatnonzero(given) if given.dtype == bool else np.asarray(given) % size
    return [int(i) for i in given]


@eqx.filter_jit
def _sweep_chunk(model, corrupt, clean_values, metric, entries: SweepGrid, site: str, what):
    per_block, has_positions, has_heads = what

    def one(layer, position, head):
        value = clean_values[model.row_of(site, layer)] if per_block else clean_values
        edit = Set(site, value, layer=layer if per_block else None, positions=position if has_positions else None,
                     heads=head if has_heads else None)
        return metric(run(model, corrupt, [edit]).logits)

    return jax.vmap(one)(entries.layers, entries.positions, entries.heads)


def _progress(items, enabled: bool, description: str):
    """``items`` counted on a progress line (to a terminal only)."""
    items = list(items)
    return Progress(description, count=len(items), enabled=quiet_unless_terminal(enabled), unit="chunks").over(items)
