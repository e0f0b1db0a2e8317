"""The writer thread of ``jstd.collect``: each batch's kept rows moved to the shard being filled, and each shard
written (atomically, by ``dataset.write_shard``) and listed in the index as it fills, while the main thread
dispatches the next batch.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
from jaxtyping import Array, Int

from jstd.collect.batches import Batch, RowsMeta
from jstd.core.progress import Progress, quiet_unless_terminal
from jstd.collect.dataset import (FORMAT, INDEX, ROW_MAP, SAFETENSORS_DTYPE, shard_name, sparse_names, write_json,
                                  write_shard)


class ShardWriterThread:
    """A thread that moves each batch's rows to the shard being filled and writes shards as they fill, while the
    main thread dispatches the next batch. Holds at most ``DEPTH`` batches in flight and one shard.

    ``index`` (the folder's, as ``resume.prepare`` gives it) is updated in place and rewritten after each shard:
    a shard is listed once it is whole, with the sha256 of every row's token up to its end (``hasher``, continued
    from the one given). An error of the thread surfaces in the main thread's next ``put`` or in ``finish``; an
    OSError of a failed write names the folder and the complete shards kept. The main thread calls ``finish``
    after the last batch, or ``abort`` on its own error."""

    DEPTH = 2

    def __init__(self, folder: Path, index: dict, sites: Sequence[str], shard_bytes: int, progress: bool,
                 hasher=None, sparse: Sequence[str] = ()):
        self.folder, self.index, self.sites, self.shard_bytes = folder, index, sites, shard_bytes
        self.sparse = tuple(sparse)  # sites written as counts, indices and values (dataset.py)
        self.dense = tuple(s for s in sites if s not in self.sparse)
        self.nnz: dict[str, int] = {s: 0 for s in self.sparse}  # entries filled in each sparse site's buffers
        self.hasher = hashlib.sha256() if hasher is None else hasher
        self.queue: queue.Queue = queue.Queue(maxsize=self.DEPTH)
        self.error: BaseException | None = None
        self.stopped = False
        self.buffers: dict[str, np.ndarray] | None = None
        self.fill = 0
        self.bar = Progress("collect", enabled=quiet_unless_terminal(progress), unit="tokens")
        self.thread = threading.Thread(target=self._loop, name="jstd-collect-writer", daemon=True)
        self.thread.start()

    def put(self, item: tuple[dict[str, Array], Int[np.ndarray, "rows"], RowsMeta, Batch] | None) -> None:
        """Hand the thread ``(values, take, rows, batch)``: the step's values per site, the indices of the kept
        rows into their first axis, those rows' row map, and the batch (None: no more). Waits while ``DEPTH``
        are in flight; raises the thread's error."""
        while True:
            self._raise()
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def count(self, batch: Batch) -> None:
        """Advance the progress bar by ``batch``'s real tokens."""
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
        sparse = {s: _sparse_rows(host[s], take) for s in self.sparse}
        # entries of sparse site s in the kept rows before row i: ends[s][i]
        ends = {s: np.concatenate([[0], np.cumsum(c.reshape(len(take), -1).sum(1, dtype=np.int64))])
                for s, (c, _, _) in sparse.items()}
        if self.buffers is None:
            self._allocate(host, {s: ends[s][-1] / max(len(take), 1) for s in self.sparse})
        done = 0
        while done < len(take):
            k = min(len(take) - done, self.capacity - self.fill)
            for s in self.sparse:  # as many rows as the entry buffers hold
                room = self.buffers[f"{s}.indices"].shape[0] - self.nnz[s]
                k = min(k, int(np.searchsorted(ends[s], ends[s][done] + room, side="right")) - 1 - done)
            if k == 0:  # the next row's entries do not fit: the shard is full
                if self.fill == 0:  # (an empty buffer holds any row: never reached)
                    raise RuntimeError("jstd.collect: a row's entries exceed the writer's empty entry buffer")
                self._write_shard()
                continue
            part = slice(self.fill, self.fill + k)
            for s in self.dense:
                np.take(host[s], take[done:done + k], axis=0, out=self.buffers[s][part])
            for s, (counts, indices, vals) in sparse.items():
                lo, hi = ends[s][done], ends[s][done + k]
                at = slice(self.nnz[s], self.nnz[s] + hi - lo)
                self.buffers[f"{s}.counts"][part] = counts[done:done + k]
                self.buffers[f"{s}.indices"][at] = indices[lo:hi]
                self.buffers[f"{s}.values"][at] = vals[lo:hi]
                self.nnz[s] += int(hi - lo)
            for name, a in zip(ROW_MAP, rows):
                self.buffers[name][part] = a[done:done + k]
            self.hasher.update(rows.token[done:done + k].tobytes())
            self.fill += k
            done += k
            if self.fill == self.capacity:
                self._write_shard()
        self.count(batch)

    def _allocate(self, host, entries_per_row: dict[str, float]):
        """The shard's buffers: ``capacity`` rows from ``shard_bytes`` (a sparse site's row counted at this first
        batch's mean entries), and for each sparse site an entry buffer of ``shard_bytes`` (at least one row's
        every entry), so the writer's memory stays constant whatever the latents' density."""
        per_row = 0
        for s in self.sites:
            row = host[s].shape[1:]
            if s in self.sparse:
                per_row += 4 * int(np.prod(row[:-1], dtype=np.int64)) + entries_per_row[s] * (4 + host[s].itemsize)
            else:
                per_row += int(np.prod(row, dtype=np.int64)) * host[s].itemsize
        self.capacity = max(1, int(int(self.shard_bytes) // max(per_row, 1)))
        self.buffers = {s: np.empty((self.capacity,) + host[s].shape[1:], host[s].dtype) for s in self.dense}
        for s in self.sparse:
            row = host[s].shape[1:]
            room = max(int(self.shard_bytes) // (4 + host[s].itemsize), int(np.prod(row, dtype=np.int64)))
            names = sparse_names(s)
            self.buffers[names["counts"]] = np.empty((self.capacity,) + row[:-1], np.int32)
            self.buffers[names["indices"]] = np.empty(room, np.int32)
            self.buffers[names["values"]] = np.empty(room, host[s].dtype)
        self.buffers.update({name: np.empty(self.capacity, dt) for name, dt in ROW_MAP.items()})
        for s in self.sites:
            entry = self.index["sites"][s]
            entry.update(shape=list(host[s].shape[1:]), dtype=_dtype_name(host[s].dtype))

    def _write_shard(self):
        if self.fill == 0:
            return
        shards = self.index["shards"]
        name = shard_name(len(shards))
        filled = {s: self.nnz[s] for s in self.sparse}
        tensors = {k: v[:self.fill] for k, v in self.buffers.items()}
        for s in self.sparse:
            for part in ("indices", "values"):
                tensors[f"{s}.{part}"] = self.buffers[f"{s}.{part}"][:filled[s]]
        write_shard(self.folder / name, tensors, {"format": FORMAT})
        shard = dict(file=name, rows=self.fill, first_row=self.index["rows"], tokens_sha256=self.hasher.hexdigest())
        if self.sparse:
            shard["nnz"] = filled
        shards.append(shard)
        self.index["rows"] += self.fill
        write_json(self.folder / INDEX, self.index)
        self.fill = 0
        self.nnz = {s: 0 for s in self.sparse}

    def finish(self, documents: int, truncated: int) -> None:
        """Wait for the batches in flight, write the last shard, and mark the index complete with the corpus's
        ``documents`` and ``truncated`` counts. Raises the thread's error, or this write's."""
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
            self.bar.close()

    def abort(self) -> None:
        """Stop the thread after the batch it is moving (the rest in flight is dropped, the complete shards stay
        listed), waiting up to a minute for it; closes the progress bar."""
        self.stopped = True
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        self.thread.join(timeout=60)
        self.bar.close()


def _write_error(e: BaseException, folder: Path, index: dict) -> BaseException:
    """``e`` as the main thread raises it: an OSError reworded to name ``folder`` and the complete shards kept
    (same errno, ``e`` its cause); any other error as it is."""
    if not isinstance(e, OSError):
        return e
    error = OSError(e.errno, f"jstd.collect: writing to {folder} failed ({e.strerror or e}); the {index['rows']} "
                             f"rows of its {len(index['shards'])} complete shards are kept: free space (or fix the "
                             "folder) and rerun the same call to resume")
    error.__cause__ = e
    return error


def _sparse_rows(dense: np.ndarray, take: Int[np.ndarray, "rows"]
                 ) -> tuple[Int[np.ndarray, "rows *vectors"], Int[np.ndarray, "nnz"], np.ndarray]:
    """``(counts, indices, values)`` of the rows ``take`` of ``dense`` ``[n, …, width]``: the nonzero entries of
    each last-axis vector, row-major (the stored form, ``dataset.py``)."""
    kept = np.take(dense, take, axis=0)
    flat = kept.reshape(-1, kept.shape[-1])
    vector, indices = np.nonzero(flat != 0)
    counts = np.bincount(vector, minlength=flat.shape[0]).astype(np.int32).reshape(kept.shape[:-1])
    return counts, indices.astype(np.int32), flat[vector, indices]


def _dtype_name(dtype) -> str:
    return SAFETENSORS_DTYPE[np.dtype(dtype)]
