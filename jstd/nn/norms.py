"""The norms shared by every family and tower: ``RMSNorm`` (and its per-head ``HeadNorm``), ``LayerNorm``, and the
weightless ``L2Norm`` (Llama 4's q/k norm).

Each computes in float32 as transformers does and casts back; each owns its
fragment of the name map (``entries``: its checkpoint tensors relative to the
module, ``weight`` / ``bias``).

Called with a tap scope and a site name (``norm(x, s, "mlp_norm_normalized")``: a block's norms), a norm serves
its *normalized* value there: ``x / rms(x)`` (LayerNorm: ``(x - mean) / std``) before its weight (and bias), the
value TransformerLens calls ``lnX.hook_normalized``, in the input's dtype; an edit there changes what the weight
multiplies. ``frozen_scale`` (static; ``jstd.nn.frozen``) holds ``1 / rms`` (``1 / std``) constant for gradients:
the forward value is unchanged, a derivative treats the norm as a fixed diagonal (the local linearisation that
attribution graphs use).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jstd.nn.params import param, shape
from jstd.nn.namemap import Entry


def _scaled(x32, inverse, frozen: bool):
    """``x32 · inverse`` with ``inverse`` held constant for gradients when ``frozen``."""
    return x32 * (jax.lax.stop_gradient(inverse) if frozen else inverse)


def _served(normed, dtype, s, site):
    """The float32 ``normed`` passed through the tap at ``site`` in ``dtype`` (where it is read or edited): the
    same float32 value when nothing edits it (a read does not round the forward), the edited value otherwise."""
    if s is None or site is None or not s.touches(site):
        return normed
    read = normed.astype(dtype)
    new = s(site, read)
    return normed if new is read else new.astype(jnp.float32)


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
    frozen_scale: bool = eqx.field(static=True, default=False)

    @property
    def effective_weight(self) -> Float[Array, "embed"]:
        """What the normed value is multiplied by, in float32 (``1 + weight`` with ``unit_offset``)."""
        w = self.weight.astype(jnp.float32)
        return 1.0 + w if self.unit_offset else w

    def __call__(self, x: Float[Array, "... embed"], s=None, site: str | None = None) -> Float[Array, "... embed"]:
        """The normed ``x``; with a tap scope ``s`` and ``site``, ``x / rms(x)`` passes the tap there first."""
        x32 = x.astype(jnp.float32)
        inverse = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        normed = _served(_scaled(x32, inverse, self.frozen_scale), x.dtype, s, site)
        if self.unit_offset:
            return (self.effective_weight * normed).astype(x.dtype)
        if self.weight_in_float32:
            return (self.weight * normed).astype(x.dtype)
        return self.weight * normed.astype(x.dtype)

    def entries(self, names=None) -> list[Entry]:
        """The norm's checkpoint tensor relative to it: ``weight``."""
        return [Entry("weight", "weight")]

    @classmethod
    def skeleton(cls, width: int, eps: float, dtype, weight_in_float32: bool = False,
                 unit_offset: bool = False) -> "RMSNorm":
        """The norm over ``width`` features with its weight as a ``dtype`` shape (no array)."""
        return cls(shape(width, dtype=dtype), eps, weight_in_float32, unit_offset)


class HeadNorm(RMSNorm):
    """An RMSNorm over each attention head's ``head_dim`` (a per-head ``q_norm`` / ``k_norm``: Qwen3, Qwen3.5)."""

    weight: Float[Array, "head_dim"] = param("head_dim")


class L2Norm(eqx.Module):
    """``x · rsqrt(mean(x²) + eps)`` over the last axis without a weight, in float32 and cast back (Llama 4's q/k
    norm, transformers' ``Llama4TextL2Norm``, despite its name an RMS norm). ``frozen_scale``: the ``rsqrt`` held
    for gradients (``jstd.nn.frozen``)."""

    eps: float = eqx.field(static=True)
    frozen_scale: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        x32 = x.astype(jnp.float32)
        inverse = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return _scaled(x32, inverse, self.frozen_scale).astype(x.dtype)


class LayerNorm(eqx.Module):
    """(x - mean) / sqrt(var + eps) · weight + bias, computed in float32 and cast back once (torch's kernel)."""

    weight: Float[Array, "embed"] = param("embed")
    bias: Float[Array, "embed"] = param("embed")
    eps: float = eqx.field(static=True)
    frozen_scale: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Float[Array, "... embed"], s=None, site: str | None = None) -> Float[Array, "... embed"]:
        """The normed ``x``; with a tap scope ``s`` and ``site``, ``(x - mean) / std`` passes the tap there first."""
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        centered = x32 - mean
        var = jnp.mean(centered * centered, axis=-1, keepdims=True)
        normed = _served(_scaled(centered, jax.lax.rsqrt(var + self.eps), self.frozen_scale), x.dtype, s, site)
        y = normed * self.weight.astype(jnp.float32) + self.bias.astype(jnp.float32)
        return y.astype(x.dtype)

    def entries(self, names=None) -> list[Entry]:
        """The norm's checkpoint tensors relative to it: ``weight`` and ``bias``."""
        return [Entry("weight", "weight"), Entry("bias", "bias")]

    @classmethod
    def skeleton(cls, width: int, eps: float, dtype) -> "LayerNorm":
        """The norm over ``width`` features with its weight and bias as ``dtype`` shapes (no arrays)."""
        return cls(shape(width, dtype=dtype), shape(width, dtype=dtype), eps)
