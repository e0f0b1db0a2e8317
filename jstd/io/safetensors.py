"""A streaming safetensors reader: each tensor read once, into the buffer the caller gives.

Every file's header is parsed and checked against the file's size up front, so
a truncated download, a corrupted header, a git-lfs pointer or a GGUF file in
place of the weights fails before anything is read, naming the file. Tensors
are read with ``readinto`` into the caller's buffer (no memory map, so the file
never becomes a second resident copy of the weights).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
LFS_POINTER = b"version https://git-lfs"
GGUF_MAGIC = b"GGUF"
MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header
CONVERT = ("convert it once with transformers: AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(DST) "
           "(or the model's own class; transformers 5 writes safetensors, 4.x needs safe_serialization=True), "
           "then jstd.load(DST)")


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
    """All the tensors of a checkpoint folder (one file, or shards with an index).

    Raises CheckpointError naming the file for a missing shard, a truncated file, a corrupted header, a git-lfs
    pointer, a GGUF file or a folder holding no safetensors at all (with what to do).
    """

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
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
            if end - start != math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize:
                raise corrupted(f"tensor {key!r} spans {end - start} bytes, but {dtype} {list(shape)} needs "
                                f"{math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize}")
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

    def read_into(self, key: str, out: np.ndarray) -> None:
        """Read the bytes of tensor ``key`` into ``out``, a writable C-contiguous array of exactly its size (in
        bytes: the caller chooses the view)."""
        f, dtype, shape, start = self.entries[key]
        need = math.prod(shape) * self.dtype(key).itemsize
        if not out.flags.c_contiguous or not out.flags.writeable or out.nbytes != need:
            raise ValueError(f"read_into: {key!r} needs a writable C-contiguous buffer of {need} bytes, got "
                             f"{out.nbytes} bytes (contiguous: {out.flags.c_contiguous})")
        view = memoryview(out.reshape(-1).view(np.uint8))
        with open(self.folder / f, "rb") as fh:
            fh.seek(start)
            got = fh.readinto(view)
        if got != view.nbytes:
            raise CheckpointError(f"{f} is truncated at tensor {key!r}; download it again")
