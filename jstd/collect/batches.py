"""The corpus of ``jstd.collect`` as batches the model runs: what kind of corpus ``data`` is, texts tokenized and
left-padded into length buckets, token rows split into batches, and the rows each batch keeps.

A ``Batch`` has a fixed size (the last one filled with copies of a real row) and a length from a few buckets, so
each (batch size, length) compiles once; its filler rows and padding are never kept.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
from jaxtyping import Bool, Int, Shaped

from jstd.core.inputs import Inputs

MIN_BUCKET = 16
# positions=f: f(tokens [batch, seq], attention_mask [batch, seq]) -> bool [batch, seq], numpy arrays
PositionFn = Callable[[Int[np.ndarray, "batch seq"], Int[np.ndarray, "batch seq"]], Bool[np.ndarray, "batch seq"]]


class Batch(NamedTuple):
    """One batch as the model runs it: ``inputs`` (numpy tokens and mask), ``document`` per row (-1 for a filler
    row), ``real`` (whether a row's real positions are kept), ``last`` (each row's last real position),
    ``documents``: the documents seen so far."""

    inputs: Inputs
    document: Int[np.ndarray, "batch"]
    real: Bool[np.ndarray, "batch"]
    last: Int[np.ndarray, "batch"]
    documents: int


class RowsMeta(NamedTuple):
    """The kept rows' row map: each row's document, its position in the document's tokens, and its token id."""

    document: Shaped[np.ndarray, "rows"]
    position: Shaped[np.ndarray, "rows"]
    token: Shaped[np.ndarray, "rows"]


def bucket_lengths(max_length: int, lengths: Sequence[int] | None) -> tuple[int, ...]:
    """The padded lengths a batch may take, ascending, the longest ``max_length``."""
    if lengths is None:
        lengths, n = [], MIN_BUCKET
        while n < max_length:
            lengths.append(n)
            n *= 2
    out = tuple(sorted({int(n) for n in lengths if int(n) < max_length} | {int(max_length)}))
    if out[0] < 1:
        raise ValueError(f"lengths must be positive, got {lengths}")
    return out


def corpus_source(data, column: str) -> tuple[str, Any]:
    """What kind of corpus ``data`` is: ``("inputs", Inputs)``, ``("batches", iterator of Inputs)`` or
    ``("texts", iterator of strings)``. Reads the first item of a plain iterable (given back in the iterator);
    TypeError or ValueError for what collect does not take."""
    if isinstance(data, Inputs):
        if data.tokens is None or np.shape(data.tokens)[0] == 0:
            raise ValueError("collect got no documents: the jstd.Inputs holds 0 rows of token ids")
        return ("batches" if data.images else "inputs"), data
    if isinstance(data, (str, bytes)):
        raise TypeError("collect takes many documents: a list of strings (wrap one text in a list), a dataset or "
                        "jstd.Inputs")
    if hasattr(data, "column_names"):  # an HF datasets.Dataset, duck-typed
        if isinstance(data.column_names, dict):  # a DatasetDict: split -> columns
            raise ValueError(f"collect takes one split of a DatasetDict: pass dataset[split], one of "
                             f"{', '.join(map(str, data.column_names))}")
        names = list(data.column_names)
        if column not in names:
            raise ValueError(f"the dataset has no column {column!r}; its columns: {', '.join(names)}; "
                             "pass column=NAME")
        items = (row[column] for row in data) if hasattr(type(data), "__iter__") else iter(data[column])
        first = next(items, _NONE)
        if first is _NONE:
            raise ValueError(f"collect got no documents: the dataset has 0 rows (column {column!r})")
        if not isinstance(first, str):
            raise TypeError(f"document 0 (column {column!r}) is a {type(first).__name__}, not a string")
        return "texts", _chain(first, items)
    if hasattr(data, "keys"):
        raise TypeError("collect takes a tokenizer's output as jstd.Inputs.of(batch)")
    try:
        items = iter(data)
    except TypeError:
        raise TypeError(f"collect takes texts, a dataset or jstd.Inputs, got {type(data).__name__}") from None
    first = next(items, _NONE)
    if first is _NONE:
        raise ValueError("collect got no documents (an empty corpus)")
    rest = _chain(first, items)
    if isinstance(first, Inputs):
        return "batches", rest
    if isinstance(first, str):
        return "texts", rest
    raise TypeError(f"document 0 is a {type(first).__name__}: collect takes strings or jstd.Inputs "
                    "(token ids: pass jstd.Inputs(tokens, attention_mask))")


_NONE = object()  # no first item


def _chain(first, rest):
    yield first
    yield from rest


class Batches:
    """The corpus as ``Batch``es, in document order; ``truncated`` counts documents cut to ``max_length``."""

    def __init__(self, it: Iterator[Batch]):
        self.it, self.truncated = it, 0

    def __iter__(self):
        return self.it


def corpus_batches(kind: str, source, processor, batch_size: int, max_length: int, lengths: Sequence[int],
                   vocab: int) -> Batches:
    """``source`` of ``kind`` (as ``corpus_source`` tells them) as batches: ``Inputs`` rows split into batches
    of ``batch_size``, given ``Inputs`` each one batch as it is, texts tokenized by ``processor`` into batches
    of ``batch_size`` padded to one of ``lengths``. Lazy: the corpus is read as the batches are."""
    out = Batches(iter(()))
    if kind == "inputs":
        out.it = _split_inputs(source, batch_size)
    elif kind == "batches":
        out.it = _given_batches(source)
    else:
        out.it = _text_batches(source, processor, batch_size, max_length, lengths, out)
    return out


