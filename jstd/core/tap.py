"""The mechanism that applies edits and records reads at a site.

A forward passes every standard value through a ``Taps`` (a ``Scope``: one per
host call, the model or one block inside a stack's scan; a block's is a
``BlockScope``, one ``Scope`` per group of blocks its sites are stacked over).
Shared modules tap *relative* names (``self_attn.attention_queries``); the scope's prefix
(``layers.``, ``vision.layers.``, ``vision.``, or none on the text model) makes
them whole, so one Attention serves every stack. The set of reads and the
structure of the edits are static Python data; the edits' arrays and the
block index are traced. A site nobody reads or edits costs nothing after
compilation.
"""

from __future__ import annotations

from typing import Callable, Protocol

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from jstd.core.edits import Edit
from jstd.kernels.rounding import rounded
from jstd.core.sites import SITES, SiteError


class Taps(Protocol):
    """What a module calls at each value it computes: ``s(name, value)`` returns the (edited) value."""

    def __call__(self, site: str, value: Array) -> Array: ...

    def touches(self, *sites: str) -> bool: ...


class Tap:
    """The reads and edits of one call of ``run``.

    reads: whole site names to record (``layers.X``, never ``layers.5.X``).
    edits: the edits, in the order they compose.
    depths: each stack's number of blocks (``{"layers": 16, "vision.layers": 24}``).
    num_blocks: for each block site, how many blocks compute it (stacked edit
        arrays are checked against it).
    single: block sites read at some blocks only (``layers.5.X``, never the
        whole stack): site -> those blocks. The stack keeps just these values
        and returns them as ``{block: value}``.
    """

    def __init__(self, reads: frozenset[str], edits: tuple[Edit, ...], depths: dict[str, int],
                 num_blocks: dict[str, int], single: dict[str, tuple[int, ...]] | None = None):
        self.reads = frozenset(reads)
        self.single = dict(single or {})
        self.depths = depths
        self.num_blocks = num_blocks
        self.edits: dict[str, list[Edit]] = {}
        for e in edits:
            self.edits.setdefault(e.site, []).append(e)
        self.applied: set[int] = set()

    def touches(self, *sites: str) -> bool:
        """Whether any of ``sites`` (whole names) is read or edited on this call (a static fact)."""
        return any(s in self.reads or s in self.edits for s in sites)

    def scope(self, prefix: str = "", layer=None, stack_index=None) -> "Scope":
        """A scope whose names are relative to ``prefix`` (``""``, ``"vision."``, ``"layers."``): the
        model's (``layer=None``) or one block's (traced indices)."""
        return Scope(self, prefix, layer, stack_index)

    def unapplied(self) -> list[Edit]:
        return [e for es in self.edits.values() for e in es if id(e) not in self.applied]


class Scope:
    """Taps inside one host call; ``records`` holds what was read there, by whole name."""

    def __init__(self, tap: Tap, prefix: str, layer, stack_index):
        self.tap = tap
        self.prefix = prefix
        self.layer = layer
        self.stack_index = stack_index
        self.records: dict[str, Array] = {}

    def touches(self, *sites: str) -> bool:
        return self.tap.touches(*(self.prefix + s for s in sites))

    def __call__(self, site: str, value: Array) -> Array:
        """Apply the edits addressed to ``prefix + site`` (in order), record it if read, return it."""
        site = self.prefix + site
        edits = self.tap.edits.get(site, ())
        for edit in edits:
            value = self._apply(edit, site, value)
            self.tap.applied.add(id(edit))
        if edits:
            # what an edit wrote is what downstream reads: no fusing an edit's
            # arithmetic into the consumer (which would add an unrounded value)
            value = rounded(value)
        if site in self.tap.reads:
            self.records[site] = value
        return value

    def _apply(self, edit: Edit, site: str, value: Array) -> Array:
        spec = SITES[site]
        stacked = spec.per_block and edit.layer is None
        fields = {}
        for name in edit.arrays():
            a = getattr(edit, name)
            shape = np.shape(a)
            if stacked and len(shape) == value.ndim + 1:
                blocks = self.tap.num_blocks[site]
                if shape[0] != blocks:
                    raise SiteError(
                        f"{type(edit).__name__} at {site}: {name} is stacked over {shape[0]} blocks, "
                        f"but {blocks} blocks compute {site}; pass one entry per block or layer=..."
                    )
                a = jnp.asarray(a)[self.stack_index]
                shape = shape[1:]
            try:
                ok = np.broadcast_shapes(shape, value.shape) == value.shape
            except ValueError:
                ok = False
            if not ok:
                stack = f" (or stacked over blocks: {(self.tap.num_blocks.get(site),) + value.shape})" if stacked else ""
                raise SiteError(
                    f"{type(edit).__name__} at {site}: {name} of shape {tuple(np.shape(getattr(edit, name)))} "
                    f"does not broadcast to the site's shape {value.shape} [{', '.join(spec.layout)}]; "
                    f"pass an array broadcastable to {value.shape}{stack}"
                )
            fields[name] = a
        if fields:
            names = list(fields)
            edit = eqx.tree_at(lambda e: [getattr(e, n) for n in names], edit, [fields[n] for n in names])
        new = edit.within(value, self)
        if edit.layer is not None:
            target = jnp.asarray(edit.layer)
            target = jnp.where(target < 0, target + self.tap.depths[spec.stack], target)
            new = jnp.where(self.layer == target, new, value)
        return new


class BlockScope:
    """The taps of one block inside a stack: one ``tap.scope`` per group of slots a site is stacked over.

    ``group_of(site)`` (a whole name) gives the slots whose blocks compute it;
    ``stack_index(group)`` the block's (possibly traced) index among the blocks
    of those slots, which indexes an edit's arrays stacked over them.
    """

    def __init__(self, tap: Tap, prefix: str, layer, group_of: Callable[[str], frozenset],
                 stack_index: Callable[[frozenset], object]):
        self.tap = tap
        self.prefix = prefix
        self.layer = layer
        self._group_of = group_of
        self._stack_index = stack_index
        self._scopes: dict[frozenset, Scope] = {}

    def touches(self, *sites: str) -> bool:
        return self.tap.touches(*(self.prefix + s for s in sites))

    def __call__(self, site: str, value: Array) -> Array:
        group = self._group_of(self.prefix + site)
        if group not in self._scopes:
            self._scopes[group] = self.tap.scope(self.prefix, self.layer, self._stack_index(group))
        return self._scopes[group](site, value)

    @property
    def records(self) -> dict[str, Array]:
        return {k: v for scope in self._scopes.values() for k, v in scope.records.items()}
