"""``jstd.collect`` across processes (``jax.distributed``: a TPU pod slice, several GPU hosts), when the model's
arrays span them.

Every process runs the same ``jstd.collect`` call. The corpus is split into one contiguous share of documents per
process (``share``: shares differ by one document at most); each step, every process feeds one batch of its share
(``batch_size`` rows) and the step runs on the global batch (rows of process 0 first, split over the mesh's
``data`` axis), so each process's devices compute its own rows; each process writes its rows into its own part,
``OUT/part-0000p-of-0000n``, an ordinary collection (written, checked and resumed as one: a process killed mid-run
loses only its shard being filled, and the rerun resumes every part after its last complete shard). The processes
agree each step, through one small all-gather, on the padded length (the longest of their batches: a batch padded
further on the left gives the same values) and on whether anyone still has rows to compute; a process whose share
is done, or whose rows of that batch are on disk already, runs the step on filler rows and keeps nothing.

When every part is complete, process 0 writes ``OUT/index.json``: the parts' shards listed in order (process 0's
documents first), so ``ActivationDataset(OUT)`` reads one dataset, row for row the collection a single process
makes of the whole corpus (documents numbered in the whole corpus).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jstd.collect.batches import Batch, RowsMeta, padded, select_rows
from jstd.collect.dataset import INDEX, read_index, write_json
from jstd.core.checks import spans_processes
from jstd.core.inputs import Inputs
from jstd.nn.params import DATA


def spanned_mesh(model) -> Mesh | None:
    """The mesh of ``model``'s arrays when they span processes (``jax.distributed``); None for a model that one
    process holds whole."""
    for leaf in jax.tree.leaves(model):
        if spans_processes(leaf):
            return leaf.sharding.mesh
    return None


def part_name(process: int, processes: int) -> str:
    return f"part-{process:05d}-of-{processes:05d}"


def share(documents: int, process: int, processes: int) -> tuple[int, int]:
    """``(first, end)``: the documents of ``process``'s share, contiguous, in process order."""
    return documents * process // processes, documents * (process + 1) // processes


def split_corpus(data, process: int, processes: int):
    """``(this process's share of data, its first document)``. ValueError for a corpus that cannot be split without
    reading it all (an iterator, a generator, given batches): pass a list of texts, a ``datasets.Dataset`` or a
    ``jstd.Inputs`` of token ids."""
    if isinstance(data, Inputs):
        lo, hi = share(len(data.tokens), process, processes)
        mask = None if data.attention_mask is None else data.attention_mask[lo:hi]
        return Inputs(data.tokens[lo:hi], mask, data.images, data.layout), lo
    if hasattr(data, "column_names") and hasattr(data, "select"):
        lo, hi = share(len(data), process, processes)
        return data.select(range(lo, hi)), lo
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)) and not (
            len(data) and isinstance(data[0], Inputs)):
        lo, hi = share(len(data), process, processes)
        return data[lo:hi], lo
    raise ValueError(f"jstd.collect across {processes} processes splits the corpus into one share a process: pass "
                     f"a list of texts, a datasets.Dataset or a jstd.Inputs of token ids (got a "
                     f"{type(data).__name__}, which would have to be read whole to be split)")


