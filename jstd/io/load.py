"""``jstd.load``: a HuggingFace checkpoint as a jstd model, streamed tensor by tensor."""

from __future__ import annotations

import jax
import numpy as np

from jstd.io.buffers import Scratch, aligned_buffer, fill_entry, fill_part, sliced_shape
from jstd.io.hf import plan, with_generation_ids
from jstd.io.hub import resolve
from jstd.io.safetensors import SafetensorsFiles
from jstd.io.source import hf_source, with_source
from jstd.io.stacked import is_converted, load_converted
from jstd.nn.namemap import at_path, leaf_paths, replace_at
from jstd.sharding import placer


def load(path_or_repo_id, *, dtype=None, mesh=None, rules=None):
    """Load a checkpoint (local folder or hub repo id) as a jstd model.

    ``dtype``: the dtype of every parameter, one of ``supported_dtypes()``:
    float32 or bfloat16, float16 off the CPU (the CPU backend cannot run it:
    pass bfloat16 or float32 there), float64 with ``jax_enable_x64``. None
    keeps the dtype the config states where the backend runs it and float32
    otherwise (a float16 checkpoint loads as float32 on the CPU).

    Each tensor is read once from the file straight into its slot of its
    stacked parameter's page-aligned buffer (tensors needing a transpose or a
    cast through a scratch buffer of at most 8 MiB, a part at a time), and the
    CPU device adopts each finished buffer without a copy: peak memory is the
    model plus one scratch buffer (the first load in a process also imports
    transformers' config classes, about 30 MiB, in a private copy that never
    imports torch: ``jstd.io.torchless``). The source is never written. Config keys the family does not read
    but that differ from transformers' defaults are reported in one
    ``ConfigWarning`` (``unhandled``).

    Raises ValueError for an unsupported ``dtype`` or ``model_type`` (listing
    the supported ones), FileNotFoundError for a path that is not a checkpoint,
    and CheckpointError naming the file (and key) for a corrupted, truncated
    or missing file, a git-lfs pointer, GGUF or PyTorch-pickle weights, and a
    missing, extra, misshapen or non-floating tensor.

    ``mesh`` (a ``jax.sharding.Mesh``, e.g. ``jstd.sharding.mesh()``): each
    tensor, once read, goes straight to its shards on the mesh as ``rules``
    (a flax rule list: ``jstd.sharding.FSDP`` by default, ``DP``, ``TP``,
    ``FSDP_TP``) map its logical axes (``jstd.sharding``), and its host buffer
    is freed: host memory peaks at the largest tensor, never the model. The
    model equals ``jstd.shard(jstd.load(path), mesh, rules)``. ValueError for
    ``rules`` without ``mesh``.
    """
    folder = resolve(path_or_repo_id)
    if is_converted(folder):  # a stacked jstd checkpoint (jstd convert): read as stored, no name map, streamed
        return with_generation_ids(load_converted(folder, dtype=dtype, mesh=mesh, rules=rules), folder)
    hf, family, dtype, files, skeleton, entries = plan(folder, dtype)
    scratch = Scratch()
    place = placer(skeleton, mesh, rules)
    leaves = [_read(files, e, at_path(skeleton, e.path), scratch, place) for e in entries]
    model = replace_at(skeleton, [e.path for e in entries], leaves)
    unfilled = [p for p, leaf in leaf_paths(model) if isinstance(leaf, jax.ShapeDtypeStruct)]
    if unfilled:
        raise RuntimeError(f"{family.family} name map leaves parameters unfilled: {unfilled}")
    return with_generation_ids(with_source(model, hf_source(folder, files, entries)), folder)  # source: for export


def _read(files: SafetensorsFiles, entry, leaf: jax.ShapeDtypeStruct, scratch: Scratch, place):
    """One parameter, all its blocks, in one page-aligned buffer, placed by ``place(path, buffer)``
    (``jstd.sharding.placer``: the CPU device adopts it without a copy; a mesh gets its shards)."""
    if hasattr(place, "shards"):  # on a mesh: each device's part, block by block; the host holds one block's tensor
        return _read_parts(files, entry, leaf, scratch, place)
    buf = aligned_buffer(leaf.shape, np.dtype(leaf.dtype))
    fill_entry(files, entry, buf, scratch)
    return place(entry.path, buf)


def _read_parts(files: SafetensorsFiles, entry, leaf: jax.ShapeDtypeStruct, scratch: Scratch, place):
    """One parameter placed part by part (``place.shards``): each of this process's devices' parts read block by
    block, and of each block's tensor only the bytes the part needs (``fill_part``), so a process reads and holds
    only its own parts (on several hosts, each host its devices')."""
    dtype = np.dtype(leaf.dtype)
    shape = leaf.shape[1:] if entry.stacked else leaf.shape

    def part(index: tuple) -> np.ndarray:
        if not entry.stacked:
            out = np.empty(sliced_shape(shape, index), dtype)
            fill_part(files, entry, list(entry.keys), shape, index, out, scratch)
            return out
        rows = entry.blocks[index[0]]
        out = np.empty((len(rows),) + sliced_shape(shape, index[1:]), dtype)
        for row, i in enumerate(rows):
            fill_part(files, entry, [k.format(i=i) for k in entry.keys], shape, index[1:], out[row], scratch)
        return out

    return place.shards(entry.path, leaf.shape, part)

