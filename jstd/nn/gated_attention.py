"""Softmax attention with an output gate (Qwen3-Next, Qwen3.5's full-attention blocks).

    q | g = q_proj(x)                         # per head: head_dim query channels, then head_dim gate channels
    q, k  = rope(q_norm(q)), rope(k_norm(k_proj(x)))      # per-head norms
    heads = softmax(q kᵀ · scale + mask) v                # attention_head_outputs
    out   = o_proj(heads · sigmoid(g))                    # attention_premix: the gated heads

``q_proj`` emits ``2 · head_dim`` channels per head, the query and the gate of
that head side by side (transformers views it as ``[..., heads, 2 · head_dim]``
and chunks the last axis in two); the name map splits it into ``q`` and
``gate``. The gate is applied in the model's dtype, as transformers does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import equinox as eqx
from jaxtyping import Array, Float

from jstd.nn.namemap import Entry
from jstd.nn.params import shape
from jstd.kernels.projection import add_bias
from jstd.nn.attention import Attention
from jstd.nn.norms import HeadNorm


def _query_half(heads: int, half: int):
    """[heads * 2 * dim, ...] -> the query (half 0) or gate (half 1) rows per head, as jstd lays them out:
    a weight [in, heads, dim], a bias [heads, dim]."""
    def take(w):
        per_head = w.reshape(heads, 2, -1, *w.shape[1:])[:, half]  # [heads, dim] or [heads, dim, in]
        return per_head if w.ndim == 1 else per_head.transpose(2, 0, 1)
    return take


class GatedAttention(Attention):
    """``Attention`` whose heads' outputs are multiplied by ``sigmoid(x @ gate)`` before ``o_proj``.

    The taps are ``Attention``'s: ``attention_head_outputs`` is the heads'
    output before the gate, ``attention_premix`` what ``o_proj`` receives (after
    it). ``gate`` ``[embed, heads, head_dim]`` (and ``gate_bias``) are the
    second half of each head's ``q_proj`` rows. With ``frozen_pattern`` (``jstd.nn.frozen``) the gate is held
    with the probabilities: part of the pattern, so the mixer stays a fixed linear map of its values.
    """

    gate: Float[Array, "embed heads head_dim"] = eqx.field(default=None, metadata={"axes": ("embed", "heads",
                                                                                             "head_dim")})
    gate_bias: Float[Array, "heads head_dim"] | None = eqx.field(default=None, metadata={"axes": ("heads",
                                                                                                  "head_dim")})

    def gated(self, heads: Float[Array, "batch seq heads head_dim"],
              x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq heads head_dim"]:
        gate = jax.nn.sigmoid(add_bias(jnp.einsum("bte,ehd->bthd", x, self.gate), self.gate_bias))
        return heads * (jax.lax.stop_gradient(gate) if self.frozen_pattern else gate)

    def entries(self, names=None) -> list[Entry]:
        """``Attention``'s names, with ``q_proj`` (and its bias) split per head into the query and the gate."""
        H = self.q.shape[-2]
        own = [e for e in super().entries(names) if e.path not in ("q", "q_bias")]
        halves = [Entry("q_proj.weight", "q", _query_half(H, 0)), Entry("q_proj.weight", "gate", _query_half(H, 1))]
        if self.q_bias is not None:
            halves += [Entry("q_proj.bias", "q_bias", _query_half(H, 0)),
                       Entry("q_proj.bias", "gate_bias", _query_half(H, 1))]
        return halves + own

    @classmethod
    def skeleton(cls, embed, heads, kv_heads, head_dim, scale, bias: bool, dtype, qk_norm_eps: float,
                 unit_offset: bool) -> "GatedAttention":
        """Per-head ``q_norm`` / ``k_norm`` with ``qk_norm_eps`` (zero-centred weights with ``unit_offset``);
        ``bias``: every projection has one (``attention_bias``)."""
        plain = Attention.skeleton(embed, heads, kv_heads, head_dim, scale, bias, bias, dtype)
        norm = lambda: HeadNorm.skeleton(head_dim, qk_norm_eps, dtype, True, unit_offset)
        fields = {f: getattr(plain, f) for f in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "scale")}
        return cls(**fields, q_norm=norm(), k_norm=norm(), gate=shape(embed, heads, head_dim, dtype=dtype),
                   gate_bias=shape(heads, head_dim, dtype=dtype) if bias else None)
