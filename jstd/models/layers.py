"""Blocks shared by the families: RMSNorm, the gated MLP, softmax attention, the pre- and post-norm blocks.

Weights are stored input-major (``x @ w``), attention projections split into
heads: q ``[embed, heads, head_dim]``, k and v ``[embed, kv_heads, head_dim]``,
o ``[heads, head_dim, embed]``. Every value a block computes passes a tap
(``s(site, value)``) under its standard name.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jstd.kernels import attention as attn_kernels
from jstd.kernels.rope import apply_rotary
from jstd.kernels.rounding import rounded
from jstd.models.base import param, shape

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _bias(x, b):
    return x if b is None else x + b


class RMSNorm(eqx.Module):
    """x / rms(x) · weight, the normalization in float32 and cast back before the weight (as transformers).

    ``weight_in_float32``: multiply the weight with the float32 normed value and
    cast the product back (OLMo-2/3's norms) instead of casting first (Llama's);
    the two differ only below float32.
    """

    weight: Float[Array, "embed"] = param("embed")
    eps: float = eqx.field(static=True)
    weight_in_float32: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.weight_in_float32:
            return (self.weight * normed).astype(x.dtype)
        return self.weight * normed.astype(x.dtype)

    @classmethod
    def skeleton(cls, width: int, eps: float, dtype, weight_in_float32: bool = False) -> "RMSNorm":
        return cls(shape(width, dtype=dtype), eps, weight_in_float32)


class GatedMLP(eqx.Module):
    """down(act(gate(x)) · up(x)); taps ``mlp_activation`` and ``mlp_neurons``; returns down's output."""

    gate: Float[Array, "embed mlp"] = param("embed", "mlp")
    up: Float[Array, "embed mlp"] = param("embed", "mlp")
    down: Float[Array, "mlp embed"] = param("mlp", "embed")
    gate_bias: Float[Array, "mlp"] | None = param("mlp")
    up_bias: Float[Array, "mlp"] | None = param("mlp")
    down_bias: Float[Array, "embed"] | None = param("embed")
    act: str = eqx.field(static=True)

    def __call__(self, x: Float[Array, "batch seq embed"], s) -> Float[Array, "batch seq embed"]:
        act = s("layers.mlp.mlp_activation", activation(self.act)(_bias(x @ self.gate, self.gate_bias)))
        neurons = s("layers.mlp.mlp_neurons", act * _bias(x @ self.up, self.up_bias))
        return _bias(neurons @ self.down, self.down_bias)

    @classmethod
    def skeleton(cls, embed: int, mlp: int, act: str, bias: bool, dtype) -> "GatedMLP":
        b = lambda n: shape(n, dtype=dtype) if bias else None
        return cls(shape(embed, mlp, dtype=dtype), shape(embed, mlp, dtype=dtype), shape(mlp, embed, dtype=dtype),
                   b(mlp), b(mlp), b(embed), act)


class Attention(eqx.Module):
    """Softmax attention with grouped-query heads, optional biases and rotary embedding.

    ``q_norm`` / ``k_norm`` (OLMo-2/3; None on Llama) are RMSNorms over the
    whole query / key projection (every head at once), applied before the
    split into heads and before the rotary.

    Taps, in order: queries, keys, values (after the rotary, before the GQA
    repeat), scores and probabilities (explicit path only: taken when either is
    read or edited), head_outputs, premix. Returns o_proj's output.

    ``past``: the cached ``(keys, values)`` ``[batch, kv_heads, cached,
    head_dim]`` of earlier positions (``jstd.Context``); the keys attended are
    then the cached ones followed by the tokens' own, on the ``mask``'s key
    axis and on the scores' and probabilities'.
    """

    q: Float[Array, "embed heads head_dim"] = param("embed", "heads", "head_dim")
    k: Float[Array, "embed kv_heads head_dim"] = param("embed", "kv_heads", "head_dim")
    v: Float[Array, "embed kv_heads head_dim"] = param("embed", "kv_heads", "head_dim")
    o: Float[Array, "heads head_dim embed"] = param("heads", "head_dim", "embed")
    q_bias: Float[Array, "heads head_dim"] | None = param("heads", "head_dim")
    k_bias: Float[Array, "kv_heads head_dim"] | None = param("kv_heads", "head_dim")
    v_bias: Float[Array, "kv_heads head_dim"] | None = param("kv_heads", "head_dim")
    o_bias: Float[Array, "embed"] | None = param("embed")
    scale: float = eqx.field(static=True)
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def project(self, x, w, b, norm=None):
        if norm is None:
            y = jnp.einsum("bte,ehd->bhtd", x, w)
            return y if b is None else y + b[None, :, None, :]
        y = jnp.einsum("bte,ehd->bthd", x, w)
        y = y if b is None else y + b
        batch, seq, heads, dim = y.shape
        y = norm(y.reshape(batch, seq, heads * dim)).reshape(batch, seq, heads, dim)
        return jnp.swapaxes(y, 1, 2)

    def __call__(self, x: Float[Array, "batch seq embed"], cos_sin, mask: Bool[Array, "batch 1 seq keys"], s, past=None):
        q = self.project(x, self.q, self.q_bias, self.q_norm)
        k = self.project(x, self.k, self.k_bias, self.k_norm)
        v = self.project(x, self.v, self.v_bias)
        if cos_sin is not None:
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        q = s("layers.self_attn.attention_queries", q)
        k = s("layers.self_attn.attention_keys", k)
        v = s("layers.self_attn.attention_values", v)
        if past is not None:
            k, v = (jnp.concatenate([cached.astype(own.dtype), own], axis=2) for cached, own in zip(past, (k, v)))
        if s.touches("layers.self_attn.attention_scores", "layers.self_attn.attention_probabilities"):
            scores = s("layers.self_attn.attention_scores", attn_kernels.scores(q, k, self.scale, mask))
            probs = s("layers.self_attn.attention_probabilities", attn_kernels.probabilities(scores))
            heads = attn_kernels.mix(probs, v)
        else:
            heads = attn_kernels.fused(q, k, v, self.scale, mask)
        heads = s("layers.self_attn.attention_head_outputs", heads)
        heads = s("layers.self_attn.attention_premix", heads)
        return _bias(jnp.einsum("bthd,hde->bte", heads, self.o), self.o_bias)

    @classmethod
    def skeleton(cls, embed, heads, kv_heads, head_dim, scale, bias: bool, o_bias: bool, dtype,
                 qk_norm_eps: float | None = None) -> "Attention":
        """``qk_norm_eps``: give the attention OLMo's whole-projection q_norm / k_norm with this eps."""
        b = lambda *d: shape(*d, dtype=dtype) if bias else None
        norm = lambda n: None if qk_norm_eps is None else RMSNorm.skeleton(n * head_dim, qk_norm_eps, dtype, True)
        return cls(
            shape(embed, heads, head_dim, dtype=dtype), shape(embed, kv_heads, head_dim, dtype=dtype),
            shape(embed, kv_heads, head_dim, dtype=dtype), shape(heads, head_dim, embed, dtype=dtype),
            b(heads, head_dim), b(kv_heads, head_dim), b(kv_heads, head_dim),
            shape(embed, dtype=dtype) if o_bias else None, scale, norm(heads), norm(kv_heads),
        )


