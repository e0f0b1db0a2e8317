"""The split of a pytree for a jit cached on its structure: its array-like leaves go in as dynamic arguments, the
rest (static fields, functions, strings) key the cache. The same split as equinox's ``hashable_partition`` /
``hashable_combine``, written here for its per-call cost (a flatten and two list comprehensions) and because
equinox keeps those private."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


def partition(tree) -> tuple[list, tuple, jax.tree_util.PyTreeDef]:
    """``tree``'s array-like leaves (None in the other places), its other leaves (None in the arrays' places, as a
    tuple: hashable when they are), and its structure."""
    leaves, treedef = jax.tree.flatten(tree)
    return ([x if eqx.is_array_like(x) else None for x in leaves],
            tuple(None if eqx.is_array_like(x) else x for x in leaves), treedef)


def combine(dynamic: list, fixed: tuple, treedef: jax.tree_util.PyTreeDef):
    """The tree ``partition`` split (its inverse)."""
    return jax.tree.unflatten(treedef, [s if a is None else a for a, s in zip(dynamic, fixed)])


def device_array(x):
    """``x`` as a jax array, equal to ``jnp.asarray(x)``: a numpy array or scalar through ``jax.device_put``, which
    compiles nothing (``jnp.asarray`` of host data compiles a small program for each new shape and dtype, several
    per sweep), anything else (jax arrays, tracers, Python numbers and lists) through ``jnp.asarray``."""
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.device_put(x)
    return jnp.asarray(x)