def check_batch_size(mesh: Mesh, batch_size: int) -> None:
    """ValueError unless each process's ``batch_size`` rows split evenly over its devices on the ``data`` axis."""
    data = dict(zip(mesh.axis_names, mesh.devices.shape)).get(DATA, 1)
    per_process = max(data // jax.process_count(), 1)
    if batch_size % per_process:
        raise ValueError(f"jstd.collect across {jax.process_count()} processes: batch_size={batch_size} rows a "
                         f"process must split evenly over its {per_process} devices on the mesh's data axis; pass a "
                         f"multiple of {per_process}")


def numbered(batches, first: int):
    """``batches`` with their documents numbered in the whole corpus (this share starts at document ``first``)."""
    for b in batches:
        yield b._replace(document=np.where(b.document >= 0, b.document + first, -1), documents=b.documents + first)


def _agreed(values: Sequence[int]) -> np.ndarray:
    """``[processes, len(values)]``: every process's ``values`` (one all-gather)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int64)))


def run_across(model, mesh: Mesh, batches, check, writer, sites: tuple[str, ...], positions, edits: tuple,
               dtype: str | None, batch_size: int, step) -> int:
    """The collection loop of one process (``driver._run_batches`` across processes): every process runs every
    step, on its batch or filler rows, and hands ``writer`` only its own kept rows that are not on disk yet. The
    documents of this share read (numbered in the whole corpus)."""
    from jax.experimental import multihost_utils

    rows_spec = PartitionSpec(DATA)
    reshard = _resharder(NamedSharding(mesh, rows_spec))
    it = iter(batches)
    documents, last = 0, positions == "last"
    while True:
        batch = next(it, None)
        seqs = _agreed([batch is not None, 0 if batch is None else batch.inputs.tokens.shape[1]])
        if not seqs[:, 0].any():
            break
        seq = int(seqs[:, 1].max())
        need, drop = False, None
        if batch is not None:
            documents = batch.documents
            batch = padded(batch, seq)
            take, rows = select_rows(batch, positions)
            drop = check.written(rows.token)
            need = drop is not None and len(rows.token) - drop > 0
        if not _agreed([need])[:, 0].any():
            if batch is not None and drop is not None:
                writer.count(batch)
            continue
        if batch is None:
            batch = filler(batch_size, seq, documents)
        arrays = (batch.inputs.tokens, batch.inputs.attention_mask, batch.last)
        tokens, mask, last_index = multihost_utils.host_local_array_to_global_array(arrays, mesh, rows_spec)
        values = reshard(step(model, Inputs(tokens, mask), edits, last_index if last else None, sites=sites,
                              last=last, dtype=dtype))
        local = multihost_utils.global_array_to_host_local_array(values, mesh, rows_spec)
        if need:
            writer.put((local, take[drop:], RowsMeta(*(a[drop:] for a in rows)), batch))
        elif drop is not None and batch.real.any():
            writer.count(batch)
    check.finish()
    return documents


@functools.lru_cache(maxsize=8)
def _resharder(sharding: NamedSharding):
    return jax.jit(lambda values: values, out_shardings=sharding)


def filler(batch_size: int, seq: int, documents: int) -> Batch:
    """A batch of ``batch_size`` rows that keeps nothing (a share that is done runs the others' steps on it)."""
    tokens = np.zeros((batch_size, seq), np.int32)
    return Batch(Inputs(tokens, np.ones_like(tokens)), np.full(batch_size, -1), np.zeros(batch_size, bool),
                 np.full(batch_size, seq - 1, np.int32), documents)


def merge_parts(out: Path, processes: int) -> None:
    """``out/index.json``: the parts' indices as one collection, their shards in process order (paths inside
    ``out``, first rows counted across parts); complete when every part is."""
    parts = [part_name(p, processes) for p in range(processes)]
    indices = [read_index(out / name) for name in parts]
    if any(i is None for i in indices):
        missing = [n for n, i in zip(parts, indices) if i is None]
        raise RuntimeError(f"jstd.collect: {out} lacks the parts {missing} (a process's folder is not on this disk?): "
                           "every process must write into one shared folder")
    merged = dict(indices[0], shards=[], rows=0, parts=parts, documents=0, truncated_documents=0)
    for name, index in zip(parts, indices):
        for shard in index["shards"]:
            merged["shards"].append(dict(shard, file=f"{name}/{shard['file']}", first_row=merged["rows"]))
            merged["rows"] += shard["rows"]
        merged["documents"] = max(merged["documents"], index.get("documents", 0))
        merged["truncated_documents"] += index.get("truncated_documents", 0)
        for site, entry in index["sites"].items():  # a part with no rows has no shapes
            if merged["sites"][site].get("shape") is None:
                merged["sites"][site] = entry
    merged["complete"] = all(i["complete"] for i in indices)
    merged["settings"] = {k: v for k, v in indices[0]["settings"].items() if k != "share"}
    merged.pop("tokens_sha256", None)
    write_json(out / INDEX, merged)


def check_top(out: Path) -> None:
    """ValueError when ``out`` holds a single-process collection (a collection across processes writes parts)."""
    index = read_index(out) if out.exists() else None
    if index is not None and "parts" not in index:
        raise ValueError(f"jstd.collect: {out} holds a collection made by one process; a collection across "
                         "processes writes one part a process: collect into another folder")
