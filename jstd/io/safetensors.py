"""The safetensors format, streamed both ways: the package's one reader (``SafetensorsFiles``) and one writer
(``Writer``, and ``write_tensors`` for a single open file).

Reading: every file's header is parsed and checked against the file's size up
front, so a truncated download, a corrupted header, a git-lfs pointer or a GGUF
file in place of the weights fails before anything is read, naming the file.
Tensors are read with ``readinto`` into the caller's buffer, or mapped from the
file's pages (``SafetensorsFiles.mapped``): never a second resident copy.

Writing: tensor by tensor, in a planned order, each tensor's data optionally
starting at an aligned file offset (filler ``U8`` tensors named ``PADDING`` + a
number fill the gaps, so the files stay valid safetensors), so that a reader
can map it in place.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}  # numpy dtype -> its safetensors name (DTYPES inverted)
SHARD_BYTES = 2 << 30  # the largest shard ``Writer`` writes (a single larger tensor gets its own)
PADDING = "__jstd_padding__."  # the filler tensors ``Writer`` aligns tensors with
LFS_POINTER = b"version https://git-lfs"
GGUF_MAGIC = b"GGUF"
MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header
CONVERT = ("convert it once with transformers: AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(DST) "
           "(or the model's own class; transformers 5 writes safetensors, 4.x needs safe_serialization=True), "
           "then jstd.load(DST)")


def as_bytes(array: np.ndarray) -> memoryview:
    """``array``'s bytes in C order, flat (a view, no copy, of a C-contiguous array)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def nbytes(shape, dtype) -> int:
    """The bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * np.dtype(dtype).itemsize


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: missing, truncated, corrupted, extra or misshapen tensors, or
    weights in a format jstd does not read."""


def gguf_message(path: Path) -> str:
    """What to do with a GGUF file (jstd reads safetensors)."""
    return (f"{path} is a GGUF file; jstd reads safetensors checkpoints (a folder with config.json and "
            f"*.safetensors). Convert it once with transformers (needs the gguf package): "
            f"AutoModelForCausalLM.from_pretrained({str(path.parent)!r}, gguf_file={path.name!r}).save_pretrained(DST), "
            "then jstd.load(DST)")


def no_weights_message(folder: Path) -> str:
    """Why ``folder`` has no safetensors weights and how to get them (GGUF and PyTorch pickles named)."""
    gguf = sorted(folder.glob("*.gguf"))
    if gguf:
        return gguf_message(gguf[0])
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        return (f"{folder} holds {', '.join(pickles)} (PyTorch pickles) and no *.safetensors file; jstd reads "
                f"safetensors only: {CONVERT}")
    return (f"no *.safetensors file in {folder}; jstd reads safetensors checkpoints (a repo id downloads only "
            f"*.safetensors weights: if the repo has only pytorch_model.bin, {CONVERT})")


