"""A streaming safetensors reader: one tensor at a time, straight from the file.

The header of every file is parsed and checked against the file's size up
front, so a truncated download fails before anything is read, naming the file
and the first key past its end. Tensors are read with ``readinto`` into a fresh
buffer (no memory map, so no second resident copy of the file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: missing, truncated, extra or misshapen tensors."""


class SafetensorsFiles:
    """All the tensors of a checkpoint folder (one file, or shards with an index)."""

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (folder / f).exists():
                    raise CheckpointError(f"{index.name} names {f}, which is not in {folder}; the download is incomplete")
        else:
            weight_map = None
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors file in {folder}; jstd loads safetensors checkpoints only")
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
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path.name} is truncated: {size} bytes, not even a safetensors header")
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                raise CheckpointError(f"{path.name} is truncated: its header needs {8 + n} bytes, the file has {size}")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        out = {}
        for key, info in header.items():
            start, end = info["data_offsets"]
            if 8 + n + end > size:
                raise CheckpointError(
                    f"{path.name} is truncated: tensor {key!r} ends at byte {8 + n + end}, the file has {size}; "
                    "download it again"
                )
            if info["dtype"] not in DTYPES:
                raise CheckpointError(f"{path.name}: tensor {key!r} has unsupported dtype {info['dtype']}")
            out[key] = (info["dtype"], tuple(info["shape"]), 8 + n + start)
        return out

    def keys(self) -> set[str]:
        return set(self.entries)

    def where(self, key: str) -> str:
        return self.entries[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][2]

    def read(self, key: str) -> np.ndarray:
        """The tensor ``key`` as a numpy array in its stored dtype."""
        f, dtype, shape, start = self.entries[key]
        out = np.empty(shape, DTYPES[dtype])
        with open(self.folder / f, "rb") as fh:
            fh.seek(start)
            got = fh.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if got != out.nbytes:
            raise CheckpointError(f"{f} is truncated at tensor {key!r}; download it again")
        return out
