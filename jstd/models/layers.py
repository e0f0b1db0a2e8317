"""Layers shared by every family and tower: norms, MLPs, softmax attention, and the one Block.

Weights are stored input-major (``x @ w``), attention projections split into
heads: q ``[embed, heads, head_dim]``, k and v ``[embed, kv_heads, head_dim]``,
o ``[heads, head_dim, embed]``. Every value a layer computes passes a tap
(``s(site, value)``) under its name *relative to its block*
(``self_attn.attention_queries``); the stack the block runs in supplies the
prefix (``layers.``, ``vision.layers.``).

Each layer owns its fragment of the name map: ``entries(names)`` lists its
checkpoint tensors relative to the module (``q_proj.weight`` -> ``q``), and
the block and stack place the fragments (``Entry.under``). ``names`` holds a
family's HuggingFace module names where they differ between families.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jstd.models.namemap import Entry, linear, split, split_in, split_out
from jstd.kernels import attention as attn_kernels
from jstd.kernels.rope import apply_rotary
from jstd.kernels.rounding import rounded
from jstd.models.base import param, shape
from jstd.core.tap import Taps

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(jnp.asarray(1.702, x.dtype) * x),
    "relu": jax.nn.relu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def add_bias(x, b):
    """``x + b``, or ``x`` where the layer has no bias (``b`` None)."""
    return x if b is None else x + b


def present(module, entries: list[Entry]) -> list[Entry]:
    """The entries whose parameter exists on ``module`` (optional biases and norms are None when absent)."""
    return [e for e in entries if getattr(module, e.path.split(".")[0]) is not None]


def times(x: Float[Array, "..."], multiplier: float) -> Float[Array, "..."]:
    """``x * multiplier`` as torch computes a tensor times a Python float: in float32, cast back.

    (In bfloat16 torch keeps the scalar at float32 precision; rounding it to
    bfloat16 first, as ``x * multiplier`` would in JAX, differs for 0.3.)
    """
    return (x.astype(jnp.float32) * jnp.float32(multiplier)).astype(x.dtype)


class RMSNorm(eqx.Module):
    """x / rms(x) · weight, the normalization in float32 and cast back before the weight (as transformers).

    ``weight_in_float32``: multiply the weight with the float32 normed value and
    cast the product back (OLMo-2/3's norms) instead of casting first (Llama's);
    the two differ only below float32. ``unit_offset``: the stored weight is
    zero-centred and the norm multiplies by ``1 + weight`` (formed in float32,
    then as ``weight_in_float32``: Qwen3.5's and Qwen3-Next's norms).
    """

    weight: Float[Array, "embed"] = param("embed")
    eps: float = eqx.field(static=True)
    weight_in_float32: bool = eqx.field(static=True, default=False)
    unit_offset: bool = eqx.field(static=True, default=False)

    @property
    def effective_weight(self) -> Float[Array, "embed"]:
        """What the normed value is multiplied by, in float32 (``1 + weight`` with ``unit_offset``)."""
        w = self.weight.astype(jnp.float32)
        return 1.0 + w if self.unit_offset else w

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (self.effective_weight * normed).astype(x.dtype)
        if self.weight_in_float32:
            return (self.weight * normed).astype(x.dtype)
        return self.weight * normed.astype(x.dtype)

    def entries(self, names=None) -> list[Entry]:
        return [Entry("weight", "weight")]

    @classmethod
    def skeleton(cls, width: int, eps: float, dtype, weight_in_float32: bool = False,
                 unit_offset: bool = False) -> "RMSNorm":
        return cls(shape(width, dtype=dtype), eps, weight_in_float32, unit_offset)


class HeadNorm(RMSNorm):
    """An RMSNorm over each attention head's ``head_dim`` (a per-head ``q_norm`` / ``k_norm``: Qwen3, Qwen3.5)."""

    weight: Float[Array, "head_dim"] = param("head_dim")


