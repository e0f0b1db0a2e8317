"""How a decoding step chooses each row's next token from its logits: greedy (the argmax) or a ``Sampling`` draw."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from jstd.core.checks import checked


class Sampling(eqx.Module):
    """How a token is drawn from a step's logits (``sampling=None`` in ``generate``: greedy, the argmax).

    As transformers' sampling: the logits divided by ``temperature``, then only
    the ``top_k`` largest kept (None: all), then only the smallest set of the
    largest whose probability reaches ``top_p`` (None: all; the most likely
    token is always kept), then one draw from the softmax with the step's key
    (``jax.random.fold_in(key, step)``: the same key gives the same tokens).
    ``temperature`` and ``top_p`` are values (traced and vmapped fine);
    ``top_k`` is static (an int).
    """

    temperature: Float[ArrayLike, ""] = 1.0
    top_k: int | None = eqx.field(static=True, default=None)
    top_p: Float[ArrayLike, ""] | None = None

    def __check_init__(self):
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer))
                                       or self.top_k < 1):
            raise ValueError(f"Sampling: top_k must be a positive int (or None: no top-k filter), got {self.top_k!r}")
        for name in ("temperature", "top_p"):  # concrete values (arrays too) here; traced ones in ``filtered``
            value = getattr(self, name)
            if value is not None and not isinstance(value, jax.core.Tracer):
                _checked_number(value, name)

    def filtered(self, logits: Float[Array, "batch vocab"]) -> Float[Array, "batch vocab"]:
        """The logits (float32) after temperature, top-k and top-p: removed tokens hold -inf. A traced
        ``temperature`` <= 0 or ``top_p`` outside (0, 1] fails the compiled call (``eqx.error_if``)."""
        temperature = _checked_number(jnp.asarray(self.temperature, jnp.float32), "temperature")
        x = logits.astype(jnp.float32) / temperature
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = jax.lax.top_k(x, self.top_k)[0][..., -1:]
            x = jnp.where(x < kth, -jnp.inf, x)
        if self.top_p is not None:
            top_p = _checked_number(jnp.asarray(self.top_p, jnp.float32), "top_p")
            ordered = jnp.sort(x, axis=-1)[..., ::-1]
            probs = jax.nn.softmax(ordered, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens more likely than each
            kept = before < top_p
            threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
            x = jnp.where(x < threshold, -jnp.inf, x)
        return x

    def choose(self, logits: Float[Array, "batch vocab"], key: PRNGKeyArray) -> Int[Array, "batch"]:
        """One token per row drawn with ``key`` from the ``filtered`` logits."""
        return jax.random.categorical(key, self.filtered(logits), axis=-1).astype(jnp.int32)


def _checked_number(value, name: str):
    """``value`` (``temperature`` or ``top_p``) checked: ``temperature`` > 0, ``top_p`` in (0, 1] (NaN refused);
    ValueError when concrete, the compiled call's error when traced (``jstd.core.checks.checked``)."""
    span = "in (0, 1]" if name == "top_p" else "> 0 (greedy decoding: sampling=None)"
    if name == "top_p":
        bad = lambda xp, v: ~((v > 0) & (v <= 1))
    else:
        bad = lambda xp, v: ~(v > 0)
    def message(v, flags):
        return (f"Sampling: {name} must be {span}, got {float(v[flags].reshape(-1)[0])!r}"
                + (f" (of {v.reshape(-1).tolist()})" if v.ndim else ""))

    return checked(value, bad, f"Sampling: {name} must be {span}", concrete=message)


def next_token(sampling: Sampling | None, logits: Float[Array, "batch vocab"], key: PRNGKeyArray,
               step: Int[ArrayLike, ""]) -> Int[Array, "batch"]:
    """Each row's token at decoding step ``step`` (0: the one the prefill's logits choose): the argmax of
    ``logits`` without ``sampling``, else ``sampling``'s draw with ``jax.random.fold_in(key, step)``."""
    if sampling is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sampling.choose(logits, jax.random.fold_in(key, step))
