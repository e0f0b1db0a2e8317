"""``stream``: row 0's new tokens one jitted step at a time (the prefill, then one ``decode`` per call), so that
they can be shown as they come; the tokens ``generate`` gives without edits."""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Int, PRNGKeyArray

from jstd.core.inputs import Inputs, as_inputs, with_layout
from jstd.generate.budget import check_fits, check_max_new_tokens
from jstd.generate.cache import decode, prefill, stepper
from jstd.generate.sampling import Sampling, next_token
from jstd.nn.model import Model


def stream(model: Model, inputs: Int[ArrayLike, "batch prompt"] | Inputs, *, max_new_tokens: int,
           sampling: Sampling | None = None, key: PRNGKeyArray | None = None,
           eos_token_id: int | Sequence[int] | Int[ArrayLike, "ids"] | None = None) -> Iterator[list[int]]:
    """Yield row 0's new tokens so far (a list of ids) after each step, stopping after an EOS id: the tokens
    ``generate`` gives without edits, one jitted step per call so they can be shown as they come (``eos_token_id``
    as ``generate``'s: None is the checkpoint's). Raises ``generate``'s ValueError for a bad ``max_new_tokens``
    (not a positive int, or a cache that cannot fit)."""
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    inputs = with_layout(as_inputs(inputs))
    prompt = np.shape(inputs.tokens)[1]
    check_fits(model, np.shape(inputs.tokens)[0], prompt, max_new_tokens)
    eos_token_id = model.config.eos_token_ids if eos_token_id is None else eos_token_id
    eos = set(np.asarray(eos_token_id, np.int64).reshape(-1).tolist())
    key = jax.random.key(0) if key is None else key
    token, cache = _stream_start(model, inputs, sampling, key, max_new_tokens)
    decoder = stepper(model)
    if decoder is not model.decoder:  # the blocks unrolled: each reads its own cache arrays, as in generate's loop
        cache = cache.per_block()
    out = []
    for i in range(max_new_tokens):
        if i:
            token, cache = _stream_next((decoder, sampling, key), cache, token, jnp.asarray(prompt + i - 1),
                                        jnp.asarray(i))
        out.append(int(np.asarray(token)[0]))
        yield list(out)
        if out[-1] in eos:
            return


@eqx.filter_jit
def _stream_start(model, inputs, sampling, key, new):
    out, cache = prefill(model, inputs, (), new)
    return next_token(sampling, out.logits[:, -1], key, 0), cache


@functools.partial(eqx.filter_jit, donate="all-except-first")
def _stream_next(fixed, cache, token, at, i):
    """The next token and the cache: the cache donated, so that each step writes it in place as generate's loop
    does (not copied into a new one per call)."""
    model, sampling, key = fixed
    step, cache = decode(model, cache, token, at, ())
    return next_token(sampling, step.logits[:, -1], key, i), cache
