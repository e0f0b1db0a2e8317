"""The converted checkpoint layout: ``jstd convert`` writes a stacked jstd checkpoint from a HuggingFace folder
(``convert``), ``jstd.load`` reads it back (``load_converted``).

The layout (format ``jstd-stacked``, version 1) is a folder holding:

- ``jstd.json``, the marker: format, version, family, model_type, the parameters' dtype, the model's structure
  (its static fields and each parameter's shape, as plain JSON, ``jstd/io/structure.py``: no code is ever loaded
  from it) and the names and shapes of the HuggingFace tensors it came from (what ``export`` writes back);
- safetensors shards (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with
  ``model.safetensors.index.json``) holding jstd's stacked parameter arrays, each keyed by its tree path
  (``layers.blocks.0.self_attn.q``) and stored in exactly the layout and dtype of the loaded parameter, so
  loading is one read per parameter straight into its page-aligned buffer, with no transform;
- ``config.json`` and the tokenizer / processor files, copied from the source unchanged;
- ``hf-ignored/model.safetensors``, where the source has tensors the family knowingly does not read (a tower's
  pooling head, multi-token-prediction layers): those tensors as stored, so that ``export`` writes them back.

Each tensor's data starts at a file offset that is a multiple of 64 KiB (filler ``U8`` tensors named
``__jstd_padding__.N`` fill the gaps, so the files stay valid safetensors): the reader maps each parameter from
its file in place.

``convert`` reads its source without writing to it, and writes its destination into a temporary sibling folder
that is renamed into place when complete (``jstd/io/staging.py``): an interrupted run leaves nothing at the
destination (only a hidden ``.NAME.partial-PID`` folder, with no marker, which nothing loads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from jaxtyping import Array

from jstd.families import family_for
from jstd.io.buffers import Scratch, aligned_buffer, fill_entry, fill_part, sliced_shape
from jstd.io.hf import hf_config, param_dtype, plan, supported_dtypes
from jstd.io.hub import resolve
from jstd.io.safetensors import SHARD_BYTES, CheckpointError, SafetensorsFiles, Writer
from jstd.io.source import Source, hf_source, with_source
from jstd.core.progress import Progress
from jstd.io.staging import Staging, check_destination
from jstd.io.structure import decode_structure, encode_structure
from jstd.nn.namemap import Entry, leaf_paths
from jstd.sharding import placer

FORMAT = "jstd-stacked"
VERSION = 1
MARKER = "jstd.json"
ALIGN = 1 << 16  # the converted layout's tensors start at file offsets that are multiples of any page size
IGNORED = "hf-ignored"  # the subfolder holding the source's tensors jstd does not read, as stored (for export)
# files of a checkpoint folder that are weights, never copied to the destination
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".safetensors.index.json",
           ".bin.index.json")


def copy_side_files(src: Path, dst: Path) -> None:
    """The tokenizer / processor / generation files of ``src`` (every top-level file but weights, config.json and
    the converted layout's marker) copied into ``dst``."""
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(WEIGHTS) \
                and p.name not in ("config.json", MARKER):
            shutil.copyfile(p, dst / p.name)


# ---- HF -> jstd -----------------------------------------------------------------------------------------------------

def convert(src, dst, *, dtype=None, force: bool = False, progress: bool = True,
            shard_bytes: int = SHARD_BYTES) -> Path:
    """Convert the HuggingFace checkpoint ``src`` (folder or hub repo id) into a stacked jstd checkpoint at ``dst``
    (see the module docstring for the layout); returns ``dst``.

    Streamed parameter by parameter: peak memory is one stacked parameter (all blocks of one weight), never the
    model. ``dtype``: the stored dtype, as ``jstd.load``'s (None: what ``jstd.load(src)`` would give); the
    converted checkpoint then loads to exactly ``jstd.load(src, dtype=dtype)``, bit for bit. ``progress``: one
    stderr line per parameter. Written into a temporary sibling folder renamed to ``dst`` when complete.

    Raises ValueError when ``dst`` is ``src``, inside it or contains it, or is a non-empty folder and ``force``
    is False (with ``force`` the old ``dst`` is replaced only once the new one is complete), and whatever
    ``jstd.load(src)`` raises for the source (CheckpointError naming the file, ValueError for an unsupported
    model or dtype).
    """
    folder = resolve(src)
    if is_converted(folder):
        raise ValueError(f"jstd convert: {folder} is already a converted jstd checkpoint ({MARKER}); jstd.load reads "
                         "it as it is, and jstd export MODEL DST writes it back as a HuggingFace folder")
    dst = check_destination(folder, Path(dst), force, "convert")
    hf, family, dtype, files, skeleton, entries = plan(folder, dtype)
    entries = {e.path: e for e in entries}
    leaves = leaf_paths(skeleton)
    unmapped = [p for p, _ in leaves if p not in entries]
    if unmapped:
        raise RuntimeError(f"{family.family} name map leaves parameters unfilled: {unmapped}")
    source = hf_source(folder, files, entries.values())
    meta = {"format": FORMAT, "version": VERSION, "family": family.family, "model_type": hf.model_type,
            "dtype": np.dtype(dtype).name, "structure": encode_structure(skeleton), "source": source.tensors,
            "ignored": source.ignored}
    scratch = Scratch()
    staging = Staging(dst)
    with staging as tmp:
        writer = Writer(tmp, [(p, leaf.shape, leaf.dtype) for p, leaf in leaves], {"format": FORMAT}, shard_bytes,
                        align=ALIGN)
        bar = Progress(f"jstd convert {folder.name}", writer.total, writer.count, progress)
        for path, leaf in leaves:
            buf = np.empty(leaf.shape, leaf.dtype)
            fill_entry(files, entries[path], buf, scratch)
            writer.write(path, buf)
            bar.step(buf.nbytes)
            del buf
        writer.close()
        if source.ignored:  # kept as stored, out of the loader's way, so that export can write them back
            _copy_ignored(files, sorted(source.ignored), tmp / IGNORED)
        copy_side_files(folder, tmp)
        shutil.copyfile(folder / "config.json", tmp / "config.json")
        (tmp / MARKER).write_text(json.dumps(meta, indent=1))  # last: a folder without it is not a checkpoint
        staging.commit()
    return dst


def _copy_ignored(files: SafetensorsFiles, keys: list[str], folder: Path) -> None:
    """The tensors ``keys`` of ``files``, as stored, one at a time, into a new single file in the new ``folder``."""
    folder.mkdir()
    writer = Writer(folder, files.plan(keys), {"format": "pt"}, 1 << 62)
    writer.copy(files, keys)
    writer.close()


# ---- reading the converted layout -----------------------------------------------------------------------------------

def is_converted(folder) -> bool:
    """Whether ``folder`` holds a converted jstd checkpoint (its marker, ``jstd.json``)."""
    return (Path(folder) / MARKER).is_file()


def load_converted(folder, *, dtype=None, mesh=None, rules=None,
                   place: Callable[[str, np.ndarray], Array] | None = None):
    """A converted jstd checkpoint (``convert``'s output) as a jstd model; ``jstd.load`` calls this for a folder
    holding ``jstd.json``.

    ``dtype``: as ``jstd.load``'s (None: the stored dtype where the backend computes in it, else float32).
    ``mesh``, ``rules``: as ``jstd.load``'s, each parameter placed on its shards as it is read
    (``jstd.sharding.placer``). ``place(path, buffer)``, in their stead, puts each finished parameter where it
    belongs. Each parameter is mapped in one piece from its file (page-aligned, in its final layout: no transform,
    no copy; through a scratch buffer only when casting); transformers is not imported.

    Raises CheckpointError naming the file for a marker of another format or a newer version, a corrupted or
    truncated shard, and a missing, extra or misshapen parameter.
    """

    folder = Path(folder)
    meta = _marker(folder)
    stored = np.dtype(meta["dtype"])
    if dtype is None:
        target = stored if stored.name in supported_dtypes() else np.dtype("float32")
    else:
        target = np.dtype(param_dtype(dtype, None))
    retype = lambda name: target if np.dtype(name) == stored else np.dtype(name)
    try:
        skeleton = decode_structure(meta["structure"], retype)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError) as e:
        skeleton = _rebuilt_skeleton(folder, meta, target, e)
    if place is None:
        place = placer(skeleton, mesh, rules)
    files = SafetensorsFiles(folder)
    leaves = leaf_paths(skeleton)
    _check_keys(folder, files, {p for p, _ in leaves})
    scratch = Scratch()
    arrays = [_parts(files, path, leaf, scratch, place) if hasattr(place, "shards")
              else place(path, _parameter(files, path, leaf, scratch)) for path, leaf in leaves]
    model = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(skeleton), arrays)
    return with_source(model, Source((folder / "config.json").read_text(), meta.get("source", {}),
                                     meta.get("ignored", {}), folder / IGNORED))


