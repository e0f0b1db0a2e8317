"""A stack of blocks run under ``lax.scan``, one repeating period of block kinds per step.

Each block has a *kind* (``config.layer_types``: ``full_attention`` on every
Llama block; ``linear_attention`` and ``full_attention`` on a hybrid). The
stack runs as the shortest period ``P`` with ``kinds[i] == P[i % len(P)]``
and stores one stacked block per *slot* of the period: ``slots[q]`` holds
blocks ``q, q + p, q + 2p, …`` on a leading axis. A ``lax.scan`` over the
``n = depth // p`` whole periods runs slot 0 … p-1 at row ``j``, then the tail
(the first ``depth % p`` slots at row ``n``) runs once more. Consecutive slots
of one structure (a hybrid's three DeltaNet slots: a *run*, ``Stack.runs``)
run as an inner ``lax.scan`` over the run, so each block kind is traced and
compiled once per period (and once more on a tail), not once per slot.
Compile time depends on the period's kinds, not on the depth.

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
from jax.extend.core import jaxpr_as_fun

from jstd.core.tap import BlockScope
from jstd.nn.namemap import Entry
from jstd.nn.params import constrain_rows, stacked


def period_of(kinds: Sequence[str]) -> int:
    """The length of the shortest ``P`` with ``kinds[i] == P[i % len(P)]`` for every block."""
    kinds = tuple(kinds)
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


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

    def runs(self, width: int) -> tuple[tuple[int, ...], ...]:
        """Slots ``0 … width - 1`` in order, consecutive equal ones (``_equal``: same block structure, and the
        same kind) together.

        A run of several slots (a hybrid's DeltaNet slots) runs as an inner ``lax.scan`` over them, so its block
        is traced and compiled once; slots held one by one (``Rows``) each run alone, reading their own arrays.
        """
        runs: list[tuple[int, ...]] = []
        for q in range(width):
            if (runs and not isinstance(self.slots[q], Rows) and self.kinds[runs[-1][0]] == self.kinds[q]
                    and _equal(self.slots[runs[-1][0]], self.slots[q])):
                runs[-1] += (q,)
            else:
                runs.append((q,))
        return tuple(runs)

    def __call__(self, h, tap, args: Mapping[str, tuple], pasts: Mapping[str, object] | None = None, first=None,
                 keep: tuple[int, ...] = (), after: Callable | None = None):
        """Run every block over ``h`` in order; return ``(h, reads)``, or ``(h, reads, streams)`` with ``keep``.

        args: mixer host -> the arguments its mixer takes after the normed stream
            (``{"self_attn": (cos_sin, mask)}``), or -> block kind -> them where
            they differ by kind (a sliding window's mask, Gemma 3's local rotary).
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
        p, (n, tail) = self.period, divmod(self.depth, self.period)
        run = _Pass(self, tap, args, pasts or {}, first, after)
        single = _SingleReads(self, tap, run, h)
        streams = {i: jnp.zeros_like(h) for i in keep if i < n * p}

        def body(carry, j):
            h, kept, streams = carry
            h, records, outs = run.period(h, j, p, {i % p for i in streams})
            kept = single.take(kept, records, j)  # moves the single-block reads out of records
            streams = {i: jnp.where(j == i // p, outs[i % p], v) for i, v in streams.items()}
            return (h, kept, streams), records

        if isinstance(self.slots[0], Rows):  # unstacked: every period unrolled, each block's own arrays
            carry, steps = (h, single.kept, streams), []
            for j in range(n):
                carry, records = body(carry, j)
                steps.append(records)
            (h, kept, streams), period_reads = carry, jax.tree.map(lambda *x: jnp.stack(x), *steps)
        else:
            (h, kept, streams), period_reads = jax.lax.scan(body, (h, single.kept, streams), jnp.arange(n))
        tail_reads = {}
        if tail:
            h, tail_reads, outs = run.period(h, n, tail, {i - n * p for i in keep if i >= n * p})
            kept = single.take(kept, tail_reads, n)
            streams.update({i: outs[i - n * p] for i in keep if i >= n * p})
        reads = {**_stacked_reads(period_reads, tail_reads), **single.reads(kept)}
        return (h, reads, [streams[i] for i in keep]) if keep else (h, reads)

    def first(self, depth: int) -> "Stack":
        """The stack of its first ``depth`` blocks (the same arrays, sliced): what a forward that stops after block
        ``depth - 1`` runs."""
        if not 1 <= depth <= self.depth:
            raise ValueError(f"Stack.first: depth {depth} is outside 1..{self.depth}")
        p = self.period
        slots = tuple(jax.tree.map(lambda a: a[:len(range(q, depth, p))], self.slots[q]) for q in range(min(p, depth)))
        return dataclasses.replace(self, slots=slots, kinds=self.kinds[:depth])

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
    """``step(h)`` for blocks at or after ``first``; ``(h, zeros shaped like its reads)`` before it.

    ``step`` is traced once (the block's Python runs once): its jaxpr gives the reads' shapes for the skipping
    branch and is replayed as the running one (a cold sweep's largest trace cost was tracing it twice)."""
    closed, shapes = jax.make_jaxpr(step, return_shape=True)(h)
    run = lambda h: jax.tree.unflatten(jax.tree.structure(shapes), jaxpr_as_fun(closed)(*jax.tree.leaves(h)))
    skip = lambda h: (h, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[1]))
    return jax.lax.cond(layer >= first, run, skip, h)


def _equal(a, b) -> bool:
    """Whether stacked slots ``a`` and ``b`` hold blocks of one structure: one tree (static fields included) with
    rows of the same shapes and dtypes (their numbers of rows may differ by the tail)."""
    (la, ta), (lb, tb) = jax.tree.flatten(a), jax.tree.flatten(b)
    return ta == tb and all(x.shape[1:] == y.shape[1:] and x.dtype == y.dtype for x, y in zip(la, lb))


class _Pass:
    """One call of ``Stack.__call__``: runs the blocks of a period's slots at a row, a run of equal slots at once."""

    def __init__(self, stack: Stack, tap, args, pasts, first, after):
        self.stack, self.tap, self.args, self.pasts, self.first, self.after = stack, tap, args, pasts, first, after
        self.prefix = stack.prefix + "."
        self._groups: dict[str, frozenset] = {}

    def group_of(self, site: str) -> frozenset:
        """The slots whose blocks compute ``site`` (a whole name): its reads and stacked edits are over them."""
        if site not in self._groups:
            rel = site[len(self.prefix):]
            self._groups[site] = frozenset(q for q, slot in enumerate(self.stack.slots) if rel in slot.sites())
        return self._groups[site]

    def index_in(self, group: frozenset, j, q, k=0):
        """Block ``j * p + q + k``'s index among the blocks of the slots in ``group`` (which holds ``q … q + k``)."""
        return j * len(group) + sum(g < q for g in group) + k

    def row(self, q: int, j):
        """Slot ``q``'s block at row ``j`` (its parameters)."""
        slot = self.stack.slots[q]
        if isinstance(slot, Rows):
            return slot.rows[j]
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), slot)

    def block(self, h, j, q: int, k, take: Callable):
        """``(h, records)`` of block ``j * p + q + k`` (``k``: traced inside a run's scan, else 0) over ``h``;
        ``take()`` gives its parameters. It is called inside the block's branch, so a block skipped under
        ``first`` never slices its row out of the stacked weights (on CPU such a slice is a copy of the block)."""
        stack = self.stack
        layer = j * stack.period + q + k
        host = stack.slots[q].attn.host
        past = self.pasts.get(host)
        if past is not None:  # stacked over the blocks with the host
            row = self.index_in(frozenset(g for g, slot in enumerate(stack.slots) if slot.has(host)), j, q, k)
            # an int row (unrolled blocks) slices statically: XLA folds a static slice of a stack of per-block
            # arrays into that block's array (a generation's cache), where a dynamic one may stay a copy
            index = (lambda a: a[row]) if isinstance(row, int) else (
                lambda a: jax.lax.dynamic_index_in_dim(a, row, keepdims=False))
            past = jax.tree.map(index, past)

        def step(h):
            s = BlockScope(self.tap, self.prefix, layer, self.group_of, lambda group: self.index_in(group, j, q, k))
            args = self.args[host]
            if isinstance(args, dict):  # by block kind (a run holds slots of one kind: Stack.runs)
                args = args[stack.kinds[q]]
            h = take()(constrain_rows(h), args, s, past)  # a no-op without jax.set_mesh
            return (h if self.after is None else self.after(h, layer)), s.records

        return step(h) if self.first is None else _from_block(self.first, layer, step, h)

    def run(self, h, j, qs: tuple[int, ...], with_outputs: bool):
        """Blocks ``j * p + q`` for ``q`` in the run ``qs``: ``(h, records, outputs)``, the records stacked over
        ``qs`` and each block's output stream (None unless ``with_outputs``).

        A run of several slots is a ``lax.scan`` over them whose body takes its slot's row with ``lax.switch``: one
        traced block for the run, each row's arrays sliced once, as the scan over periods slices them (a
        ``jnp.stack`` of the rows would copy them once more, and compiles slower)."""
        if len(qs) == 1:
            h, records = self.block(h, j, qs[0], 0, lambda: self.row(qs[0], j))
            return h, {site: v[None] for site, v in records.items()}, [h]

        def body(h, k):
            h, records = self.block(h, j, qs[0], k, lambda: jax.lax.switch(k, [lambda q=q: self.row(q, j) for q in qs]))
            return h, (records, h if with_outputs else None)

        h, (records, outs) = jax.lax.scan(body, h, jnp.arange(len(qs)))
        return h, records, None if outs is None else list(outs)

    def period(self, h, j, width: int, outputs: set[int]):
        """Slots ``0 … width - 1`` at row ``j`` (traced inside the scan, an int for the tail and unstacked):
        ``(h, records, outs)``; ``records[run]``: the reads of each run (``Stack.runs``) stacked over its slots;
        ``outs[q]``: slot ``q``'s output for each ``q`` in ``outputs``."""
        records, outs = {}, {}
        for qs in self.stack.runs(width):
            h, records[qs], o = self.run(h, j, qs, bool(outputs.intersection(qs)))
            outs.update({q: o[k] for k, q in enumerate(qs) if q in outputs})
        return h, records, outs


