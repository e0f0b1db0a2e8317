"""``jstd.load``: a HuggingFace checkpoint as a jstd model, streamed tensor by tensor."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import mmap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jstd.io.convert import hf_source, is_converted, load_converted, with_source
from jstd.io.hub import resolve
from jstd.io.safetensors import CheckpointError, SafetensorsFiles

# Config keys no forward reads, whatever the family: bookkeeping, token ids (the tokenizer's and generation's
# business) and training-only numbers (initialization, caching; any key naming a dropout). transformers' base
# PretrainedConfig attributes (architectures, dtype, id2label, output_*, ...) are added to these where they are used.
GENERIC = frozenset({
    "torch_dtype", "use_cache", "initializer_range", "initializer_factor", "bos_token_id", "eos_token_id",
    "pad_token_id", "_pad_token_id", "sep_token_id", "decoder_start_token_id",
})


class ConfigWarning(UserWarning):
    """A config key with a non-default value that the family does not read: jstd ignores it, so the model may
    compute something other than transformers'."""


def hf_config(folder: Path):
    """``folder``'s config.json parsed by transformers' AutoConfig, once its ``model_type`` is known to be one of
    jstd's families.

    Raises CheckpointError for a config.json that is not a JSON object, ValueError for a ``model_type`` jstd has
    no family for (listing them).
    """
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{path} is not valid JSON ({e}); download it again") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a JSON {type(raw).__name__}, not a config object; download it again")
    family_for(raw.get("model_type"), path)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def family_for(model_type: str | None, where: str = "the config"):
    """The family serving ``model_type``; ValueError listing jstd's families when there is none (``where``: the
    file named in the message)."""
    from jstd.models import FAMILIES, REFUSED

    if model_type in REFUSED:
        raise ValueError(f"{REFUSED[model_type]} (in {where})")
    if model_type not in FAMILIES:
        what = "no model_type" if model_type is None else f"unsupported model_type {model_type!r}"
        raise ValueError(f"{what}; jstd supports: {', '.join(sorted(FAMILIES))} (in {where}; to add a family see "
                         "docs/architecture.md, 'Adding a family')")
    return FAMILIES[model_type]


def supported_dtypes() -> tuple[str, ...]:
    """The parameter dtypes jstd computes in on the default backend: float32 and bfloat16; float16 off the CPU
    (XLA's CPU dot has no float16 inputs with float32 accumulation); float64 with ``jax_enable_x64``."""
    names = ("float32", "bfloat16")
    if jax.default_backend() != "cpu":
        names += ("float16",)
    if jax.config.jax_enable_x64:
        names += ("float64",)
    return names


def param_dtype(dtype, hf) -> np.dtype:
    """The dtype of every parameter: ``dtype`` when given (one of ``supported_dtypes()``), else the config's
    (``dtype`` / ``torch_dtype``) where it is supported, else float32 (float16 on the CPU widens to float32,
    exactly).

    Raises ValueError naming the dtype and the supported ones (with the fix for float16 on the CPU).
    """
    supported = supported_dtypes()
    if dtype is None:
        stated = str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32").replace("torch.", "")
        return jnp.dtype(stated if stated in supported else "float32")
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name in supported:
        return jnp.dtype(name)
    if name == "float16":
        raise ValueError("jstd.load: dtype=float16 does not run on the CPU backend (XLA's CPU dot has no float16 "
                         "inputs with float32 accumulation); pass dtype=jnp.bfloat16 (the same size) or jnp.float32 "
                         "(float16 weights widen exactly)")
    why = {"float64": " (float64 needs jax.config.update('jax_enable_x64', True) first)"}.get(name, "")
    if name and "float8" in name:
        why = " (8-bit floats are storage formats: load in bfloat16)"
    raise ValueError(f"jstd.load: dtype={dtype!r} is not a floating dtype jstd computes in on the "
                     f"{jax.default_backend()} backend; pass one of {', '.join(supported)}{why}")


def unhandled(hf, family) -> dict[str, object]:
    """``{key: value}`` for each attribute of ``hf``'s config class whose value differs from the class's default
    and that ``family`` neither reads nor knowingly ignores (``Family.handled``), generic keys (``GENERIC``,
    transformers' base attributes, dropouts) aside. A wrapper's ``text_config`` and ``vision_config`` are checked
    against its text and tower families, their keys dotted (``text_config.sliding_window``). Keys the config class
    does not declare are not reported: transformers' model does not read them either."""
    from transformers import PretrainedConfig

    try:
        default = type(hf)().to_dict()
    except Exception:  # a config class that needs arguments: nothing to compare against
        return {}
    parts = {}
    if hasattr(family, "text_family"):  # a wrapper: its text model and tower have their own families
        parts = {"text_config": family.text_family(hf), "vision_config": family.tower_for(hf)}
    known = family.handled | GENERIC | set(PretrainedConfig().to_dict())
    out = {}
    for key, value in hf.to_dict().items():
        if key in parts:
            out.update({f"{key}.{k}": v for k, v in unhandled(getattr(hf, key), parts[key]).items()})
        elif key in default and value != default[key] and key not in known and "dropout" not in key:
            out[key] = value
    return out


