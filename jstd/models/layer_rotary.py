"""Rotaries by block kind: configs whose ``rope_parameters`` is nested by layer type (Gemma 3's local and global
blocks, OLMo-3's sliding and full ones) give each kind its own rotary."""

from __future__ import annotations

from jstd.kernels.rope import Rotary
from jstd.kernels.rope_config import rotary_from_config


def rotaries(hf, head_dim: int, kinds, main: str = "full_attention") -> tuple[Rotary | None, tuple]:
    """``(rotary, kind_rotary)`` for ``CausalLM``: the ``main`` kind's rotary, and ``(kind, rotary)`` for every
    other kind in ``kinds`` (each from its entry of the nested ``rope_parameters``)."""
    others = tuple((k, rotary_from_config(hf, head_dim, layer_type=k)) for k in dict.fromkeys(kinds) if k != main)
    return rotary_from_config(hf, head_dim, layer_type=main), others
