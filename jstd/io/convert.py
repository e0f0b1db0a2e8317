"""Converting checkpoints: ``jstd convert`` writes a stacked jstd checkpoint from a HuggingFace folder, ``jstd.load``
reads it back (``load_converted``), and ``jstd export`` writes a jstd model (edited or not) as a HuggingFace folder.

The converted layout (format ``jstd-stacked``, version 1) is a folder holding:

- ``jstd.json``, the marker: format, version, family, model_type, the parameters' dtype, the model's structure
  (its static fields and each parameter's shape, as plain JSON: no code is ever loaded from it) and the names and
  shapes of the HuggingFace tensors it came from (what ``export`` writes back);
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

Every function here reads its source without writing to it, and writes its destination into a temporary sibling
folder that is renamed into place when complete: an interrupted run leaves nothing at the destination (only a
hidden ``.NAME.partial-PID`` folder, with no marker, which nothing loads).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import mmap
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from jaxtyping import Array

from jstd.families import family_for
from jstd.io.buffers import Scratch, aligned_buffer, fill_entry
from jstd.io.hf import hf_config, param_dtype, plan, stored_names, supported_dtypes
from jstd.io.hub import resolve
from jstd.io.safetensors import DTYPES, CheckpointError, SafetensorsFiles
from jstd.models.base import with_fields
from jstd.models.namemap import at_path, leaf_paths
from jstd.sharding import placer

FORMAT = "jstd-stacked"
VERSION = 1
MARKER = "jstd.json"
SHARD_BYTES = 2 << 30  # the largest shard convert and export write (a single larger parameter gets its own)
# files of a checkpoint folder that are weights, never copied to the destination
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".safetensors.index.json",
           ".bin.index.json")
SAFETENSORS_NAME = {np.dtype(v).name: k for k, v in DTYPES.items()}
ALIGN = 1 << 16  # the converted layout's tensors start at file offsets that are multiples of any page size
PADDING = "__jstd_padding__."  # the filler tensors that align them
IGNORED = "hf-ignored"  # the subfolder holding the source's tensors jstd does not read, as stored (for export)
# classes the structure of a checkpoint written by an earlier jstd names where they no longer live:
# "module:qualname" as written -> where the class is now (the fields are the same)
MOVED = {
    "jstd.config:ModelConfig": "jstd.core.config:ModelConfig",
    "jstd.config:VisionConfig": "jstd.core.config:VisionConfig",
}


class Source:
    """The HuggingFace layout a model was loaded from: ``config`` (the text of its config.json), ``tensors``
    (stored name -> (shape, dtype name) of every tensor the family's name map reads), ``ignored`` (the same for
    the checkpoint's tensors the family knowingly does not read: a tower's pooling head, multi-token-prediction
    layers) and ``folder`` (where those are stored). Kept on a loaded model as ``model.source`` for ``export``. It
    is metadata: it compares equal to any other ``Source`` and to None and hashes alike, so two models' tree
    structures match whatever checkpoint they came from."""

    __slots__ = ("config", "tensors", "ignored", "folder")

    def __init__(self, config: str, tensors: dict[str, tuple[tuple[int, ...], str]], ignored=None, folder=None):
        shapes = lambda d: {k: (tuple(int(n) for n in shape), str(dtype)) for k, (shape, dtype) in (d or {}).items()}
        self.config, self.tensors, self.ignored = config, shapes(tensors), shapes(ignored)
        self.folder = None if folder is None else str(folder)

    def __eq__(self, other):
        return other is None or isinstance(other, Source)

    def __hash__(self):
        return 0

    def __repr__(self):
        return f"Source(model_type={json.loads(self.config).get('model_type')!r}, {len(self.tensors)} tensors)"


def with_source(model, source: Source | None):
    """``model`` with ``model.source`` set to ``source`` (a shallow copy; the parameters are shared)."""
    return with_fields(model, source=source)


def hf_source(folder: Path, files: SafetensorsFiles, entries) -> Source:
    """The ``Source`` of a HuggingFace folder: its config.json and the stored tensors ``entries`` (the family's
    name map, keys already spelled as stored) read."""
    keys = {k.format(i=i) for e in entries for k in e.keys for i in (e.blocks if e.stacked else [0])}
    layout = lambda names: {k: (files.shape(k), files.dtype(k).name) for k in sorted(names)}
    return Source((Path(folder) / "config.json").read_text(), layout(keys), layout(files.keys() - keys), folder)


# ---- the model's structure as plain JSON ----------------------------------------------------------------------------

def encode_structure(tree) -> object:
    """The static structure of a skeleton (``jax.ShapeDtypeStruct`` leaves) as JSON: jstd dataclasses by class
    name and fields, tuples, dicts, scalars and strings; each parameter as its shape and dtype. TypeError for
    anything else (the converted layout cannot hold it)."""
    if isinstance(tree, jax.ShapeDtypeStruct):
        return {"@leaf": list(tree.shape), "dtype": np.dtype(tree.dtype).name}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, tuple):
        return {"@tuple": [encode_structure(x) for x in tree]}
    if isinstance(tree, list):
        return [encode_structure(x) for x in tree]
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        return {"@dict": {k: encode_structure(v) for k, v in tree.items()}}
    cls = type(tree)
    if dataclasses.is_dataclass(tree) and cls.__module__.split(".")[0] == "jstd" and "<" not in cls.__qualname__:
        return {"@class": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: encode_structure(getattr(tree, f.name)) for f in dataclasses.fields(tree)
                           if f.name != "source"}}
    raise TypeError(f"the converted layout cannot hold a {cls.__module__}.{cls.__qualname__} ({tree!r:.60})")


def decode_structure(data, dtype: Callable[[str], np.dtype] = np.dtype):
    """The skeleton ``encode_structure`` wrote. Only jstd's own dataclasses are built (without running any of
    their code: fields are set one by one); ``dtype(stored name)`` gives each parameter's dtype. ValueError for
    anything this jstd does not know (a class renamed or a field added since the checkpoint was written)."""
    if isinstance(data, list):
        return [decode_structure(x, dtype) for x in data]
    if not isinstance(data, dict):
        return data
    if "@leaf" in data:
        return jax.ShapeDtypeStruct(tuple(data["@leaf"]), dtype(data["dtype"]))
    if "@tuple" in data:
        return tuple(decode_structure(x, dtype) for x in data["@tuple"])
    if "@dict" in data:
        return {k: decode_structure(v, dtype) for k, v in data["@dict"].items()}
    module, _, qualname = MOVED.get(str(data.get("@class", "")), str(data.get("@class", ""))).partition(":")
    if module.split(".")[0] != "jstd" or not qualname:
        raise ValueError(f"not a jstd class: {data.get('@class')!r}")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{module}:{qualname} is not a jstd dataclass")
    fields = {f.name for f in dataclasses.fields(cls)} - {"source"}
    if set(data["fields"]) != fields:
        raise ValueError(f"{qualname} has fields {sorted(fields)}, the checkpoint {sorted(data['fields'])}")
    obj = cls.__new__(cls)
    for name, value in data["fields"].items():
        object.__setattr__(obj, name, decode_structure(value, dtype))
    if "source" in {f.name for f in dataclasses.fields(cls)}:
        object.__setattr__(obj, "source", None)
    return obj


# ---- writing safetensors, streamed ----------------------------------------------------------------------------------

class _Writer:
    """Safetensors shards written tensor by tensor, in the order planned: ``plan`` is ``[(name, shape, dtype)]``;
    ``write(name, array)`` takes them in that order. ``align``: each tensor's data starts at a file offset that is
    a multiple of it (filler ``U8`` tensors named ``PADDING`` + a number between them), so that a reader can map it
    in place."""

    def __init__(self, folder: Path, plan, metadata: dict[str, str], shard_bytes: int = SHARD_BYTES, align: int = 0):
        self.folder, self.metadata, self.align, self.padding = folder, metadata, align, {}
        self.shards: list[list] = [[]]
        size = 0
        for name, shape, dtype in plan:
            n = math.prod(shape) * np.dtype(dtype).itemsize
            if self.shards[-1] and size + n > shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, tuple(shape), np.dtype(dtype)))
            size += n
        count = len(self.shards)
        self.names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                                for i in range(count)]
        self.queue = [(f, entry) for f, shard in zip(self.names, self.shards) for entry in shard]
        self.fh, self.current, self.done = None, None, 0

    def _open(self, name: str) -> None:
        if self.fh is not None:
            self.fh.close()
        shard = self.shards[self.names.index(name)]
        header, start = {"__metadata__": self.metadata}, 0
        self.padding = {}
        for key, shape, dtype in shard:
            if self.align and start % self.align:  # a filler tensor, so that the format's data has no holes
                pad = -start % self.align
                header[f"{PADDING}{len(self.padding)}"] = {"dtype": "U8", "shape": [pad],
                                                           "data_offsets": [start, start + pad]}
                self.padding[key] = pad
                start += pad
            n = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": SAFETENSORS_NAME[dtype.name], "shape": list(shape),
                           "data_offsets": [start, start + n]}
            start += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % (self.align or 8))  # the data starts on an aligned offset too
        self.fh = open(self.folder / name, "wb")
        self.fh.write(len(raw).to_bytes(8, "little") + raw)
        self.current = name

    def write(self, name: str, array: np.ndarray) -> None:
        f, (key, shape, dtype) = self.queue[self.done]
        if key != name or array.shape != shape or array.dtype != dtype:
            raise RuntimeError(f"writer expected {key} {shape} {dtype}, got {name} {array.shape} {array.dtype}")
        if f != self.current:
            self._open(f)
        if self.padding.get(key):
            self.fh.write(bytes(self.padding[key]))
        self.fh.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))
        self.done += 1

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        if self.done != len(self.queue):
            raise RuntimeError(f"writer closed after {self.done} of {len(self.queue)} tensors")
        if len(self.names) > 1:
            index = {"metadata": {"total_size": sum(math.prod(s) * d.itemsize for sh in self.shards for _, s, d in sh)},
                     "weight_map": {k: f for f, sh in zip(self.names, self.shards) for k, _, _ in sh}}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


class _Progress:
    """One stderr line rewritten per tensor: ``label: i/n tensors, done/total MB``."""

    def __init__(self, label: str, total_bytes: int, count: int, enabled: bool):
        self.label, self.total, self.count, self.enabled = label, total_bytes, count, enabled
        self.i, self.bytes, self.t0 = 0, 0, time.perf_counter()
        self.shown = -1.0

    def step(self, nbytes: int) -> None:
        self.i += 1
        self.bytes += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self.shown >= 0.2 or self.i == self.count):  # at most 5 lines a second
            self.shown = now
            end = "\n" if self.i == self.count else ""
            print(f"\r{self.label}: {self.i}/{self.count} tensors, {self.bytes / 1e6:.0f}/{self.total / 1e6:.0f} MB, "
                  f"{time.perf_counter() - self.t0:.1f} s", end=end, file=sys.stderr, flush=True)


def _check_destination(src: Path | None, dst: Path, force: bool, what: str) -> Path:
    dst = Path(dst).expanduser().absolute()
    if src is not None:
        s, d = src.resolve(), dst.resolve()
        if d == s or s in d.parents:
            raise ValueError(f"jstd {what}: the destination {dst} is the source folder {src} or inside it; jstd never "
                             "writes into its source: pass a folder outside it")
        if d in s.parents:
            raise ValueError(f"jstd {what}: the destination {dst} contains the source {src}; pass another folder")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"jstd {what}: {dst} exists and is not a folder; pass a new folder")
    if dst.exists() and any(dst.iterdir()) and not force:
        raise ValueError(f"jstd {what}: {dst} exists and is not empty; pass another folder, or force=True "
                         "(--force) to replace it once the new one is complete")
    return dst


class _Staging:
    """A temporary sibling of ``dst`` (``.NAME.partial-PID``), renamed to ``dst`` by ``commit`` (replacing an old
    ``dst``), removed if the work fails or is interrupted."""

    def __init__(self, dst: Path):
        self.dst = dst
        self.tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"

    def __enter__(self) -> Path:
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self.tmp

    def commit(self) -> None:
        old = None
        if self.dst.exists():
            old = self.dst.parent / f".{self.dst.name}.old-{os.getpid()}"
            os.rename(self.dst, old)
        os.rename(self.tmp, self.dst)
        if old is not None:
            shutil.rmtree(old)

    def __exit__(self, kind, value, tb):
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def _copy_side_files(src: Path, dst: Path) -> None:
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
    dst = _check_destination(folder, Path(dst), force, "convert")
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
    layout = [(p, leaf.shape, leaf.dtype) for p, leaf in leaves]
    bar = _Progress(f"jstd convert {folder.name}", sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in layout),
                    len(layout), progress)
    scratch = Scratch()
    staging = _Staging(dst)
    with staging as tmp:
        writer = _Writer(tmp, layout, {"format": FORMAT}, shard_bytes, align=ALIGN)
        for path, leaf in leaves:
            e = entries[path]
            buf = np.empty(leaf.shape, leaf.dtype)
            fill_entry(files, e, buf, scratch)
            writer.write(path, buf)
            bar.step(buf.nbytes)
            del buf
        writer.close()
        if source.ignored:  # kept as stored, out of the loader's way, so that export can write them back
            (tmp / IGNORED).mkdir()
            _copy_tensors(files, sorted(source.ignored), tmp / IGNORED)
        _copy_side_files(folder, tmp)
        shutil.copyfile(folder / "config.json", tmp / "config.json")
        (tmp / MARKER).write_text(json.dumps(meta, indent=1))  # last: a folder without it is not a checkpoint
        staging.commit()
    return dst


def _copy_tensors(files: SafetensorsFiles, keys: list[str], folder: Path, writer: "_Writer | None" = None) -> None:
    """The tensors ``keys`` of ``files``, as stored, one at a time, into ``writer`` (a new single file in
    ``folder`` when None)."""
    own = writer is None
    if own:
        writer = _Writer(folder, [(k, files.shape(k), files.dtype(k)) for k in keys], {"format": "pt"}, 1 << 62)
    for k in keys:
        buf = np.empty(files.shape(k), files.dtype(k))
        files.read_into(k, buf)
        writer.write(k, buf)
    if own:
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
    expected = {p for p, _ in leaves}
    stored_keys = {k for k in files.keys() if not k.startswith(PADDING)}
    missing, extra = sorted(expected - stored_keys), sorted(stored_keys - expected)
    if missing or extra:
        key = (missing or extra)[0]
        where = files.where(key) if key in files.keys() else ", ".join(sorted({files.where(k) for k in files.keys()}))
        what = "missing parameter" if missing else "unexpected tensor"
        raise CheckpointError(f"{folder.name}: {what} {key!r} ({where})"
                              + (f" and {len(missing or extra) - 1} more" if len(missing or extra) > 1 else "")
                              + f"; {MARKER} describes another model: convert the checkpoint again")
    scratch = Scratch()
    arrays = []
    for path, leaf in leaves:
        shape, have = files.shape(path), files.dtype(path)
        if shape != leaf.shape or have.kind != "f" and "float" not in have.name:
            raise CheckpointError(f"parameter {path!r} in {files.where(path)} is {have.name} {list(shape)}; "
                                  f"{MARKER} says {list(leaf.shape)} floating: convert the checkpoint again")
        buf = _mapped(files, path) if have == leaf.dtype else None
        if buf is not None:
            pass
        elif have == leaf.dtype:
            buf = aligned_buffer(leaf.shape, have)
            files.read_into(path, buf)
        else:
            buf = aligned_buffer(leaf.shape, np.dtype(leaf.dtype))
            raw = scratch.get(shape, have)
            files.read_into(path, raw)
            np.copyto(buf, raw, casting="unsafe")
        arrays.append(place(path, buf))
    model = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(skeleton), arrays)
    return with_source(model, Source((folder / "config.json").read_text(), meta.get("source", {}),
                                     meta.get("ignored", {}), folder / IGNORED))


def _mapped(files: SafetensorsFiles, key: str) -> np.ndarray | None:
    """Tensor ``key`` mapped copy-on-write from its file (its pages are the page cache's, mapped at once, never
    copied unless written: a computation that donates the buffer writes into private copies, never the file),
    where its data starts on a page boundary (``convert`` aligns every tensor); None elsewhere (then it is read
    into a buffer). The CPU device adopts the mapping without a copy, so the model's arrays share the file's
    cached pages: replacing the checkpoint (``convert --force`` renames) is safe, writing into its files in place
    while the model lives is not (as with any memory-mapped load)."""
    name, _, shape, start = files.entries[key]
    flags = getattr(mmap, "MAP_PRIVATE", None)
    n = math.prod(shape) * files.dtype(key).itemsize
    if flags is None or n == 0 or start % mmap.ALLOCATIONGRANULARITY or start % mmap.PAGESIZE:
        return None
    with open(files.folder / name, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if start + n > size:
            raise CheckpointError(f"{name} is truncated at tensor {key!r}; convert the checkpoint again")
        mapped = mmap.mmap(fh.fileno(), n, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    try:  # map every page now, read-only until written (Linux 5.14+); a write (a donated buffer) copies the page
        mapped.madvise(getattr(mmap, "MADV_POPULATE_READ", 22) if sys.platform.startswith("linux") else -1)
    except (OSError, ValueError, AttributeError):
        if hasattr(mmap, "MADV_WILLNEED"):
            mapped.madvise(mmap.MADV_WILLNEED)
    return np.frombuffer(mapped, files.dtype(key)).reshape(shape)


def _rebuilt_skeleton(folder: Path, meta: dict, dtype, why: Exception):
    """The skeleton from config.json through the family (transformers parses it), when this jstd cannot rebuild
    the stored structure (written by another jstd version)."""

    hf = hf_config(folder)
    family = family_for(hf.model_type)
    if family.family != meta.get("family"):
        raise CheckpointError(f"{folder / MARKER}: family {meta.get('family')!r}, but config.json's model_type "
                              f"{hf.model_type!r} is {family.family}'s; convert the checkpoint again") from why
    return family.skeleton(hf, dtype)


# ---- jstd -> HF -----------------------------------------------------------------------------------------------------

def _inverse_index(entry, shape: tuple[int, ...], path: str, key: str) -> np.ndarray:
    """Where each element of ``entry``'s parameter comes from in the stored tensor of ``shape`` (flat indices):
    the transform applied to an index array. ValueError when the transform does not move values unchanged (it
    scales or combines them: export would need its explicit inverse)."""
    n = math.prod(shape)
    idx = np.asarray(entry.transform(np.arange(n, dtype=np.int64).reshape(shape)))
    probe = np.random.default_rng(0).standard_normal(n).reshape(shape)
    moved = np.asarray(entry.transform(probe))
    if (idx.dtype.kind != "i" or moved.shape != idx.shape or idx.size and (idx.min() < 0 or idx.max() >= n)
            or not np.array_equal(moved, probe.reshape(-1)[idx])):
        raise ValueError(f"jstd.export: the name map's transform from {key!r} to {path} is not a pure re-layout "
                         "(it changes or combines values), so its inverse is not known; export does not support this "
                         "family yet (add an explicit inverse for that transform in jstd/io/convert.py)")
    return idx


def export(model, dst, *, force: bool = False, files_from=None, progress: bool = False) -> Path:
    """Write ``model`` (loaded with ``jstd.load``, edited or not) as a HuggingFace checkpoint folder at ``dst``
    that transformers loads with the same weights; returns ``dst``.

    Each parameter goes back to the stored tensors it was loaded from, in the model's dtype (config.json's
    ``dtype`` set to it), through the inverse of the family's name map: every name-map transform is a pure
    re-layout (transpose, reshape, split, stack), inverted by applying it to an index array and scattering. Weight
    edits (a head zeroed in ``o``) are written as they are. The checkpoint's tensors the family does not read are
    copied from where the model was loaded (``model.source.folder``; a warning if they are gone). ``files_from``:
    a folder whose tokenizer / processor files are copied too. Written into a temporary sibling folder renamed to
    ``dst`` when complete.

    Raises ValueError when the model carries no ``source`` (it was not loaded from a checkpoint), when ``dst`` is
    a non-empty folder and ``force`` is False, or when a transform is not a pure re-layout.
    """

    source = getattr(model, "source", None)
    if not isinstance(source, Source):
        raise ValueError("jstd.export: this model has no record of the checkpoint layout it came from "
                         "(model.source is None: it was not made by jstd.load); load it with jstd.load, edit it "
                         "with eqx.tree_at (which keeps model.source), then export")
    dst = _check_destination(Path(files_from) if files_from else None, Path(dst), force, "export")
    leaves = jax.tree.leaves(model)
    dtypes = {np.dtype(x.dtype).name for x in leaves}
    config = json.loads(source.config)
    if len(dtypes) == 1:
        _set_dtype(config, dtypes.pop())
    staging = _Staging(dst)
    with staging as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        hf = hf_config(tmp)
        family = family_for(hf.model_type)
        skeleton = family.skeleton(hf, np.float32)
        stored = stored_names(family.stored_prefixes(hf), source.tensors.keys())
        entries = [dataclasses.replace(e, key=stored(e.key) if isinstance(e.key, str) else tuple(map(stored, e.key)))
                   for e in family.name_map(hf, skeleton) if at_path(skeleton, e.path) is not None]
        groups: dict[tuple[str, ...], list] = {}
        for e in entries:
            for row, i in (enumerate(e.blocks) if e.stacked else [(None, 0)]):
                groups.setdefault(tuple(k.format(i=i) for k in e.keys), []).append((e, row))
        unknown = sorted(k for keys in groups for k in keys if k not in source.tensors)
        if unknown:
            raise ValueError(f"jstd.export: model.source does not list {unknown[0]!r}, which the {family.family} name "
                             "map writes; the model's source record is from another model")
        plan = [(k, source.tensors[k][0], _leaf(model, e.path).dtype) for keys, parts in groups.items()
                for k in keys for e, _ in parts[:1]]
        extra = _ignored_files(source)
        plan += [(k, extra.shape(k), extra.dtype(k)) for k in sorted(source.ignored)] if extra else []
        bar = _Progress(f"jstd export {dst.name}", sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in plan),
                        len(plan), progress)
        writer = _Writer(tmp, plan, {"format": "pt"})
        index_cache: dict = {}
        for keys, parts in groups.items():
            shapes = [source.tensors[k][0] for k in keys]
            whole = (sum(s[0] for s in shapes), *shapes[0][1:]) if len(keys) > 1 else shapes[0]
            out = np.empty(whole, _leaf(model, parts[0][0].path).dtype)
            covered = np.zeros(math.prod(whole), bool)
            for e, row in parts:
                cache = (id(e), whole)
                if cache not in index_cache:
                    index_cache[cache] = _inverse_index(e, whole, e.path, " + ".join(keys))
                idx = index_cache[cache]
                value = _leaf(model, e.path)
                value = np.asarray(value if row is None else value[row])  # one block to the host at a time
                if value.shape != idx.shape:
                    raise ValueError(f"jstd.export: {e.path} has shape {value.shape} (row {row}), but {keys[0]!r} "
                                     f"{list(whole)} maps to {idx.shape}")
                out.reshape(-1)[idx.reshape(-1)] = value.reshape(-1)
                covered[idx.reshape(-1)] = True
            if not covered.all():
                raise ValueError(f"jstd.export: {(~covered).sum()} elements of {' + '.join(keys)} come from no "
                                 "parameter (the name map drops them); export cannot rebuild that tensor")
            start = 0
            for k, s in zip(keys, shapes):
                writer.write(k, out[start:start + s[0]] if len(keys) > 1 else out)
                start += s[0]
                bar.step(math.prod(s) * out.dtype.itemsize)
            index_cache = {c: v for c, v in index_cache.items() if c[0] in {id(e) for e, _ in parts}}
        if extra:
            _copy_tensors(extra, sorted(source.ignored), tmp, writer)
        writer.close()
        if files_from:
            _copy_side_files(Path(files_from), tmp)
        staging.commit()
    return dst


def _ignored_files(source: Source) -> SafetensorsFiles | None:
    """The source's tensors the family does not read, where they are still stored as recorded (None when there
    are none; a warning, and None, when they are gone or changed: export then writes the rest)."""
    if not source.ignored:
        return None
    try:
        files = SafetensorsFiles(source.folder)
        if all(k in files.keys() and (files.shape(k), files.dtype(k).name) == v for k, v in source.ignored.items()):
            return files
    except (OSError, ValueError, TypeError):
        pass
    import warnings

    names = ", ".join(sorted(source.ignored)[:3]) + (", ..." if len(source.ignored) > 3 else "")
    warnings.warn(f"jstd.export: {len(source.ignored)} tensors jstd does not read ({names}) are no longer in "
                  f"{source.folder}; the exported folder "
                  "lacks them (transformers initializes them anew)", stacklevel=3)
    return None


def _leaf(model, path: str):
    return at_path(model, path)


def _set_dtype(config: dict, name: str) -> None:
    """``dtype`` set to ``name`` in ``config`` and in every sub-config that states one (``torch_dtype`` dropped)."""
    config.pop("torch_dtype", None)
    config["dtype"] = name
    for value in config.values():
        if isinstance(value, dict) and ("dtype" in value or "torch_dtype" in value or "model_type" in value):
            _set_dtype(value, name)
