"""Metrics: functions of the logits that patching, attribution and steering optimize or sweep.

A metric is any function ``logits [batch, seq, vocab] -> array`` (usually a
scalar). These are equinox modules, so their arrays (targets, reference
logits) are dynamic and a sweep compiles once per metric kind, not per metric.
Each averages over the batch rows, at one position (default the last).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int


def _pick(x: Float[Array, "batch vocab"], ids) -> Float[Array, "batch"]:
    ids = jnp.asarray(ids)
    if ids.ndim == 0:
        return x[:, ids]
    if ids.ndim == 1:
        return jnp.take_along_axis(x, ids[:, None], axis=-1)[:, 0]
    raise ValueError(f"target ids are an int or one per row [batch], got shape {ids.shape}")


class PositionMetric(eqx.Module):
    """A metric of the logits at one ``position`` only: ``metric(logits) == metric.at(logits[:, position])``.

    Sweeps use the contract: they compute the logits at that position alone.
    """

    position: int = eqx.field(static=True, kw_only=True, default=-1)

    def __call__(self, logits: Float[Array, "batch seq vocab"]) -> Float[Array, ""]:
        return self.at(logits[:, self.position])

    def at(self, logits: Float[Array, "batch vocab"]) -> Float[Array, ""]:
        """The metric from the logits at ``position``."""
        raise NotImplementedError


class LogitDifference(PositionMetric):
    """``logits[:, position, target] - logits[:, position, other]``, averaged over rows."""

    target: Int[ArrayLike, "*batch"]
    other: Int[ArrayLike, "*batch"]

    def at(self, logits: Float[Array, "batch vocab"]) -> Float[Array, ""]:
        x = logits.astype(jnp.float32)
        return jnp.mean(_pick(x, self.target) - _pick(x, self.other))


class TargetProbability(PositionMetric):
    """The probability of ``target`` at ``position`` (softmax in float32), averaged over rows."""

    target: Int[ArrayLike, "*batch"]

    def at(self, logits: Float[Array, "batch vocab"]) -> Float[Array, ""]:
        return jnp.mean(_pick(jax.nn.softmax(logits.astype(jnp.float32), -1), self.target))


class KLDivergence(PositionMetric):
    """KL(reference || run) of the next-token distributions at ``position``, averaged over rows.

    ``reference`` holds the reference run's logits, ``[batch, vocab]`` at that
    position or the full ``[batch, seq, vocab]``.
    """

    reference: Float[Array, "batch vocab"]

    def __init__(self, reference: Float[ArrayLike, "batch ..."], position: int = -1):
        reference = jnp.asarray(reference, jnp.float32)
        self.reference = reference[:, position] if reference.ndim == 3 else reference
        self.position = position

    def at(self, logits: Float[Array, "batch vocab"]) -> Float[Array, ""]:
        log_p = jax.nn.log_softmax(self.reference, -1)
        log_q = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1))


def logit_difference(target, other, *, position: int = -1) -> LogitDifference:
    """The metric ``logit[target] - logit[other]`` at ``position`` (ids: an int or one per row), mean over rows."""
    return LogitDifference(jnp.asarray(target), jnp.asarray(other), position=position)


def target_probability(target, *, position: int = -1) -> TargetProbability:
    """The metric ``p(target)`` at ``position`` (ids: an int or one per row), mean over rows."""
    return TargetProbability(jnp.asarray(target), position=position)


def kl_divergence(reference_logits, *, position: int = -1) -> KLDivergence:
    """The metric KL(reference || run) at ``position``, mean over rows."""
    return KLDivergence(reference_logits, position)
