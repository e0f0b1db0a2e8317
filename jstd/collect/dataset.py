"""An activation dataset on disk: safetensors shards of ``[tokens, …]`` rows plus ``index.json``, and its reader.

The format is plain enough to read without jstd (``safetensors.numpy.load_file``
and ``json``):

- ``shard-00000.safetensors``, ``shard-00001.safetensors``, …: one tensor per
  collected site, named by the site (``layers.layer_output``), with one row per
  kept token position (``[tokens, layers, hidden]`` for a site read on every
  block), and the row map as three more tensors: ``document`` (int64, the
  document's index in the corpus), ``position`` (int32, the token's index in
  its document's tokens, 0 = the first, special tokens included) and ``token``
  (int32, the token id there).
- A *sparse* site (a dictionary's ``X.sae.latents`` by default; ``sparse=`` in
  ``jstd.collect``) is stored as three tensors instead of one: ``SITE.counts``
  (int32 ``[tokens, …]``: the row's shape without its last axis, the number of
  nonzero entries of each last-axis vector), ``SITE.indices`` (int32 ``[nnz]``:
  their places along the last axis, ascending within a vector) and
  ``SITE.values`` (``[nnz]``, the site's dtype), the vectors one after another
  in row-major order (CSR with counts: ``offsets = concat([0],
  cumsum(counts.ravel()))``; vector ``j`` holds ``indices[offsets[j]:offsets[j
  + 1]]``). Zeros (and -0.0) are not stored; densifying gives +0.0 there. A
  TopK dictionary's rows hold at most k entries; a ReLU's what fired.
- ``index.json``: ``sites`` (per site: ``layout``, the row's axis names from
  ``jstd/core/sites.py`` with ``tokens`` first and ``layers`` for the block axis;
  ``shape``, a row's dense shape; ``blocks``, the block indices along ``layers``;
  ``dtype``; ``sparse``: for a sparse site, its three tensors' names),
  ``model`` (family, config, path where known), ``settings`` (what the
  collection was made with), ``shards`` (file names with their row counts, first
  rows, and ``nnz`` per sparse site) and ``complete``.

Shards are written under a temporary name and renamed when whole; the index
lists a shard only once it is renamed, so a reader never sees a partial one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import jax
import ml_dtypes
import numpy as np
from jaxtyping import Int, Shaped

from jstd.io.safetensors import DTYPE_NAMES as SAFETENSORS_DTYPE  # noqa: F401 (re-exported: the writer names dtypes)
from jstd.io.safetensors import DTYPES, SafetensorsFiles, write_tensors
from jstd.io.staging import atomic

INDEX = "index.json"
FORMAT = "jstd.activations"
VERSION = 1
ROW_MAP = {"document": np.int64, "position": np.int32, "token": np.int32}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as one safetensors file at ``path``, atomically: to ``path.tmp``, flushed and fsynced,
    then renamed (``jstd.io.staging.atomic``, ``jstd.io.safetensors.write_tensors``). Raises TypeError for a
    dtype safetensors has no name for, and the OSError of a failed write (a full disk: ENOSPC), with the temporary
    file removed."""
    with atomic(path, "wb") as f:
        write_tensors(f, tensors, metadata)


