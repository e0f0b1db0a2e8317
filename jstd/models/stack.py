"""A stack of blocks run under ``lax.scan``, one repeating period of block kinds per step.

Each block has a *kind* (``config.layer_types``: ``full_attention`` on every
Llama block; ``linear_attention`` and ``full_attention`` on a hybrid). The
stack runs as the shortest period ``P`` with ``kinds[i] == P[i % len(P)]``
and stores one stacked block per *slot* of the period: ``slots[q]`` holds
blocks ``q, q + p, q + 2p, …`` on a leading axis. A ``lax.scan`` over the
``n = depth // p`` whole periods runs slot 0 … p-1 at row ``j``, then the tail
(the first ``depth % p`` slots at row ``n``) runs once more, unrolled. Compile
time depends on the period, not on the depth.

A stack has a prefix (``layers``, ``vision.layers``): its blocks tap relative
names and the stack makes them whole. A block site is served by the blocks
whose slot computes it (``blocks_for``); its reads come back stacked over
those blocks in block order, and stacked edits index the right row.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from jstd.models.namemap import Entry
from jstd.models.base import constrain_rows, stacked


def period_of(kinds: Sequence[str]) -> int:
    """The length of the shortest ``P`` with ``kinds[i] == P[i % len(P)]`` for every block."""
    kinds = tuple(kinds)
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


class BlockScope:
    """The taps of one block: one ``tap.scope`` per group of slots a site is stacked over.

    ``stack_index(group)`` gives the block's (possibly traced) index among the
    blocks of the slots in ``group``.
    """

    def __init__(self, tap, prefix: str, layer, group_of: Callable[[str], frozenset],
                 stack_index: Callable[[frozenset], object]):
        self.tap = tap
        self.prefix = prefix
        self.layer = layer
        self._group_of = group_of
        self._stack_index = stack_index
        self._scopes: dict[frozenset, object] = {}

    def touches(self, *sites: str) -> bool:
        return self.tap.touches(*(self.prefix + s for s in sites))

    def __call__(self, site: str, value):
        group = self._group_of(self.prefix + site)
        if group not in self._scopes:
            self._scopes[group] = self.tap.scope(self.prefix, self.layer, self._stack_index(group))
        return self._scopes[group](site, value)

    @property
    def records(self) -> dict:
        return {k: v for scope in self._scopes.values() for k, v in scope.records.items()}


class Rows(eqx.Module):
    """A slot's blocks one by one instead of stacked (``Stack.unstacked``): ``rows[j]`` is row ``j``."""

    rows: tuple

    def has(self, host: str) -> bool:
        return self.rows[0].has(host)

    def sites(self) -> frozenset[str]:
        return self.rows[0].sites()

    @property
    def attn(self):
        return self.rows[0].attn