def _marker(folder: Path) -> dict:
    """The marker of ``folder``, checked to be of this format and of a version this jstd reads."""
    marker = folder / MARKER
    try:
        meta = json.loads(marker.read_text())
        fmt, version = meta["format"], int(meta["version"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker} is not a jstd checkpoint marker ({type(e).__name__}: {e}); convert the "
                              "checkpoint again (jstd convert SRC DST)") from None
    if fmt != FORMAT:
        raise CheckpointError(f"{marker}: format {fmt!r} is not {FORMAT!r}; convert the checkpoint again")
    if version > VERSION:
        raise CheckpointError(f"{marker}: written by a newer jstd (format version {version}; this jstd reads up to "
                              f"{VERSION}); upgrade jstd or convert the checkpoint again with this one")
    return meta


def _check_keys(folder: Path, files: SafetensorsFiles, expected: set[str]) -> None:
    """CheckpointError naming the first parameter the marker describes and the shards lack, or the reverse."""
    missing, extra = sorted(expected - files.keys()), sorted(files.keys() - expected)
    if missing or extra:
        key = (missing or extra)[0]
        where = files.where(key) if key in files.keys() else ", ".join(sorted({files.where(k) for k in files.keys()}))
        what = "missing parameter" if missing else "unexpected tensor"
        raise CheckpointError(f"{folder.name}: {what} {key!r} ({where})"
                              + (f" and {len(missing or extra) - 1} more" if len(missing or extra) > 1 else "")
                              + f"; {MARKER} describes another model: convert the checkpoint again")


