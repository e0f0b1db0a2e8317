"""``jstd.collect``: sites over a corpus, to disk, at forward speed and in constant memory; ``jstd collect`` on the
command line.

One compiled ``jstd.run`` per batch shape reads the sites; a writer thread moves each batch's values to the
current shard while the next batch computes; padding and filler rows never reach the disk. The format and its
reader are in ``jstd/collect/dataset.py``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import queue
import re
import sys
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jstd.collect.dataset import (SAFETENSORS_DTYPE, FORMAT, INDEX, ROW_MAP, VERSION, ActivationDataset, bfloat16_safe, read_index,
                              shard_name, write_json, write_shard)
from jstd.core.edits import as_edits
from jstd.core.inputs import Inputs
from jstd.io.load import load
from jstd.io.processor import load_processor
from jstd.run import check_sites, run
from jstd.core.sites import SITES, SiteError, parse

SHARD_BYTES = 256 * 2**20
MIN_BUCKET = 16
# positions=f: f(tokens [batch, seq], attention_mask [batch, seq]) -> bool [batch, seq], numpy arrays
PositionFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def collect(
    model,
    data,
    sites: str | Sequence[str],
    out_dir: str | os.PathLike,
    *,
    processor=None,
    column: str = "text",
    batch_size: int = 8,
    max_length: int = 256,
    lengths: Sequence[int] | None = None,
    positions: str | PositionFn = "all",
    edits=(),
    dtype=None,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> ActivationDataset:
    """Run ``model`` over a corpus and write ``sites`` at the kept token positions to ``out_dir``; the dataset.

    model: a model from ``jstd.load``, or a checkpoint folder or repo id (loaded, with its processor).
    data: the documents, each one row: an iterable of strings (a list, a generator, a file's lines), a
        HuggingFace ``datasets.Dataset`` (any object with ``column_names``; its ``column`` is read row by row),
        a ``jstd.Inputs`` of token ids (each row a document; split into batches of ``batch_size``), or an
        iterable of ``jstd.Inputs`` (each one batch as it is: the way to collect on image prompts).
    sites: names of sites with a token axis (``layers.layer_output``, ``layers.3.mlp.mlp_neurons``,
        ``token_embeddings``, ``logits``…); each row of a site is one token position:
        ``[tokens, layers, hidden]`` for a site of every block, ``[tokens, hidden]`` for ``layers.3.X``,
        ``[tokens, layers, heads, qk_head_dim]`` for queries (the layout axes after ``batch`` and ``seq``).
    processor: the tokenizer or processor for text (default: ``jstd.load_processor`` of ``model`` when it is a
        path). Texts are tokenized with its special tokens, cut to their first ``max_length`` tokens (a
        warning counts the cut documents), left-padded to the smallest of ``lengths`` (default: powers of two
        from 16, and ``max_length``) that holds the batch's longest; the last batch is filled with copies of a
        real row. So each (batch size, length) compiles once.
    positions: ``"all"`` (every real token), ``"last"`` (each document's last token), or a function
        ``f(tokens, attention_mask) -> bool [batch, seq]`` of the batch's numpy arrays (padding is dropped
        whatever it returns).
    edits: edits applied on every batch (an ablation, a steering vector), as ``jstd.run`` takes them; their
        ``positions`` index the padded batch.
    dtype: the dtype written (``"bfloat16"``, ``jnp.float16``…; default: the model's), cast on the device.
    shard_bytes: the size of a shard's site tensors; the writer holds one shard and the batches in flight.

    Writes ``out_dir``: safetensors shards and ``index.json`` (``jstd/activations.py``); each shard is written
    under a temporary name and renamed when whole. A call into a folder holding an unfinished collection with
    the same settings resumes after its last complete shard (its tokens are checked to be the same); a finished
    one is checked and returned. Raises ValueError when ``out_dir`` holds other files or a collection with
    other settings or texts (naming the difference), SiteError for sites without a token axis or that the
    model lacks, and the OSError of a failed write (a full disk) after the complete shards are recorded:
    never a silently short dataset.
    """
    path = None
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
        model = load(path)
    sites = (sites,) if isinstance(sites, str) else tuple(sites)
    if not sites:
        raise ValueError("collect needs at least one site, e.g. sites=('layers.layer_output',)")
    if batch_size < 1 or max_length < 1:
        raise ValueError(f"batch_size and max_length must be positive, got {batch_size} and {max_length}")
    check_sites(model, sites, "collect")
    layouts = {s: row_layout(model, s) for s in sites}
    lengths = bucket_lengths(max_length, lengths)
    positions_key = _positions_key(positions)
    write_dtype = None if dtype is None else str(bfloat16_safe(jnp.dtype(dtype)))

    kind, source = _source(data, column)
    if kind == "texts" and processor is None:
        if path is None:
            raise ValueError("collect on texts needs the tokenizer: pass processor=jstd.load_processor(path), "
                             "or give the model as its path")
        processor = load_processor(path)
    settings = dict(sites=list(sites), positions=positions_key, batch_size=batch_size, max_length=max_length,
                    lengths=list(lengths), dtype=write_dtype, edits=_edits_key(edits), model=_model_key(model),
                    data=kind, column=column if kind == "texts" else None, shard_bytes=int(shard_bytes))
    out = Path(out_dir)
    index = _prepare(out, settings, model, path, layouts)
    done = index["rows"]

    batches = _batches(kind, source, processor, batch_size, max_length, lengths, model.config.vocab_size)
    writer = _Writer(out, index, sites, shard_bytes, progress)
    hasher = hashlib.sha256()
    seen = documents = 0
    verified = done == 0
    if not verified:
        index["complete"] = False
    edits_tuple = as_edits(edits)
    try:
        for batch in batches:
            documents = batch.documents
            take, rows = _selection(batch, positions)
            n = len(rows.token)
            if seen + n <= done and not verified:  # rows of complete shards: only their tokens are checked
                hasher.update(rows.token.tobytes())
                seen += n
                continue
            drop = 0
            if not verified:
                drop = done - seen
                hasher.update(rows.token[:drop].tobytes())
                _verify(out, index, hasher, done, seen + drop)
                writer.hasher, verified = hasher.copy(), True
            seen += n
            if n - drop == 0:
                writer.count(batch)
                continue
            last = positions == "last"
            index_arg = jnp.asarray(batch.last) if last else None
            values = _step(model, batch.inputs, edits_tuple, index_arg, sites=sites, last=last, dtype=write_dtype)
            writer.put((values, take[drop:], RowsMeta(*(a[drop:] for a in rows)), batch))
        if not verified:
            _verify(out, index, hasher, done, seen)
            writer.hasher = hasher
        writer.finish(documents, batches.truncated)
    except BaseException:
        writer.abort()
        raise
    if batches.truncated:
        warnings.warn(f"jstd.collect: {batches.truncated} of {documents} documents were longer than "
                      f"max_length={max_length} tokens and were cut to their first {max_length}", stacklevel=2)
    return ActivationDataset(out)


def row_layout(model, site: str) -> dict:
    """How ``site``'s value becomes rows: its layout with ``tokens`` first, the block indices, and the axes."""
    base, index = parse(site)
    spec = SITES[base]
    stacked = spec.per_block and index is None
    axes = (("layers",) if stacked else ()) + spec.layout
    if "batch" not in axes or "seq" not in axes:
        why = ("a value per image or patch, not per token position" if "images" in axes or "image_tokens" in axes
               else "a value per key position as well: its rows would be as wide as each padded batch"
               if "query" in axes else "no token axis")
        raise SiteError(f"collect keeps one row per token position; {site!r} has layout {spec.layout}: {why}. "
                        "Collect a site with batch and seq axes, or read this one with jstd.run")
    rest = [a for a in axes if a not in ("batch", "seq")]
    blocks = list(model.blocks_for(base)) if stacked else ([index % model.depth(spec.stack)] if spec.per_block else [])
    return dict(layout=["tokens"] + rest, blocks=blocks, axes=list(axes))


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


@functools.partial(jax.jit, static_argnames=("sites", "last", "dtype"))
def _step(model, inputs: Inputs, edits, last_index, *, sites: tuple[str, ...], last: bool, dtype: str | None):
    """Each site as ``[batch·seq, …]`` rows (``[batch, …]`` at ``last_index`` when ``last``), in ``dtype``."""
    out = run(model, inputs, edits, reads=sites)
    values = {}
    for s in sites:
        axes = row_layout_axes(s)
        v = out[s]
        v = jnp.transpose(v, [axes.index("batch"), axes.index("seq")]
                          + [i for i, a in enumerate(axes) if a not in ("batch", "seq")])
        if last:
            v = v[jnp.arange(v.shape[0]), last_index]
        else:
            v = v.reshape((-1,) + v.shape[2:])
        values[s] = v if dtype is None else v.astype(dtype)
    return values


def row_layout_axes(site: str) -> tuple[str, ...]:
    base, index = parse(site)
    spec = SITES[base]
    return (("layers",) if spec.per_block and index is None else ()) + spec.layout


class Batch(NamedTuple):
    """One batch as the model runs it: ``inputs`` (numpy tokens and mask), ``document`` per row (-1 for a filler
    row), ``real`` (whether a row's real positions are kept), ``last`` (each row's last real position),
    ``documents``: the documents seen so far."""

    inputs: Inputs
    document: np.ndarray
    real: np.ndarray
    last: np.ndarray
    documents: int


class RowsMeta(NamedTuple):
    document: np.ndarray
    position: np.ndarray
    token: np.ndarray


def _source(data, column: str) -> tuple[str, Any]:
    """What kind of corpus ``data`` is: ``("inputs", Inputs)``, ``("batches", iterator of Inputs)`` or
    ``("texts", iterator of strings)``."""
    if isinstance(data, Inputs):
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
        if hasattr(type(data), "__iter__"):
            return "texts", (row[column] for row in data)
        return "texts", iter(data[column])
    if hasattr(data, "keys"):
        raise TypeError("collect takes a tokenizer's output as jstd.Inputs.of(batch)")
    try:
        items = iter(data)
    except TypeError:
        raise TypeError(f"collect takes texts, a dataset or jstd.Inputs, got {type(data).__name__}") from None
    first = next(items, None)
    if first is None:
        raise ValueError("collect got no documents")
    rest = _chain(first, items)
    if isinstance(first, Inputs):
        return "batches", rest
    if isinstance(first, str):
        return "texts", rest
    raise TypeError(f"collect takes strings or jstd.Inputs, got an iterable of {type(first).__name__} "
                    "(token ids: pass jstd.Inputs(tokens, attention_mask))")


def _chain(first, rest):
    yield first
    yield from rest


class _Batches:
    """The corpus as ``Batch``es, in document order; ``truncated`` counts documents cut to ``max_length``."""

    def __init__(self, it: Iterator[Batch]):
        self.it, self.truncated = it, 0

    def __iter__(self):
        return self.it


def _batches(kind, source, processor, batch_size, max_length, lengths, vocab) -> _Batches:
    out = _Batches(iter(()))
    if kind == "inputs":
        out.it = _split_inputs(source, batch_size)
    elif kind == "batches":
        out.it = _given_batches(source)
    else:
        out.it = _text_batches(source, processor, batch_size, max_length, lengths, out)
    return out


def _rows_batch(tokens: np.ndarray, mask: np.ndarray, document: np.ndarray, real: np.ndarray, documents: int,
                images=None, layout=()) -> Batch:
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


def _selection(batch: Batch, positions) -> tuple[np.ndarray, RowsMeta]:
    """The rows ``_step``'s output keeps (indices into its first axis) and their (document, position, token)."""
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


class _Writer:
    """A thread that moves each batch's rows to the shard being filled and writes shards as they fill, while the
    main thread dispatches the next batch. Holds at most ``DEPTH`` batches in flight and one shard."""

    DEPTH = 2

    def __init__(self, folder: Path, index: dict, sites, shard_bytes: int, progress: bool):
        self.folder, self.index, self.sites, self.shard_bytes = folder, index, sites, shard_bytes
        self.hasher = hashlib.sha256()
        self.queue: queue.Queue = queue.Queue(maxsize=self.DEPTH)
        self.error: BaseException | None = None
        self.stopped = False
        self.buffers: dict[str, np.ndarray] | None = None
        self.fill = 0
        self.bar = _bar(progress)
        self.thread = threading.Thread(target=self._loop, name="jstd-collect-writer", daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        while True:
            self._raise()
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def count(self, batch: Batch) -> None:
        if self.bar is not None:
            self.bar.update(int(np.asarray(batch.inputs.attention_mask)[batch.real].sum()))

    def _raise(self):
        if self.error is not None:
            raise self.error

    def _loop(self):
        while True:
            item = self.queue.get()
            if item is None or self.stopped:
                return
            try:
                self._take(*item)
            except BaseException as e:  # surfaced by the main thread's next put or finish
                self.error = _write_error(e, self.folder, self.index)
                return

    def _take(self, values, take, rows: RowsMeta, batch):
        host = {s: np.asarray(values[s]) for s in self.sites}  # waits for this batch's compute
        if self.buffers is None:
            self._allocate(host)
        done = 0
        while done < len(take):
            k = min(len(take) - done, self.capacity - self.fill)
            part = slice(self.fill, self.fill + k)
            for s in self.sites:
                np.take(host[s], take[done:done + k], axis=0, out=self.buffers[s][part])
            for name, a in zip(ROW_MAP, rows):
                self.buffers[name][part] = a[done:done + k]
            self.hasher.update(rows.token[done:done + k].tobytes())
            self.fill += k
            done += k
            if self.fill == self.capacity:
                self._write_shard()
        self.count(batch)

    def _allocate(self, host):
        per_row = sum(host[s][0].nbytes for s in self.sites) if all(len(host[s]) for s in self.sites) else 1
        self.capacity = max(1, int(self.shard_bytes) // max(per_row, 1))
        self.buffers = {s: np.empty((self.capacity,) + host[s].shape[1:], host[s].dtype) for s in self.sites}
        self.buffers.update({name: np.empty(self.capacity, dt) for name, dt in ROW_MAP.items()})
        for s in self.sites:
            entry = self.index["sites"][s]
            entry.update(shape=list(host[s].shape[1:]), dtype=_dtype_name(host[s].dtype))

    def _write_shard(self):
        if self.fill == 0:
            return
        shards = self.index["shards"]
        name = shard_name(len(shards))
        write_shard(self.folder / name, {k: v[:self.fill] for k, v in self.buffers.items()},
                    {"format": FORMAT})
        shards.append(dict(file=name, rows=self.fill, first_row=self.index["rows"],
                           tokens_sha256=self.hasher.hexdigest()))
        self.index["rows"] += self.fill
        write_json(self.folder / INDEX, self.index)
        self.fill = 0

    def finish(self, documents: int, truncated: int) -> None:
        self.put(None)
        self.thread.join()
        self._raise()
        try:
            self._write_shard()
            self.index.update(complete=True, documents=documents, truncated_documents=truncated,
                              tokens_sha256=self.hasher.hexdigest())
            write_json(self.folder / INDEX, self.index)
        except BaseException as e:
            raise _write_error(e, self.folder, self.index) from e
        finally:
            if self.bar is not None:
                self.bar.close()

    def abort(self) -> None:
        self.stopped = True
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        self.thread.join(timeout=60)
        if self.bar is not None:
            self.bar.close()


def _write_error(e: BaseException, folder: Path, index: dict) -> BaseException:
    if not isinstance(e, OSError):
        return e
    error = OSError(e.errno, f"jstd.collect: writing to {folder} failed ({e.strerror or e}); the {index['rows']} "
                             f"rows of its {len(index['shards'])} complete shards are kept: free space (or fix the "
                             "folder) and rerun the same call to resume")
    error.__cause__ = e
    return error


def _bar(progress: bool):
    if not progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(desc="collect", unit="tok", unit_scale=True, disable=None)


def _dtype_name(dtype) -> str:
    return SAFETENSORS_DTYPE[np.dtype(dtype)]


def _prepare(out: Path, settings: dict, model, path, layouts) -> dict:
    """The index to continue: a fresh one for an empty or missing folder, the folder's own when its settings
    match (stray temporary and unlisted shard files removed). Raises ValueError otherwise."""
    index = read_index(out) if out.exists() else None
    if index is None:
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"jstd.collect: {out} is not empty and holds no {INDEX}; collect into a new or empty "
                             "folder")
        out.mkdir(parents=True, exist_ok=True)
        index = dict(format=FORMAT, version=VERSION, complete=False, rows=0, shards=[],
                     sites={s: dict(layout=l["layout"], blocks=l["blocks"], shape=None, dtype=None)
                            for s, l in layouts.items()},
                     row_map={name: dict(dtype=str(np.dtype(dt))) for name, dt in ROW_MAP.items()},
                     model=dict(family=model.family, model_type=model.config.model_type, path=path,
                                config=repr(model.config)),
                     settings=settings)
        write_json(out / INDEX, index)
        return index
    old = index["settings"]
    differ = [k for k in settings if old.get(k) != settings[k]]
    if differ:
        what = "; ".join(f"{k}: {old.get(k)!r} there, {settings[k]!r} now" for k in differ)
        raise ValueError(f"jstd.collect: {out} holds a collection made with other settings ({what}); collect into "
                         "another folder, or delete this one to collect anew")
    listed = {s["file"] for s in index["shards"]} | {INDEX}
    for f in out.iterdir():
        if f.name.endswith(".tmp") or (f.name.startswith("shard-") and f.name not in listed):
            f.unlink()  # a shard cut short, or written but not yet listed when the run stopped
    return index


def _verify(out: Path, index: dict, hasher, done: int, seen: int) -> None:
    want = index["shards"][-1]["tokens_sha256"] if index["shards"] else hashlib.sha256().hexdigest()
    if seen < done or hasher.hexdigest() != want:
        raise ValueError(f"jstd.collect: {out} holds a collection of other texts (its first {done} rows' tokens "
                         "differ from this corpus's); collect into another folder, or delete this one")


def _positions_key(positions) -> str:
    if positions in ("all", "last"):
        return positions
    if callable(positions):
        code = getattr(positions, "__code__", None)
        digest = hashlib.sha256(code.co_code if code is not None else b"").hexdigest()[:16]
        return f"function {getattr(positions, '__module__', '')}.{getattr(positions, '__qualname__', '?')} {digest}"
    raise ValueError(f"positions must be 'all', 'last' or a function (tokens, attention_mask) -> bool mask; "
                     f"got {positions!r}")


def _edits_key(edits) -> str:
    leaves, treedef = jax.tree.flatten(as_edits(edits))
    h = hashlib.sha256(re.sub(r" at 0x[0-9a-f]+", "", str(treedef)).encode())
    for leaf in leaves:
        h.update(np.asarray(leaf).tobytes() if hasattr(leaf, "shape") or isinstance(leaf, (int, float))
                 else repr(leaf).encode())
    return h.hexdigest()[:32]


_MODEL_KEYS: dict[int, tuple[weakref.ref, str]] = {}


def _model_key(model) -> str:
    """A fingerprint of the model: family, config, and every weight's shape, dtype, sum and sum of squares."""
    entry = _MODEL_KEYS.get(id(model))
    if entry is not None and entry[0]() is model:
        return entry[1]
    leaves = [x for x in jax.tree.leaves(model) if hasattr(x, "shape")]
    if all(d.platform == "cpu" for x in leaves for d in getattr(x, "devices", lambda: ())()):
        sums = np.asarray([[np.sum(a, dtype=np.float64), np.sum(np.square(a, dtype=np.float64))]
                           for a in map(np.asarray, leaves)])  # on the host's own memory: no copy, no compile
    else:
        sums = np.asarray(_sums(leaves))
    h = hashlib.sha256(f"{model.family} {model.config!r}".encode())
    for x in leaves:
        h.update(f"{x.shape}{x.dtype}".encode())
    h.update(np.round(sums.astype(np.float64), 4).tobytes())
    key = h.hexdigest()[:32]
    _MODEL_KEYS[id(model)] = (weakref.ref(model, lambda _, k=id(model): _MODEL_KEYS.pop(k, None)), key)
    return key


@jax.jit
def _sums(leaves):
    return jnp.stack([jnp.stack([jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.square(x.astype(jnp.float32)))])
                      for x in leaves])
