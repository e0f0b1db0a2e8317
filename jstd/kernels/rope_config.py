"""The ``Rotary`` a transformers config builds: ``rotary_from_config``, one small builder per ``rope_type``.

Covers every ``rope_type`` of transformers' ``ROPE_INIT_FUNCTIONS`` that a
plain (1-D positions) rotary module uses: ``default``, ``linear``, ``dynamic``,
``yarn``, ``longrope``, ``llama3`` and ``proportional`` (``SUPPORTED_ROPE_TYPES``),
each with ``partial_rotary_factor`` (rotary on the first ``rotary_dim`` dims of
a head, the rest passed through). The config is read here; the frequencies are
computed by ``jstd.kernels.rope_init`` and served by ``jstd.kernels.rope.Rotary``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from jaxtyping import Float

from jstd.kernels.rope import Rotary
from jstd.kernels.rope_init import (
    default_inv_freq,
    dynamic_base_at_init,
    linear_inv_freq,
    llama3_inv_freq,
    longrope_inv_freq,
    proportional_inv_freq,
    static_freqs,
    yarn_inv_freq,
)

# what a builder returns: the frequencies, the cos/sin multiplier and the Rotary's further fields
Frequencies = tuple[Float[np.ndarray, " half"], float, dict]


@dataclasses.dataclass(frozen=True)
class _RopeInputs:
    """What a builder reads: the config, its (selected) ``rope_parameters`` and the values resolved from both."""

    config: object
    params: dict
    nested: bool  # rope_parameters is nested by layer type
    base: float
    partial: float
    dim: int  # int(head_dim * partial)
    head_dim: int
    max_pos: int | None  # config.max_position_embeddings

    def original_max(self) -> int:
        """The pre-extension context length (yarn, longrope, llama3)."""
        # transformers' standardize_rope_params: for a flat dict a config attribute has priority (Phi3),
        # then the dict, then max_position_embeddings
        attr = None if self.nested else getattr(self.config, "original_max_position_embeddings", None)
        if attr is not None:
            return attr
        value = self.params.get("original_max_position_embeddings")
        return self.max_pos if value is None else value


def _default(r: _RopeInputs) -> Frequencies:
    return default_inv_freq(r.base, r.dim), 1.0, {}


def _linear(r: _RopeInputs) -> Frequencies:
    return linear_inv_freq(r.base, r.dim, r.params["factor"]), 1.0, {}


def _dynamic(r: _RopeInputs) -> Frequencies:
    """The unscaled frequencies, and what ``Rotary`` needs to rescale the base for longer inputs."""
    factor = r.params["factor"]
    if r.max_pos is None:
        raise ValueError("dynamic rope needs config.max_position_embeddings")
    inv = default_inv_freq(dynamic_base_at_init(r.base, factor, r.max_pos, r.dim), r.dim)
    return inv, 1.0, dict(original_max_position_embeddings=int(r.max_pos), rope_theta=float(r.base), factor=factor,
                          dim=r.dim)


def _scaling(r: _RopeInputs, default_attention_factor: Callable[[dict, float, int], float]) -> tuple[int, float, float]:
    """``(original_max, factor, attention_factor)`` of yarn and longrope: ``factor`` defaults to
    ``max_position_embeddings / original_max``, ``attention_factor`` to the type's
    ``default_attention_factor(params, factor, original_max)``."""
    omax = r.original_max()
    factor = r.params.get("factor")
    if factor is None:
        factor = r.max_pos / omax
    attention_factor = r.params.get("attention_factor")
    if attention_factor is None:
        attention_factor = default_attention_factor(r.params, factor, omax)
    return omax, factor, attention_factor


def _yarn_mscale(scale, m=1):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_attention_factor(params: dict, factor: float, omax: int) -> float:
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn(r: _RopeInputs) -> Frequencies:
    omax, factor, attention_factor = _scaling(r, _yarn_attention_factor)
    beta_fast = r.params.get("beta_fast") or 32
    beta_slow = r.params.get("beta_slow") or 1
    # transformers reads `truncate` from the top-level rope_parameters (so a nested config always truncates)
    top = getattr(r.config, "rope_parameters", {}) or {}
    truncate = top.get("truncate", True)
    return yarn_inv_freq(r.base, r.dim, factor, omax, beta_fast, beta_slow, truncate), attention_factor, {}


def _longrope_attention_factor(params: dict, factor: float, omax: int) -> float:
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omax))


def _longrope(r: _RopeInputs) -> Frequencies:
    """The ``short_factor`` frequencies, and the ``long_factor`` ones for inputs past ``original_max``."""
    omax, factor, attention_factor = _scaling(r, _longrope_attention_factor)
    inv = longrope_inv_freq(r.base, r.dim, r.params["short_factor"])
    long = longrope_inv_freq(r.base, r.dim, r.params["long_factor"])
    if long.shape != inv.shape:
        raise ValueError(f"longrope long_factor/short_factor lengths differ: {long.shape} vs {inv.shape}")
    return inv, attention_factor, dict(long_inv_freq=static_freqs(long), original_max_position_embeddings=int(omax))


def _llama3(r: _RopeInputs) -> Frequencies:
    p = r.params
    inv = llama3_inv_freq(r.base, r.dim, p["factor"], p["low_freq_factor"], p["high_freq_factor"], r.original_max())
    return inv, 1.0, {}


def _proportional(r: _RopeInputs) -> Frequencies:
    return proportional_inv_freq(r.base, r.head_dim, r.partial, r.params.get("factor", 1.0)), 1.0, {}


_BUILDERS: dict[str, Callable[[_RopeInputs], Frequencies]] = {
    "default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "longrope": _longrope,
    "llama3": _llama3, "proportional": _proportional,
}
SUPPORTED_ROPE_TYPES = tuple(_BUILDERS)


def _nested_keys(config, params: dict) -> list[str]:
    labels = getattr(config, "_rope_type_labels", None) or getattr(config, "layer_types", None) or ()
    return [k for k in params if k in labels]


def _rope_parameters(config, layer_type: str | None) -> tuple[dict, bool] | None:
    """``(rope_parameters, nested)``: the config's (for a nested one, ``layer_type``'s entry, as a dict), or None
    where there is none (no or empty ``rope_parameters``, a NoPE layer)."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        return None
    nested = _nested_keys(config, params)
    if nested:
        if layer_type is None:
            raise ValueError(
                f"rope_parameters is nested by layer type ({nested}); pass layer_type= to rotary_from_config"
            )
        params = params.get(layer_type)
        if params is None:
            return None
    return dict(params), bool(nested)