class PreNormBlock(eqx.Module):
    """Llama's block: h = x + attn(norm(x)); out = h + mlp(norm(h)).

    ``contribution`` turns a sublayer's own output into what the block adds to
    the stream (the identity here; families with post-norms or multipliers
    override it), so ``layer_input + attention_output + mlp_output ==
    layer_output`` holds exactly on every subclass.

    ``mixer`` names the mixer's host: ``self_attn`` here, ``linear_attn`` on a
    block whose ``attn`` is a linear-attention mixer called the same way
    (``attn(x, cos_sin, mask, s, past)``).
    """

    attention_norm: RMSNorm
    attn: Attention
    mlp_norm: RMSNorm
    mlp: GatedMLP

    mixer: ClassVar[str] = "self_attn"

    def contribution(self, sublayer: str, y, s):
        return y

    def __call__(self, h: Float[Array, "batch seq embed"], cos_sin, mask, s, past=None) -> Float[Array, "batch seq embed"]:
        x = s("layers.layer_input", h)
        normed = s("layers.attention_norm_output", self.attention_norm(x))
        a = self.attn(normed, cos_sin, mask, s, past)
        a = s(f"layers.{self.mixer}.attention_output", self.contribution(self.mixer, a, s))
        mid = s("layers.layer_mid", x + a)
        m_in = s("layers.mlp_input", s("layers.mlp_norm_output", self.mlp_norm(mid)))
        m = s("layers.mlp.mlp_output", self.contribution("mlp", self.mlp(m_in, s), s))
        return s("layers.layer_output", mid + m)


class PostNormBlock(eqx.Module):
    """OLMo-2/3's block: the sublayers read the raw stream and are normed before the add.

        h   = x + attention_post_norm(attn(x))
        out = h + mlp_post_norm(mlp(h))

    There is no input norm, so the block has no ``attention_norm_output`` or
    ``mlp_norm_output``; the attention reads ``layer_input`` and
    ``mlp_input`` is ``layer_mid`` itself. ``attention_output`` and
    ``mlp_output`` are the post-norms' outputs (what the stream receives), so
    ``layer_input + attention_output + mlp_output == layer_output`` exactly.
    Taps in PreNormBlock's order. The post-norms' outputs are ``rounded`` so the
    stream adds exactly the values read (and edited) there. (HF names:
    ``post_attention_layernorm`` is ``attention_post_norm``,
    ``post_feedforward_layernorm`` is ``mlp_post_norm``.)
    An edit at ``mlp_input`` reaches the MLP only; edit ``layer_mid`` to change
    the stream too.
    """

    attn: Attention
    attention_post_norm: RMSNorm
    mlp: GatedMLP
    mlp_post_norm: RMSNorm

    def __call__(self, h: Float[Array, "batch seq embed"], cos_sin, mask, s, past=None) -> Float[Array, "batch seq embed"]:
        x = s("layers.layer_input", h)
        a = s("layers.self_attn.attention_output", rounded(self.attention_post_norm(self.attn(x, cos_sin, mask, s, past))))
        mid = s("layers.layer_mid", x + a)
        m = s("layers.mlp.mlp_output", rounded(self.mlp_post_norm(self.mlp(s("layers.mlp_input", mid), s))))
        return s("layers.layer_output", mid + m)


def stack(block_skeleton, num: int):
    """A block skeleton stacked ``num`` times on a leading axis."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((num,) + a.shape, a.dtype), block_skeleton)
