"""Lens and readout: the logit lens, target tokens, top-k readouts, next-token probabilities.

    lens = jstd.logit_lens(model, tokens, positions=-1)            # [layers, batch, 1, vocab]
    ids = jstd.get_first_tokens(["Paris"], tokenizer)              # first token of "Paris" and " Paris"
    top = jstd.top_k(jax.nn.softmax(lens[:, 0, -1]), 5, tokenizer)  # values, ids, decoded tokens
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.core.edits import check_index, check_left_padded
from jstd.core.inputs import Inputs, as_inputs
from jstd.interventions.reading import read
from jstd.run import project_on_vocab
from jstd.core.sites import SITES, SiteError, parse


def logit_lens(
    model, tokens: Int[Array, "batch seq"], *, site: str = "layers.layer_output", positions=None, edits=(),
    attention_mask: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "layers batch positions vocab"]:
    """``project_on_vocab`` (final norm, head, and what the family does after the head) of ``site`` at every block.

    One run reads ``site`` (a residual-stream site: ``[batch, seq, hidden]``)
    on every block, with ``edits`` applied; ``positions`` (an int, a list, or
    None for all) selects the positions projected, in the order given. With the
    default site, the last block's lens equals the logits (exactly the same
    computation). Raises SiteError for a site that is not a per-block residual
    stream or a position outside ``-seq..seq-1`` (negatives count from the
    end), ValueError for negative positions on rows padded on the right (their
    end is padding: pad on the left).
    """
    base, index = parse(site)
    spec = SITES[base]
    if index is not None or not spec.per_block or spec.layout != ("batch", "seq", "hidden"):
        raise SiteError(f"logit_lens reads a residual-stream site on every block ('layers.layer_output', "
                        f"'layers.layer_mid', ...); got {site!r}")
    inputs = as_inputs(tokens, attention_mask)
    idx = None if positions is None else jnp.atleast_1d(jnp.asarray(positions))
    if idx is not None and idx.dtype != bool and (np.asarray(idx) < 0).any():  # counted from each row's end
        mask = check_left_padded(inputs.attention_mask, f"logit_lens (positions={positions})")
        inputs = Inputs(inputs.tokens, mask, inputs.images, inputs.layout)
    hidden = read(model, inputs, (base,), edits)[base]
    if idx is not None:
        idx = check_index(idx, hidden.shape[2], f"logit_lens at {base}: positions", "seq")
        idx = jnp.flatnonzero(idx) if idx.dtype == bool else jnp.where(idx < 0, idx + hidden.shape[2], idx)
        hidden = jnp.take(hidden, idx, axis=2)
    return _project(model, hidden)


_project = jax.jit(project_on_vocab)


class TokenizationError(ValueError):
    """A word that yields no token of its own."""


def get_first_tokens(words: str | Sequence[str], tokenizer, *, space: bool | None = None) -> list[int]:
    """The first token of ``"word"`` and of ``" word"`` for each word, deduplicated, in order (as nnterp).

    ``space=True`` gives only the leading-space form ``" word"``: on BPE
    vocabularies the token a model predicts after another word ("The capital
    of France is" -> ``" Paris"``), so ``get_first_tokens("Paris", tok,
    space=True)[0]`` is the id to score. ``space=False`` gives only the plain
    form (a word at the start of a text or after a newline); ``None`` both,
    plain first. ``" word"``'s first token is the first one past a bare space
    token (SentencePiece vocabularies may write the space alone). On
    tokenizers that add a prefix space themselves (``"word"`` and ``" word"``
    collide), ``"word"``'s own first token is found by tokenizing ``"🍐word"``
    and dropping the pear's tokens. ``jstd.token_strings(tokenizer, text)``
    shows which form a prompt holds. Raises TokenizationError for a word with
    no token, or (``space=True``) no token after the space.
    """
    words = [words] if isinstance(words, str) else list(words)
    ids = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bare = ids(" ")[:1]
    out: list[int] = []
    for word in words:
        plain, spaced = ids(word), ids(" " + word)
        if not plain:
            raise TokenizationError(f"{word!r} tokenizes to nothing")
        lead = next((t for t in spaced if [t] != bare), None)
        if space is not True:
            first = plain[0]
            if lead == first:
                pear = ids("🍐")
                joined = ids("🍐" + word)
                if joined[: len(pear)] != pear or len(joined) <= len(pear):
                    raise TokenizationError(f"cannot find the first token of {word!r} without a prefix space")
                first = joined[len(pear)]
            out.append(first)
        if space and lead is None:
            raise TokenizationError(f"{' ' + word!r} has no token after the space; use space=False for {word!r}")
        if space is not False and lead is not None:
            out.append(lead)
    return list(dict.fromkeys(out))


class TopK(NamedTuple):
    """The ``k`` largest entries on the last axis: values, token ids, and decoded tokens (with a tokenizer)."""

    values: Float[Array, "... k"]
    ids: Int[Array, "... k"]
    tokens: list | None


def top_k(scores: Float[Array, "... vocab"], k: int = 5, tokenizer=None) -> TopK:
    """The ``k`` highest-scoring tokens of ``scores`` (logits or probabilities) on the last axis, best first.

    With a tokenizer, ``tokens`` holds the decoded strings, nested like the
    leading axes.
    """
    values, ids = jax.lax.top_k(jnp.asarray(scores), k)
    tokens = None
    if tokenizer is not None:
        flat = np.asarray(ids).reshape(-1, k)
        decoded = [[tokenizer.decode([int(i)]) for i in row] for row in flat]
        tokens = np.array(decoded, dtype=object).reshape(ids.shape).tolist()
    return TopK(values, ids, tokens)


def next_token_probs(
    model, tokens: Int[Array, "batch seq"], edits=(), *, attention_mask: Int[Array, "batch seq"] | None = None,
) -> Float[Array, "batch vocab"]:
    """The next-token distribution after the last position of each row (float32 softmax of the logits).

    With left padding (``attention_mask``), the last position is each row's last real token; a row padded on
    the right raises ValueError (its last position is padding: pad on the left).
    """
    inputs = as_inputs(tokens, attention_mask)
    check_left_padded(inputs.attention_mask, "next_token_probs")
    return read(model, inputs, ("next_token_probs",), edits)["next_token_probs"]
