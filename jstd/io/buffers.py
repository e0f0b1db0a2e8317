"""Host buffers for parameters as they are read: page-aligned (so the CPU device adopts them without a copy), one
reusable scratch buffer for the tensors that need a transform or a cast, and the fill of one name-map entry."""

from __future__ import annotations

import math
import mmap

import numpy as np

from jstd.io.safetensors import CheckpointError, SafetensorsFiles

def aligned_buffer(shape, dtype: np.dtype) -> np.ndarray:
    """An uninitialized page-aligned array (so ``device_put`` can alias it). On Linux its pages are mapped at once
    (``MAP_POPULATE``): faulting them in one by one as they are first written costs several times the copy itself
    (0.4 s against 0.06 s for 100 MB in a VM)."""
    n = math.prod(shape) * dtype.itemsize
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE if hasattr(mmap, "MAP_POPULATE") else None
    if flags is None or n == 0:  # elsewhere: 64-byte aligned inside a numpy allocation
        raw = np.empty(n + 64, np.uint8)
        raw = raw[(-raw.ctypes.data) % 64:][:n]
    else:
        raw = np.frombuffer(mmap.mmap(-1, n, flags=flags), np.uint8)
    return raw.view(dtype).reshape(shape)


class Scratch:
    """One reusable buffer for the tensors that cannot be read straight into their slot."""

    def __init__(self):
        self.raw = np.empty(0, np.uint8)

    def get(self, shape, dtype) -> np.ndarray:
        n = math.prod(shape) * dtype.itemsize
        if self.raw.nbytes < n:
            self.raw = np.empty(n, np.uint8)
        return self.raw[:n].view(dtype).reshape(shape)


def fill(files: SafetensorsFiles, entry, keys: list[str], slot: np.ndarray, scratch: Scratch) -> None:
    """The tensor stored under ``keys`` (parts concatenated along axis 0), transformed, into ``slot``, shape-checked.

    When the transform keeps the stored bytes' order and dtype (the identity, reshapes) the file is read straight
    into ``slot``; otherwise into ``scratch``, then copied once, transformed (and cast), into ``slot``."""
    shapes = [files.shape(k) for k in keys]
    dtypes = {files.dtype(k) for k in keys}
    name = keys[0] if len(keys) == 1 else " + ".join(keys)
    if len(keys) > 1 and (len(dtypes) > 1 or any(not s or s[1:] != shapes[0][1:] for s in shapes)):
        raise CheckpointError(f"the parts {name} in {files.where(keys[0])} (shapes {shapes}, dtypes "
                              f"{sorted(map(str, dtypes))}) do not concatenate along axis 0 into {entry.path}")
    dtype = dtypes.pop()
    if dtype.kind != "f" and "float" not in dtype.name:
        raise CheckpointError(f"tensor {name!r} in {files.where(keys[0])} is stored as {dtype.name} (a quantized "
                              "checkpoint?); jstd loads floating-point weights: dequantize them first (load the "
                              "model with transformers and save_pretrained it in bfloat16)")
    stored = shapes[0] if len(keys) == 1 else (sum(s[0] for s in shapes), *shapes[0][1:])
    probe = np.empty(stored, dtype)  # never touched: only its layout after the transform is looked at
    mapped = entry.transform(probe)
    if mapped.shape != slot.shape:
        raise CheckpointError(
            f"tensor {name!r} in {files.where(keys[0])} has shape {' + '.join(map(str, shapes))}, "
            f"which maps to {mapped.shape}; the config implies {slot.shape} for {entry.path}"
        )
    # (the whole tensor, in order: a slice that starts at the stored bytes, a fused tensor's first part, is not)
    direct = (dtype == slot.dtype and mapped.dtype == dtype and mapped.flags.c_contiguous
              and mapped.ctypes.data == probe.ctypes.data and mapped.size == probe.size)
    del probe, mapped
    raw = slot if direct else scratch.get(stored, dtype)
    flat, start = raw.reshape(-1), 0
    for key, shape in zip(keys, shapes):
        files.read_into(key, flat[start:start + math.prod(shape)])
        start += math.prod(shape)
    if not direct:
        np.copyto(slot, entry.transform(raw), casting="unsafe")


def fill_entry(files: SafetensorsFiles, entry, buf: np.ndarray, scratch: Scratch) -> None:
    """Every tensor of the name-map ``entry`` into ``buf`` (the whole parameter): one ``fill`` a block (row) for a
    stacked entry, one for the rest."""
    if entry.stacked:
        for row, i in enumerate(entry.blocks):
            fill(files, entry, [k.format(i=i) for k in entry.keys], buf[row], scratch)
    else:
        fill(files, entry, list(entry.keys), buf, scratch)
