"""Running a stack of blocks under ``lax.scan``, one repeating period of block kinds per step.

A model's blocks each have a *kind* (``config.layer_types``: ``full_attention``
on every Llama block; ``linear_attention`` and ``full_attention`` on a hybrid).
Each kind's blocks are stacked on a leading axis, in block order. The stack
runs as the shortest period ``P`` with ``kinds[i] == P[i % len(P)]``: a
``lax.scan`` over the ``n = len(kinds) // len(P)`` whole periods whose body runs
the ``len(P)`` blocks of one period in order (the kinds' parameters reshaped to
``[n, per_period, ...]``), then the tail (the first ``len(kinds) % len(P)``
blocks of ``P``) once more, unrolled. Compile time depends on the period, not
on the depth. (A list of kinds with no shorter repetition is its own period.)

Each block gets a scope whose taps know, for every site, the block's index
among the blocks the site's values are stacked over (``blocks_for(site)``), so
stacked edits index the right row. The recorded reads come back reassembled in
block order: ``reads["layers.X"]`` is stacked over ``blocks_for("layers.X")``.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp


def period_of(kinds: Sequence[str]) -> int:
    """The length of the shortest ``P`` with ``kinds[i] == P[i % len(P)]`` for every block."""
    kinds = tuple(kinds)
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


class BlockScope:
    """The taps of one block: one ``tap.scope`` per group of blocks a site is stacked over.

    ``stack_index(group_kinds)`` gives the block's (possibly traced) index among
    the blocks whose kind is in ``group_kinds``.
    """

    def __init__(self, tap, layer, group_of: Callable[[str], frozenset], stack_index: Callable[[frozenset], object]):
        self.tap = tap
        self.layer = layer
        self._group_of = group_of
        self._stack_index = stack_index
        self._scopes: dict[frozenset, object] = {}

    def touches(self, *sites: str) -> bool:
        return self.tap.touches(*sites)

    def __call__(self, site: str, value):
        group = self._group_of(site)
        if group not in self._scopes:
            self._scopes[group] = self.tap.scope(layer=self.layer, stack_index=self._stack_index(group))
        return self._scopes[group](site, value)

    @property
    def records(self) -> dict:
        return {k: v for scope in self._scopes.values() for k, v in scope.records.items()}


def scan_period(
    h,
    tap,
    kinds: Sequence[str],
    stacks: Mapping[str, object],
    args: Mapping[str, tuple],
    blocks_for: Callable[[str], Sequence[int]],
    pasts: Mapping[str, object] | None = None,
    first=None,
):
    """Run every block over ``h`` in order; return ``(h, reads)``.

    kinds: each block's kind, in block order.
    stacks: kind -> that kind's blocks stacked on a leading axis, in block order;
        a block is called as ``block(h, *args[kind], scope)`` and returns the new h.
    blocks_for: site -> the blocks its values are stacked over; each such set
        must be all the blocks of some kinds.
    pasts: kind -> what earlier positions left for each of that kind's blocks
        (a pytree stacked like ``stacks[kind]``); a block with one is called as
        ``block(h, *args[kind], scope, past=its entry)``.
    first: the first block to run (an int or a traced int; None: block 0).
        Blocks before it pass ``h`` through (``lax.cond``; under a ``vmap``
        over ``first`` both branches run) and their reads are zeros.

    The reads: site -> its value stacked over ``blocks_for(site)``; for a site
    read at single blocks only (``tap.single``), site -> ``{block: value}``.

    Raises ValueError when a stack's length does not match the kinds, or when a
    site's blocks are not all the blocks of some kinds.
    """
    kinds = tuple(kinds)
    L = len(kinds)
    p = period_of(kinds)
    n, tail = divmod(L, p)
    pattern = kinds[:p]
    for kind, blocks in stacks.items():
        rows = jax.tree.leaves(blocks)[0].shape[0]
        if rows != kinds.count(kind):
            raise ValueError(f"{rows} stacked {kind} blocks, but the layer types have {kinds.count(kind)}")
    rank = [pattern[:q].count(pattern[q]) for q in range(p)]  # a block's index among its kind in a period

    groups: dict[str, frozenset] = {}

    def group_of(site: str) -> frozenset:
        if site not in groups:
            blocks = tuple(blocks_for(site))
            group = frozenset(kinds[i] for i in blocks)
            if blocks != tuple(i for i, k in enumerate(kinds) if k in group):
                raise ValueError(f"{site} is stacked over blocks {list(blocks)}, which are not all the blocks of some kinds")
            groups[site] = group
        return groups[site]

    per_period = {kind: pattern.count(kind) for kind in stacks}
    pasts = pasts or {}
    bundles = {kind: (stacks[kind], pasts.get(kind)) for kind in stacks}

    def run_period(h, j, width):
        """Blocks ``j * p + q`` for q < width (``j`` traced inside the scan, an int for the tail)."""
        records = []
        for q in range(width):
            kind = pattern[q]
            # index the whole stacks: reshaping them per period would copy every weight (XLA does not
            # treat the [n, 1, ...] reshape as a bitcast), indexing them in the loop copies one block
            index = j * per_period[kind] + rank[q]
            block, past = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), bundles[kind])

            def stack_index(group, q=q):
                return j * sum(k in group for k in pattern) + sum(k in group for k in pattern[:q])

            def step(h, q=q, kind=kind, block=block, past=past, stack_index=stack_index):
                s = BlockScope(tap, j * p + q, group_of, stack_index)
                h = block(h, *args[kind], s) if past is None else block(h, *args[kind], s, past=past)
                return h, s.records

            h, block_records = step(h) if first is None else _from_block(first, j * p + q, step, h)
            records.append(block_records)
        return h, records

    # sites read at single blocks only ("layers.5.X"): kept in the scan's carry, not stacked over every block
    single = tap.single

    def keep(kept, records, j):
        """Move the single-block reads out of ``records`` (blocks ``j * p + q``; ``j`` an int on the tail)
        into ``kept``."""
        kept = dict(kept)
        for q, r in enumerate(records):
            for site in [site for site in r if site in single]:
                value = r.pop(site)
                for i in single[site]:
                    if isinstance(j, int) and i == j * p + q:
                        kept[site, i] = value
                    elif not isinstance(j, int) and i % p == q and i < n * p:
                        kept[site, i] = jnp.where(j == i // p, value, kept[site, i])
        return kept

    kept = {}
    if single:
        shapes = jax.eval_shape(lambda h: run_period(h, 0, p)[1], h)
        kept = {(site, i): jnp.zeros(shapes[i % p][site].shape, shapes[i % p][site].dtype)
                for site, blocks in single.items() for i in blocks if i < n * p}

    def body(carry, j):
        h, kept = carry
        h, records = run_period(h, j, p)
        return (h, keep(kept, records, j)), records

    (h, kept), period_reads = jax.lax.scan(body, (h, kept), jnp.arange(n))
    tail_reads = []
    if tail:
        h, tail_reads = run_period(h, n, tail)
        kept = keep(kept, tail_reads, n)

    reads = {}
    for site, i in kept:
        reads.setdefault(site, {})[i] = kept[site, i]
    for site in {site for r in period_reads + tail_reads for site in r} - set(reads):
        parts = [r[site] for r in period_reads if site in r]  # each [n, ...], one per position in the period
        value = parts[0] if len(parts) == 1 else jnp.stack(parts, axis=1).reshape(n * len(parts), *parts[0].shape[1:])
        extra = [r[site] for r in tail_reads if site in r]
        if extra:
            value = jnp.concatenate([value, jnp.stack(extra)])
        if value.shape[0] != len(blocks_for(site)):
            raise ValueError(f"{site}: {value.shape[0]} blocks recorded it, but it is stacked over {len(blocks_for(site))}")
        reads[site] = value
    return h, reads


def _from_block(first, layer, step, h):
    """``step(h)`` for blocks at or after ``first``; ``(h, zeros shaped like its reads)`` before it."""
    shapes = jax.eval_shape(step, h)[1]
    skip = lambda h: (h, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
    return jax.lax.cond(layer >= first, step, skip, h)


def scan_blocks(blocks, h, tap, body_args, blocks_for=None, past=None, first=None):
    """Run stacked ``blocks`` of one kind over ``h`` (one block per scan step); returns (h, stacked reads).

    ``past`` (stacked like ``blocks``) and ``first`` as in ``scan_period``.
    """
    num = jax.tree.leaves(blocks)[0].shape[0]
    every = tuple(range(num))
    return scan_period(h, tap, ("block",) * num, {"block": blocks}, {"block": tuple(body_args)},
                       blocks_for or (lambda site: every), None if past is None else {"block": past}, first)