class Stack(eqx.Module):
    """Blocks stored by period slot (``slots[q]``: blocks ``q, q + p, …`` stacked), run in block order.

    kinds: each block's kind, in block order. prefix: the stack's name (``layers``).
    """

    slots: tuple = stacked()
    kinds: tuple[str, ...] = eqx.field(static=True)
    prefix: str = eqx.field(static=True)

    @property
    def depth(self) -> int:
        return len(self.kinds)

    @property
    def period(self) -> int:
        return len(self.slots)

    def blocks_for(self, site: str) -> tuple[int, ...]:
        """The blocks that compute block site ``site`` (a whole name in this stack), in order."""
        rel = site[len(self.prefix) + 1:]
        return tuple(i for i in range(self.depth) if rel in self.slots[i % self.period].sites())

    def layers_with(self, host: str) -> tuple[int, ...]:
        """The blocks that have ``host`` (``self_attn``, ``linear_attn``, ``mlp``; ``""``: every block)."""
        return tuple(i for i in range(self.depth) if self.slots[i % self.period].has(host))

    def sites(self) -> frozenset[str]:
        """Every block site some block of the stack computes, by whole name."""
        return frozenset(f"{self.prefix}.{rel}" for slot in self.slots for rel in slot.sites())

    def slot_with(self, host: str):
        """The (stacked) slot whose blocks have ``host``, None if none has (the first such slot)."""
        return next((slot for slot in self.slots if slot.has(host)), None)

    def __call__(self, h, tap, args: Mapping[str, tuple], pasts: Mapping[str, object] | None = None, first=None,
                 keep: tuple[int, ...] = (), after: Callable | None = None):
        """Run every block over ``h`` in order; return ``(h, reads)``, or ``(h, reads, streams)`` with ``keep``.

        args: mixer host -> the arguments its mixer takes after the normed stream
            (``{"self_attn": (cos_sin, mask)}``).
        pasts: mixer host -> what earlier positions left for each block with it
            (a pytree stacked over ``layers_with(host)``); such a block is
            called with ``past=`` its entry.
        first: the first block to run (an int or a traced int; None: block 0).
            Blocks before it pass ``h`` through (``lax.cond``; under a ``vmap``
            over ``first`` both branches run) and their reads are zeros.

        keep: blocks whose output stream (edits included) to return too, as
            ``streams`` (a list in ``keep``'s order): projectors that read a block
            before the last. The scan carries them, so the stack's other outputs
            are not kept.

        after: ``after(h, block) -> h`` on each block's output (``block`` its
            index, traced inside the scan): what a model adds to the stream
            between blocks (Qwen3-VL's DeepStack features), so block ``i + 1``
            reads ``after(layer_output of i, i)``. It runs with its block (a
            block skipped under ``first`` skips it too).

        The reads: site -> its value stacked over ``blocks_for(site)``; for a
        site read at single blocks only (``tap.single``), site -> ``{block: value}``.
        """
        p, L = self.period, self.depth
        n, tail = divmod(L, p)
        prefix = self.prefix + "."
        pasts = pasts or {}
        groups: dict[str, frozenset] = {}

        def group_of(site: str) -> frozenset:
            if site not in groups:
                rel = site[len(prefix):]
                groups[site] = frozenset(q for q in range(p) if rel in self.slots[q].sites())
            return groups[site]

        def index_in(group, j, q):
            return j * len(group) + sum(g < q for g in group)

        def run_period(h, j, width):
            """Blocks ``j * p + q`` for q < width (``j`` traced inside the scan, an int for the tail); each block's
            output is appended to ``outs``."""
            records = []
            for q in range(width):
                slot = self.slots[q]
                block = slot.rows[j] if isinstance(slot, Rows) else jax.tree.map(
                    lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), slot)
                host = block.attn.host
                past = pasts.get(host)
                if past is not None:
                    row = index_in(frozenset(g for g in range(p) if self.slots[g].has(host)), j, q)
                    past = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, row, keepdims=False), past)

                def step(h, q=q, block=block, past=past, host=host):
                    s = BlockScope(tap, prefix, j * p + q, group_of, lambda group, q=q: index_in(group, j, q))
                    h = block(constrain_rows(h), args[host], s, past)  # a no-op without jax.set_mesh
                    return (h if after is None else after(h, j * p + q)), s.records

                h, block_records = step(h) if first is None else _from_block(first, j * p + q, step, h)
                records.append(block_records)
                outs.append(h)
            return h, records

        # sites read at single blocks only ("layers.5.X"): kept in the scan's carry, not stacked over every block
        single = {site: blocks for site, blocks in tap.single.items() if site in self.sites()}

        def keep_single(kept, records, j):
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

        outs: list = []  # each block's output in the period being traced (run_period appends)
        kept = {}
        if single:
            shapes = jax.eval_shape(lambda h: run_period(h, 0, p)[1], h)
            kept = {(site, i): jnp.zeros(shapes[i % p][site].shape, shapes[i % p][site].dtype)
                    for site, blocks in single.items() for i in blocks if i < n * p}

        streams = {i: jnp.zeros_like(h) for i in keep if i < n * p}

        def body(carry, j):
            h, kept, streams = carry
            outs.clear()
            h, records = run_period(h, j, p)
            streams = {i: jnp.where(j == i // p, outs[i % p], v) for i, v in streams.items()}
            return (h, keep_single(kept, records, j), streams), records

        if isinstance(self.slots[0], Rows):  # unstacked: every period unrolled, each block's own arrays
            carry, period_reads = (h, kept, streams), []
            for j in range(n):
                carry, records = body(carry, j)
                period_reads.append(records)
            (h, kept, streams) = carry
            period_reads = jax.tree.map(lambda *x: jnp.stack(x), *period_reads)
        else:
            (h, kept, streams), period_reads = jax.lax.scan(body, (h, kept, streams), jnp.arange(n))
        tail_reads = []
        if tail:
            outs.clear()
            h, tail_reads = run_period(h, n, tail)
            kept = keep_single(kept, tail_reads, n)
            streams.update({i: outs[i - n * p] for i in keep if i >= n * p})

        reads = {}
        for site, i in kept:
            reads.setdefault(site, {})[i] = kept[site, i]
        for site in {site for r in period_reads + tail_reads for site in r} - set(reads):
            parts = [r[site] for r in period_reads if site in r]  # each [n, ...], one per slot that has it
            value = parts[0] if len(parts) == 1 else jnp.stack(parts, axis=1).reshape(n * len(parts), *parts[0].shape[1:])
            extra = [r[site] for r in tail_reads if site in r]
            if extra:
                value = jnp.concatenate([value, jnp.stack(extra)])
            reads[site] = value
        return (h, reads, [streams[i] for i in keep]) if keep else (h, reads)

    def unstacked(self, take: Callable) -> "Stack":
        """The same stack with each slot's blocks held one by one (``Rows``) and run unrolled, not scanned: each
        block reads its own arrays. ``take(a, j)``: row ``j`` of a stacked array."""
        rows = lambda slot: Rows(tuple(jax.tree.map(lambda a: take(a, j), slot)
                                       for j in range(jax.tree.leaves(slot)[0].shape[0])))
        return dataclasses.replace(self, slots=tuple(rows(slot) for slot in self.slots))

    # ---- building --------------------------------------------------------------
    @classmethod
    def skeleton(cls, prefix: str, kinds: Sequence[str], block: Callable[[str], object]) -> "Stack":
        """The stack of ``kinds`` whose block of each kind is ``block(kind)`` (a skeleton), stacked by slot."""
        kinds = tuple(kinds)
        p = period_of(kinds)
        slots = tuple(
            jax.tree.map(lambda a: jax.ShapeDtypeStruct((len(range(q, len(kinds), p)),) + a.shape, a.dtype), block(kinds[q]))
            for q in range(p)
        )
        return cls(slots, kinds, prefix)

    def name_map(self, path: str, key: str, names: Callable[[str], dict]) -> list[Entry]:
        """The entries of every slot: ``key`` is the checkpoint's block prefix with ``{i}``
        (``model.layers.{i}.``), ``path`` the stack's path in the model, ``names(kind)`` a block's
        HuggingFace module names (``Block.entries``)."""
        entries = []
        for q, slot in enumerate(self.slots):
            rows = tuple(range(q, self.depth, self.period))
            for e in slot.entries(names(self.kinds[q])):
                entries.append(dataclasses.replace(
                    e.under(key, f"{path}.slots.{q}."), blocks=rows))
        return entries


def _from_block(first, layer, step, h):
    """``step(h)`` for blocks at or after ``first``; ``(h, zeros shaped like its reads)`` before it."""
    shapes = jax.eval_shape(step, h)[1]
    skip = lambda h: (h, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
    return jax.lax.cond(layer >= first, step, skip, h)
