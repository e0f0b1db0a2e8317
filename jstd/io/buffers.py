"""Host buffers for parameters as they are read: page-aligned (so the CPU device adopts them without a copy), one
reusable scratch buffer for the tensors that need a transform or a cast, and the fill of one name-map entry."""

from __future__ import annotations

import math
import mmap

import numpy as np

from jstd.io.safetensors import CheckpointError, SafetensorsFiles

CHUNK_BYTES = 8 << 20  # the most a transformed or cast tensor is read at a time (``_fill_in_parts``)

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


def _stored(files: SafetensorsFiles, entry, keys: list[str], shape) -> tuple[tuple, np.dtype, np.ndarray, np.ndarray]:
    """``(the stored shape, its dtype, probe, mapped)``: the tensor stored under ``keys`` (parts concatenated along
    axis 0) checked to concatenate, to be floating and to map to ``shape`` through ``entry.transform``; ``probe``,
    an untouched array of the stored shape (only its layout after the transform is looked at), and ``mapped``, the
    transform of it."""
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
    probe = np.empty(stored, dtype)  # never touched
    with np.errstate(all="ignore"):  # (a transform that computes computes on garbage)
        mapped = entry.transform(probe)
    if mapped.shape != tuple(shape):
        raise CheckpointError(
            f"tensor {name!r} in {files.where(keys[0])} has shape {' + '.join(map(str, shapes))}, "
            f"which maps to {mapped.shape}; the config implies {tuple(shape)} for {entry.path}"
        )
    return stored, dtype, probe, mapped


def fill(files: SafetensorsFiles, entry, keys: list[str], slot: np.ndarray, scratch: Scratch) -> None:
    """The tensor stored under ``keys`` (parts concatenated along axis 0), transformed, into ``slot``, shape-checked.

    When the transform keeps the stored bytes' order and dtype (the identity, reshapes) the file is read straight
    into ``slot``; otherwise into ``scratch``, then copied once, transformed (and cast), into ``slot`` — a part of
    at most ``CHUNK_BYTES`` at a time where the transform is a view cut along one axis into ranges of the stored
    bytes (a transpose, a split into heads: ``_outer_axis``), so the transient is never a whole large tensor."""
    stored, dtype, probe, mapped = _stored(files, entry, keys, slot.shape)
    # (the whole tensor, in order: a slice that starts at the stored bytes, a fused tensor's first part, is not)
    direct = (dtype == slot.dtype and mapped.dtype == dtype and mapped.flags.c_contiguous
              and mapped.ctypes.data == probe.ctypes.data and mapped.size == probe.size)
    axis = None if direct or len(keys) > 1 else _outer_axis(probe, mapped)
    del probe, mapped
    if axis is not None and slot.nbytes > CHUNK_BYTES:  # transformed or cast a part at a time: a small scratch
        _fill_in_parts(files, keys[0], entry.transform, stored, dtype, slot, axis, scratch)
        return
    raw = slot if direct else scratch.get(stored, dtype)
    flat, start = raw.reshape(-1), 0
    for key in keys:
        n = math.prod(files.shape(key))
        files.read_into(key, flat[start:start + n])
        start += n
    if not direct:
        np.copyto(slot, entry.transform(raw), casting="unsafe")


def _outer_axis(probe: np.ndarray, mapped: np.ndarray) -> int | None:
    """The axis of ``mapped`` (a transform of the C-contiguous ``probe``) along which it is cut into pieces that
    each come from one contiguous range of ``probe``'s bytes, in order: the axis with the largest stride, when
    ``mapped`` is a view of all of ``probe`` (a transpose, a reshape into heads, both) whose index along that axis
    alone picks the range (stride times length is the whole). None otherwise (a copy, a slice, a reversal)."""
    if mapped.size != probe.size or mapped.ctypes.data != probe.ctypes.data or mapped.size == 0:
        return None
    long = [k for k in range(mapped.ndim) if mapped.shape[k] > 1]
    if not long or any(mapped.strides[k] <= 0 for k in long):
        return None
    axis = max(long, key=lambda k: mapped.strides[k])
    stride = mapped.strides[axis]
    reach = sum((mapped.shape[k] - 1) * mapped.strides[k] for k in long if k != axis) + mapped.itemsize
    if stride * mapped.shape[axis] != probe.nbytes or reach > stride:  # each index's elements within its range
        return None
    return axis


