"""Softmax attention shared by every family and tower: ``Attention`` (grouped-query heads, optional biases,
optional q/k norms, rotary).

Weights are stored input-major (``x @ w``), the projections split into heads:
q ``[embed, heads, head_dim]``, k and v ``[embed, kv_heads, head_dim]``, o
``[heads, head_dim, embed]``. Every value it computes passes a tap
(``s(site, value)``) under its name relative to its block
(``self_attn.attention_queries``); ``entries(names)`` lists its checkpoint
tensors relative to the module (``q_proj.weight`` -> ``q``).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jstd.core.tap import Taps
from jstd.kernels import attention as attn_kernels
from jstd.kernels.projection import add_bias, flat_product
from jstd.kernels.rope import apply_rotary
from jstd.nn.params import param, shape
from jstd.nn.namemap import Entry, present, split, split_in, split_out
from jstd.nn.norms import L2Norm, RMSNorm


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

    ``sliding_window`` (static; None: full attention): a query at index ``i``
    attends only keys at ``i - sliding_window + 1 .. i``. The mask the caller
    gives holds the window (``CausalLM`` builds one mask per block kind from
    it, with ``kernels.attention.window_mask``), so scores and probabilities
    still span the whole key axis, the keys outside the window masked.
    ``softcap`` (static; None: none): scores are ``tanh(s / cap) · cap`` of the
    scaled ``q·kᵀ`` (Gemma 2's ``attn_logit_softcapping``);
    ``attention_scores`` is the value after the cap (and the mask).

    ``sinks`` (None but on gpt-oss): a learned logit per head joining every row's softmax as one more column
    (``kernels.attention.sink_probabilities``): it takes probability mass and adds no value. Then
    ``attention_scores`` holds the keys' columns only, ``attention_probabilities`` the joint softmax over the keys
    (rows sum to ``1 - sink_probability``), ``sink_probability`` ``[batch, heads, query]`` the sink's share (an
    edit re-normalises the keys' mass: their probabilities become the softmax over the keys alone times
    ``1 - sink_probability``) and ``attention_sinks`` ``[heads]`` the logits themselves (read-only).

    ``frozen_pattern`` (static; ``jstd.nn.frozen``): the probabilities (as
    edited) are held constant for gradients, so a derivative sees attention as
    a fixed mixing of the values; it takes the explicit path.

    Position and score options (static; off by default):

    * ``rotary_interleaved`` (GPT-J): the rotary turns adjacent dims ``2i, 2i + 1``
      (``rotate_every_two``) instead of the halves (``kernels.rope.apply_rotary``).
    * ``float32_scores`` (GPT-Neo, GPT-J): queries and keys are cast to float32
      before ``q·kᵀ``; ``attention_scores`` is float32 whatever the model's
      dtype, and the probabilities are cast to the values' dtype after the
      softmax. The identity on a float32 model. (GPT-Neo's unscaled scores are
      ``scale`` 1.)
    * ``alibi`` (BLOOM): ALiBi slopes, one a head (``kernels.attention.alibi_slopes``).
      ``attention_scores`` then holds ``scale · q·kᵀ + slope_h · position(key)``
      (torch's form, ``kernels.attention.alibi_bias``): per query it differs from
      the paper's ``-slope_h · (query - key)`` by a constant the softmax ignores,
      so the distance bias a head adds is ``scores - scale · q·kᵀ``.
    * ``scaled_queries`` (OPT): the queries are multiplied by ``scale`` (in float32, rounded to their dtype) before
      an unscaled ``q·kᵀ``, as OPT scales ``q_proj``'s output; ``attention_queries`` are before that scale. The
      same scores up to rounding; in bfloat16 torch's where the scale is no power of two (head_dim 80, 128).

    ``softcap``, ``alibi``, ``float32_scores`` and ``scaled_queries`` reach the kernels as one record, ``score_options``
    (``kernels.attention.ScoreOptions``).

    Llama 4's options (static; off by default):

    * ``attention_chunk`` (chunked local attention): a query attends only the keys of its own chunk of
      ``attention_chunk`` positions (counted from the row's first real token). Like a sliding window, the caller's
      mask holds it (``kernels.attention.chunk_mask``, built per block kind by ``attention_inputs``).
    * ``qk_l2_norm`` (``use_qk_norm``; ``norms.L2Norm``): queries and keys, after the rotary, are normed per head
      without a weight, ``x · rsqrt(mean(x²) + eps)`` in float32 and cast back (transformers' ``Llama4TextL2Norm``);
      ``jstd.nn.frozen`` holds its scale as every norm's.
    * ``temperature`` ``(floor_scale, attn_scale)`` (``attn_temperature_tuning``, on blocks without a rotary): the
      queries are multiplied by ``log1p(floor((position + 1) / floor_scale)) · attn_scale + 1``, in float32 and
      cast back; the positions come as the third element of the call's ``args`` (``attention_inputs`` gives them).

    ``attention_queries`` and ``attention_keys`` are what enters the product: after the rotary and the L2 norm (and,
    for the queries, the temperature). ValueError when a temperature-tuned attention is called without positions.
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
    sliding_window: int | None = eqx.field(static=True, default=None)
    softcap: float | None = eqx.field(static=True, default=None)
    sinks: Float[Array, "heads"] | None = param("heads", default=None)
    frozen_pattern: bool = eqx.field(static=True, default=False)
    rotary_interleaved: bool = eqx.field(static=True, default=False)
    float32_scores: bool = eqx.field(static=True, default=False)
    alibi: tuple[float, ...] | None = eqx.field(static=True, default=None)
    attention_chunk: int | None = eqx.field(static=True, default=None)
    qk_l2_norm: L2Norm | None = None
    temperature: tuple[float, float] | None = eqx.field(static=True, default=None)
    scaled_queries: bool = eqx.field(static=True, default=False)

    host: ClassVar[str] = "self_attn"
    SITES: ClassVar[tuple[str, ...]] = (
        "attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_probabilities",
        "attention_head_outputs", "attention_premix",
    )
    SINK_SITES: ClassVar[tuple[str, ...]] = ("attention_sinks", "sink_probability")

    @property
    def sites(self) -> tuple[str, ...]:
        return self.SITES + (self.SINK_SITES if self.sinks is not None else ())

    @property
    def score_options(self) -> attn_kernels.ScoreOptions:
        """The kernels' record of how scores are made (soft-cap, ALiBi, float32 products)."""
        return attn_kernels.ScoreOptions(self.softcap, self.alibi, self.float32_scores, self.scaled_queries)

    def project(self, x: Float[Array, "batch seq embed"], w: Float[Array, "embed heads head_dim"],
                b: Float[Array, "heads head_dim"] | None, norm: RMSNorm | None = None
                ) -> Float[Array, "batch heads seq head_dim"]:
        """``x`` projected into heads by ``w`` (plus ``b``), normed by ``norm`` (per head when it is one head wide,
        else over the whole projection), head-major."""
        # a flat product, then the heads moved forward (one small transpose the next op fuses): an einsum straight
        # into head-major lets XLA:CPU multiply transposed, copying both the input and the output
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
        cos_sin, mask, *positions = args
        q = self.project(x, self.q, self.q_bias, self.q_norm)
        k = self.project(x, self.k, self.k_bias, self.k_norm)
        v = self.project(x, self.v, self.v_bias)
        if cos_sin is not None:
            q, k = (apply_rotary(x, *cos_sin, interleaved=self.rotary_interleaved) for x in (q, k))
        if self.qk_l2_norm is not None:
            q, k = self.qk_l2_norm(q), self.qk_l2_norm(k)
        if self.temperature is not None:
            if not positions:
                raise ValueError("this attention tunes its temperature by the tokens' positions (Llama 4's NoPE "
                                 "blocks): call it with args (cos_sin, mask, positions), as attention_inputs gives them")
            q = (q * temperature_scale(positions[0], *self.temperature)[:, None, :, None]).astype(q.dtype)
        q = s("self_attn.attention_queries", q)
        k = s("self_attn.attention_keys", k)
        v = s("self_attn.attention_values", v)
        interior = ("self_attn.attention_scores", "self_attn.attention_probabilities")
        if self.sinks is not None:
            s("self_attn.attention_sinks", self.sinks)
            interior += ("self_attn.sink_probability",)
        explicit = self.frozen_pattern or s.touches(*interior)
        if past is not None and explicit:  # the scores span the cached keys then the tokens' own
            k, v = attn_kernels.joined(past, k, v)
        if explicit:
            scores = s("self_attn.attention_scores", attn_kernels.scores(q, k, self.scale, mask, self.score_options))
            probs = attn_kernels.probabilities(scores) if self.sinks is None else self.sunk(scores, s)
            probs = s("self_attn.attention_probabilities", probs.astype(v.dtype))
            heads = attn_kernels.mix(jax.lax.stop_gradient(probs) if self.frozen_pattern else probs, v)
        else:
            heads = attn_kernels.fused(q, k, v, self.scale, mask, self.score_options, self.sinks, past)
        heads = s("self_attn.attention_head_outputs", heads)
        heads = s("self_attn.attention_premix", self.gated(heads, x))
        return add_bias(flat_product(heads, self.o, 2), self.o_bias)

    def sunk(self, scores: Float[Array, "batch heads q k"], s: Taps) -> Float[Array, "batch heads q k"]:
        """The keys' probabilities beside the sinks, tapping ``sink_probability``; where an edit changed it, the
        softmax over the keys alone times ``1 - sink_probability`` (the keys' mass re-normalised)."""
        probs, sink = attn_kernels.sink_probabilities(scores, self.sinks)
        edited = s("self_attn.sink_probability", sink)
        if edited is sink:
            return probs
        alone = attn_kernels.probabilities(scores) * (1 - edited)[..., None]
        return jnp.where((edited == sink)[..., None], probs, alone.astype(probs.dtype))

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
            Entry("sinks", "sinks"),
        ])

    @classmethod
    def skeleton(cls, embed, heads, kv_heads, head_dim, scale, bias: bool, o_bias: bool, dtype,
                 qk_norm_eps: float | None = None, sliding_window: int | None = None,
                 softcap: float | None = None, sinks: bool = False) -> "Attention":
        """``qk_norm_eps``: give the attention OLMo's whole-projection q_norm / k_norm with this eps;
        ``sliding_window``, ``softcap``: the fields (None: full attention, no cap); ``sinks``: a sink logit per
        head (gpt-oss)."""
        b = lambda *d: shape(*d, dtype=dtype) if bias else None
        norm = lambda n: None if qk_norm_eps is None else RMSNorm.skeleton(n * head_dim, qk_norm_eps, dtype, True)
        return cls(
            shape(embed, heads, head_dim, dtype=dtype), shape(embed, kv_heads, head_dim, dtype=dtype),
            shape(embed, kv_heads, head_dim, dtype=dtype), shape(heads, head_dim, embed, dtype=dtype),
            b(heads, head_dim), b(kv_heads, head_dim), b(kv_heads, head_dim),
            shape(embed, dtype=dtype) if o_bias else None, scale, norm(heads), norm(kv_heads),
            None if sliding_window is None else int(sliding_window), None if softcap is None else float(softcap),
            shape(heads, dtype=dtype) if sinks else None,
        )


def temperature_scale(positions: Int[Array, "batch seq"], floor_scale: float, attn_scale: float
                      ) -> Float[Array, "batch seq"]:
    """Llama 4's attention temperature per query: ``log1p(floor((position + 1) / floor_scale)) · attn_scale + 1``
    in float32 (transformers' ``attn_scales``)."""
    p = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0
