"""Multi-head latent attention (``LatentAttention``: DeepSeek-V2, V2-Lite, V3): queries, keys and values projected
through low-rank latents, the keys' rotary part shared by every head.

    q_latent   = q_a_layernorm(x @ q_a)                          # [batch, seq, q_lora_rank]  (q_lora_rank set)
    q          = q_latent @ q_b   (or x @ q, without q_lora_rank) # [batch, heads, seq, nope + rope]
    c, k_rot   = split(x @ kv_a, [kv_lora_rank, rope])             # kv_a_proj_with_mqa
    kv_latent  = kv_a_layernorm(c)                                 # [batch, seq, kv_lora_rank]: what is cached
    rope_keys  = rope(k_rot)                                       # [batch, seq, rope]: cached too, shared by the heads
    k_nope, v  = split(kv_latent @ kv_b, [nope, v_head_dim])       # per head
    keys       = [k_nope_h, rope_keys] for each head h             # [batch, heads, seq, nope + rope]
    queries    = [q_nope, rope(q_rope)]
    out        = o_proj(softmax(queries · keysᵀ · scale + mask) @ values)

Values (``self_attn.*``): ``q_latent`` (with ``q_lora_rank``) and ``kv_latent`` (after their norms: what
``q_b_proj`` / ``kv_b_proj`` read), ``rope_keys`` (the rotated shared key part), and the standard interior with
``attention_queries`` / ``attention_keys`` the per-head tensors entering the product (``nope + rope`` wide: each
head's own unrotated part, then the rotary part — the query's own, and for the keys ``rope_keys`` broadcast to
every head, the same numbers in each head), ``attention_values`` ``v_head_dim`` wide, scores, probabilities,
head outputs and premix as ``Attention``'s. Edits of ``q_latent``, ``kv_latent`` and ``rope_keys`` reach
everything after them (an edit of ``kv_latent`` changes both the keys' unrotated parts and the values).

``scale`` is ``(nope + rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN with
``mscale_all_dim`` (transformers' ``yarn_apply_mscale``; the family computes it).

The rotary turns ``rope_keys`` and each query's last ``rope`` dims; ``rotary``:

* ``"complex"`` (DeepSeek-V2): adjacent pairs ``(2i, 2i + 1)`` as complex numbers times ``exp(i·θ)``, in float32
  (the caller's cos/sin in float32: ``CausalLM.rotary_in_float32``) and cast back; the output stays interleaved.
* ``"deinterleaved"`` (DeepSeek-V3's ``rope_interleave``): the same pairs, the result laid out as halves (the even
  dims' rotations, then the odd ones': transformers' ``apply_rotary_pos_emb_interleave``), in the model dtype.
* ``"halves"``: the rotary of Llama (``rotate_half``).

Cache (``jstd.Context``, ``jstd.generate``): a block caches ``kv_latent`` and ``rope_keys``, ``kv_lora_rank +
rope`` numbers per position (576 on DeepSeek-V2/V3), not the per-head keys and values (``heads · (nope + rope +
v_head_dim)``: 5120 on V2-Lite's 16 heads, 40960 on V3's 128). So an edit of ``attention_keys`` or
``attention_values`` cannot reach positions held in a cache: on a run that continues a context (a decoding step)
such an edit raises, naming ``kv_latent`` / ``rope_keys`` (which are cached as edited) instead.

A continued run (a decoding step; a short ``Context`` segment) attends in latent space (``attend_latent``, weight
absorption): ``kv_b``'s key part folded into the queries, scored against the cached latent itself, its value part
applied after the probabilities, so a step costs ``O(cached · heads · (kv_lora + rope))`` instead of expanding
every cached latent (``O(cached · kv_lora · heads · (nope + v_head_dim))``). The same function, roundings apart
(float32 tolerance against transformers); it is taken only where exact for the call (``absorbs``): where
``attention_keys``, ``attention_values``, the scores or the probabilities are read or edited (or the pattern is
frozen), and for a segment long enough that expanding costs less, the run expands the cached latents into keys and
values (``attend_expanded``). The prompt (a run without a cache) always expands.
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jstd.core.tap import Taps
from jstd.kernels import attention as attn_kernels
from jstd.kernels.projection import add_bias, flat_product
from jstd.kernels.rope import apply_rotary
from jstd.nn.attention import Attention
from jstd.nn.namemap import Entry, linear, present, split_in, split_out
from jstd.nn.norms import RMSNorm
from jstd.nn.params import param, shape

ROTARIES = ("complex", "deinterleaved", "halves")
# the sites a block's cache holds (Context.keys / values: cache_layout)
CACHE_SITES = ("layers.self_attn.kv_latent", "layers.self_attn.rope_keys")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm take DeepseekV2RMSNorm's default eps, not rms_norm_eps


class LatentAttention(eqx.Module):
    """Multi-head latent attention (see the module docstring). Weights input-major: ``q_a`` ``[embed, q_lora]``,
    ``q_b`` ``[q_lora, heads, nope + rope]`` (or ``q`` ``[embed, heads, nope + rope]``), ``kv_a`` ``[embed,
    kv_lora + rope]``, ``kv_b`` ``[kv_lora, heads, nope + v]``, ``o`` ``[heads, v, embed]``.

    Called as ``attn(x, (cos_sin, mask), s, past)`` like ``Attention``; ``past``: the cached ``(kv_latent,
    rope_keys)`` ``[batch, 1, cached, kv_lora]`` / ``[batch, 1, cached, rope]`` of earlier positions."""

    q: Float[Array, "embed heads qk_head_dim"] | None = param("embed", "heads", "head_dim")
    q_a: Float[Array, "embed q_lora"] | None = param("embed", "q_lora")
    q_a_bias: Float[Array, "q_lora"] | None = param("q_lora")
    q_norm: RMSNorm | None
    q_b: Float[Array, "q_lora heads qk_head_dim"] | None = param("q_lora", "heads", "head_dim")
    kv_a: Float[Array, "embed kv_lora_rope"] = param("embed", "kv_lora")
    kv_a_bias: Float[Array, "kv_lora_rope"] | None = param("kv_lora")
    kv_norm: RMSNorm
    kv_b: Float[Array, "kv_lora heads nope_v"] = param("kv_lora", "heads", "head_dim")
    o: Float[Array, "heads v_head_dim embed"] = param("heads", "head_dim", "embed")
    o_bias: Float[Array, "embed"] | None = param("embed")
    scale: float = eqx.field(static=True)
    nope: int = eqx.field(static=True)
    rope: int = eqx.field(static=True)
    rotary: str = eqx.field(static=True, default="halves")
    frozen_pattern: bool = eqx.field(static=True, default=False)

    host: ClassVar[str] = "self_attn"
    sliding_window: ClassVar[int | None] = None  # full attention (what attention_inputs asks every attention)
    LATENT_SITES: ClassVar[tuple[str, ...]] = ("kv_latent", "rope_keys")

    @property
    def sites(self) -> tuple[str, ...]:
        return Attention.SITES + self.LATENT_SITES + (("q_latent",) if self.q_b is not None else ())

    @property
    def kv_lora_rank(self) -> int:
        return self.kv_b.shape[-3]

    @property
    def v_head_dim(self) -> int:
        return self.o.shape[-2]

    def cache_layout(self) -> tuple[tuple[str, tuple[int, int]], tuple[str, tuple[int, int]]]:
        """What a block caches per position (``core.context.cache_layout``): ``kv_latent`` and ``rope_keys``."""
        return (CACHE_SITES[0], (1, self.kv_lora_rank)), (CACHE_SITES[1], (1, self.rope))

    def rotate(self, x: Float[Array, "batch heads seq rope"], cos_sin) -> Float[Array, "batch heads seq rope"]:
        """``x`` turned by the rotary, laid out as ``rotary`` says."""
        if self.rotary == "complex":
            return apply_rotary(x.astype(jnp.float32), *cos_sin, interleaved=True).astype(x.dtype)
        if self.rotary == "deinterleaved":
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rotary(x, *cos_sin)

    def expand(self, latent: Float[Array, "batch seq kv_lora"]) -> tuple[Array, Array]:
        """``(k_nope, values)`` ``[batch, heads, seq, nope]`` / ``[batch, heads, seq, v]`` from the latent."""
        kv = jnp.swapaxes(flat_product(latent, self.kv_b), 1, 2)
        return kv[..., :self.nope], kv[..., self.nope:]

    def keys(self, k_nope: Float[Array, "batch heads seq nope"], rope_keys: Float[Array, "batch seq rope"]
             ) -> Float[Array, "batch heads seq qk_head_dim"]:
        """Each head's key: its unrotated part, then the shared rotary part broadcast to the head."""
        shared = jnp.broadcast_to(rope_keys[:, None], (*k_nope.shape[:-1], self.rope)).astype(k_nope.dtype)
        return jnp.concatenate([k_nope, shared], axis=-1)

    def __call__(self, x: Float[Array, "batch seq embed"], args, s: Taps, past=None) -> Float[Array, "batch seq embed"]:
        cos_sin, mask = args
        if self.q_b is not None:
            latent = s("self_attn.q_latent", self.q_norm(add_bias(x @ self.q_a, self.q_a_bias)))
            q = jnp.swapaxes(flat_product(latent, self.q_b), 1, 2)
        else:
            q = jnp.swapaxes(flat_product(x, self.q), 1, 2)
        compressed = add_bias(x @ self.kv_a, self.kv_a_bias)
        kv_latent = s("self_attn.kv_latent", self.kv_norm(compressed[..., :self.kv_lora_rank]))
        rope_keys = self.rotate(compressed[:, None, :, self.kv_lora_rank:], cos_sin)[:, 0]
        rope_keys = s("self_attn.rope_keys", rope_keys)
        q = jnp.concatenate([q[..., :self.nope], self.rotate(q[..., self.nope:], cos_sin)], axis=-1)
        q = s("self_attn.attention_queries", q)
        past = None if past is None else tuple(c[:, 0].astype(x.dtype) for c in past)
        if past is not None and self.absorbs(s, x.shape[1], past[0].shape[1]):
            heads = self.attend_latent(q, past, (kv_latent, rope_keys), mask)
        else:
            heads = self.attend_expanded(q, kv_latent, rope_keys, mask, s, past)
        heads = s("self_attn.attention_head_outputs", heads)
        heads = s("self_attn.attention_premix", heads)
        return add_bias(flat_product(heads, self.o, 2), self.o_bias)

    def absorbs(self, s: Taps, seq: int, cached: int) -> bool:
        """Whether a continued call of ``seq`` tokens over ``cached`` cached positions attends in latent space
        (``attend_latent``) rather than over expanded keys and values (``attend_expanded``): the same function, so
        only where nobody reads or edits what only the expanded path computes (``attention_keys``,
        ``attention_values``, scores, probabilities; no frozen pattern), and where it costs fewer products (a
        decoding step always does: the expansion of every cached latent is gone; a long continued segment does
        not, since each of its tokens then scores ``kv_lora + rope`` wide instead of ``nope + rope``)."""
        per_head = ("self_attn.attention_keys", "self_attn.attention_values", "self_attn.attention_scores",
                    "self_attn.attention_probabilities")
        if self.frozen_pattern or s.touches(*per_head):
            return False
        keys, L, n, r, v = cached + seq, self.kv_lora_rank, self.nope, self.rope, self.v_head_dim
        latent = seq * L * (n + v) + seq * keys * 2 * (L + r)  # absorbing and unabsorbing, scores and mix
        expanded = keys * L * (n + v) + seq * keys * 2 * (n + r)  # the expansion, scores and mix (values padded)
        return latent < expanded

    def attend_latent(self, q: Float[Array, "batch heads seq qk_head_dim"], past: tuple[Array, Array],
                      new: tuple[Array, Array], mask: Bool[Array, "batch 1 seq keys"]
                      ) -> Float[Array, "batch seq heads v"]:
        """Each head's output without per-head keys or values (weight absorption). ``past``: the cached
        ``(kv_latent, rope_keys)`` ``[batch, cached, kv_lora]`` / ``[batch, cached, rope]``; ``new``: the call's own;
        ``mask`` over the cached positions then the call's.

        ``kv_b``'s key part is folded into the query (``absorb``: a query ``kv_lora`` wide), scored against the
        latent itself, the rotary part against ``rope_keys`` (one key "head" serves every query head); the
        probabilities (softmax in float32) times the latent, then ``kv_b``'s value part per head (``unabsorb``).
        The same function as ``attend_expanded`` (``q_nope · (W_uk c) = (q_nope W_ukᵀ) · c``, ``Σ p · W_uv c =
        W_uv Σ p c``; the roundings differ). The cache is read where it lies: its part of the scores and of the mix
        is computed apart from the call's own tokens', never concatenated with them."""
        b, h, s, _ = q.shape
        f32 = jnp.promote_types(q.dtype, jnp.float32)
        rows = lambda x: x.reshape(b, h * s, x.shape[-1])  # each batch row's heads × tokens, head-major: free
        absorbed, rotary = rows(self.absorb(q[..., :self.nope]).astype(q.dtype)), rows(q[..., self.nope:])

        def scores(latent, rope_keys):
            return (jnp.einsum("bql,bkl->bqk", absorbed, latent, preferred_element_type=f32)
                    + jnp.einsum("bqr,bkr->bqk", rotary, rope_keys.astype(q.dtype), preferred_element_type=f32))

        logits = jnp.concatenate([scores(*past), scores(*new)], axis=-1).reshape(b, h, s, -1) * self.scale
        logits = jnp.where(mask, logits, jnp.finfo(f32).min)
        p = rows(jax.nn.softmax(logits, axis=-1).astype(q.dtype))
        cached = past[0].shape[1]
        mixed = (jnp.einsum("bqk,bkl->bql", p[..., :cached], past[0], preferred_element_type=f32)
                 + jnp.einsum("bqk,bkl->bql", p[..., cached:], new[0], preferred_element_type=f32))
        return self.unabsorb(mixed.reshape(b, h, s, -1)).astype(q.dtype)

    def absorb(self, q_nope: Float[Array, "batch heads seq nope"]) -> Float[Array, "batch heads seq kv_lora"]:
        """Each head's unrotated query through its key part of ``kv_b``: ``q_nope · W_ukᵀ`` (float32 products)."""
        w_uk, _ = self.head_major()
        return jnp.einsum("bhsn,hnl->bhsl", q_nope, w_uk, preferred_element_type=jnp.float32)

    def unabsorb(self, mixed: Float[Array, "batch heads seq kv_lora"]) -> Float[Array, "batch seq heads v"]:
        """Each head's probability-weighted latent through its value part of ``kv_b`` (float32 products)."""
        _, w_uv = self.head_major()
        return jnp.swapaxes(jnp.einsum("bhsl,hlv->bhsv", mixed, w_uv, preferred_element_type=jnp.float32), 1, 2)

    def head_major(self) -> tuple[Float[Array, "heads nope kv_lora"], Float[Array, "heads kv_lora v"]]:
        """``kv_b``'s key and value parts laid out as products batched over the heads read them: ``[heads, nope,
        kv_lora]`` and ``[heads, kv_lora, v]``.

        Copies, made behind an optimization barrier so that XLA keeps them as they are: in a loop over decoding
        steps (``generate``'s) they depend on no step, and XLA hoists them out of the loop, once a call. Without
        the barrier the transposes fold into the products, and XLA:CPU's layout assignment (after the hoisting)
        puts a transposed copy of ``kv_b`` inside every step. (A multiply-and-sum that reads ``kv_b`` in place
        instead is an unvectorised reduction there, far slower than the copy.)"""
        w_uk = jnp.transpose(self.kv_b[..., :self.nope], (1, 2, 0))
        w_uv = jnp.swapaxes(self.kv_b[..., self.nope:], 0, 1)
        return jax.lax.optimization_barrier((w_uk, w_uv))

    def attend_expanded(self, q, kv_latent, rope_keys, mask, s: Taps, past) -> Float[Array, "batch seq heads v"]:
        """Attention over per-head keys and values: the latents (``past``: the cached ``(kv_latent, rope_keys)``
        ``[batch, cached, ...]``, then the call's own) expanded through ``kv_b`` (``expand``), the keys, values,
        scores and probabilities tapped."""
        k_nope, v = self.expand(kv_latent)
        k = self.keys(k_nope, rope_keys)
        k_edited = s("self_attn.attention_keys", k)
        v_edited = s("self_attn.attention_values", v)
        if past is not None:
            if k_edited is not k or v_edited is not v:
                raise ValueError(
                    "multi-head latent attention caches kv_latent and rope_keys, not the per-head keys and values: "
                    "an edit of attention_keys or attention_values cannot reach the cached positions of a continued "
                    "run (a Context, a generate step). Edit layers.self_attn.kv_latent (the keys' unrotated parts "
                    "and the values) or layers.self_attn.rope_keys (the keys' rotary part) instead, or run the "
                    "whole sequence with jstd.run")
            cached_latent, cached_rope = past
            past_k_nope, past_v = self.expand(cached_latent)
            k_edited = jnp.concatenate([self.keys(past_k_nope, cached_rope), k_edited], axis=2)
            v_edited = jnp.concatenate([past_v, v_edited], axis=2)
        k, v = k_edited, v_edited
        interior = ("self_attn.attention_scores", "self_attn.attention_probabilities")
        if self.frozen_pattern or s.touches(*interior):
            scores = s("self_attn.attention_scores", attn_kernels.scores(q, k, self.scale, mask))
            probs = s("self_attn.attention_probabilities", attn_kernels.probabilities(scores).astype(v.dtype))
            return attn_kernels.mix(jax.lax.stop_gradient(probs) if self.frozen_pattern else probs, v)
        # the fused kernel takes values as wide as the keys: zero columns, dropped after
        wide = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - v.shape[-1])))
        return attn_kernels.fused(q, k, wide, self.scale, mask)[..., :v.shape[-1]]

    def entries(self, names=None) -> list[Entry]:
        """Its checkpoint tensors relative to it: ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
        ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` (biases with ``attention_bias``)."""
        H = self.o.shape[-3]
        return present(self, [
            Entry("q_proj.weight", "q", split_out(H)),
            Entry("q_a_proj.weight", "q_a", linear), Entry("q_a_proj.bias", "q_a_bias"),
            Entry("q_a_layernorm.weight", "q_norm.weight"), Entry("q_b_proj.weight", "q_b", split_out(H)),
            Entry("kv_a_proj_with_mqa.weight", "kv_a", linear), Entry("kv_a_proj_with_mqa.bias", "kv_a_bias"),
            Entry("kv_a_layernorm.weight", "kv_norm.weight"), Entry("kv_b_proj.weight", "kv_b", split_out(H)),
            Entry("o_proj.weight", "o", split_in(H)), Entry("o_proj.bias", "o_bias"),
        ])

    @classmethod
    def skeleton(cls, embed: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int, nope: int, rope: int,
                 v_head_dim: int, scale: float, bias: bool, dtype, rotary: str = "halves") -> "LatentAttention":
        """The layer's shapes; ``q_lora_rank`` None: a full-rank ``q_proj``. ``bias`` (``attention_bias``): biases on
        ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``. ValueError for an unknown ``rotary`` or an odd rotary
        width."""
        if rotary not in ROTARIES:
            raise ValueError(f"unknown latent-attention rotary {rotary!r}; jstd has {', '.join(ROTARIES)}")
        if rope % 2:
            raise ValueError(f"qk_rope_head_dim={rope} must be even: the rotary turns pairs of dims")
        qk = nope + rope
        s = lambda *d: shape(*d, dtype=dtype)
        low = q_lora_rank is not None
        return cls(
            None if low else s(embed, heads, qk), s(embed, q_lora_rank) if low else None,
            s(q_lora_rank) if low and bias else None,
            RMSNorm.skeleton(q_lora_rank, LATENT_NORM_EPS, dtype) if low else None,
            s(q_lora_rank, heads, qk) if low else None,
            s(embed, kv_lora_rank + rope), s(kv_lora_rank + rope) if bias else None,
            RMSNorm.skeleton(kv_lora_rank, LATENT_NORM_EPS, dtype), s(kv_lora_rank, heads, nope + v_head_dim),
            s(heads, v_head_dim, embed), s(embed) if bias else None, float(scale), int(nope), int(rope), rotary,
        )
