"""``jstd.load``: a HuggingFace checkpoint as a jstd model, streamed tensor by tensor."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jstd.io.hub import resolve
from jstd.io.safetensors import CheckpointError, SafetensorsFiles


def hf_config(folder: Path):
    """config.json parsed by transformers' AutoConfig."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def family_for(hf):
    from jstd.models import FAMILIES

    model_type = getattr(hf, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; jstd supports: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def default_dtype(hf):
    name = str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32").replace("torch.", "")
    return jnp.dtype(name)


def _get(tree, path: str):
    for part in path.split("."):
        tree = tree[int(part)] if part.isdigit() else getattr(tree, part)
    return tree


def load(path_or_repo_id, *, dtype=None):
    """Load a checkpoint (local folder or hub repo id) as a jstd model.

    ``dtype`` casts every parameter (``jnp.float32``, ``jnp.bfloat16``, …);
    None keeps the dtype the config states (float32 when it states none).
    Tensors stream one at a time into the stacked parameter arrays: peak memory
    is the model plus one stacked parameter. The source is never written.

    Raises ValueError for an unsupported model_type (listing the supported
    ones) and CheckpointError naming the file and key for a missing, extra,
    misshapen or truncated tensor.
    """
    folder = resolve(path_or_repo_id)
    hf = hf_config(folder)
    family = family_for(hf)
    dtype = jnp.dtype(dtype) if dtype is not None else default_dtype(hf)
    files = SafetensorsFiles(folder)
    skeleton = family.skeleton(hf, dtype)
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
    leaves = [_read(files, e, _get(skeleton, e.path)) for e in entries]
    model = _replace(skeleton, [e.path for e in entries], leaves)
    unfilled = [p for p, leaf in _paths(model) if isinstance(leaf, jax.ShapeDtypeStruct)]
    if unfilled:
        raise RuntimeError(f"{family.family} name map leaves parameters unfilled: {unfilled}")
    return model


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


def _read(files: SafetensorsFiles, entry, leaf: jax.ShapeDtypeStruct):
    """One parameter, all its blocks, in one aligned buffer that the CPU device adopts without a copy."""
    buf = _aligned(leaf.shape, np.dtype(leaf.dtype))
    if entry.stacked:
        for row, i in enumerate(entry.blocks):
            buf[row] = _checked(files, entry, [k.format(i=i) for k in entry.keys], leaf.shape[1:])
    else:
        buf[...] = _checked(files, entry, list(entry.keys), leaf.shape)
    return jax.device_put(buf)


def _aligned(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialized array whose data is ``align``-byte aligned (so ``device_put`` can alias it)."""
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(n + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset:offset + n].view(dtype).reshape(shape)


def _checked(files, entry, keys, want):
    """The tensor stored under ``keys`` (parts concatenated along axis 0), transformed and shape-checked."""
    stored = [files.read(k) for k in keys]
    t = entry.transform(stored[0] if len(stored) == 1 else np.concatenate(stored))
    if t.shape != tuple(want):
        key = keys[0] if len(keys) == 1 else " + ".join(keys)
        shapes = " + ".join(str(files.shape(k)) for k in keys)
        raise CheckpointError(
            f"tensor {key!r} in {files.where(keys[0])} has shape {shapes}, "
            f"which maps to {t.shape}; the config implies {tuple(want)} for {entry.path}"
        )
    return t


def _replace(tree, paths, leaves):
    import equinox as eqx

    getters = [functools.partial(_get, path=p) for p in paths]
    return eqx.tree_at(lambda t: [g(t) for g in getters], tree, leaves)


def _paths(tree):
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))[0]]