class LayerNorm(eqx.Module):
    """(x - mean) / sqrt(var + eps) · weight + bias, computed in float32 and cast back once (torch's kernel)."""

    weight: Float[Array, "embed"] = param("embed")
    bias: Float[Array, "embed"] = param("embed")
    eps: float = eqx.field(static=True)

    def __call__(self, x: Float[Array, "... embed"]) -> Float[Array, "... embed"]:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        centered = x32 - mean
        var = jnp.mean(centered * centered, axis=-1, keepdims=True)
        y = centered * jax.lax.rsqrt(var + self.eps) * self.weight.astype(jnp.float32) + self.bias.astype(jnp.float32)
        return y.astype(x.dtype)

    def entries(self, names=None) -> list[Entry]:
        return [Entry("weight", "weight"), Entry("bias", "bias")]

    @classmethod
    def skeleton(cls, width: int, eps: float, dtype) -> "LayerNorm":
        return cls(shape(width, dtype=dtype), shape(width, dtype=dtype), eps)


class GatedMLP(eqx.Module):
    """down(act(gate(x)) · up(x)); taps ``mlp.mlp_activation`` and ``mlp.mlp_neurons``; returns down's output."""

    gate: Float[Array, "embed mlp"] = param("embed", "mlp")
    up: Float[Array, "embed mlp"] = param("embed", "mlp")
    down: Float[Array, "mlp embed"] = param("mlp", "embed")
    gate_bias: Float[Array, "mlp"] | None = param("mlp")
    up_bias: Float[Array, "mlp"] | None = param("mlp")
    down_bias: Float[Array, "embed"] | None = param("embed")
    act: str = eqx.field(static=True)

    sites: ClassVar[tuple[str, ...]] = ("mlp_activation", "mlp_neurons")

    def __call__(self, x: Float[Array, "batch seq embed"], s: Taps) -> Float[Array, "batch seq embed"]:
        act = s("mlp.mlp_activation", activation(self.act)(add_bias(x @ self.gate, self.gate_bias)))
        neurons = s("mlp.mlp_neurons", act * add_bias(x @ self.up, self.up_bias))
        return add_bias(neurons @ self.down, self.down_bias)

    def entries(self, names=None) -> list[Entry]:
        return present(self, [
            Entry("gate_proj.weight", "gate", linear), Entry("up_proj.weight", "up", linear),
            Entry("down_proj.weight", "down", linear), Entry("gate_proj.bias", "gate_bias"),
            Entry("up_proj.bias", "up_bias"), Entry("down_proj.bias", "down_bias"),
        ])

    @classmethod
    def skeleton(cls, embed: int, mlp: int, act: str, bias: bool, dtype) -> "GatedMLP":
        b = lambda n: shape(n, dtype=dtype) if bias else None
        return cls(shape(embed, mlp, dtype=dtype), shape(embed, mlp, dtype=dtype), shape(mlp, embed, dtype=dtype),
                   b(mlp), b(mlp), b(embed), act)


