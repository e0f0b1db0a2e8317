"""Metrics: functions of the logits that patching, attribution and steering optimize or sweep.

A metric is any function ``logits [batch, seq, vocab] -> array`` (usually a
scalar). These are equinox modules, so their arrays (targets, reference
logits) are dynamic and a sweep compiles once per metric kind, not per metric.
Each averages over the batch rows, at one position (default the last).

Token ids are checked against the logits' vocabulary when the metric is
called (ValueError for concrete ids; an equinox runtime error for traced
ones), never clamped. ``position`` counts from the end of the padded
sequence when negative, so the tools refuse right-padded batches for it
(``check_metric``): pad on the left.
"""

from __future__ import annotations

from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from jstd.core.checks import checked, shown
from jstd.core.jit import device_array
from jstd.core.edits import check_index, check_left_padded


def token_ids(ids, what: str) -> Int[Array, "*batch"]:
    """``ids`` as an integer array; TypeError for another dtype (a float, a string's tokens not yet looked up)."""
    if not isinstance(ids, (jax.core.Tracer, jax.Array)) and np.asarray(ids).dtype.kind in "iu":
        ids = device_array(np.asarray(ids))  # (compiles nothing, as jnp.asarray of host ids would)
    ids = ids if isinstance(ids, jax.core.Tracer) else jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{what} must be integer token ids (an int or one per row), got dtype {ids.dtype}; "
                        "look words up with jstd.get_first_tokens")
    return ids


def check_token_ids(ids, vocab_size: int, batch: int, what: str) -> Int[Array, "*batch"]:
    """``ids`` (an int or one per row of ``batch``) checked to lie in ``0..vocab_size-1``.

    Concrete ids raise ValueError now; traced ids an equinox runtime error when
    the compiled call runs. Returns the ids (the check attached when traced).
    """
    ids = token_ids(ids, what)
    if ids.ndim > 1 or (ids.ndim == 1 and ids.shape[0] != batch):
        raise ValueError(f"{what} must be an int or one id per row ({batch} rows), got shape {tuple(ids.shape)}")
    fix = f"must lie in 0..{vocab_size - 1} (the logits' vocabulary of {vocab_size} ids); pass ids of this model's tokenizer"
    return checked(ids, lambda xp, i: (i < 0) | (i >= vocab_size), f"{what} is out of range: token ids {fix}",
                   concrete=lambda i, bad: f"{what}={shown(i[bad])} is out of range: token ids {fix}")


def _pick(x: Float[Array, "batch vocab"], ids, what: str) -> Float[Array, "batch"]:
    ids = check_token_ids(ids, x.shape[-1], x.shape[0], what)
    if ids.ndim == 0:
        return x[:, ids]
    return jnp.take_along_axis(x, ids[:, None], axis=-1)[:, 0]


def check_metric(metric: Callable, logits_shape: tuple[int, int, int], attention_mask, tool: str):
    """A ``PositionMetric``'s checks before ``tool`` runs: its token ids and position against logits of
    ``logits_shape`` (evaluated abstractly: it raises here, before a sweep compiles), and, when it reads from the
    end, ``attention_mask`` left-padded (``jstd.core.edits.check_left_padded``). Returns the mask (checked when
    traced). Other metrics (any function of the logits) are the caller's own and pass as they are.
    """
    if not isinstance(metric, PositionMetric):
        return attention_mask
    jax.eval_shape(lambda logits: metric(logits), jax.ShapeDtypeStruct(tuple(logits_shape), jnp.float32))
    if metric.position < 0:
        return check_left_padded(attention_mask, f"the metric {type(metric).__name__} (position={metric.position}) of {tool}")
    return attention_mask


class PositionMetric(eqx.Module):
    """A metric of the logits at one ``position`` only: ``metric(logits) == metric.at(logits[:, position])``.

    Sweeps use the contract: they compute the logits at that position alone.
    """

    position: int = eqx.field(static=True, kw_only=True, default=-1)

    def __call__(self, logits: Float[Array, "batch seq vocab"]) -> Float[Array, ""]:
        check_index(self.position, logits.shape[1], f"{type(self).__name__}: position", "seq")
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
        return jnp.mean(_pick(x, self.target, "LogitDifference: target") - _pick(x, self.other, "LogitDifference: other"))


class TargetProbability(PositionMetric):
    """The probability of ``target`` at ``position`` (softmax in float32), averaged over rows."""

    target: Int[ArrayLike, "*batch"]

    def at(self, logits: Float[Array, "batch vocab"]) -> Float[Array, ""]:
        return jnp.mean(_pick(jax.nn.softmax(logits.astype(jnp.float32), -1), self.target, "TargetProbability: target"))


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
        if self.reference.shape != logits.shape:
            raise ValueError(f"KLDivergence: the reference logits at the position have shape {self.reference.shape}, "
                             f"the run's {logits.shape} [batch, vocab]; pass the reference run's logits on the same "
                             "batch and model")
        log_p = jax.nn.log_softmax(self.reference, -1)
        log_q = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1))


def logit_difference(target, other, *, position: int = -1) -> LogitDifference:
    """The metric ``logit[target] - logit[other]`` at ``position`` (ids: an int or one per row), mean over rows."""
    return LogitDifference(token_ids(target, "logit_difference: target"), token_ids(other, "logit_difference: other"),
                           position=position)


def target_probability(target, *, position: int = -1) -> TargetProbability:
    """The metric ``p(target)`` at ``position`` (ids: an int or one per row), mean over rows."""
    return TargetProbability(token_ids(target, "target_probability: target"), position=position)


def kl_divergence(reference_logits, *, position: int = -1) -> KLDivergence:
    """The metric KL(reference || run) at ``position``, mean over rows."""
    return KLDivergence(reference_logits, position)