def write_json(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path``, atomically (a temporary file, fsynced, renamed)."""
    with atomic(path, "w") as f:
        json.dump(data, f, indent=1)


def memmap_shard(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file ``path`` as a read-only memory map (nothing is read until used), in
    the file's order. Raises CheckpointError (a ValueError) naming the file for a truncated or corrupted one."""
    files = SafetensorsFiles(path)
    return {name: files.mapped(name, lazy=True) for name in files.entries}


def read_index(folder: Path) -> dict | None:
    """The collection's ``index.json`` in ``folder``, or None when there is none."""
    path = Path(folder) / INDEX
    if not path.exists():
        return None
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise ValueError(f"{path} is not a jstd activation index (format {index.get('format')!r}, "
                         f"expected {FORMAT!r})")
    return index


class RowMap(NamedTuple):
    """Where each row of a dataset comes from: ``document[i]`` (the document's index in the corpus),
    ``position[i]`` (the token's index in its document) and ``token[i]`` (the token id there)."""

    document: Shaped[np.ndarray, "rows"]
    position: Shaped[np.ndarray, "rows"]
    token: Shaped[np.ndarray, "rows"]


SPARSE_PARTS = ("counts", "indices", "values")


def sparse_names(site: str) -> dict[str, str]:
    """The tensor names of a sparse site in a shard: ``{"counts": "SITE.counts", "indices": …, "values": …}``."""
    return {part: f"{site}.{part}" for part in SPARSE_PARTS}


class SparseRows(NamedTuple):
    """Rows of a sparse site: ``counts [rows, …]`` (nonzero entries of each last-axis vector), ``indices [nnz]``
    and ``values [nnz]`` (the vectors one after another, row-major), and ``width`` (the last axis' size).
    ``dense()`` gives ``[rows, …, width]``."""

    counts: Int[np.ndarray, "rows *vectors"]
    indices: Int[np.ndarray, "nnz"]
    values: Shaped[np.ndarray, "nnz"]
    width: int

    @property
    def offsets(self) -> Int[np.ndarray, "vectors_plus_one"]:
        """Where each vector starts in ``indices``/``values`` (row-major over ``counts``), and ``nnz`` last."""
        return np.concatenate([[0], np.cumsum(self.counts.reshape(-1), dtype=np.int64)])

    def dense(self) -> Shaped[np.ndarray, "rows *vectors width"]:
        """The rows as a dense array (zeros where nothing is stored)."""
        flat = np.zeros((self.counts.size, self.width), self.values.dtype)
        vector = np.repeat(np.arange(self.counts.size), self.counts.reshape(-1))
        flat[vector, self.indices] = self.values
        return flat.reshape(self.counts.shape + (self.width,))


class ActivationDataset:
    """A collection written by ``jstd.collect``, read lazily: every shard is memory-mapped, nothing is loaded until
    a batch or a read asks for it.

    ``len(ds)``: the rows (kept token positions); ``ds.sites``; ``ds.index``
    (the ``index.json`` dict); ``ds.layout(site)``, ``ds.shape(site)``;
    ``ds.rows``: the ``RowMap`` (document, position, token per row);
    ``ds.read(site, rows)``: rows as one array; ``ds.batches(n, key=…)``:
    batches, shuffled with a JAX key or in order. A sparse site
    (``ds.sparse``) reads as ``SparseRows`` (counts, indices, values), or dense
    with ``dense=True``.

    Raises FileNotFoundError for a folder without ``index.json``; ValueError for
    an unfinished collection (resume it with the same ``jstd.collect`` call)
    unless ``partial=True``, which reads its complete shards.
    """

    def __init__(self, folder: str | os.PathLike, *, partial: bool = False):
        self.folder = Path(folder)
        index = read_index(self.folder)
        if index is None:
            raise FileNotFoundError(f"{self.folder} has no {INDEX}: it is not a collection written by jstd.collect")
        if not index["complete"] and not partial:
            raise ValueError(f"the collection in {self.folder} is unfinished ({index['rows']} rows in "
                             f"{len(index['shards'])} complete shards): rerun the same jstd.collect call to resume it, "
                             "or pass partial=True to read the complete shards")
        self.index = index
        self.sites = tuple(index["sites"])
        self.sparse = tuple(s for s in self.sites if index["sites"][s].get("sparse"))
        self._shards = [_checked_shard(self.folder, s, self.sites, self.sparse) for s in index["shards"]]
        self._starts = np.cumsum([0] + [s["rows"] for s in index["shards"]])
        self._rows = None
        self._offsets: dict[tuple[int, str], np.ndarray] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __repr__(self) -> str:
        if not self._shards:
            return (f"ActivationDataset({str(self.folder)!r}: 0 rows, no complete shard yet; "
                    f"sites {', '.join(self.sites)})")
        sites = ", ".join(f"{s} {self.shape(s)}" for s in self.sites)
        return f"ActivationDataset({str(self.folder)!r}: {len(self)} rows; {sites})"

    def layout(self, site: str) -> tuple[str, ...]:
        """The axis names of ``site``'s rows, ``tokens`` first (``("tokens", "layers", "hidden")``)."""
        return tuple(self._site(site, shaped=False)["layout"])

    def shape(self, site: str) -> tuple[int, ...]:
        """``(rows, …)``: the shape of ``site`` over the whole dataset."""
        return (len(self),) + tuple(self._site(site)["shape"])

    def _site(self, site: str, shaped: bool = True) -> dict:
        if site not in self.index["sites"] and site not in ROW_MAP:
            raise KeyError(f"{site!r} was not collected here; sites: {', '.join(self.sites)}")
        entry = self.index["sites"].get(site) or {"layout": ["tokens"], "shape": []}
        if shaped and entry.get("shape") is None:  # a collection being written, before its first shard
            why = ("holds no rows (its positions kept none)" if self.index["complete"] else
                   "has no complete shard yet (it is being written); open it again once jstd.collect has written one")
            raise ValueError(f"the collection in {self.folder} {why}: the shape of {site!r} is not known "
                             "(len(ds) is 0)")
        return entry

    @property
    def rows(self) -> RowMap:
        """The row map (loaded once: 16 bytes a row)."""
        if self._rows is None:
            self._rows = RowMap(*(self.read(name) for name in ROW_MAP))
        return self._rows

    def shards(self) -> list[dict[str, np.ndarray]]:
        """Each shard's tensors as read-only memory maps (sites and the row map's ``document``, ``position``,
        ``token``)."""
        return list(self._shards)

    def read(self, site: str, rows: slice | Sequence[int] | np.ndarray | None = None, *, dense: bool = False
             ) -> Shaped[np.ndarray, "rows *row"] | SparseRows:
        """``site``'s values at ``rows`` (a slice, integer indices in any order, or None for every row) as one
        array ``[len(rows), …]``; also ``document``, ``position``, ``token``. A sparse site gives ``SparseRows``
        (its stored form), or the dense array with ``dense=True``."""
        self._site(site)
        if site in self.sparse:
            part = self._read_sparse(site, rows)
            return part.dense() if dense else part
        if rows is None or isinstance(rows, slice):
            start, stop, step = (rows or slice(None)).indices(len(self))
            if step == 1:
                parts = []
                for i, shard in enumerate(self._shards):
                    lo, hi = max(start, self._starts[i]), min(stop, self._starts[i + 1])
                    if lo < hi:
                        parts.append(shard[site][lo - self._starts[i]:hi - self._starts[i]])
                if parts:
                    return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])
                return np.zeros((0,) + tuple(self.shape(site)[1:]), self._dtype(site))
            rows = np.arange(start, stop, step)
        rows = np.asarray(rows, np.int64)
        if rows.size and (rows.min() < -len(self) or rows.max() >= len(self)):
            raise IndexError(f"row index out of range for a dataset of {len(self)} rows")
        rows = rows % max(len(self), 1)
        out = np.empty((len(rows),) + tuple(self.shape(site)[1:]), self._dtype(site))
        shard_of = np.searchsorted(self._starts, rows, side="right") - 1
        for i in np.unique(shard_of):
            at = np.nonzero(shard_of == i)[0]
            local = rows[at] - self._starts[i]
            order = np.argsort(local, kind="stable")  # read each shard front to back
            out[at[order]] = self._shards[i][site][local[order]]
        return out

    def _row_indices(self, rows) -> np.ndarray:
        if rows is None or isinstance(rows, slice):
            return np.arange(*(rows or slice(None)).indices(len(self)))
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.size and (rows.min() < -len(self) or rows.max() >= len(self)):
            raise IndexError(f"row index out of range for a dataset of {len(self)} rows")
        return rows % max(len(self), 1)

    def _vector_offsets(self, i: int, site: str) -> np.ndarray:
        """Shard ``i``'s offsets of ``site``'s vectors (computed once; checked against the shard's ``nnz``)."""
        if (i, site) not in self._offsets:
            counts = self._shards[i][f"{site}.counts"]
            offsets = np.concatenate([[0], np.cumsum(np.asarray(counts).reshape(-1), dtype=np.int64)])
            if offsets[-1] != len(self._shards[i][f"{site}.indices"]):
                entry = self.index["shards"][i]
                raise ValueError(f"shard {entry['file']} of the collection in {self.folder}: the counts of {site!r} "
                                 f"add up to {offsets[-1]} entries, but it holds "
                                 f"{len(self._shards[i][f'{site}.indices'])}; the collection is damaged: collect it "
                                 "again into a new folder (or delete this one)")
            self._offsets[(i, site)] = offsets
        return self._offsets[(i, site)]

    def _read_sparse(self, site: str, rows) -> SparseRows:
        rows = self._row_indices(rows)
        shape = tuple(self._site(site)["shape"])
        per_row = int(np.prod(shape[:-1], dtype=np.int64))  # vectors a row holds
        counts = np.empty((len(rows),) + shape[:-1], np.int32)
        starts = np.empty(len(rows), np.int64)  # each row's first entry in its shard
        shard_of = np.searchsorted(self._starts, rows, side="right") - 1
        for i in np.unique(shard_of):
            at = np.nonzero(shard_of == i)[0]
            local = rows[at] - self._starts[i]
            order = np.argsort(local, kind="stable")
            counts[at[order]] = self._shards[i][f"{site}.counts"][local[order]]
            starts[at] = self._vector_offsets(i, site)[local * per_row]
        lengths = counts.reshape(len(rows), -1).sum(1, dtype=np.int64)
        out_start = np.concatenate([[0], np.cumsum(lengths)])
        indices = np.empty(int(out_start[-1]), np.int32)
        values = np.empty(int(out_start[-1]), self._dtype(site))
        for i in np.unique(shard_of):
            at = np.nonzero(shard_of == i)[0]
            n = lengths[at]
            run = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # 0, 1, … within each row
            src, dst = np.repeat(starts[at], n) + run, np.repeat(out_start[at], n) + run
            order = np.argsort(src, kind="stable")  # read each shard front to back
            indices[dst[order]] = self._shards[i][f"{site}.indices"][src[order]]
            values[dst[order]] = self._shards[i][f"{site}.values"][src[order]]
        return SparseRows(counts, indices, values, int(shape[-1]))

    def _dtype(self, site: str):
        if site in ROW_MAP:
            return ROW_MAP[site]
        return np.dtype(DTYPES[self.index["sites"][site]["dtype"]])

    def batches(self, batch_size: int, *, sites: Sequence[str] | None = None, key: jax.Array | None = None,
                drop_last: bool = False, row_map: bool = False, dense: bool = False
                ) -> Iterator[dict[str, np.ndarray | SparseRows]]:
        """Batches of ``batch_size`` rows: dicts ``site -> [batch, …]`` numpy arrays for ``sites`` (default: every
        site; a sparse site as ``SparseRows``, or dense with ``dense=True``), with ``document``, ``position`` and
        ``token`` too when ``row_map``. In row order, or in the order of ``jax.random.permutation(key,
        len(self))`` when ``key`` is given; the last, smaller batch is kept unless ``drop_last``. Each batch reads
        only its own rows from the shards."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        names = tuple(self.sites if sites is None else sites) + (tuple(ROW_MAP) if row_map else ())
        n = len(self)
        for s in names:
            self._site(s, shaped=n > 0)  # no complete shard yet: no rows, no batches
        order = None if key is None else np.asarray(jax.random.permutation(key, n))
        stop = n - n % batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            rows = slice(start, min(start + batch_size, n)) if order is None else order[start:start + batch_size]
            yield {s: self.read(s, rows, dense=dense) for s in names}


def _checked_shard(folder: Path, entry: dict, sites: Sequence[str], sparse: Sequence[str] = ()
                   ) -> dict[str, np.ndarray]:
    """The shard ``entry`` of ``index.json`` memory-mapped, checked to hold every site (a sparse one's counts with
    the rows, its indices and values with the ``nnz`` the index lists) and the row map with the rows the index
    lists. ValueError naming the shard when its header is corrupted, a tensor is missing or its rows differ (a
    shard replaced or cut short: never read silently short)."""
    path = folder / entry["file"]
    fix = "the collection is damaged: collect it again into a new folder (or delete this one)"
    try:
        tensors = memmap_shard(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"shard {entry['file']} of the collection in {folder} cannot be read ({e}); {fix}") from None
    dense = [s for s in sites if s not in sparse]
    counted = {f"{s}.counts": entry["rows"] for s in sparse}
    listed = {f"{s}.{part}": entry.get("nnz", {}).get(s) for s in sparse for part in ("indices", "values")}
    for name, want in [*((n, entry["rows"]) for n in (*dense, *ROW_MAP)), *counted.items(), *listed.items()]:
        if name not in tensors:
            raise ValueError(f"shard {entry['file']} of the collection in {folder} holds no {name!r} tensor; {fix}")
        rows = tensors[name].shape[0] if tensors[name].ndim else None
        if rows != want:
            what = "entries" if name in listed else "rows"
            raise ValueError(f"shard {entry['file']} of the collection in {folder} holds {rows} {what} of {name!r}, "
                             f"but {INDEX} lists {want}; {fix}")
    return tensors


def bfloat16_safe(dtype) -> np.dtype:
    """``dtype`` as numpy knows it (``bfloat16`` through ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if str(dtype) == "bfloat16" else np.dtype(dtype)