class SafetensorsFiles:
    """All the tensors of a checkpoint folder (one file, or shards with an index), or of the one safetensors file
    ``folder`` names; ``Writer``'s filler tensors (``PADDING``) are not listed.

    Raises CheckpointError naming the file for a missing shard, a truncated file, a corrupted header, a git-lfs
    pointer, a GGUF file or a folder holding no safetensors at all (with what to do).
    """

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if folder.is_file():
            folder, weight_map, files = folder.parent, None, [folder.name]
        elif index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a safetensors index ({type(e).__name__}: {e}); download it "
                                      "again") from None
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (folder / f).exists():
                    raise CheckpointError(f"{index.name} names {f}, which is not in {folder}; the download is incomplete")
        else:
            weight_map = None
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(no_weights_message(folder))
        self.folder = folder
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
        for f in files:
            for key, (dtype, shape, start) in self._header(folder / f).items():
                if key.startswith(PADDING):  # a Writer's filler, not a tensor (each shard numbers its own from 0)
                    continue
                if key in self.entries:
                    raise CheckpointError(f"tensor {key!r} is in both {self.entries[key][0]} and {f}")
                self.entries[key] = (f, dtype, shape, start)
        if weight_map is not None:
            for key, f in weight_map.items():
                if key not in self.entries or self.entries[key][0] != f:
                    raise CheckpointError(f"{index.name} says {key!r} is in {f}, but {f} does not hold it")

    @staticmethod
    def _header(path: Path) -> dict:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(64)
            if head.startswith(LFS_POINTER):
                raise CheckpointError(
                    f"{path.name} is a git-lfs pointer file ({size} bytes), not the weights: the repository was "
                    f"cloned without its large files; run `git lfs pull` in {path.parent} (or download the "
                    "checkpoint with huggingface_hub)")
            if head.startswith(GGUF_MAGIC):
                raise CheckpointError(gguf_message(path))
            if len(head) < 8:
                raise CheckpointError(f"{path.name} is truncated: {size} bytes, not even a safetensors header")
            n = int.from_bytes(head[:8], "little")
            if n > MAX_HEADER:
                raise CheckpointError(f"{path.name} is not a safetensors file or its header is corrupted: its first 8 "
                                      f"bytes give a header of {n} bytes (the file has {size}); download it again")
            if 8 + n > size:
                raise CheckpointError(f"{path.name} is truncated: its header needs {8 + n} bytes, the file has {size}")
            fh.seek(8)
            raw = fh.read(n)
        corrupted = lambda why: CheckpointError(f"{path.name}: its safetensors header is corrupted ({why}); download "
                                                "the file again")
        try:
            header = json.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise corrupted(f"not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise corrupted(f"a JSON {type(header).__name__}, not an object")
        header.pop("__metadata__", None)
        out = {}
        for key, info in header.items():
            try:
                dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
                valid = all(isinstance(d, int) and d >= 0 for d in (*shape, start, end)) and start <= end
            except (TypeError, KeyError, ValueError):
                valid = False
            if not valid:
                raise corrupted(f"tensor {key!r} has entry {info!r}")
            if dtype not in DTYPES:
                raise CheckpointError(f"{path.name}: tensor {key!r} has unsupported dtype {dtype}")
            if end - start != nbytes(shape, DTYPES[dtype]):
                raise corrupted(f"tensor {key!r} spans {end - start} bytes, but {dtype} {list(shape)} needs "
                                f"{nbytes(shape, DTYPES[dtype])}")
            if 8 + n + end > size:
                raise CheckpointError(
                    f"{path.name} is truncated: tensor {key!r} ends at byte {8 + n + end}, the file has {size}; "
                    "download it again"
                )
            out[key] = (dtype, shape, 8 + n + start)
        return out

    def keys(self) -> set[str]:
        return set(self.entries)

    def where(self, key: str) -> str:
        return self.entries[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][2]

    def dtype(self, key: str) -> np.dtype:
        """The numpy dtype ``key`` is stored in."""
        return np.dtype(DTYPES[self.entries[key][1]])

    def read_into(self, key: str, out: np.ndarray, offset: int | None = None) -> None:
        """Read the bytes of tensor ``key`` into ``out``, a writable C-contiguous array of exactly its size (in
        bytes: the caller chooses the view); with ``offset``, the ``out.nbytes`` bytes of the tensor from byte
        ``offset`` on (a part of it). ValueError for a buffer that is not writable and contiguous, of another size
        or (with ``offset``) reaching beyond the tensor."""
        need = nbytes(self.shape(key), self.dtype(key)) - (offset or 0)
        if not out.flags.c_contiguous or not out.flags.writeable or out.nbytes != need and not (
                offset is not None and offset >= 0 and 0 < out.nbytes <= need):
            raise ValueError(f"read_into: {key!r} needs a writable C-contiguous buffer of {need} bytes, got "
                             f"{out.nbytes} bytes (contiguous: {out.flags.c_contiguous})")
        self.read_range(key, offset or 0, out)

    def open(self, key: str):
        """The file holding ``key``, open for reading (binary): hand it to ``read_range`` for many ranges."""
        return open(self.folder / self.entries[key][0], "rb")

    def read_range(self, key: str, start: int, out: np.ndarray, fh=None) -> None:
        """Bytes ``[start, start + out.nbytes)`` of tensor ``key``'s data into ``out`` (writable, C-contiguous):
        every read of a tensor's bytes goes through here. ``fh``: its file open (``open``), else opened here.
        ValueError for a range outside the tensor; CheckpointError for a file cut short."""
        f, _, shape, offset = self.entries[key]
        size = nbytes(shape, self.dtype(key))
        if not out.flags.c_contiguous or not out.flags.writeable or start < 0 or start + out.nbytes > size:
            raise ValueError(f"read_range: bytes [{start}, {start + out.nbytes}) of {key!r} ({size} bytes) need a "
                             "range inside the tensor and a writable C-contiguous buffer")
        view = as_bytes(out)
        if fh is None:
            with self.open(key) as fh:
                fh.seek(offset + start)
                got = fh.readinto(view)
        else:
            fh.seek(offset + start)
            got = fh.readinto(view)
        if got != view.nbytes:
            raise CheckpointError(f"{f} is truncated at tensor {key!r}; download it again")

    def plan(self, keys) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """``[(key, shape, dtype)]`` of ``keys`` as stored: the ``Writer`` plan that copies them."""
        return [(k, self.shape(k), self.dtype(k)) for k in keys]

    def mapped(self, key: str, *, lazy: bool = False) -> np.ndarray | None:
        """Tensor ``key`` as an array over its file's pages (the page cache's: never a second copy).

        Default (a model's parameter): mapped copy-on-write, every page mapped at once (read-only until written:
        a computation that donates the buffer writes into private copies, never the file), where its data starts
        on a page boundary (``Writer(align=...)`` aligns it); None elsewhere, for an empty tensor and where the
        platform has no private mappings (read it into a buffer then). The CPU device adopts the mapping without
        a copy, so arrays made from it share the file's cached pages: replacing the file (renaming another over
        it) is safe, writing into it in place while they live is not (as with any memory-mapped load).

        ``lazy`` (a dataset's rows): read-only, each page read when first touched, at any offset; never None (an
        empty tensor is a new empty array).

        Raises CheckpointError when the file has been cut short since its header was read.
        """
        name, _, shape, start = self.entries[key]
        dtype = self.dtype(key)
        n = nbytes(shape, dtype)
        flags = getattr(mmap, "MAP_PRIVATE", None)
        if lazy and n == 0:
            return np.zeros(shape, dtype)
        if not lazy and (flags is None or n == 0 or start % mmap.ALLOCATIONGRANULARITY or start % mmap.PAGESIZE):
            return None
        skip = start % mmap.ALLOCATIONGRANULARITY  # 0 unless lazy: a mapping starts on a granule
        with open(self.folder / name, "rb") as fh:
            if start + n > os.fstat(fh.fileno()).st_size:
                raise CheckpointError(f"{name} is truncated at tensor {key!r}; convert the checkpoint again")
            if lazy:
                pages = mmap.mmap(fh.fileno(), skip + n, access=mmap.ACCESS_READ, offset=start - skip)
            else:
                pages = mmap.mmap(fh.fileno(), n, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        if not lazy:
            _populate(pages)
        return np.frombuffer(pages, dtype, math.prod(shape), skip).reshape(shape)


def _populate(pages: mmap.mmap) -> None:
    """Every page of ``pages`` mapped now, read-only until written (Linux 5.14+; else only read ahead)."""
    try:
        pages.madvise(getattr(mmap, "MADV_POPULATE_READ", 22) if sys.platform.startswith("linux") else -1)
    except (OSError, ValueError, AttributeError):
        if hasattr(mmap, "MADV_WILLNEED"):
            pages.madvise(mmap.MADV_WILLNEED)


# ---- writing --------------------------------------------------------------------------------------------------------

def write_array(fh, array: np.ndarray) -> None:
    """``array``'s bytes (C order) to the open binary file ``fh``, without copying a contiguous array: every tensor
    a ``Writer`` writes goes through here."""
    fh.write(as_bytes(array))


class _File:
    """One safetensors file written into the open binary file ``fh``: its header at once, for ``entries``
    (``[(name, shape, numpy dtype)]``), then each tensor's data by ``write``, in that order."""

    def __init__(self, fh, entries, metadata: dict[str, str] | None, align: int):
        self.fh, self.entries, self.padding, self.done = fh, entries, {}, 0
        header, start = ({"__metadata__": metadata} if metadata else {}), 0
        for key, shape, dtype in entries:
            if align and start % align:  # a filler tensor, so that the format's data has no holes
                pad = -start % align
                header[f"{PADDING}{len(self.padding)}"] = {"dtype": "U8", "shape": [pad],
                                                           "data_offsets": [start, start + pad]}
                self.padding[key] = pad
                start += pad
            n = nbytes(shape, dtype)
            header[key] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [start, start + n]}
            start += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % (align or 8))  # the data starts on an aligned offset too
        fh.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, array: np.ndarray) -> None:
        key = self.entries[self.done][0]
        if self.padding.get(key):
            self.fh.write(bytes(self.padding[key]))
        write_array(self.fh, array)
        self.done += 1


