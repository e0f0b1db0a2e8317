"""``jstd export``: a jstd model (loaded with ``jstd.load``, edited or not) written back as a HuggingFace folder.

Each parameter goes back to the stored tensors it was loaded from (``model.source``, ``jstd/io/source.py``)
through the inverse of the family's name map; the destination is written into a temporary sibling folder renamed
into place when complete (``jstd/io/staging.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import jax
import numpy as np

from jstd.families import family_for
from jstd.io.hf import hf_config, stored_names
from jstd.io.safetensors import SafetensorsFiles, Writer, nbytes
from jstd.io.source import Source
from jstd.io.stacked import IGNORED, copy_side_files, is_converted
from jstd.core.progress import Progress
from jstd.io.staging import Staging, check_destination
from jstd.nn.namemap import at_path, spelled


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
    the folder the model was loaded from or ``files_from``, inside one or contains one (with or without
    ``force``: export never writes into or over what it reads, as ``convert``), when ``dst`` is a non-empty folder
    and ``force`` is False, or when a transform is not a pure re-layout.
    """

    source = getattr(model, "source", None)
    if not isinstance(source, Source):
        raise ValueError("jstd.export: this model has no record of the checkpoint layout it came from "
                         "(model.source is None: it was not made by jstd.load); load it with jstd.load, edit it "
                         "with eqx.tree_at (which keeps model.source), then export")
    # never into, over or around a folder it reads from, with or without force
    dst = [check_destination(folder, Path(dst), force, "export") for folder in _source_folders(source, files_from)][0]
    dtypes = {np.dtype(x.dtype).name for x in jax.tree.leaves(model)}
    config = json.loads(source.config)
    if len(dtypes) == 1:
        _set_dtype(config, dtypes.pop())
    staging = Staging(dst)
    with staging as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        groups = _groups(hf_config(tmp), source)
        extra = _ignored_files(source)
        plan = [(k, source.tensors[k][0], at_path(model, e.path).dtype) for keys, parts in groups.items()
                for k in keys for e, _ in parts[:1]]
        writer = Writer(tmp, plan + (extra.plan(sorted(source.ignored)) if extra else []), {"format": "pt"})
        bar = Progress(f"jstd export {dst.name}", writer.total, writer.count, progress)
        _write_groups(model, source, groups, writer, bar)
        if extra:
            writer.copy(extra, sorted(source.ignored))
        writer.close()
        if files_from:
            copy_side_files(Path(files_from), tmp)
        staging.commit()
    return dst


def _source_folders(source: Source, files_from) -> list[Path | None]:
    """The folders export reads from: the checkpoint the model was loaded from (a converted checkpoint's own
    folder, not its ``hf-ignored`` subfolder) and ``files_from``; ``[None]`` when there are none."""
    folders = []
    if source.folder is not None:
        folder = Path(source.folder)
        folders.append(folder.parent if folder.name == IGNORED and is_converted(folder.parent) else folder)
    if files_from:
        folders.append(Path(files_from))
    return folders or [None]


def _groups(hf, source: Source) -> dict[tuple[str, ...], list]:
    """The family's name map inverted: each tuple of stored tensors written together (one, or the parts one
    parameter is split from) -> the ``(entry, block row or None)`` that fill it. ValueError when ``source`` does
    not list one of those stored tensors."""
    family = family_for(hf.model_type)
    skeleton = family.skeleton(hf, np.float32)
    stored = stored_names(family.stored_prefixes(hf), source.tensors.keys())
    entries = spelled([e for e in family.name_map(hf, skeleton) if at_path(skeleton, e.path) is not None], stored,
                      source.tensors.keys())
    groups: dict[tuple[str, ...], list] = {}
    for e in entries:
        for row, i in (enumerate(e.blocks) if e.stacked else [(None, 0)]):
            groups.setdefault(tuple(k.format(i=i) for k in e.keys), []).append((e, row))
    unknown = sorted(k for keys in groups for k in keys if k not in source.tensors)
    if unknown:
        raise ValueError(f"jstd.export: model.source does not list {unknown[0]!r}, which the {family.family} name "
                         "map writes; the model's source record is from another model")
    return groups


def _write_groups(model, source: Source, groups: dict, writer: Writer, bar: Progress) -> None:
    """Every group's stored tensors rebuilt from ``model`` and written, in order (one group in memory at a time;
    each entry's inverse index kept while the next group still uses it)."""
    index_cache: dict = {}
    for keys, parts in groups.items():
        shapes = [source.tensors[k][0] for k in keys]
        out = _rebuilt(model, keys, parts, shapes, index_cache)
        start = 0
        for k, s in zip(keys, shapes):
            writer.write(k, out[start:start + s[0]] if len(keys) > 1 else out)
            start += s[0]
            bar.step(nbytes(s, out.dtype))
        index_cache = {c: v for c, v in index_cache.items() if c[0] in {id(e) for e, _ in parts}}


def _rebuilt(model, keys: tuple[str, ...], parts: list, shapes: list, index_cache: dict) -> np.ndarray:
    """The stored tensors ``keys`` (of ``shapes``), concatenated along their first axis when several, scattered
    from the model's parameters ``parts``. ValueError when a parameter's shape does not match, or when some
    element comes from no parameter."""
    whole = (sum(s[0] for s in shapes), *shapes[0][1:]) if len(keys) > 1 else shapes[0]
    out = np.empty(whole, at_path(model, parts[0][0].path).dtype)
    covered = np.zeros(math.prod(whole), bool)
    for e, row in parts:
        cache = (id(e), whole)
        if cache not in index_cache:
            index_cache[cache] = _inverse_index(e, whole, e.path, " + ".join(keys))
        idx = index_cache[cache]
        value = at_path(model, e.path)
        value = np.asarray(value if row is None else value[row])  # one block to the host at a time
        if value.shape != idx.shape:
            raise ValueError(f"jstd.export: {e.path} has shape {value.shape} (row {row}), but {keys[0]!r} "
                             f"{list(whole)} maps to {idx.shape}")
        out.reshape(-1)[idx.reshape(-1)] = value.reshape(-1)
        covered[idx.reshape(-1)] = True
    if not covered.all():
        raise ValueError(f"jstd.export: {(~covered).sum()} elements of {' + '.join(keys)} come from no "
                         "parameter (the name map drops them); export cannot rebuild that tensor")
    return out


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
                         "family yet (add an explicit inverse for that transform in jstd/io/export.py)")
    return idx


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
    names = ", ".join(sorted(source.ignored)[:3]) + (", ..." if len(source.ignored) > 3 else "")
    warnings.warn(f"jstd.export: {len(source.ignored)} tensors jstd does not read ({names}) are no longer in "
                  f"{source.folder}; the exported folder "
                  "lacks them (transformers initializes them anew)", stacklevel=3)
    return None


def _set_dtype(config: dict, name: str) -> None:
    """``dtype`` set to ``name`` in ``config`` and in every sub-config that states one (``torch_dtype`` dropped)."""
    config.pop("torch_dtype", None)
    config["dtype"] = name
    for value in config.values():
        if isinstance(value, dict) and ("dtype" in value or "torch_dtype" in value or "model_type" in value):
            _set_dtype(value, name)
