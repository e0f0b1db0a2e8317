"""The gated DeltaNet mixer (linear attention) and the pre-norm block around it.

    q, k, v = silu(causal_conv(x @ W_q)), silu(causal_conv(x @ W_k)), silu(causal_conv(x @ W_v))
    decay   = -exp(A_log) · softplus(x @ W_a + dt_bias)          # log decay, float32
    beta    = sigmoid(x @ W_b)  (· 2 with linear_allow_neg_eigval)
    y, S    = gated_delta_rule(q, k, v, decay, beta, S0)         # l2-normed q, k inside
    out     = o_proj(rms_norm(y) · silu(x @ W_g))                # per value head

as transformers' ``OlmoHybridGatedDeltaNet`` and ``Qwen3_5GatedDeltaNet`` (the same
mixer; their checkpoints lay the projections out differently: ``entries``). The causal convolutions are
depthwise, ``conv_width`` taps wide, zero-padded on the left. With a padding
mask, ``x`` is zeroed at padded positions first (transformers'
``apply_mask_to_padding_states``): with left padding the state stays exactly
zero through the padding, so a padded row equals its unpadded prompt.

Taps (``linear_attn.*``, relative to the block), in order: ``attention_queries``,
``attention_keys`` ``[batch, seq, qk_heads, key_dim]`` (after the convolution
and its SiLU, before the kernel's l2 norm), ``attention_values``
``[batch, seq, heads, value_dim]``, ``decays``, ``betas`` ``[batch, seq,
heads]``, ``state_input`` (zeros: the state a prompt starts from; an edit there
is the kernel's initial state), ``states`` (read-only: the state after every
token, formed only when read), ``state_output`` (read-only: the state after
the last token, what a cache keeps; nothing in the call reads it, so an edit
there could change nothing — edit ``state_input`` or the values that write
it), ``attention_head_outputs``
(the kernel's output, before the gated norm and ``o_proj``). States are
float32 ``[batch, heads, key_dim, value_dim]``. When ``states`` is read,
``state_output`` is its last entry, so ``states[:, -1] == state_output``
exactly.

``frozen_pattern`` (static; ``jstd.nn.frozen``), the analogue of softmax attention's held probabilities: the
mixer's *pattern* — everything but its values — is held for gradients: the queries and keys (after their
convolution and SiLU, so their l2 norms too), the decays and betas, the output gate ``silu(x @ W_g)`` and (an
``RMSNorm``, frozen with the others) the output norm's ``1 / rms``; on the value path the activation after the
convolution is held as a gain, ``act(u) = u · (act(u) / u)`` with the ratio held. The delta rule is linear in the
values once ``q, k, decay, beta`` are fixed, so a derivative then sees the mixer as a fixed linear map of its input
along the values (``x @ W_v``, the convolution, the held gain, the recurrence, the held norm and gate, ``o_proj``).
The forward is unchanged.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jstd.kernels.select import gated_delta_rule  # the kernel for the backend (jstd/kernels/select.py)
from jstd.nn.namemap import Entry, linear, split_in, split_out
from jstd.nn.params import param, shape
from jstd.kernels.activations import activation
from jstd.kernels.projection import flat_product
from jstd.nn.norms import RMSNorm
from jstd.core.tap import Taps

SITE = "linear_attn."


def causal_conv(x: Float[Array, "batch seq heads dim"], w: Float[Array, "width heads dim"],
                before: Float[Array, "batch width_1 heads dim"] | None = None) -> Float[Array, "batch seq heads dim"]:
    """Depthwise causal convolution along seq: ``out[t] = sum_j w[j] x[t - width + 1 + j]``.

    ``before`` holds the ``width - 1`` inputs before ``x[0]`` (None: zeros, a
    sequence starting at position 0). Accumulated in float32 (as torch's
    conv1d), cast back to ``x``'s dtype.
    """
    width, seq = w.shape[0], x.shape[1]
    if before is None:
        padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (width - 1, 0), (0, 0), (0, 0)))
    else:
        padded = jnp.concatenate([before, x], axis=1).astype(jnp.float32)
    w = w.astype(jnp.float32)
    out = padded[:, 0:seq] * w[0]
    for j in range(1, width):
        out = out + padded[:, j:j + seq] * w[j]
    return out.astype(x.dtype)


def held_gain(act, u: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """``act(u)`` whose derivative is the held gain ``act(u) / u`` (``act'(0)`` where ``u == 0``): the forward value
    is ``act(u)``; a derivative sees multiplication by a fixed diagonal (``sigmoid(u)`` for SiLU)."""
    out = act(u)
    nonzero = u != 0
    at_zero = jax.grad(lambda z: act(z))(jnp.zeros((), jnp.float32)).astype(u.dtype)
    ratio = jnp.where(nonzero, out / jnp.where(nonzero, u, 1), at_zero)
    return jax.lax.stop_gradient(out) + (u - jax.lax.stop_gradient(u)) * jax.lax.stop_gradient(ratio)


class HeadRMSNorm(RMSNorm):
    """An RMSNorm over each head's values (its weight's axis is ``value_dim``, not ``embed``)."""

    weight: Float[Array, "value_dim"] = param("value_dim")


class GatedDeltaNet(eqx.Module):
    """The gated DeltaNet mixer; called as ``mixer(x, (cos_sin, mask), s, past)`` like softmax attention.

    ``cos_sin`` is unused (the delta rule has no positions); ``mask`` is the
    ``[batch, seq]`` padding mask (True: a real token) or None. ``past``
    (``jstd.Context``) is ``(state, conv_inputs)``: the state before the first
    token ``[batch, heads, key_dim, value_dim]`` (what ``state_input`` then
    holds) and the mixer inputs at the ``conv_width - 1`` positions before it
    ``[batch, conv_width - 1, embed]``. Returns ``o_proj``'s output.
    """

    q: Float[Array, "embed qk_heads key_dim"] = param("embed", "linear_qk_heads", "key_dim")
    k: Float[Array, "embed qk_heads key_dim"] = param("embed", "linear_qk_heads", "key_dim")
    v: Float[Array, "embed heads value_dim"] = param("embed", "linear_heads", "value_dim")
    q_conv: Float[Array, "width qk_heads key_dim"] = param("conv", "linear_qk_heads", "key_dim")
    k_conv: Float[Array, "width qk_heads key_dim"] = param("conv", "linear_qk_heads", "key_dim")
    v_conv: Float[Array, "width heads value_dim"] = param("conv", "linear_heads", "value_dim")
    a: Float[Array, "embed heads"] = param("embed", "linear_heads")
    b: Float[Array, "embed heads"] = param("embed", "linear_heads")
    A_log: Float[Array, "heads"] = param("linear_heads")
    dt_bias: Float[Array, "heads"] = param("linear_heads")
    gate: Float[Array, "embed heads value_dim"] = param("embed", "linear_heads", "value_dim")
    o_norm: "HeadRMSNorm"
    o: Float[Array, "heads value_dim embed"] = param("linear_heads", "value_dim", "embed")
    act: str = eqx.field(static=True)
    allow_neg_eigval: bool = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True, default=32)  # the chunked kernel's fastest on CPU (docs/benchmarks.md)
    frozen_pattern: bool = eqx.field(static=True, default=False)

    host: ClassVar[str] = "linear_attn"
    sites: ClassVar[tuple[str, ...]] = (
        "attention_queries", "attention_keys", "attention_values", "decays", "betas", "state_input", "states",
        "state_output", "attention_head_outputs",
    )

    @property
    def conv_width(self) -> int:
        """The convolutions' width (``linear_conv_kernel_dim``)."""
        return self.q_conv.shape[-3]

    def __call__(self, x: Float[Array, "batch seq embed"], args, s: Taps, past=None):
        _, mask = args
        if mask is not None:
            x = x * mask[..., None].astype(x.dtype)
        act = activation(self.act)
        proj = flat_product  # x [batch, seq, embed] times w [embed, heads, dim]
        earlier = None if past is None else past[1].astype(x.dtype)
        conv = lambda w, c: causal_conv(proj(x, w), c, None if earlier is None else proj(earlier, w))
        held = jax.lax.stop_gradient if self.frozen_pattern else (lambda a: a)
        q = held(s(SITE + "attention_queries", act(conv(self.q, self.q_conv))))
        k = held(s(SITE + "attention_keys", act(conv(self.k, self.k_conv))))
        u = conv(self.v, self.v_conv)
        v = s(SITE + "attention_values", held_gain(act, u) if self.frozen_pattern else act(u))
        a = jnp.einsum("bte,eh->bth", x, self.a).astype(jnp.float32)
        decay = -jnp.exp(self.A_log.astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias.astype(jnp.float32))
        decay = held(s(SITE + "decays", decay))
        beta = jax.nn.sigmoid(jnp.einsum("bte,eh->bth", x, self.b))
        beta = held(s(SITE + "betas", beta * 2.0 if self.allow_neg_eigval else beta))

        batch, heads, key_dim, value_dim = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
        initial = None if past is None else past[0].astype(jnp.float32)
        if s.touches(SITE + "state_input"):
            start = jnp.zeros((batch, heads, key_dim, value_dim), jnp.float32) if initial is None else initial
            initial = s(SITE + "state_input", start)
        with_states = s.touches(SITE + "states")
        result = gated_delta_rule(q, k, v, decay, beta, initial_state=initial, use_qk_l2norm=True,
                                  chunk_size=self.chunk_size, return_states=with_states)
        if with_states:
            y, _, states = result
            states = s(SITE + "states", states)
            final = states[:, -1]
        else:
            y, final = result
        s(SITE + "state_output", final)  # read-only (jstd/core/sites.py): what a cache keeps; nothing downstream reads it
        y = s(SITE + "attention_head_outputs", y)

        gate = held(jax.nn.silu(proj(x, self.gate).astype(jnp.float32)))
        y = (self.o_norm(y).astype(jnp.float32) * gate).astype(y.dtype)
        return flat_product(y, self.o, 2)

    def entries(self, names=None) -> list[Entry]:
        """transformers' names, in the layout ``names["linear_attn_layout"]`` gives.

        ``"separate"`` (the default; OLMo-Hybrid): ``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``, ``b_proj``,
        ``g_proj`` (the gate), ``o_norm``, ``o_proj``; the q, k and v convolutions are one depthwise conv1d in
        transformers, which checkpoints store in three parts (``q_conv1d``, ``k_conv1d``, ``v_conv1d``: split as
        q|k|v in OLMo-core's files, in equal thirds when transformers saved them), so the parts are concatenated
        and split by q|k|v channels. ``"fused"`` (Qwen3.5): ``in_proj_qkv`` (q|k|v rows), ``in_proj_z`` (the
        gate), ``in_proj_a``, ``in_proj_b``, one ``conv1d`` over q|k|v channels, ``norm``, ``out_proj``.
        """
        width, Hk, dk = self.q_conv.shape[-3:]
        Hv = self.v_conv.shape[-2]
        key_dim = Hk * dk

        def conv(start, stop, heads):  # [q|k|v channels, 1, width] -> [width, heads, dim]
            return lambda w: w[start:stop, 0, :].T.reshape(width, heads, -1)

        def rows(start, stop, heads):  # [q|k|v rows, embed] -> [embed, heads, dim]
            return lambda w: split_out(heads)(w[start:stop])

        layout = (names or {}).get("linear_attn_layout", "separate")
        if layout == "fused":
            qkv, convs, a, b, gate, norm, out = ("in_proj_qkv.weight", "conv1d.weight", "in_proj_a", "in_proj_b",
                                                 "in_proj_z", "norm", "out_proj")
            projections = [Entry(qkv, "q", rows(0, key_dim, Hk)), Entry(qkv, "k", rows(key_dim, 2 * key_dim, Hk)),
                           Entry(qkv, "v", rows(2 * key_dim, None, Hv))]
        elif layout == "separate":
            convs, a, b, gate, norm, out = (tuple(f"{x}_conv1d.weight" for x in "qkv"), "a_proj", "b_proj", "g_proj",
                                            "o_norm", "o_proj")
            projections = [Entry("q_proj.weight", "q", split_out(Hk)), Entry("k_proj.weight", "k", split_out(Hk)),
                           Entry("v_proj.weight", "v", split_out(Hv))]
        else:
            raise ValueError(f"unknown DeltaNet checkpoint layout {layout!r}; known: 'separate', 'fused'")
        return projections + [
            Entry(convs, "q_conv", conv(0, key_dim, Hk)), Entry(convs, "k_conv", conv(key_dim, 2 * key_dim, Hk)),
            Entry(convs, "v_conv", conv(2 * key_dim, None, Hv)),
            Entry(f"{a}.weight", "a", linear), Entry(f"{b}.weight", "b", linear),
            Entry("A_log", "A_log"), Entry("dt_bias", "dt_bias"), Entry(f"{gate}.weight", "gate", split_out(Hv)),
            Entry(f"{norm}.weight", "o_norm.weight"), Entry(f"{out}.weight", "o", split_in(Hv)),
        ]

    @classmethod
    def skeleton(cls, embed, qk_heads, heads, key_dim, value_dim, width, act, allow_neg_eigval, norm_eps, dtype):
        return cls(
            shape(embed, qk_heads, key_dim, dtype=dtype), shape(embed, qk_heads, key_dim, dtype=dtype),
            shape(embed, heads, value_dim, dtype=dtype),
            shape(width, qk_heads, key_dim, dtype=dtype), shape(width, qk_heads, key_dim, dtype=dtype),
            shape(width, heads, value_dim, dtype=dtype),
            shape(embed, heads, dtype=dtype), shape(embed, heads, dtype=dtype),
            shape(heads, dtype=dtype), shape(heads, dtype=dtype),
            shape(embed, heads, value_dim, dtype=dtype),
            HeadRMSNorm.skeleton(value_dim, norm_eps, dtype),
            shape(heads, value_dim, embed, dtype=dtype),
            act, bool(allow_neg_eigval),
        )
