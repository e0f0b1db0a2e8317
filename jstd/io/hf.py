"""Reading a HuggingFace checkpoint's configuration: ``config.json`` through transformers' config classes (once its
``model_type`` is known to be jstd's; without importing torch: ``jstd.io.torchless``), the parameter dtype, the config keys a family does not read, the name map spelled as the files
store it, and ``generation_config.json``'s token ids. Reads no tensor."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jstd.families import family_for
from jstd.io.hub import resolve
from jstd.io.safetensors import CheckpointError, SafetensorsFiles
from jstd.io.torchless import transformers
from jstd.nn.params import with_fields
from jstd.nn.namemap import at_path, spelled

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
    jstd's families; torch is not imported (``jstd.io.torchless.transformers``: the config's ``dtype`` stays a
    string where torch was not imported before).

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
    with transformers() as hf:
        return hf.AutoConfig.from_pretrained(folder)


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
    with transformers() as library:
        base = set(library.PretrainedConfig().to_dict())
        try:
            default = type(hf)().to_dict()
        except Exception:  # a config class that needs arguments: nothing to compare against
            return {}
    parts = {}
    if hasattr(family, "text_family"):  # a wrapper: its text model and tower have their own families
        parts = {"text_config": family.text_family(hf), "vision_config": family.tower_for(hf)}
    known = family.handled | GENERIC | base
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


def plan(folder: Path, dtype) -> tuple:
    """What reading the HuggingFace checkpoint ``folder`` starts from: ``(hf config, family, parameter dtype,
    its SafetensorsFiles, the model's skeleton, the name map's entries)``, after every check that reads no
    tensor (``ConfigWarning`` for unhandled config keys; ``mapped_entries``' CheckpointErrors). The config is
    read and used inside ``torchless.transformers()``, so that any import transformers makes resolves there."""
    with transformers():
        return _plan(folder, dtype)


def _plan(folder: Path, dtype) -> tuple:
    hf = hf_config(folder)
    family = family_for(hf.model_type)
    dtype = param_dtype(dtype, hf)
    warn_unhandled(hf, family, folder)
    files = SafetensorsFiles(folder)
    hf = untied_if_stored_apart(folder, hf, family, files)
    skeleton = family.skeleton(hf, dtype)
    return hf, family, dtype, files, skeleton, mapped_entries(folder, hf, family, skeleton, files)


def untied_if_stored_apart(folder: Path, hf, family, files: SafetensorsFiles):
    """``hf`` as transformers 5 loads it: a config with ``tie_word_embeddings`` whose checkpoint stores an output
    head that differs from the embedding keeps that head (untied, a ``ConfigWarning`` saying so), as
    ``PreTrainedModel.tie_weights`` does; else ``hf`` itself (a stored head equal to the embedding is the
    embedding)."""
    if not getattr(hf, "tie_word_embeddings", False):
        return hf
    import copy

    untied = copy.copy(hf)
    untied.tie_word_embeddings = False
    skeleton = family.skeleton(untied, jnp.float32)
    stored = stored_names(family.stored_prefixes(untied), files.keys())
    keys = {e.path: stored(e.key) for e in family.name_map(untied, skeleton) if isinstance(e.key, str)}
    head, embed = (next((keys[p] for p in paths if p in keys), None)
                   for paths in (("lm_head", "text.lm_head"), ("embed", "text.embed")))
    if head is None or embed is None or head not in files.keys() or embed not in files.keys():
        return hf
    if files.shape(head) == files.shape(embed) and files.dtype(head) == files.dtype(embed):
        a, b = (np.empty(files.shape(k), files.dtype(k)) for k in (head, embed))
        files.read_into(head, a)
        files.read_into(embed, b)
        if np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            return hf
    warnings.warn(f"{folder.name}: config.json ties the output head to the embedding (tie_word_embeddings), but the "
                  f"checkpoint stores {head!r} with other values than {embed!r}; jstd keeps the stored head, as "
                  "transformers does (it does not tie them): set tie_word_embeddings=false in config.json to "
                  "silence this warning", ConfigWarning, stacklevel=3)
    return untied


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")  # a per-expert tensor: (prefix, expert, rest)


def _experts_stored(missing: list[str], expected: set[str], keys) -> str:
    """When a missing tensor is one expert's: how many experts the config asks for and the checkpoint stores, in
    the spelling it stores them (else "")."""
    found = next((m for m in map(_EXPERT.match, missing) if m), None)
    if found is None:
        return ""
    head, _, tail = found.groups()
    def experts(names):
        return {int(m.group(2)) for m in map(_EXPERT.match, names) if m and m.group(1) == head and m.group(3) == tail}
    stored, wanted = experts(keys), experts(expected)
    return (f"; the config asks for {max(wanted) + 1} experts, the checkpoint stores {len(stored)} spelled "
            f"{head}{{e}}{tail}: set the config's expert count (num_experts or num_local_experts) to what "
            "the checkpoint holds")


def mapped_entries(folder: Path, hf, family, skeleton, files: SafetensorsFiles) -> list:
    """The family's name map over ``skeleton``, keys spelled as ``files`` stores them (``stored_names``); raises
    CheckpointError naming a tensor the map expects that ``files`` lacks, or one it has that no entry reads and the
    family does not knowingly ignore."""
    stored = stored_names(family.stored_prefixes(hf), files.keys())
    entries = spelled([e for e in family.name_map(hf, skeleton) if at_path(skeleton, e.path) is not None], stored,
                      files.keys())
    expected = {k.format(i=i) for e in entries for k in e.keys for i in (e.blocks if e.stacked else [0])}
    missing = sorted(expected - files.keys())
    if missing:
        raise CheckpointError(
            f"{folder.name}: missing tensor {missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + f" (the {family.family} name map expects it; files: {', '.join(sorted({files.where(k) for k in files.keys()}))})"
            + _experts_stored(missing, expected, files.keys())
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
    return fnmatch.fnmatchcase(key, pattern)


def with_generation_ids(model, folder: Path):
    """``model`` with ``config.eos_token_ids`` / ``pad_token_id`` the checkpoint's (``generation_config``)."""
    ids = generation_config(folder)
    return with_fields(model, config=dataclasses.replace(model.config, eos_token_ids=ids["eos_token_id"],
                                                         pad_token_id=ids["pad_token_id"]))


def generation_config(path_or_repo_id) -> dict:
    """A checkpoint's generation defaults: ``{"eos_token_id": tuple of ids, "pad_token_id": int or None}`` from its
    ``generation_config.json`` (else its ``config.json``, a wrapper's ``text_config`` too); ids absent are
    ``()`` / None. Pass them to ``generate``."""
    folder = resolve(path_or_repo_id)
    found: dict = {}
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for source in (data, data.get("text_config") or {}):
            for field in ("eos_token_id", "pad_token_id"):
                if found.get(field) is None and source.get(field) is not None:
                    found[field] = source[field]
    eos = found.get("eos_token_id")
    eos = () if eos is None else tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    pad = found.get("pad_token_id")
    return {"eos_token_id": eos, "pad_token_id": None if pad is None else int(pad)}