def _entry(name: str, shape, dtype) -> tuple[str, tuple[int, ...], np.dtype]:
    """A plan entry checked: TypeError for a dtype safetensors has no name for."""
    dtype = np.dtype(dtype)
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"{name}: dtype {dtype} has no safetensors name")
    return name, tuple(int(n) for n in shape), dtype


def write_tensors(fh, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """``tensors`` as one safetensors file into the open binary file ``fh`` (8-byte aligned, ``metadata`` as its
    ``__metadata__`` when given). Raises TypeError, before writing anything, for a dtype safetensors has no name
    for."""
    out = _File(fh, [_entry(k, a.shape, a.dtype) for k, a in tensors.items()], metadata, 0)
    for a in tensors.values():
        out.write(a)


class Writer:
    """Safetensors shards written into ``folder`` tensor by tensor, in the order planned, holding one tensor at a
    time: ``plan`` is ``[(name, shape, dtype)]``; ``write(name, array)`` takes them in that order (RuntimeError
    for another); ``close()`` ends the last shard and writes the index (RuntimeError if a planned tensor is
    unwritten).

    The files are ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json`` when the plan exceeds ``shard_bytes`` (a shard holds consecutive tensors up
    to that size; a larger tensor gets its own). ``align``: each tensor's data starts at a file offset that is a
    multiple of it (``PADDING`` filler tensors between them), so that ``SafetensorsFiles.mapped`` maps it.
    ``metadata``: every file's ``__metadata__``. ``count`` and ``total``: the tensors and bytes planned. TypeError,
    before writing anything, for a dtype safetensors has no name for.
    """

    def __init__(self, folder: Path, plan, metadata: dict[str, str], shard_bytes: int = SHARD_BYTES, align: int = 0):
        self.folder, self.metadata, self.align = Path(folder), metadata, align
        self.shards: list[list] = [[]]
        size = 0
        for name, shape, dtype in plan:
            n = nbytes(shape, dtype)
            if self.shards[-1] and size + n > shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(_entry(name, shape, dtype))
            size += n
        count = len(self.shards)
        self.names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                                for i in range(count)]
        self.queue = [(f, entry) for f, shard in zip(self.names, self.shards) for entry in shard]
        self.count, self.total = len(self.queue), sum(nbytes(s, d) for _, (_, s, d) in self.queue)
        self.fh, self.file, self.current, self.done = None, None, None, 0

    def _open(self, name: str) -> None:
        if self.fh is not None:
            self.fh.close()
        self.fh = open(self.folder / name, "wb")
        self.file = _File(self.fh, self.shards[self.names.index(name)], self.metadata, self.align)
        self.current = name

    def write(self, name: str, array: np.ndarray) -> None:
        f, (key, shape, dtype) = self.queue[self.done]
        if key != name or array.shape != shape or array.dtype != dtype:
            raise RuntimeError(f"writer expected {key} {shape} {dtype}, got {name} {array.shape} {array.dtype}")
        if f != self.current:
            self._open(f)
        self.file.write(array)
        self.done += 1

    def copy(self, files: SafetensorsFiles, keys) -> None:
        """The tensors ``keys`` of ``files`` written as stored, one at a time (next in the plan, in that order)."""
        for k in keys:
            buf = np.empty(files.shape(k), files.dtype(k))
            files.read_into(k, buf)
            self.write(k, buf)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        if self.done != len(self.queue):
            raise RuntimeError(f"writer closed after {self.done} of {len(self.queue)} tensors")
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: f for f, sh in zip(self.names, self.shards) for k, _, _ in sh}}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
