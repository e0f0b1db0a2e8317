"""Steering: add a vector at chosen blocks and positions, build one from contrastive prompts, or optimize one.

    v = jstd.contrastive_vector(model, positive_tokens, negative_tokens, layer=2)
    out = jstd.run(model, tokens, jstd.steer([2, 3], v, factor=4.0))

``steer`` is nnterp's ``steer`` as edits: ``factor * vector`` added to
``layers.layer_output`` (or any site) of each chosen block. ``optimize``
trains any edit arrays (a steering vector, a patch, a gain) with optax by
gradient through ``jstd.run``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PyTree

from jstd.interventions.ablation import site_mean
from jstd.core.edits import Add, site_axes
from jstd.core.sites import SITES, parse


def steer(
    layers: int | Sequence[int], vector: Float[ArrayLike, "*shape"], *, factor: float = 1.0, positions=None,
    site: str = "layers.layer_output", where=None,
) -> list[Add]:
    """Edits adding ``factor * vector`` to ``site`` at each block in ``layers`` (at ``positions``; None: all).

    ``vector`` broadcasts against the site's per-block value (``[hidden]`` for a
    residual site). The result is exactly ``Add(site, factor * vector,
    layer=l)`` per block (at ``positions`` when chosen).
    """
    layers = list(layers) if isinstance(layers, (list, tuple, range)) or jnp.ndim(layers) == 1 else [layers]
    value = factor * jnp.asarray(vector)
    return [Add(site, value, layer=l, positions=positions, where=where) for l in layers]


def contrastive_vector(
    model, positive: Int[Array, "batch seq"], negative: Int[Array, "batch2 seq2"], layer: int | None = None, *,
    site: str = "layers.layer_output", exclude_first: bool = True,
    positive_mask: Int[Array, "batch seq"] | None = None, negative_mask: Int[Array, "batch2 seq2"] | None = None,
) -> Array:
    """The mean of ``site`` on ``positive`` prompts minus its mean on ``negative`` prompts.

    Each mean is over rows and positions, excluding position 0 (the first real
    token, an attention sink) when ``exclude_first`` and padding (the masks);
    the two batches may differ in size and length. Returns ``[hidden]`` for a
    residual site at one ``layer``, ``[layers, hidden]`` with ``layer`` None
    (one vector per block), in general the site's per-block value shape without
    its batch and position axes.
    """
    means = [site_mean(model, site, t, layer=layer, exclude_first=exclude_first, attention_mask=m)
             for t, m in ((positive, positive_mask), (negative, negative_mask))]
    diff = means[0] - means[1]
    base, index = parse(site)
    stacked = SITES[base].per_block and layer is None and index is None
    pos_axis, _ = site_axes(base)
    drop = {0} | ({pos_axis} if pos_axis is not None else set())  # one axis on vision.image_features
    return jnp.squeeze(diff, axis=tuple(sorted(a + int(stacked) for a in drop)))


def optimize(
    loss: Callable[..., Float[Array, ""]], params: PyTree, *, args: tuple = (), steps: int = 100, optimizer=None,
    learning_rate: float = 1e-2,
) -> tuple[PyTree, Float[Array, "steps"]]:
    """Minimize ``loss(params, *args)`` with optax for ``steps`` steps; returns the final params and the loss per step.

    ``params`` is any pytree of arrays (a steering vector, a dict of edit
    arrays, an equinox module for ``Apply``); ``loss`` builds edits from it and
    calls ``jstd.run``, so the gradient flows through the model into the edits.
    Pass the model (and tokens) in ``args`` rather than closing over them, so
    the weights enter the compiled loop as arguments, not as constants; only
    ``params`` are trained.
    ``optimizer`` is an ``optax.GradientTransformation`` (default
    ``optax.adam(learning_rate)``). The whole loop is one compiled ``lax.scan``.
    Requires optax.
    """
    import optax

    optimizer = optimizer or optax.adam(learning_rate)
    arrays, static = eqx.partition(params, eqx.is_inexact_array)

    @eqx.filter_jit
    def train(arrays, args):
        def step(carry, _):
            arrays, state = carry
            value, grads = jax.value_and_grad(lambda a: loss(eqx.combine(a, static), *args))(arrays)
            updates, state = optimizer.update(grads, state, arrays)
            return (optax.apply_updates(arrays, updates), state), value

        (arrays, _), losses = jax.lax.scan(step, (arrays, optimizer.init(arrays)), None, length=steps)
        return arrays, losses

    arrays, losses = train(arrays, tuple(args))
    return eqx.combine(arrays, static), losses
