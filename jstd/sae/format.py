"""SAELens' on-disk format, read and written without torch: a folder with ``cfg.json`` and ``sae_weights.safetensors``.

``cfg.json`` holds SAELens 6's fields: ``architecture`` (``standard``, ``topk``,
``jumprelu``, ``transcoder``, ``jumprelu_transcoder``), ``d_in``, ``d_sae``,
``d_out`` (transcoders), ``dtype``, ``device``, ``apply_b_dec_to_input``,
``normalize_activations``, ``reshape_activations``, ``k`` and
``rescale_acts_by_decoder_norm`` (TopK), and ``metadata`` (``hook_name``,
``hook_name_out``, ``model_name``, …). Older configs with ``hook_name`` at the
top are read too; what jstd does not model is kept and written back. The
weights: ``W_enc [d_in, d_sae]``, ``b_enc``, ``W_dec [d_sae, d_out]``,
``b_dec``, ``threshold`` (JumpReLU).

``hook_name`` is where the dictionary reads: a TransformerLens hook
(``blocks.3.hook_resid_post``) or a jstd site with its block
(``layers.3.layer_output``). ``site_of`` maps either to ``(site, layer)``;
jstd writes TransformerLens names where one exists, so SAELens' tools find
the hook, and the jstd site in ``metadata.jstd_site``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jstd.core.sites import SITES, SiteError, parse
from jstd.io.safetensors import SafetensorsFiles, write_tensors
from jstd.io.staging import atomic
from jstd.sae.module import SAE, architecture_name

CFG, WEIGHTS = "cfg.json", "sae_weights.safetensors"
FIELDS = ("architecture", "d_in", "d_sae", "d_out", "dtype", "device", "apply_b_dec_to_input", "normalize_activations",
          "reshape_activations", "k", "rescale_acts_by_decoder_norm", "metadata", "hook_name", "hook_name_out")
# TransformerLens hook (inside blocks.{i}.) -> the jstd block site holding the same value. TransformerLens'
# hook_mlp_in is the stream *before* the MLP's norm (resid_mid), lnX.hook_normalized is x / rms(x) *before* the
# norm's weight; circuit-tracer's mlp.hook_in / mlp.hook_out (its ReplacementMLP's) are the MLP's input (the normed
# stream with the weight) and output. The first hook naming a site is the one jstd writes for it.
HOOKS = {
    "hook_resid_pre": "layers.layer_input",
    "hook_resid_mid": "layers.layer_mid",
    "hook_resid_post": "layers.layer_output",
    "hook_attn_out": "layers.self_attn.attention_output",
    "hook_mlp_out": "layers.mlp.mlp_output",
    "ln1.hook_normalized": "layers.attention_norm_normalized",
    "ln2.hook_normalized": "layers.mlp_norm_normalized",
    "mlp.hook_post": "layers.mlp.mlp_neurons",
    "hook_mlp_in": "layers.layer_mid",
    "mlp.hook_in": "layers.mlp_input",
    "mlp.hook_out": "layers.mlp.mlp_output",
}
_TL = re.compile(r"^blocks\.(?P<layer>\d+)\.(?P<hook>.+)$")
_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16, "float64": jnp.float32}


def site_of(hook_name: str) -> tuple[str, int | None]:
    """``(jstd site, block)`` of a TransformerLens hook name or a jstd site name (``layers.3.layer_output``).

    Raises SiteError for a hook jstd has no site for, listing the ones it maps."""
    m = _TL.match(hook_name or "")
    if m:
        if m["hook"] not in HOOKS:
            raise SiteError(f"hook {hook_name!r} has no jstd site; jstd maps blocks.N.{{{', '.join(HOOKS)}}}; "
                            "pass site= to jstd.splice")
        return HOOKS[m["hook"]], int(m["layer"])
    return parse(hook_name)


def hook_name_of(site: str, layer: int | None) -> str:
    """The TransformerLens hook name of a jstd block site at ``layer`` where there is one, else the jstd name."""
    base, index = parse(site)
    layer = index if index is not None else layer
    hook = next((h for h, s in HOOKS.items() if s == base), None)
    if hook is not None and layer is not None:
        return f"blocks.{int(layer)}.{hook}"
    if layer is not None and SITES[base].stack:
        return f"{SITES[base].stack}.{int(layer)}.{SITES[base].relative}"
    return base


def load_sae(folder: str | os.PathLike, *, dtype=None) -> SAE:
    """The dictionary in an SAELens folder (``cfg.json`` + ``sae_weights.safetensors``), in its ``dtype`` (or
    ``dtype=``, floating only). FileNotFoundError for a folder without them; ValueError for an architecture or
    setting jstd does not support, a cfg.json that is not JSON or lacks d_in / d_sae, no architecture where the
    tensors and fields leave several, stored tensors the architecture does not use, weights whose shapes do not
    fit the config, or a dtype that is not floating."""
    folder = Path(folder)
    for name in (CFG, WEIGHTS):
        if not (folder / name).exists():
            raise FileNotFoundError(f"{folder} has no {name}: an SAELens dictionary folder holds {CFG} and {WEIGHTS}")
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"load_sae: dtype={jnp.dtype(dtype)} is not a floating dtype (the weights would be "
                         "truncated); pass jnp.float32, jnp.bfloat16 or jnp.float16, or None for cfg.json's")
    try:
        cfg = json.loads((folder / CFG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{folder / CFG} is not JSON ({e}); an SAELens dictionary's {CFG} is a JSON object of its "
                         "settings") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{folder / CFG} holds a JSON {type(cfg).__name__}, not an object of settings")
    for field in ("d_in", "d_sae"):
        if not isinstance(cfg.get(field), int) or isinstance(cfg.get(field), bool):
            raise ValueError(f"{folder / CFG}: the field {field!r} is "
                             + ("missing" if field not in cfg else f"{cfg[field]!r}, not an int")
                             + f"; SAELens' {CFG} gives the dictionary's sizes d_in and d_sae")
    files = SafetensorsFiles(folder / WEIGHTS)
    architecture = _architecture(folder, cfg, files.keys())
    if cfg.get("reshape_activations", "none") != "none":
        raise ValueError(f"{folder}: reshape_activations={cfg['reshape_activations']!r} (per-head hook_z "
                         "dictionaries) is not supported; jstd splices at sites of one row per position")
    want = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if architecture.startswith("jumprelu") else [])
    missing = [k for k in want if k not in files.keys()]
    if missing:
        raise ValueError(f"{folder / WEIGHTS} lacks {', '.join(missing)} for a {architecture} dictionary")
    unused = sorted(set(files.keys()) - set(want))
    if unused:
        raise ValueError(f"{folder / WEIGHTS} stores {', '.join(unused)}, which a {architecture} dictionary does "
                         f"not use (it reads {', '.join(want)}); is cfg.json's architecture right?")
    kind = dtype or _DTYPES.get(str(cfg.get("dtype", "float32")).replace("torch.", ""), jnp.float32)
    arrays = {k: jnp.asarray(np.array(files.mapped(k, lazy=True)), kind) for k in want}
    d_in, d_sae = cfg.get("d_in"), cfg.get("d_sae")
    d_out = cfg.get("d_out", d_in)
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,),
              "threshold": (d_sae,)}
    for k, a in arrays.items():
        if a.shape != shapes[k]:
            raise ValueError(f"{folder / WEIGHTS}: {k} has shape {a.shape}; cfg.json (d_in={d_in}, d_sae={d_sae}"
                             f", d_out={d_out}) needs {shapes[k]}")
    metadata = dict(cfg.get("metadata") or {})
    extra = {k: v for k, v in cfg.items() if k not in FIELDS}
    extra["metadata"] = metadata
    extra["device"] = cfg.get("device", "cpu")
    return SAE(arrays["W_enc"], arrays["b_enc"], arrays["W_dec"], arrays["b_dec"], arrays.get("threshold"),
               architecture=architecture, k=cfg.get("k") if architecture == "topk" else None,
               apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", not architecture.endswith("transcoder"))),
               normalize_activations=cfg.get("normalize_activations", "none") or "none",
               rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
               hook_name=cfg.get("hook_name") or metadata.get("hook_name"),
               hook_name_out=cfg.get("hook_name_out") or metadata.get("hook_name_out"),
               extra=json.dumps(extra, sort_keys=True))


def _architecture(folder: Path, cfg: dict, stored) -> str:
    """cfg.json's ``architecture``; without one (SAELens' configs before it had the field), the one the stored
    tensors and fields leave: ``standard`` (no ``threshold``) or ``jumprelu`` (a ``threshold``), when nothing
    points to a TopK (``k``) or a transcoder (``d_out`` or ``hook_name_out``). ValueError otherwise, as SAELens
    refuses the folder."""
    if "architecture" in cfg:
        return architecture_name(cfg["architecture"])
    hints = [f for f in ("k", "d_out", "hook_name_out") if cfg.get(f) is not None
             or (cfg.get("metadata") or {}).get(f) is not None]
    if hints:
        raise ValueError(f"{folder / CFG} has no 'architecture' and its fields ({', '.join(hints)}) point to a TopK "
                         "dictionary or a transcoder; add \"architecture\" (standard, topk, jumprelu, transcoder, "
                         "jumprelu_transcoder) to cfg.json")
    return "jumprelu" if "threshold" in stored else "standard"


def save_sae(sae: SAE, folder: str | os.PathLike) -> Path:
    """Write ``sae`` (one dictionary, not a stack) as an SAELens folder that SAELens 6 loads
    (``SAE.load_from_disk``); files are written atomically. Returns the folder."""
    if sae.stacked:
        raise ValueError(f"save_sae writes one dictionary; this one is stacked {sae.stacked}: save sae[i] each")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    extra = json.loads(sae.extra)
    metadata = dict(extra.pop("metadata", {}))
    for key, value in (("hook_name", sae.hook_name), ("hook_name_out", sae.hook_name_out)):
        if value is not None:
            metadata[key] = value
            try:
                site, layer = site_of(value)
                whole = f"{SITES[site].stack}.{layer}.{SITES[site].relative}" if layer is not None else site
                metadata.setdefault("jstd_site" if key == "hook_name" else "jstd_site_out", whole)
            except SiteError:
                pass
    cfg = {"architecture": sae.architecture, "d_in": sae.d_in, "d_sae": sae.d_sae,
           "dtype": str(np.dtype(sae.dtype)), "device": extra.pop("device", "cpu"),
           "apply_b_dec_to_input": sae.apply_b_dec_to_input, "normalize_activations": sae.normalize_activations,
           "reshape_activations": "none", **extra, "metadata": metadata}
    if sae.hook_name is not None:
        cfg["hook_name"] = sae.hook_name
    if sae.transcoder:
        cfg["d_out"] = sae.d_out
    if sae.activation == "topk":
        cfg.update(k=sae.k, rescale_acts_by_decoder_norm=sae.rescale_acts_by_decoder_norm)
    tensors = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    if sae.threshold is not None:
        tensors["threshold"] = sae.threshold
    with atomic(folder / WEIGHTS, "wb") as f:
        write_tensors(f, {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()})
    with atomic(folder / CFG, "w") as f:
        json.dump(cfg, f, indent=1)
    return folder