def _parts(files: SafetensorsFiles, path: str, leaf, scratch: Scratch, place) -> Array:
    """Parameter ``path`` placed on a mesh part by part (``placer``'s ``shards``): of its stored tensor, each of
    this process's devices' parts reads only the byte ranges it needs (``fill_part``)."""
    _check_stored(files, path, leaf)
    entry = Entry(path, path)

    def part(index: tuple) -> np.ndarray:
        out = np.empty(sliced_shape(leaf.shape, index), np.dtype(leaf.dtype))
        fill_part(files, entry, [path], leaf.shape, index, out, scratch)
        return out

    return place.shards(path, leaf.shape, part)


def _check_stored(files: SafetensorsFiles, path: str, leaf) -> None:
    shape, have = files.shape(path), files.dtype(path)
    if shape != leaf.shape or have.kind != "f" and "float" not in have.name:
        raise CheckpointError(f"parameter {path!r} in {files.where(path)} is {have.name} {list(shape)}; "
                              f"{MARKER} says {list(leaf.shape)} floating: convert the checkpoint again")


def _parameter(files: SafetensorsFiles, path: str, leaf, scratch: Scratch) -> np.ndarray:
    """Parameter ``path`` as a host buffer of ``leaf``'s shape and dtype: mapped from its file where it is stored
    in that dtype and aligned, else read (and cast through ``scratch``) into a page-aligned buffer."""
    _check_stored(files, path, leaf)
    have = files.dtype(path)
    buf = files.mapped(path) if have == leaf.dtype else None
    if buf is not None:
        return buf
    if have == leaf.dtype:
        buf = aligned_buffer(leaf.shape, have)
        files.read_into(path, buf)
        return buf
    buf = aligned_buffer(leaf.shape, np.dtype(leaf.dtype))
    raw = scratch.get(tuple(leaf.shape), have)
    files.read_into(path, raw)
    np.copyto(buf, raw, casting="unsafe")
    return buf


def _rebuilt_skeleton(folder: Path, meta: dict, dtype, why: Exception):
    """The skeleton from config.json through the family (transformers parses it), when this jstd cannot rebuild
    the stored structure (written by another jstd version)."""

    hf = hf_config(folder)
    family = family_for(hf.model_type)
    if family.family != meta.get("family"):
        raise CheckpointError(f"{folder / MARKER}: family {meta.get('family')!r}, but config.json's model_type "
                              f"{hf.model_type!r} is {family.family}'s; convert the checkpoint again") from why
    return family.skeleton(hf, dtype)