class MLP(eqx.Module):
    """fc2(act(fc1(x))) with biases (the ViT MLP): ``mlp.mlp_activation`` is act's output and, with no gate,
    ``mlp.mlp_neurons`` the same value as fc2 receives it."""

    fc1: Float[Array, "embed mlp"] = param("embed", "mlp")
    fc1_bias: Float[Array, "mlp"] = param("mlp")
    fc2: Float[Array, "mlp embed"] = param("mlp", "embed")
    fc2_bias: Float[Array, "embed"] = param("embed")
    act: str = eqx.field(static=True)

    sites: ClassVar[tuple[str, ...]] = ("mlp_activation", "mlp_neurons")

    def __call__(self, x: Float[Array, "batch seq embed"], s: Taps) -> Float[Array, "batch seq embed"]:
        neurons = s("mlp.mlp_neurons", s("mlp.mlp_activation", activation(self.act)(x @ self.fc1 + self.fc1_bias)))
        return neurons @ self.fc2 + self.fc2_bias

    def entries(self, names=None) -> list[Entry]:
        """``names["fc1"]`` / ``names["fc2"]``: the linears' module names where not ``fc1`` / ``fc2`` (Qwen3-VL's
        ``linear_fc1`` / ``linear_fc2``)."""
        fc1, fc2 = ((names or {}).get(k, k) for k in ("fc1", "fc2"))
        return [Entry(f"{fc1}.weight", "fc1", linear), Entry(f"{fc1}.bias", "fc1_bias"),
                Entry(f"{fc2}.weight", "fc2", linear), Entry(f"{fc2}.bias", "fc2_bias")]

    @classmethod
    def skeleton(cls, embed: int, mlp: int, act: str, dtype) -> "MLP":
        return cls(shape(embed, mlp, dtype=dtype), shape(mlp, dtype=dtype), shape(mlp, embed, dtype=dtype),
                   shape(embed, dtype=dtype), act)


class Attention(eqx.Module):
    """Softmax attention with grouped-query heads, optional biases and rotary embedding.

    ``q_norm`` / ``k_norm`` (None on Llama) are RMSNorms applied before the
    rotary: over the whole query / key projection (every head at once, before
    the split into heads: OLMo-2/3) or, when the norm is one head wide
    (``HeadNorm``), over each head (Qwen3, Qwen3.5).

    Called as ``attn(x, (cos_sin, mask), s, past)``: ``cos_sin`` None runs no
    rotary (towers); ``mask`` ``[batch, 1, seq, keys]`` (True: attend) or None
    (every token sees every token, as in a tower).

    Taps (``self_attn.*``), in order: queries, keys, values (after the rotary,
    before the GQA repeat), scores and probabilities (explicit path only: taken
    when either is read or edited), head_outputs, premix. Returns o_proj's output.

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

    host: ClassVar[str] = "self_attn"
    sites: ClassVar[tuple[str, ...]] = (
        "attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_probabilities",
        "attention_head_outputs", "attention_premix",
    )

    def project(self, x, w, b, norm=None):
        if norm is None and x.shape[1] > 1:  # head-major straight out of the product
            y = jnp.einsum("bte,ehd->bhtd", x, w)
            return y if b is None else y + b[None, :, None, :]
        y = flat_product(x, w)  # [batch, seq, heads, head_dim]; one position (a decoding step): see flat_product
        y = y if b is None else y + b
        if norm is None:
            return jnp.swapaxes(y, 1, 2)
        batch, seq, heads, dim = y.shape
        if norm.weight.shape[-1] == dim:  # one head wide: a norm per head
            return jnp.swapaxes(norm(y), 1, 2)
        y = norm(y.reshape(batch, seq, heads * dim)).reshape(batch, seq, heads, dim)
        return jnp.swapaxes(y, 1, 2)

    def gated(self, heads: Float[Array, "batch seq heads head_dim"], x: Float[Array, "batch seq embed"]):
        """What ``o_proj`` receives (``attention_premix``) from the heads' outputs; the heads themselves here
        (a gated attention multiplies them by its gate)."""
        return heads

    def __call__(self, x: Float[Array, "batch seq embed"], args, s: Taps, past=None) -> Float[Array, "batch seq embed"]:
        cos_sin, mask = args
        q = self.project(x, self.q, self.q_bias, self.q_norm)
        k = self.project(x, self.k, self.k_bias, self.k_norm)
        v = self.project(x, self.v, self.v_bias)
        if cos_sin is not None:
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        q = s("self_attn.attention_queries", q)
        k = s("self_attn.attention_keys", k)
        v = s("self_attn.attention_values", v)
        if past is not None:
            k, v = (jnp.concatenate([cached.astype(own.dtype), own], axis=2) for cached, own in zip(past, (k, v)))
        if s.touches("self_attn.attention_scores", "self_attn.attention_probabilities"):
            scores = s("self_attn.attention_scores", attn_kernels.scores(q, k, self.scale, mask))
            probs = s("self_attn.attention_probabilities", attn_kernels.probabilities(scores))
            heads = attn_kernels.mix(probs, v)
        else:
            heads = attn_kernels.fused(q, k, v, self.scale, mask)
        heads = s("self_attn.attention_head_outputs", heads)
        heads = s("self_attn.attention_premix", self.gated(heads, x))
        return add_bias(flat_product(heads, self.o, 2), self.o_bias)

    def entries(self, names=None) -> list[Entry]:
        """``names["out"]``: the output projection's name (``o_proj``; ``out_proj`` on CLIP and SigLIP)."""
        H, K = self.q.shape[-2], self.k.shape[-2]
        o = (names or {}).get("out", "o_proj")
        return present(self, [
            Entry("q_proj.weight", "q", split_out(H)), Entry("k_proj.weight", "k", split_out(K)),
            Entry("v_proj.weight", "v", split_out(K)), Entry(f"{o}.weight", "o", split_in(H)),
            Entry("q_proj.bias", "q_bias", split(H)), Entry("k_proj.bias", "k_bias", split(K)),
            Entry("v_proj.bias", "v_bias", split(K)), Entry(f"{o}.bias", "o_bias"),
            Entry("q_norm.weight", "q_norm.weight"), Entry("k_norm.weight", "k_norm.weight"),
        ])

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