def warn_unhandled(hf, family, folder: Path) -> None:
    """One ``ConfigWarning`` line listing ``unhandled(hf, family)``, if any."""
    keys = unhandled(hf, family)
    if keys:
        shown = ", ".join(f"{k}={v!r}" if len(repr(v)) <= 40 else f"{k}={repr(v)[:37]}..." for k, v in keys.items())
        warnings.warn(f"{folder.name}/config.json: the {family.family} family does not read {shown} (not transformers' "
                      "defaults); jstd ignores them, so the model may compute something other than transformers'",
                      ConfigWarning, stacklevel=3)


def load(path_or_repo_id, *, dtype=None, mesh=None, rules=None):
    """Load a checkpoint (local folder or hub repo id) as a jstd model.

    ``dtype``: the dtype of every parameter, one of ``supported_dtypes()``:
    float32 or bfloat16, float16 off the CPU (the CPU backend cannot run it:
    pass bfloat16 or float32 there), float64 with ``jax_enable_x64``. None
    keeps the dtype the config states where the backend runs it and float32
    otherwise (a float16 checkpoint loads as float32 on the CPU).

    Each tensor is read once from the file straight into its slot of its
    stacked parameter's page-aligned buffer (tensors needing a transpose or a
    cast through a scratch buffer of one tensor), and the CPU device adopts
    each finished buffer without a copy: peak memory is the model plus one
    tensor (the first load in a process also imports transformers, for
    config.json, and transformers imports torch where it is installed). The source is never written. Config keys the family does not read
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
    scratch = _Scratch()
    from jstd.sharding import placer

    place = placer(skeleton, mesh, rules)
    leaves = [_read(files, e, _get(skeleton, e.path), scratch, place) for e in entries]
    model = _replace(skeleton, [e.path for e in entries], leaves)
    unfilled = [p for p, leaf in _paths(model) if isinstance(leaf, jax.ShapeDtypeStruct)]
    if unfilled:
        raise RuntimeError(f"{family.family} name map leaves parameters unfilled: {unfilled}")
    return with_generation_ids(with_source(model, hf_source(folder, files, entries)), folder)  # source: for export


def with_generation_ids(model, folder: Path):
    """``model`` with ``config.eos_token_ids`` / ``pad_token_id`` the checkpoint's (``jstd.generation_config``)."""
    from jstd.generate import generation_config
    from jstd.models.base import with_fields

    ids = generation_config(folder)
    return with_fields(model, config=dataclasses.replace(model.config, eos_token_ids=ids["eos_token_id"],
                                                         pad_token_id=ids["pad_token_id"]))



def plan(folder: Path, dtype) -> tuple:
    """What reading the HuggingFace checkpoint ``folder`` starts from: ``(hf config, family, parameter dtype,
    its SafetensorsFiles, the model's skeleton, the name map's entries)``, after every check that reads no
    tensor (``ConfigWarning`` for unhandled config keys; ``mapped_entries``' CheckpointErrors)."""
    hf = hf_config(folder)
    family = family_for(hf.model_type)
    dtype = param_dtype(dtype, hf)
    warn_unhandled(hf, family, folder)
    files = SafetensorsFiles(folder)
    skeleton = family.skeleton(hf, dtype)
    return hf, family, dtype, files, skeleton, mapped_entries(folder, hf, family, skeleton, files)


def mapped_entries(folder: Path, hf, family, skeleton, files: SafetensorsFiles) -> list:
    """The family's name map over ``skeleton``, keys spelled as ``files`` stores them (``stored_names``); raises
    CheckpointError naming a tensor the map expects that ``files`` lacks, or one it has that no entry reads and the
    family does not knowingly ignore."""
    stored = stored_names(family.stored_prefixes(hf), files.keys())
    entries = [dataclasses.replace(e, key=stored(e.key) if isinstance(e.key, str) else tuple(map(stored, e.key)))
               for e in family.name_map(hf, skeleton) if _get(skeleton, e.path) is not None]
    expected = {k.format(i=i) for e in entries for k in e.keys for i in (e.blocks if e.stacked else [0])}
    missing = sorted(expected - files.keys())
    if missing:
        raise CheckpointError(
            f"{folder.name}: missing tensor {missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + f" (the {family.family} name map expects it; files: {', '.join(sorted({files.where(k) for k in files.keys()}))})"
        )
    ignored = [stored(pattern) for pattern in family.ignored(hf)]
    extra = sorted(k for k in files.keys() - expected if not any(_matches(k, pat) for pat in ignored))
    if extra:
        raise CheckpointError(
            f"unexpected tensor {extra[0]!r} in {files.where(extra[0])}"
            + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
            + f": the {family.family} family has no parameter for it (is the config's model_type right?)"
        )
    return entries