class _SingleReads:
    """Sites read at single blocks only (``layers.5.X``, ``tap.single``): each read block's value is kept in the
    scan's carry (``kept``: ``(site, block) -> value``), not stacked over every block."""

    def __init__(self, stack: Stack, tap, run: _Pass, h):
        """``kept`` starts as zeros for the read blocks the scan runs, shaped as one period's records (traced
        once more, compiled never)."""
        self.sites = {site: blocks for site, blocks in tap.single.items() if site in stack.sites()}
        self.period, self.scanned = stack.period, stack.depth - stack.depth % stack.period
        self.kept = {}
        if self.sites:
            records = jax.eval_shape(lambda h: run.period(h, 0, stack.period, set())[1], h)
            at = lambda site, i: next(r[site] for qs, r in records.items() if i % self.period in qs)
            self.kept = {(site, i): jnp.zeros(at(site, i).shape[1:], at(site, i).dtype)
                         for site, blocks in self.sites.items() for i in blocks if i < self.scanned}

    def take(self, kept: dict, records: dict, j) -> dict:
        """``kept`` updated from ``records`` (``_Pass.period``'s, of blocks ``j * p + q``; ``j`` traced in the
        scan, an int on the tail and unstacked periods), the kept sites moved out of ``records``."""
        kept, p = dict(kept), self.period
        for qs, r in records.items():
            for site in [site for site in r if site in self.sites]:
                value = r.pop(site)
                for i in self.sites[site]:
                    if i % p not in qs:
                        continue
                    v = value[i % p - qs[0]]
                    if isinstance(j, int) and i // p == j:
                        kept[site, i] = v
                    elif not isinstance(j, int) and i < self.scanned:
                        kept[site, i] = jnp.where(j == i // p, v, kept[site, i])
        return kept

    @staticmethod
    def reads(kept: dict) -> dict:
        """site -> {block: value}."""
        reads = {}
        for (site, i), value in kept.items():
            reads.setdefault(site, {})[i] = value
        return reads


def _stacked_reads(period_reads: dict, tail_reads: dict) -> dict:
    """Each site's values in block order: ``period_reads`` (run -> site -> ``[n, len(run), ...]``, the scan's)
    period by period, then ``tail_reads`` (run -> site -> ``[len(run), ...]``)."""
    period_reads, tail_reads = ([by_run[qs] for qs in sorted(by_run)] for by_run in (period_reads, tail_reads))
    reads = {}
    for site in sorted({site for r in period_reads + tail_reads for site in r}):  # one program whatever the hash seed
        parts = [r[site] for r in period_reads if site in r]
        value = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
        value = value.reshape(-1, *value.shape[2:])
        extra = [r[site] for r in tail_reads if site in r]
        reads[site] = jnp.concatenate([value, *extra]) if extra else value
    return reads
