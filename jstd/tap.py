"""The mechanism that applies edits and records reads at a site.

A family's forward passes every standard value through a ``Scope`` (one per
host call: the model, or one block inside the scan). The set of reads and the
structure of the edits are static Python data; the edits' arrays and the block
index are traced. A site nobody reads or edits costs nothing after compilation.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jaxtyping import Array

from jstd.interventions.edits import Edit
from jstd.kernels.rounding import rounded
from jstd.sites import SITES, SiteError


class Tap:
    """The reads and edits of one call of ``run``.

    reads: base site names to record (``layers.X``, never ``layers.5.X``).
    edits: the edits, in the order they compose.
    num_blocks: for each block site, how many blocks compute it (stacked edit
        arrays are checked against it).
    single: block sites read at some blocks only (``layers.5.X``, never the
        whole stack): site -> those blocks. The stack keeps just these values
        and returns them as ``{block: value}``.
    """

    def __init__(self, reads: frozenset[str], edits: tuple[Edit, ...], num_layers: int, num_blocks: dict[str, int],
                 single: dict[str, tuple[int, ...]] | None = None):
        self.reads = frozenset(reads)
        self.single = dict(single or {})
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.edits: dict[str, list[Edit]] = {}
        for e in edits:
            self.edits.setdefault(e.site, []).append(e)
        self.applied: set[int] = set()

    def touches(self, *sites: str) -> bool:
        """Whether any of ``sites`` is read or edited on this call (a static fact)."""
        return any(s in self.reads or s in self.edits for s in sites)

    def scope(self, layer=None, stack_index=None) -> "Scope":
        """A scope for the model (``layer=None``) or for one block (traced indices)."""
        return Scope(self, layer, stack_index)

    def unapplied(self) -> list[Edit]:
        return [e for es in self.edits.values() for e in es if id(e) not in self.applied]


class Scope:
    """Taps inside one host call; ``records`` holds what was read there."""

    def __init__(self, tap: Tap, layer, stack_index):
        self.tap = tap
        self.layer = layer
        self.stack_index = stack_index
        self.records: dict[str, Array] = {}

    def touches(self, *sites: str) -> bool:
        return self.tap.touches(*sites)

    def __call__(self, site: str, value: Array) -> Array:
        """Apply the edits addressed to ``site`` (in order), record it if read, return it."""
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
            edit = _replace(edit, fields)
        new = edit(value)
        if edit.layer is not None:
            target = jnp.asarray(edit.layer)
            target = jnp.where(target < 0, target + self.tap.num_layers, target)
            new = jnp.where(self.layer == target, new, value)
        return new


def _replace(edit: Edit, fields: dict) -> Edit:
    import equinox as eqx

    names = list(fields)
    return eqx.tree_at(lambda e: [getattr(e, n) for n in names], edit, [fields[n] for n in names])
