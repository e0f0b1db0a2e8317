"""Declarative name maps: HuggingFace tensor names to a family's parameter tree.

An ``Entry`` says: the tensor ``key`` (with ``{i}`` for the block index on
stacked parameters) fills the skeleton leaf at ``path`` after ``transform``
(a numpy function from the stored layout to jstd's). A stacked entry's rows are
the blocks ``blocks`` names, in order (``Stack.name_map`` sets them: one period
slot's blocks). Layers write their fragments relative to themselves and
``under`` places them. A ``key`` that is a tuple names a tensor stored in parts,
concatenated along axis 0 before the transform. Transforms are views where
possible; the loader copies each one once, into its slot of the stacked array.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint tensor (``key``) and the skeleton leaf it fills (``path``) after ``transform``."""

    key: str | tuple[str, ...]
    path: str
    transform: Callable[[np.ndarray], np.ndarray] = lambda w: w
    blocks: tuple[int, ...] | None = None
    # other spellings of the same parameter in checkpoints (entries with the same path): the loader takes the first
    # of (this entry, *alternatives) whose tensors are all stored (``spelled``); a mixture-of-experts' fused experts
    # tensor or one tensor per expert
    alternatives: tuple["Entry", ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """The stored tensor names (one, or the parts of a tensor stored in parts)."""
        return (self.key,) if isinstance(self.key, str) else tuple(self.key)

    @property
    def stacked(self) -> bool:
        """A stacked entry's key holds ``{i}``; its rows are the blocks ``blocks`` names, in order."""
        return any("{i}" in k for k in self.keys)

    def under(self, key: str, path: str) -> "Entry":
        """The entry with ``key`` prefixed to its stored names and ``path`` to its parameter path (a fragment
        of a module's map placed in a model)."""
        keys = tuple(key + k for k in self.keys)
        return dataclasses.replace(self, key=keys[0] if isinstance(self.key, str) else keys, path=path + self.path,
                                   alternatives=tuple(a.under(key, path) for a in self.alternatives))

    def spellings(self) -> tuple["Entry", ...]:
        """This entry and its alternatives, each with this entry's blocks, none with alternatives of its own."""
        return (dataclasses.replace(self, alternatives=()),
                *(dataclasses.replace(a, blocks=self.blocks, alternatives=()) for a in self.alternatives))


def spelled(entries: list[Entry], stored: Callable[[str], str], keys) -> list[Entry]:
    """Each entry as the checkpoint spells it: its first spelling (``Entry.spellings``) whose tensors are all among
    ``keys`` for its first block, with every key respelled by ``stored`` (``io.hf.stored_names``). When none is
    complete, the spelling with the most of its tensors stored (the entry itself when none has any): the loader
    then names what is missing in the spelling the checkpoint uses."""
    keys = set(keys)
    out = []
    for e in entries:
        options = [dataclasses.replace(s, key=stored(s.key) if isinstance(s.key, str) else tuple(map(stored, s.key)))
                   for s in e.spellings()]
        first = e.blocks[0] if e.stacked and e.blocks else 0
        found = [sum(k.format(i=first) in keys for k in s.keys) for s in options]
        complete = [s for s, n in zip(options, found) if n == len(s.keys)]
        out.append(complete[0] if complete else options[max(range(len(options)), key=lambda j: (found[j], -j))])
    return out


def linear(w):
    """torch Linear weight [out, in] -> [in, out]."""
    return w.T


def split_out(heads: int):
    """[heads*dim, in] -> [in, heads, dim]: a projection into heads."""
    return lambda w: w.reshape(heads, -1, w.shape[-1]).transpose(2, 0, 1)


def split_in(heads: int):
    """[out, heads*dim] -> [heads, dim, out]: a projection out of heads."""
    return lambda w: w.reshape(w.shape[0], heads, -1).transpose(1, 2, 0)


def split(heads: int):
    """[heads*dim] -> [heads, dim]: a per-head bias."""
    return lambda b: b.reshape(heads, -1)


def present(module, entries: list[Entry]) -> list[Entry]:
    """The entries whose parameter exists on ``module`` (optional biases and norms are None when absent)."""
    return [e for e in entries if getattr(module, e.path.split(".")[0]) is not None]


# ---- tree paths, dotted as the name maps write them ("layers.blocks.0.self_attn.q") -------------------------------

def at_path(tree, path: str):
    """The node of ``tree`` at the dotted ``path`` (attribute names; digits index tuples)."""
    for part in path.split("."):
        tree = tree[int(part)] if part.isdigit() else getattr(tree, part)
    return tree


def replace_at(tree, paths, leaves):
    """``tree`` with the node at each of ``paths`` replaced by the matching one of ``leaves``."""
    import equinox as eqx

    return eqx.tree_at(lambda t: [at_path(t, p) for p in paths], tree, leaves)


def leaf_paths(tree) -> list[tuple[str, object]]:
    """``(path, leaf)`` for each leaf of ``tree`` in flattening order, paths dotted as the name maps write them."""
    import jax

    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path]
        out.append((".".join(parts), leaf))
    return out