def _rows_batch(tokens: np.ndarray, mask: np.ndarray, document: np.ndarray, real: np.ndarray, documents: int,
                images=None, layout=()) -> Batch:
    """A ``Batch`` of these rows, each row's last real position found from ``mask`` (the last column for none)."""
    seq = tokens.shape[1]
    last = np.where(mask.any(1), seq - 1 - np.argmax(mask[:, ::-1] != 0, axis=1), seq - 1).astype(np.int32)
    return Batch(Inputs(tokens, mask, images, layout), document, real, last, documents)


def _split_inputs(inputs: Inputs, batch_size: int) -> Iterator[Batch]:
    tokens = np.asarray(inputs.tokens)
    mask = np.ones_like(tokens, np.int32) if inputs.attention_mask is None else np.asarray(inputs.attention_mask)
    n = len(tokens)
    for start in range(0, n, batch_size):
        idx = np.arange(start, start + batch_size)
        real = idx < n
        idx = np.minimum(idx, n - 1)  # the last batch: copies of the last row, dropped
        yield _rows_batch(tokens[idx].astype(np.int32), mask[idx].astype(np.int32), np.where(real, idx, -1),
                          real, min(start + batch_size, n))


def _given_batches(batches: Iterable[Inputs]) -> Iterator[Batch]:
    documents = 0
    for inputs in batches:
        if not isinstance(inputs, Inputs):
            raise TypeError(f"an iterable of jstd.Inputs holds a {type(inputs).__name__}")
        tokens = np.asarray(inputs.tokens)
        mask = np.ones_like(tokens) if inputs.attention_mask is None else np.asarray(inputs.attention_mask)
        n = len(tokens)
        yield _rows_batch(tokens, mask, np.arange(documents, documents + n), np.ones(n, bool), documents + n,
                          inputs.images, inputs.layout)
        documents += n


def _text_batches(texts, processor, batch_size, max_length, lengths, counter) -> Iterator[Batch]:
    tok = getattr(processor, "tokenizer", processor)
    pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else 0
    documents = 0
    chunk = []
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"document {documents + len(chunk)} is a {type(text).__name__}, not a string")
        chunk.append(text)
        if len(chunk) == batch_size:
            yield _tokenized(tok, chunk, pad, batch_size, max_length, lengths, documents, counter)
            documents += len(chunk)
            chunk = []
    if chunk:
        yield _tokenized(tok, chunk, pad, batch_size, max_length, lengths, documents, counter)


def _tokenized(tok, texts, pad, batch_size, max_length, lengths, first, counter) -> Batch:
    """``texts`` (documents ``first``, ``first + 1``…) tokenized, cut to ``max_length`` (counted in
    ``counter.truncated``) and left-padded to the shortest of ``lengths`` that holds them, filler rows added."""
    ids = tok(list(texts), add_special_tokens=True)["input_ids"]
    counter.truncated += sum(len(i) > max_length for i in ids)
    ids = [list(i[:max_length]) for i in ids]
    longest = max(max(map(len, ids)), 1)
    seq = next(n for n in lengths if n >= longest)
    tokens = np.full((batch_size, seq), pad, np.int32)
    mask = np.zeros((batch_size, seq), np.int32)
    real = np.zeros(batch_size, bool)
    for r in range(batch_size):
        row = ids[min(r, len(ids) - 1)] or [pad]  # filler rows copy the last document; an empty one is one pad
        tokens[r, seq - len(row):] = row
        mask[r, seq - len(row):] = 1
        real[r] = r < len(ids) and len(ids[r]) > 0
    document = np.where(np.arange(batch_size) < len(ids), first + np.arange(batch_size), -1)
    return _rows_batch(tokens, mask, document, real, first + len(ids))


def select_rows(batch: Batch, positions: str | PositionFn) -> tuple[Int[np.ndarray, "rows"], RowsMeta]:
    """The rows the collect step's output keeps (indices into its first axis: ``row·seq + position``, or the row
    for ``positions="last"``) and their (document, position, token). Padding and filler rows are never kept;
    ValueError when a positions function returns another shape than the batch's tokens."""
    tokens = np.asarray(batch.inputs.tokens)
    mask = np.asarray(batch.inputs.attention_mask) != 0
    where = np.cumsum(mask, axis=1) - 1
    if positions == "last":
        rows = np.nonzero(batch.real & mask.any(1))[0]
        last = batch.last[rows]
        return rows, RowsMeta(batch.document[rows].astype(np.int64), where[rows, last].astype(np.int32),
                              tokens[rows, last].astype(np.int32))
    keep = mask & batch.real[:, None]
    if callable(positions):
        chosen = np.asarray(positions(tokens, mask.astype(np.int32)))
        if chosen.shape != tokens.shape:
            raise ValueError(f"the positions function returned shape {chosen.shape}; it must return a boolean "
                             f"mask shaped like the batch's tokens {tokens.shape}")
        keep &= chosen.astype(bool)
    r, p = np.nonzero(keep)
    return (r * tokens.shape[1] + p), RowsMeta(batch.document[r].astype(np.int64), where[r, p].astype(np.int32),
                                               tokens[r, p].astype(np.int32))


def padded(batch: Batch, seq: int) -> Batch:
    """``batch`` left-padded to ``seq`` positions (masked out: the real positions' values do not change)."""
    tokens = np.asarray(batch.inputs.tokens)
    pad = seq - tokens.shape[1]
    if pad <= 0:
        return batch
    mask = np.asarray(batch.inputs.attention_mask)
    tokens = np.concatenate([np.repeat(tokens[:, :1], pad, axis=1), tokens], axis=1)
    mask = np.concatenate([np.zeros((len(mask), pad), mask.dtype), mask], axis=1)
    return _rows_batch(tokens, mask, batch.document, batch.real, batch.documents, batch.inputs.images,
                       batch.inputs.layout)
