"""Rotary position embeddings at run time, numerically equal to transformers 5.x: ``Rotary`` (the static
frequencies and the cos/sin they give), ``apply_rotary`` and ``rotate_half``, ``mrope_streams``.

``Rotary`` is built from a transformers config by ``jstd.kernels.rope_config.rotary_from_config``; its
frequencies come from ``jstd.kernels.rope_init`` (the float32 replay of transformers' init functions).
What is exact:

* ``cos_sin`` does exactly what the torch forward does: float32
  ``positions * inv_freq``, ``cat(freqs, freqs)``, ``cos``/``sin`` in float32,
  times ``attention_scaling`` (rounded to float32), cast to ``dtype``.
* ``dynamic`` and ``longrope`` choose their frequencies from the run-time
  length ``seq_len = max(positions) + 1`` (over the whole batch, as in
  transformers). Both candidates are computed and one is selected with
  ``jnp.where``, so this works under ``jax.jit`` with traced positions. The
  result is that of the FIRST forward of a freshly built torch module, whose
  cache starts at ``max_position_embeddings``: ``dynamic`` keeps the
  unscaled frequencies up to and including that length and rescales the base
  beyond it (``rope_init.dynamic_inv_freq``). No state is kept between calls
  (torch keeps a grown ``dynamic`` set for later, shorter calls until one drops
  below the original length; that history is not reproduced).
* ``apply_rotary`` is the same expression as transformers'. Bit-exact in
  bfloat16/float16 on CPU; in float32 XLA may contract ``x * cos + r * sin``
  into a fused multiply-add (more accurate; within 1 ulp of torch).
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.kernels.rope_init import dynamic_inv_freq


class Rotary(eqx.Module):
    """A rotary embedding built from a transformers config; all fields are static.

    Fields:
        rope_type: transformers' ``rope_type``.
        inv_freq: the float32 frequencies (``rotary_dim // 2`` of them) a fresh
            torch rotary module holds after ``__init__``: the ``short_factor``
            ones for ``longrope``, the unscaled ones for ``dynamic``.
        attention_scaling: multiplies cos and sin (yarn / longrope; else 1.0).
        rotary_dim: width of cos/sin, ``2 * len(inv_freq)``; the first
            ``rotary_dim`` dims of each head are rotated.
        head_dim: the head width the rotary was built for.
        long_inv_freq: ``longrope`` only: the ``long_factor`` frequencies.
        original_max_position_embeddings: ``longrope``: the length above which
            ``long_inv_freq`` is used; ``dynamic``: the length above which the
            base is rescaled (``config.max_position_embeddings``, torch's
            ``original_max_seq_len``).
        rope_theta, factor, dim: ``dynamic`` only: the base, the factor and the
            ``int(head_dim * partial_rotary_factor)`` of the NTK rescaling.
        mrope_section: multimodal RoPE (Qwen2-VL): positions come as three
            streams ``[3, batch, seq]`` (time, height, width) and the
            frequencies are cut into consecutive sections of these sizes,
            section ``i`` turning with stream ``i % 3``. None: 1-D positions.
        mrope_interleaved: the streams interleave instead (Qwen3-VL, Qwen3.5;
            see ``mrope_streams``).
    """

    rope_type: str = eqx.field(static=True)
    inv_freq: tuple[float, ...] = eqx.field(static=True)
    attention_scaling: float = eqx.field(static=True)
    rotary_dim: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    long_inv_freq: tuple[float, ...] | None = eqx.field(static=True, default=None)
    original_max_position_embeddings: int | None = eqx.field(static=True, default=None)
    rope_theta: float | None = eqx.field(static=True, default=None)
    factor: float | int | None = eqx.field(static=True, default=None)
    dim: int | None = eqx.field(static=True, default=None)
    mrope_section: tuple[int, ...] | None = eqx.field(static=True, default=None)
    mrope_interleaved: bool = eqx.field(static=True, default=False)

    def inv_freq_for(self, seq_len: Int[Array, ""]) -> Float[Array, " half"]:
        """The float32 frequencies a fresh torch module uses on a first call with this ``seq_len``.

        ``seq_len`` is ``max(position_ids) + 1``; it matters only for ``dynamic``
        (rescaled base when ``seq_len > original_max_position_embeddings``) and
        ``longrope`` (long factors when ``seq_len > original_max_position_embeddings``).
        """
        inv = jnp.asarray(np.asarray(self.inv_freq, dtype=np.float32))
        if self.rope_type == "longrope":
            long = jnp.asarray(np.asarray(self.long_inv_freq, dtype=np.float32))
            return jnp.where(seq_len > self.original_max_position_embeddings, long, inv)
        if self.rope_type == "dynamic":
            max_pos = self.original_max_position_embeddings
            grown = dynamic_inv_freq(seq_len, self.rope_theta, self.factor, max_pos, self.dim)
            return jnp.where(seq_len > max_pos, grown, inv)
        return inv

    def cos_sin(
        self, positions: Int[Array, "batch seq"] | Int[Array, "3 batch seq"], dtype
    ) -> tuple[Float[Array, "batch seq rotary_dim"], Float[Array, "batch seq rotary_dim"]]:
        """cos and sin exactly as transformers' rotary module returns them.

        ``freqs = float32(positions)[..., None] * inv_freq`` (float32),
        ``emb = cat(freqs, freqs)``, ``cos(emb) * attention_scaling`` and
        ``sin(emb) * attention_scaling`` in float32, cast to ``dtype``.
        For ``dynamic`` / ``longrope`` the frequencies depend on
        ``max(positions) + 1`` over the whole batch, as on a first torch call.
        Works under ``jax.jit`` with traced positions.

        With ``mrope_section`` the positions are ``[3, batch, seq]`` (``[batch,
        seq]`` is taken as three equal streams): frequency ``j`` takes the
        position of stream ``mrope_streams(...)[j]``, the same elementwise
        products as transformers' per-stream cos/sin recomposed by section (or
        interleaved).
        """
        positions = jnp.asarray(positions)
        seq_len = jnp.max(positions).astype(jnp.int32) + 1
        inv = self.inv_freq_for(seq_len)
        if self.mrope_section is None:
            angles = positions[..., None].astype(jnp.float32)
        else:
            if positions.ndim == 2:
                positions = jnp.broadcast_to(positions, (3, *positions.shape))
            stream = mrope_streams(self.mrope_section, len(self.inv_freq), self.mrope_interleaved)
            angles = jnp.moveaxis(positions[stream], 0, -1).astype(jnp.float32)  # [batch, seq, half]
        freqs = angles * inv
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        scale = jnp.float32(self.attention_scaling)
        cos = jnp.cos(emb) * scale
        sin = jnp.sin(emb) * scale
        return cos.astype(dtype), sin.astype(dtype)


def mrope_streams(section: tuple[int, ...], half: int, interleaved: bool) -> Int[np.ndarray, " half"]:
    """Which position stream (0 time, 1 height, 2 width) each of the ``half`` rotary frequencies turns with.

    Sectioned (Qwen2-VL): consecutive sections of ``section``'s sizes, section ``i`` on stream ``i % 3``.
    Interleaved (Qwen3-VL, Qwen3.5: transformers' ``recomposition_frequencies``): frequency ``j`` turns with the
    height when ``j % 3 == 1`` and ``j < 3 * section[1]``, with the width when ``j % 3 == 2`` and
    ``j < 3 * section[2]``, with the time otherwise.
    """
    if not interleaved:
        return np.concatenate([np.full(n, i % 3) for i, n in enumerate(section)])
    stream = np.zeros(half, np.int64)
    for s in (1, 2):
        stream[s:section[s] * 3:3] = s
    return stream


def rotate_half(x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """``[-x2, x1]`` for the halves ``x1, x2`` of the last axis (the rotary pairing of transformers'
    non-interleaved rope)."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotate_every_two(x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """``(-x1, x0, -x3, x2, …)``: the rotary pairing of adjacent dims (GPT-J's ``rotate_every_two``)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


def apply_rotary(
    x: Float[Array, "batch heads seq head_dim"],
    cos: Float[Array, "batch seq rotary_dim"],
    sin: Float[Array, "batch seq rotary_dim"],
    interleaved: bool = False,
) -> Float[Array, "batch heads seq head_dim"]:
    """``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` dims of each head.

    cos/sin broadcast over heads (transformers' ``unsqueeze_dim=1``); dims from
    ``rotary_dim`` on pass through unchanged. Same operations, in the same
    order, as transformers' ``apply_rotary_pos_emb`` (the partial-rotary
    version when ``rotary_dim < head_dim``); result in ``x.dtype``.

    ``interleaved`` (GPT-J's ``rotate_every_two``): frequency ``i``
    turns the adjacent dims ``2i, 2i + 1`` instead of ``i, i + rotary_dim / 2``:
    ``x * cos' + rotate_every_two(x) * sin'`` with each of ``Rotary.cos_sin``'s
    frequencies repeated twice in place (torch's ``repeat_interleave``), the same
    values GPT-J's sinusoid table holds.
    """
    rotary_dim = cos.shape[-1]
    if interleaved:  # cos_sin's layout is cat(f, f): each frequency once from the first half, repeated in place
        cos, sin = (jnp.repeat(c[..., :rotary_dim // 2], 2, axis=-1) for c in (cos, sin))
    cos = cos[:, None]
    sin = sin[:, None]
    x_rot = x[..., :rotary_dim]
    out = x_rot * cos + (rotate_every_two if interleaved else rotate_half)(x_rot) * sin
    if rotary_dim < x.shape[-1]:
        out = jnp.concatenate([out.astype(x.dtype), x[..., rotary_dim:]], axis=-1)
    return out.astype(x.dtype)