def _get(tree, path: str):
    for part in path.split("."):
        tree = tree[int(part)] if part.isdigit() else getattr(tree, part)
    return tree


def stored_names(prefixes: dict[str, tuple[str, ...]], keys):
    """The function from a name-map key to its stored name: the longest of ``prefixes`` it starts with replaced
    by the first of that prefix's spellings some stored key starts with (``Family.stored_prefixes``)."""
    chosen = {}
    for prefix, spellings in prefixes.items():
        chosen[prefix] = next((c for c in spellings if any(k.startswith(c) for k in keys)), spellings[-1])
    order = sorted(chosen, key=len, reverse=True)

    def stored(key: str) -> str:
        prefix = next((p for p in order if key.startswith(p)), None)
        return key if prefix is None else chosen[prefix] + key[len(prefix):]

    return stored


def _matches(key: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(key, pattern)


def _read(files: SafetensorsFiles, entry, leaf: jax.ShapeDtypeStruct, scratch: "_Scratch", place):
    """One parameter, all its blocks, in one page-aligned buffer, placed by ``place(path, buffer)``
    (``jstd.sharding.placer``: the CPU device adopts it without a copy; a mesh gets its shards)."""
    if hasattr(place, "shards"):  # on a mesh: each device's part, block by block; the host holds one block's tensor
        return _read_parts(files, entry, leaf, scratch, place)
    buf = _buffer(leaf.shape, np.dtype(leaf.dtype))
    if entry.stacked:
        for row, i in enumerate(entry.blocks):
            _fill(files, entry, [k.format(i=i) for k in entry.keys], buf[row], scratch)
    else:
        _fill(files, entry, list(entry.keys), buf, scratch)
    return place(entry.path, buf)


def _read_parts(files: SafetensorsFiles, entry, leaf: jax.ShapeDtypeStruct, scratch: "_Scratch", place):
    """One parameter placed part by part (``place.shards``): each device's part read block by block through one
    block-sized buffer, so the host never holds more than one block's tensor and one device's part (a block is
    read again for each distinct part: from the page cache after the first)."""
    dtype = np.dtype(leaf.dtype)
    block = np.empty(leaf.shape[1:] if entry.stacked else leaf.shape, dtype)
    if not entry.stacked:  # one tensor: read once, each part a view of it
        _fill(files, entry, list(entry.keys), block, scratch)
        return place.shards(entry.path, leaf.shape, lambda index: block[index])

    def part(index: tuple) -> np.ndarray:
        rows = entry.blocks[index[0]]
        out = np.empty((len(rows),) + block[index[1:]].shape, dtype)
        for row, i in enumerate(rows):
            _fill(files, entry, [k.format(i=i) for k in entry.keys], block, scratch)
            out[row] = block[index[1:]]
        return out

    return place.shards(entry.path, leaf.shape, part)


def _buffer(shape, dtype: np.dtype) -> np.ndarray:
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


class _Scratch:
    """One reusable buffer for the tensors that cannot be read straight into their slot."""

    def __init__(self):
        self.raw = np.empty(0, np.uint8)

    def get(self, shape, dtype) -> np.ndarray:
        n = math.prod(shape) * dtype.itemsize
        if self.raw.nbytes < n:
            self.raw = np.empty(n, np.uint8)
        return self.raw[:n].view(dtype).reshape(shape)


def _fill(files: SafetensorsFiles, entry, keys: list[str], slot: np.ndarray, scratch: _Scratch) -> None:
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
    direct = (dtype == slot.dtype and mapped.dtype == dtype and mapped.flags.c_contiguous
              and mapped.ctypes.data == probe.ctypes.data)
    del probe, mapped
    raw = slot if direct else scratch.get(stored, dtype)
    flat, start = raw.reshape(-1), 0
    for key, shape in zip(keys, shapes):
        files.read_into(key, flat[start:start + math.prod(shape)])
        start += math.prod(shape)
    if not direct:
        np.copyto(slot, entry.transform(raw), casting="unsafe")


def _replace(tree, paths, leaves):
    import equinox as eqx

    getters = [functools.partial(_get, path=p) for p in paths]
    return eqx.tree_at(lambda t: [g(t) for g in getters], tree, leaves)


def _paths(tree):
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))[0]]