def _rope_type(params: dict, mrope_interleaved: bool) -> str:
    """The ``rope_type``, refused where unsupported or where its multimodal RoPE is."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope_type {rope_type!r}; supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    mrope = params.get("mrope_section")
    if mrope is not None and rope_type != "default":
        raise ValueError(f"Multimodal RoPE is supported on the default rope; this config has rope_type {rope_type!r} "
                         "with mrope_section")
    if mrope is not None and params.get("mrope_interleaved") and not mrope_interleaved:
        raise ValueError("this config asks for interleaved multimodal RoPE (mrope_interleaved), which jstd serves on "
                         "the families whose rotary interleaves (Qwen3-VL); this family's rotary sections the "
                         "frequencies (Qwen2-VL's M-RoPE)")
    return rope_type


def _inputs(config, params: dict, nested: bool, head_dim: int) -> _RopeInputs:
    """The base, partial factor and rotary width: from ``rope_parameters``, else the config's attributes."""
    base = params.get("rope_theta")
    if base is None:
        base = getattr(config, "rope_theta", None) or getattr(config, "default_theta", 10_000.0)
    partial = params.get("partial_rotary_factor")
    if partial is None:
        partial = getattr(config, "partial_rotary_factor", None) or 1.0
    return _RopeInputs(config, params, nested, base, partial, int(head_dim * partial), head_dim,
                       getattr(config, "max_position_embeddings", None))


def rotary_from_config(config, head_dim: int, *, layer_type: str | None = None,
                       mrope_interleaved: bool = False) -> Rotary | None:
    """The ``Rotary`` a transformers config builds, or None when it builds none.

    ``config`` is a parsed transformers config (``PretrainedConfig``); only its
    attributes are read (``rope_parameters`` as standardized by transformers,
    ``max_position_embeddings``, ``original_max_position_embeddings``,
    ``rope_theta`` / ``partial_rotary_factor`` fallbacks). ``head_dim`` is the
    per-head width the rotary applies to.

    Returns None when the config has no (or an empty) ``rope_parameters``, or
    when ``layer_type`` names a layer whose nested entry is None (NoPE). For
    configs whose ``rope_parameters`` is nested by layer type, ``layer_type``
    selects the entry (required then).

    Note: ``partial_rotary_factor`` is honoured for every type, as transformers'
    init functions and most models' ``compute_default_rope_parameters`` do
    (``LlamaRotaryEmbedding``'s default one ignores it).

    Raises ValueError naming the rope_type and listing the supported ones for
    an unsupported ``rope_type``. Multimodal RoPE (``mrope_section``) is
    supported on the default rope; its sections must cover the frequencies.
    It is sectioned (Qwen2-VL's) unless ``mrope_interleaved``: a family whose
    torch rotary interleaves the streams (Qwen3-VL, Qwen3.5, which do so
    whatever the config's ``mrope_interleaved`` says) passes True. A config
    asking for interleaving from a family that sections is refused.
    """
    found = _rope_parameters(config, layer_type)
    if found is None:
        return None
    params, nested = found
    rope_type = _rope_type(params, mrope_interleaved)
    inv, attention_scaling, extra = _BUILDERS[rope_type](_inputs(config, params, nested, head_dim))
    mrope = params.get("mrope_section")
    if mrope is not None:
        if sum(mrope) != len(inv):
            raise ValueError(f"mrope_section {list(mrope)} must sum to the rotary's {len(inv)} frequencies")
        extra["mrope_section"] = tuple(int(n) for n in mrope)
        extra["mrope_interleaved"] = bool(mrope_interleaved)
    return Rotary(
        rope_type=rope_type,
        inv_freq=static_freqs(inv),
        attention_scaling=float(attention_scaling),
        rotary_dim=2 * len(inv),
        head_dim=int(head_dim),
        **extra,
    )
