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
from jstd.collect.dataset import FORMAT, INDEX, ROW_MAP, SAFETENSORS_DTYPE, shard_name, write_json, write_shard


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
                 hasher=None):
        self.folder, self.index, self.sites, self.shard_bytes = folder, index, sites, shard_bytes
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


def _dtype_name(dtype) -> str:
    return SAFETENSORS_DTYPE[np.dtype(dtype)]
