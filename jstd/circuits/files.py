"""Transcoder sets on disk: circuit-tracer's formats (a folder with ``config.yaml``, or its cache layout, or a
populated HuggingFace cache) and SAELens transcoders.

circuit-tracer's folder (``utils/hf_utils.py``, ``transcoder/*.py`` of circuit-tracer 0.5.0):

- ``config.yaml``: ``model_kind`` (``transcoder_set`` | ``cross_layer_transcoder``), ``feature_input_hook``,
  ``feature_output_hook``, ``scan``, ``model_name``;
- a per-layer set: ``layer_{l}.safetensors`` with ``W_enc [F, d]``, ``W_dec [F, d]``, ``b_enc``, ``b_dec``,
  optional ``activation_function.threshold [F]`` (JumpReLU) and ``W_skip [d, d]`` (skip ``x @ W_skip.T``);
- a cross-layer transcoder: ``W_enc_{l}.safetensors`` (``W_enc_{l}``, ``b_enc_{l}``, ``b_dec_{l}``, optional
  ``threshold_{l}``) and ``W_dec_{l}.safetensors`` (``W_dec_{l} [F, L - l, d]``); its skip ``W_skip [L, d, d]``
  (``x @ W_skip[l]``) in ``W_skip.safetensors`` — a file circuit-tracer itself neither writes nor reads (its CLT
  skip lives only in memory), which jstd reads and writes so a set with one round-trips.

No network: a reference that is not a folder is looked up in circuit-tracer's cache
(``$CIRCUIT_TRACER_CACHE_DIR/<ref>/config.yaml``, default ``~/.cache/circuit_tracer``) and then in the
HuggingFace cache (``huggingface_hub.snapshot_download(..., local_files_only=True)``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jstd.circuits.transcoders import Transcoders
from jstd.io.safetensors import SafetensorsFiles, write_tensors
from jstd.io.staging import atomic
from jstd.sae.module import SAE

CONFIG = "config.yaml"
KINDS = {"transcoder_set": False, "cross_layer_transcoder": True}


def find_transcoders(ref: str | os.PathLike) -> Path:
    """The folder holding ``config.yaml`` for ``ref``: a folder, a circuit-tracer cache entry, or a repo id in the
    HuggingFace cache. FileNotFoundError saying what was tried."""
    p = Path(ref).expanduser()
    if p.is_dir():
        if not (p / CONFIG).exists():
            raise FileNotFoundError(f"{p} has no {CONFIG}: a circuit-tracer transcoder folder holds {CONFIG} and "
                                    "layer_{l}.safetensors (or W_enc_{l} / W_dec_{l}.safetensors)")
        return p
    tried = [str(p)]
    cache = Path(os.environ.get("CIRCUIT_TRACER_CACHE_DIR", "~/.cache/circuit_tracer")).expanduser()
    if (cache / str(ref) / CONFIG).exists():
        return cache / str(ref)
    tried.append(str(cache / str(ref)))
    repo = str(ref)
    if repo.count("/") == 1 and not repo.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(repo, local_files_only=True))
            if (folder / CONFIG).exists():
                return folder
        except Exception:
            pass
        tried.append(f"the huggingface_hub cache ({repo})")
    raise FileNotFoundError(f"no transcoder set {ref!r}: tried {', '.join(tried)} (nothing is downloaded; fetch it "
                            "with huggingface_hub.snapshot_download or pass its folder)")


def _config(folder: Path) -> dict:
    import yaml

    try:
        cfg = yaml.safe_load((folder / CONFIG).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{folder / CONFIG} is not YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{folder / CONFIG} is not a mapping of settings")
    return cfg


def _read(path: Path, key: str, dtype) -> jnp.ndarray:
    files = SafetensorsFiles(path)
    if key not in files.keys():
        raise ValueError(f"{path} has no tensor {key!r} (it holds {', '.join(sorted(files.keys()))})")
    return jnp.asarray(np.array(files.mapped(key, lazy=True)), dtype)


def _numbered(folder: Path, stem: str) -> list[int]:
    found = sorted(int(m[1]) for f in folder.glob(f"{stem}_*.safetensors") if (m := re.fullmatch(
        rf"{stem}_(\d+)\.safetensors", f.name)))
    if found != list(range(len(found))):
        raise ValueError(f"{folder}: {stem}_{{l}}.safetensors must be numbered 0..L-1, found {found}")
    return found


def load_transcoders(ref: str | os.PathLike, *, dtype=jnp.float32) -> Transcoders:
    """The transcoder set at ``ref`` (see ``find_transcoders``) in circuit-tracer's format, in ``dtype``.

    Raises FileNotFoundError for a set that is not there, ValueError for a config or files that do not fit
    (unknown ``model_kind``, missing hooks, missing or misnumbered files, shapes that disagree)."""
    folder = find_transcoders(ref)
    cfg = _config(folder)
    kind = cfg.get("model_kind", "transcoder_set")
    if kind not in KINDS:
        raise ValueError(f"{folder / CONFIG}: model_kind {kind!r} is not one of {', '.join(KINDS)}")
    for key in ("feature_input_hook", "feature_output_hook"):
        if not cfg.get(key):
            raise ValueError(f"{folder / CONFIG} lacks {key} (the TransformerLens hook the transcoders "
                             f"{'read' if 'input' in key else 'write'}, e.g. mlp.hook_in / mlp.hook_out)")
    hooks = dict(input_hook=cfg["feature_input_hook"], output_hook=cfg["feature_output_hook"], scan=cfg.get("scan"))
    if KINDS[kind]:
        layers = _numbered(folder, "W_enc")
        if not layers or _numbered(folder, "W_dec") != layers:
            raise ValueError(f"{folder}: a cross-layer transcoder needs W_enc_{{l}} and W_dec_{{l}}.safetensors for "
                             "every block l")
        enc = [folder / f"W_enc_{l}.safetensors" for l in layers]
        thresholds = [f"threshold_{l}" in SafetensorsFiles(p).keys() for l, p in enumerate(enc)]
        skip = folder / "W_skip.safetensors"
        return Transcoders(
            jnp.stack([_read(p, f"W_enc_{l}", dtype) for l, p in enumerate(enc)]),
            jnp.stack([_read(p, f"b_enc_{l}", dtype) for l, p in enumerate(enc)]),
            tuple(_read(folder / f"W_dec_{l}.safetensors", f"W_dec_{l}", dtype) for l in layers),
            jnp.stack([_read(p, f"b_dec_{l}", dtype) for l, p in enumerate(enc)]),
            jnp.stack([_read(p, f"threshold_{l}", dtype) for l, p in enumerate(enc)]) if all(thresholds) else None,
            _read(skip, "W_skip", dtype) if skip.exists() else None, cross_layer=True, **hooks)
    layers = _numbered(folder, "layer")
    if not layers:
        raise ValueError(f"{folder}: a transcoder set needs layer_{{l}}.safetensors for every block l")
    files = [folder / f"layer_{l}.safetensors" for l in layers]
    keys = [SafetensorsFiles(p).keys() for p in files]
    jump = ["activation_function.threshold" in k for k in keys]
    skips = ["W_skip" in k for k in keys]
    for what, flags in (("a threshold (JumpReLU)", jump), ("W_skip", skips)):
        if any(flags) and not all(flags):
            raise ValueError(f"{folder}: only some layers have {what}; every layer of a set must agree")
    stack = lambda key, **kw: jnp.stack([_read(p, key, dtype) for p in files])
    return Transcoders(stack("W_enc"), stack("b_enc"), stack("W_dec"), stack("b_dec"),
                       stack("activation_function.threshold") if all(jump) else None,
                       jnp.swapaxes(stack("W_skip"), 1, 2) if all(skips) else None, cross_layer=False, **hooks)


def save_transcoders(tc: Transcoders, folder: str | os.PathLike, *, model_name: str | None = None) -> Path:
    """Write ``tc`` as a circuit-tracer folder (``config.yaml`` + its safetensors files, each written atomically)
    that ``load_transcoders`` and circuit-tracer's own loader read. Returns the folder."""
    import yaml

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    np32 = lambda a: np.ascontiguousarray(np.asarray(a))
    write = lambda name, tensors: _write(folder / name, {k: np32(v) for k, v in tensors.items()})
    for l in range(tc.num_layers):
        if tc.cross_layer:
            tensors = {f"W_enc_{l}": tc.W_enc[l], f"b_enc_{l}": tc.b_enc[l], f"b_dec_{l}": tc.b_dec[l]}
            if tc.threshold is not None:
                tensors[f"threshold_{l}"] = tc.threshold[l]
            write(f"W_enc_{l}.safetensors", tensors)
            write(f"W_dec_{l}.safetensors", {f"W_dec_{l}": tc.W_dec[l]})
        else:
            tensors = {"W_enc": tc.W_enc[l], "W_dec": tc.W_dec[l], "b_enc": tc.b_enc[l], "b_dec": tc.b_dec[l]}
            if tc.threshold is not None:
                tensors["activation_function.threshold"] = tc.threshold[l]
            if tc.W_skip is not None:
                tensors["W_skip"] = tc.W_skip[l].T
            write(f"layer_{l}.safetensors", tensors)
    if tc.cross_layer and tc.W_skip is not None:
        write("W_skip.safetensors", {"W_skip": tc.W_skip})
    cfg = {"model_kind": "cross_layer_transcoder" if tc.cross_layer else "transcoder_set",
           "feature_input_hook": tc.input_hook, "feature_output_hook": tc.output_hook}
    if tc.scan is not None:
        cfg["scan"] = tc.scan
    if model_name is not None:
        cfg["model_name"] = model_name
    with atomic(folder / CONFIG, "w") as f:
        f.write(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def _write(path: Path, tensors: dict) -> None:
    with atomic(path, "wb") as fh:
        write_tensors(fh, tensors)


def from_saes(saes: Sequence[SAE], *, scan: str | None = None) -> Transcoders:
    """A per-layer set from SAELens transcoders (``jstd.sae.load_sae``), one per block in block order: each reads
    its ``hook_name`` and writes its ``hook_name_out`` (TransformerLens names ``blocks.{l}.X``; every block's X
    must agree). ValueError for a dictionary that is not a transcoder, a TopK one, one named for another block, or
    settings a circuit-tracer transcoder cannot hold (input normalisation)."""
    hooks = []
    for l, sae in enumerate(saes):
        if not isinstance(sae, SAE) or not sae.transcoder or sae.stacked:
            raise ValueError(f"from_saes: entry {l} is not one (unstacked) SAELens transcoder")
        if sae.normalize_activations not in ("none", None):
            raise ValueError(f"from_saes: transcoder {l} normalises its input ({sae.normalize_activations}); "
                             "attribution reads the site's raw value")
        names = []
        for name in (sae.hook_name, sae.hook_name_out):
            m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name or "")
            if m is None or int(m[1]) != l:
                raise ValueError(f"from_saes: transcoder {l} is named {name!r}; pass one per block in order, named "
                                 f"blocks.{l}.<hook> (TransformerLens names)")
            names.append(m[2])
        hooks.append(tuple(names))
    if len(set(hooks)) != 1:
        raise ValueError(f"from_saes: the transcoders read and write different hooks per block: {sorted(set(hooks))}")
    stack = lambda f: jnp.stack([f(s) for s in saes])
    return Transcoders(stack(lambda s: s.W_enc.T), stack(lambda s: s.b_enc), stack(lambda s: s.W_dec),
                       stack(lambda s: s.b_dec), stack(lambda s: s.threshold) if saes[0].threshold is not None else None,
                       None, cross_layer=False, input_hook=hooks[0][0], output_hook=hooks[0][1], scan=scan)