def flat_product(x: Array, w: Array, contracted: int = 1) -> Array:
    """``x``'s last ``contracted`` axes times ``w``'s first ones as one flat product (rows times a matrix): the
    einsum's value, e.g. ``bte,ehd->bthd`` or ``bthd,hde->bte``.

    For a few positions per row (a decoding step) an einsum into or out of the heads lets XLA:CPU's layout
    assignment lay the product out head-major and transpose the *weight* to match: a copy of each such weight at
    every step, inside the decoding loop (layout assignment runs after loop-invariant code motion). The flat
    product reads each weight as stored (``test_the_decoding_loop_reads_every_weight_where_it_lies``).
    """
    inner = int(np.prod(w.shape[:contracted]))
    flat = x.reshape(-1, inner) @ w.reshape(inner, -1)
    return flat.reshape(*x.shape[: x.ndim - contracted], *w.shape[contracted:])


RAW_OUTPUT = {"self_attn": "self_attn.attention_raw_output", "mlp": "mlp.mlp_raw_output"}
# the block's own modules, in the order of the names a family gives them (Block.entries)
BLOCK_PARTS = ("attention_norm", "attn", "attention_post_norm", "mlp_norm", "mlp", "mlp_post_norm")
LLAMA_NAMES = {"attention_norm": "input_layernorm", "attn": "self_attn", "mlp_norm": "post_attention_layernorm",
               "mlp": "mlp"}