def _fill_in_parts(files: SafetensorsFiles, key: str, transform, stored, dtype: np.dtype, slot: np.ndarray,
                   axis: int, scratch: Scratch) -> None:
    """``fill`` of one tensor whose transform cuts along ``slot``'s ``axis`` into contiguous ranges of the stored
    bytes (``_outer_axis``): read a range at a time (about ``CHUNK_BYTES``) into ``scratch`` and copied,
    transformed and cast, into its part of ``slot``: the transient is the scratch, not the tensor."""
    probe = np.empty(stored, dtype)
    mapped = transform(probe)
    shape, strides, step = list(mapped.shape), mapped.strides, mapped.strides[axis]
    del probe, mapped
    count = max(1, CHUNK_BYTES // step)
    for start in range(0, slot.shape[axis], count):
        n = min(count, slot.shape[axis] - start)
        raw = scratch.get((n * step // dtype.itemsize,), dtype)
        files.read_into(key, raw, offset=start * step)
        part = np.lib.stride_tricks.as_strided(raw, shape=shape[:axis] + [n] + shape[axis + 1:], strides=strides,
                                               writeable=False)
        index = (slice(None),) * axis + (slice(start, start + n),)
        np.copyto(slot[index], part, casting="unsafe")


def fill_part(files: SafetensorsFiles, entry, keys: list[str], shape, index: tuple, out: np.ndarray,
              scratch: Scratch) -> None:
    """The part ``index`` (a tuple of slices) of the tensor stored under ``keys``, transformed to ``shape``, into
    ``out``, reading only the bytes that part needs.

    Where the transform is a view of the stored tensor (reshapes, transposes, slices: every name map's), the part
    is a strided box of the stored bytes: it is read as its maximal contiguous runs (one read a run: a row split
    of the stored layout is one run, a column split one run a stored row), then laid out and cast into ``out``.
    Another transform (one that computes) reads the whole tensor through ``fill`` and takes the part."""
    _, dtype, probe, mapped = _stored(files, entry, keys, shape)
    part = mapped[index]
    base = probe.ctypes.data
    if mapped.dtype != dtype or not part.size or not np.may_share_memory(part, probe) or min(part.strides,
                                                                                            default=0) < 0:
        if part.size:
            whole = np.empty(shape, out.dtype)
            fill(files, entry, keys, whole, scratch)
            np.copyto(out, whole[index])
        return
    offset, item = part.ctypes.data - base, dtype.itemsize
    del probe, mapped
    # axes from the outermost stride to the innermost (length-1 axes last: they never break a run); the innermost
    # axes that tile contiguously make one run
    order = sorted(range(part.ndim), key=lambda d: (part.shape[d] > 1, part.strides[d]), reverse=True)
    run, inner = item, 0
    for d in reversed(order):
        if part.shape[d] > 1 and part.strides[d] != run:
            break
        run *= part.shape[d]
        inner += 1
    outer = order[:len(order) - inner]
    starts = np.full((), offset, np.int64)
    for d in outer:
        starts = starts[..., None] + np.arange(part.shape[d], dtype=np.int64) * part.strides[d]
    starts = starts.reshape(-1)
    buf = np.empty((len(starts), run // item), dtype)
    _read_runs(files, keys, starts, buf)
    laid = buf.reshape([part.shape[d] for d in order]).transpose(np.argsort(order))
    np.copyto(out, laid, casting="unsafe")


def sliced_shape(shape: tuple[int, ...], index: tuple) -> tuple[int, ...]:
    """The shape of ``x[index]`` for ``x`` of ``shape`` (``index``: slices, fewer than the axes allowed)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


def _read_runs(files: SafetensorsFiles, keys: list[str], starts: np.ndarray, buf: np.ndarray) -> None:
    """``buf[j]`` (one contiguous row of bytes each) from byte ``starts[j]`` of the tensors ``keys`` stored one
    after another (a run that crosses from one part to the next is read from each)."""
    sizes = [math.prod(files.shape(k)) * files.dtype(k).itemsize for k in keys]
    ends = np.cumsum(sizes)
    row = buf.shape[1] * buf.itemsize
    handles = {}
    try:
        for j, start in enumerate(starts.tolist()):
            flat = buf[j].view(np.uint8)
            done = 0
            while done < row:
                at = start + done
                k = int(np.searchsorted(ends, at, side="right"))
                local = at - (ends[k] - sizes[k])
                n = min(row - done, int(ends[k] - at))
                f = files.where(keys[k])
                if f not in handles:
                    handles[f] = files.open(keys[k])
                files.read_range(keys[k], int(local), flat[done:done + n], handles[f])
                done += n
    finally:
        for fh in handles.values():
            fh.close()


def fill_entry(files: SafetensorsFiles, entry, buf: np.ndarray, scratch: Scratch) -> None:
    """Every tensor of the name-map ``entry`` into ``buf`` (the whole parameter): one ``fill`` a block (row) for a
    stacked entry, one for the rest."""
    if entry.stacked:
        for row, i in enumerate(entry.blocks):
            fill(files, entry, [k.format(i=i) for k in entry.keys], buf[row], scratch)
    else:
        fill(files, entry, list(entry.keys), buf, scratch)