class Block(eqx.Module):
    """Every family's block: a mixer and an MLP, each with an optional norm before it, an optional norm
    after it and the family's residual multiplier::

        h   = x + mult · attention_post_norm(attn(attention_norm(x)))
        out = h + mult · mlp_post_norm(mlp(mlp_norm(h)))

    Llama and the towers have the pre-norms only, OLMo's attention blocks the
    post-norms only, HyperCLOVA X both and a multiplier. ``attn`` is softmax
    attention or a DeltaNet mixer (its ``host``: ``self_attn``, ``linear_attn``).

    Values (relative names): ``layer_input``; ``attention_norm_output`` (with an
    input norm; without, the mixer reads ``layer_input``); the mixer's values;
    ``{host}.attention_output`` (what the block adds: after the post-norm and
    multiplier); ``layer_mid``; ``mlp_norm_output`` (with an MLP norm);
    ``mlp_input``; the MLP's values; ``mlp.mlp_output``; ``layer_output``. So
    ``layer_input + attention_output + mlp_output == layer_output`` exactly on
    every block: a post-normed or multiplied contribution is ``rounded`` before
    the add (without it XLA fuses the last multiply into the add, an FMA).
    ``raw_outputs`` serves the sublayers' own outputs before post-norm and
    multiplier (HyperCLOVA X's ``attention_raw_output`` / ``mlp_raw_output``).
    An edit at ``mlp_input`` reaches the MLP only; edit ``layer_mid`` to change
    the stream too.
    """

    attention_norm: RMSNorm | LayerNorm | None
    attn: eqx.Module
    attention_post_norm: RMSNorm | None
    mlp_norm: RMSNorm | LayerNorm | None
    mlp: GatedMLP | MLP
    mlp_post_norm: RMSNorm | None
    residual_multiplier: float = eqx.field(static=True, default=1.0)
    raw_outputs: bool = eqx.field(static=True, default=False)

    def has(self, host: str) -> bool:
        """Whether the block has ``host`` (``self_attn``, ``linear_attn``, ``mlp``; ``""``: the block itself)."""
        return host in ("", "mlp", self.attn.host)

    def sites(self) -> frozenset[str]:
        """The values the block computes, by relative name."""
        host = self.attn.host
        rel = {"layer_input", "layer_mid", "mlp_input", "layer_output", f"{host}.attention_output", "mlp.mlp_output"}
        rel |= {"attention_norm_output"} if self.attention_norm is not None else set()
        rel |= {"mlp_norm_output"} if self.mlp_norm is not None else set()
        rel |= {f"{host}.{x}" for x in self.attn.sites} | {f"mlp.{x}" for x in self.mlp.sites}
        rel |= {RAW_OUTPUT[host], RAW_OUTPUT["mlp"]} if self.raw_outputs else set()
        return frozenset(rel)

    def contribution(self, host: str, y, norm, s: Taps):
        """What the block adds from a sublayer's own output ``y``: post-norm, multiplier, rounded."""
        if self.raw_outputs:
            y = s(RAW_OUTPUT[host], y)
        if norm is None and self.residual_multiplier == 1.0:
            return y  # Llama's block: the sublayer's output is what the block adds
        if norm is not None:
            y = norm(y)
        if self.residual_multiplier != 1.0:
            # the norm's output is rounded to the dtype before the multiplier, as in torch (XLA would otherwise
            # keep it in float32 through the fused multiply: excess precision)
            y = times(rounded(y) if norm is not None else y, self.residual_multiplier)
        return rounded(y)

    def __call__(self, h: Float[Array, "batch seq embed"], args, s: Taps, past=None) -> Float[Array, "batch seq embed"]:
        """One block over the stream ``h``; ``args``: what the mixer takes besides its input (``(cos_sin, mask)``)."""
        host = self.attn.host
        x = s("layer_input", h)
        normed = x if self.attention_norm is None else s("attention_norm_output", self.attention_norm(x))
        a = self.attn(normed, args, s, past)
        a = s(f"{host}.attention_output", self.contribution(host, a, self.attention_post_norm, s))
        mid = s("layer_mid", x + a)
        m_in = mid if self.mlp_norm is None else s("mlp_norm_output", self.mlp_norm(mid))
        m_in = s("mlp_input", m_in)
        m = s("mlp.mlp_output", self.contribution("mlp", self.mlp(m_in, s), self.mlp_post_norm, s))
        return s("layer_output", mid + m)

    def entries(self, names: dict) -> list[Entry]:
        """The block's name map: each part's fragment under the family's module name for it (``names``:
        part -> HuggingFace name, e.g. ``LLAMA_NAMES``; extra keys reach the parts, e.g. ``out``)."""
        entries = []
        for part in BLOCK_PARTS:
            module = getattr(self, part)
            if module is not None:
                if part not in names:
                    raise ValueError(f"the block has {part} but the family's names do not say where it is stored")
                entries += [e.under(names[part] + ".", part + ".") for e in module.entries(names)]
        return entries
