"""Rotary position embeddings, numerically equal to transformers 5.x.

Covers every ``rope_type`` of transformers' ``ROPE_INIT_FUNCTIONS`` that a
plain (1-D positions) rotary module uses: ``default``, ``linear``, ``dynamic``,
``yarn``, ``longrope``, ``llama3`` and ``proportional``, each with
``partial_rotary_factor`` (rotary on the first ``rotary_dim`` dims of a head,
the rest passed through).

How the numbers are made, and what is exact:

* The frequencies a fresh torch module holds after ``__init__`` are computed
  here once, on the host, in numpy, replaying transformers' float32 operations
  one by one (same order, same float32 rounding of Python scalars, ``a / t``
  as ``reciprocal(t) * a`` like torch's ``__rtruediv__``). The one operation
  not replayed bit for bit is torch's float32 ``pow``, which is platform
  dependent: on CPU, ``pow`` over 32+ lanes goes through SLEEF (within 1 ulp,
  differs from correct rounding in ~2% of elements), shorter tails through
  libm (correctly rounded nearly always); CUDA differs again. Here ``pow`` is
  correctly rounded (float64, rounded once), so ``inv_freq`` equals torch's
  wherever torch's ``pow`` rounds correctly and is within 1 ulp elsewhere;
  every other step is bit-exact given equal ``pow``.
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
  beyond it. No state is kept between calls (torch keeps a grown ``dynamic``
  set for later, shorter calls until one drops below the original length;
  that history is not reproduced).
* ``dynamic``'s rescaled base is torch's exact float32 value (a host table)
  for lengths up to ``max(2 * ceil(factor), 4) * max_position_embeddings``
  (at most 65536 entries past it); beyond, it is evaluated in float32 and is
  1 ulp off for a few percent of lengths. The run-time float math is fenced
  with ``lax.optimization_barrier`` because XLA's algebraic simplifier
  otherwise rewrites it (``(c1 * q) / c2`` -> ``q * (c1 / c2)``,
  ``1 / pow(b, e)`` -> ``pow(b, -e)``), which rounds differently.
* ``apply_rotary`` is the same expression as transformers'. Bit-exact in
  bfloat16/float16 on CPU; in float32 XLA may contract ``x * cos + r * sin``
  into a fused multiply-add (more accurate; within 1 ulp of torch).
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax.numpy as jnp
from jax import lax
import numpy as np
from jaxtyping import Array, Float, Int

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")

_f32 = np.float32


# ---------------------------------------------------------------------------
# host-side replay of transformers' float32 init functions (numpy, no torch)
# ---------------------------------------------------------------------------


def _exponents(dim: int, denom: int | None = None) -> np.ndarray:
    """``torch.arange(0, dim, 2).float() / denom`` in float32."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(_f32) / _f32(dim if denom is None else denom)


def _pow(base, exps: np.ndarray) -> np.ndarray:
    """``float32(base) ** exps`` (float32), correctly rounded."""
    b = np.float64(_f32(base))
    return (b ** exps.astype(np.float64)).astype(_f32)


def _recip(x: np.ndarray, numerator=1.0) -> np.ndarray:
    """torch's ``numerator / tensor``: ``tensor.reciprocal() * numerator`` in float32."""
    r = (_f32(1.0) / x).astype(_f32)
    return r if numerator == 1.0 else (r * _f32(numerator)).astype(_f32)


def default_inv_freq(base, dim: int) -> np.ndarray:
    """The default rotary frequencies ``1 / base ** (2i / dim)``, rounded as torch computes them in float32."""
    return _recip(_pow(base, _exponents(dim)))


def _linear_inv_freq(base, dim, factor) -> np.ndarray:
    return (default_inv_freq(base, dim) / _f32(factor)).astype(_f32)


def _dynamic_base_at_init(base, factor, max_pos, dim) -> float:
    """The base ``_compute_dynamic_ntk_parameters`` uses when ``seq_len`` is None (Python floats)."""
    seq_len = max_pos
    return base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))


def _torch_scalar_pow(s: np.ndarray, e: float) -> np.ndarray:
    """torch's ``float32 tensor ** python_float``: its special exponents, else double ``pow`` rounded to float32.

    The exponent here is ``dim / (dim - 2)``, so of torch's special cases only 2 (dim 4), 3 (dim 3)
    and -1 (dim 1) can occur.
    """
    s = np.asarray(s, dtype=_f32)
    if e == 2.0:
        return (s * s).astype(_f32)
    if e == 3.0:
        return ((s * s).astype(_f32) * s).astype(_f32)
    if e == -1.0:
        return (_f32(1) / s).astype(_f32)
    return (s.astype(np.float64) ** e).astype(_f32)


_DYNAMIC_TABLE_MAX = 1 << 16


def _dynamic_table_size(factor, max_pos: int) -> int:
    return int(min(max(2 * math.ceil(factor), 4) * max_pos, _DYNAMIC_TABLE_MAX))


@functools.lru_cache(maxsize=16)
def _dynamic_base_table(theta: float, factor, max_pos: int, dim: int, n: int) -> np.ndarray:
    """torch's float32 rescaled base for ``seq_len = max_pos + 1 ... max_pos + n``."""
    seq_len = np.arange(max_pos + 1, max_pos + 1 + n, dtype=np.int64)
    if isinstance(factor, int):
        scaled = (seq_len * factor).astype(_f32)
    else:
        scaled = (_f32(factor) * seq_len.astype(_f32)).astype(_f32)
    s = ((scaled / _f32(max_pos)).astype(_f32) - _f32(factor - 1)).astype(_f32)
    table = (_f32(theta) * _torch_scalar_pow(s, dim / (dim - 2))).astype(_f32)
    table.flags.writeable = False
    return table


def _yarn_inv_freq(base, dim, factor, original_max, beta_fast, beta_slow, truncate) -> np.ndarray:
    def find_correction_dim(num_rotations):
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = find_correction_dim(beta_fast)
    high = find_correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' singularity guard
    n = dim // 2
    ramp = (np.arange(n, dtype=_f32) - _f32(low)) / _f32(high - low)
    ramp = np.clip(ramp.astype(_f32), _f32(0), _f32(1))
    pos_freqs = _pow(base, _exponents(dim))
    if pos_freqs.shape[0] != n:
        raise ValueError(f"yarn rope needs an even rotary dimension, got {dim}")
    inv_extrapolation = _recip(pos_freqs)
    inv_interpolation = _recip((_f32(factor) * pos_freqs).astype(_f32))
    extrapolation_factor = (_f32(1) - ramp).astype(_f32)
    a = (inv_interpolation * (_f32(1) - extrapolation_factor).astype(_f32)).astype(_f32)
    b = (inv_extrapolation * extrapolation_factor).astype(_f32)
    return (a + b).astype(_f32)


def _longrope_inv_freq(base, dim, ext_factors) -> np.ndarray:
    ext = np.asarray(ext_factors, dtype=np.float64).astype(_f32)
    denom = (ext * _pow(base, _exponents(dim))).astype(_f32)
    return _recip(denom)


def _llama3_inv_freq(base, dim, factor, low_freq_factor, high_freq_factor, old_context_len) -> np.ndarray:
    inv_freq = default_inv_freq(base, dim)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = _recip(inv_freq, 2 * math.pi)
    inv_llama = np.where(wavelen > _f32(low_freq_wavelen), (inv_freq / _f32(factor)).astype(_f32), inv_freq)
    smooth = (_recip(wavelen, old_context_len) - _f32(low_freq_factor)).astype(_f32)
    smooth = (smooth / _f32(high_freq_factor - low_freq_factor)).astype(_f32)
    smoothed = ((((_f32(1) - smooth) * inv_llama).astype(_f32) / _f32(factor)).astype(_f32)
                + (smooth * inv_llama).astype(_f32)).astype(_f32)
    is_medium = ~(wavelen < _f32(high_freq_wavelen)) & ~(wavelen > _f32(low_freq_wavelen))
    return np.where(is_medium, smoothed, inv_llama).astype(_f32)


def _proportional_inv_freq(base, head_dim, partial_rotary_factor, factor) -> np.ndarray:
    rope_angles = int(partial_rotary_factor * head_dim // 2)
    rotated = _recip(_pow(base, _exponents(2 * rope_angles, head_dim)))
    nope = head_dim // 2 - rope_angles
    inv = np.concatenate([rotated, np.zeros(max(nope, 0), _f32)]) if nope > 0 else rotated
    return (inv / _f32(factor)).astype(_f32)


def _as_tuple(a: np.ndarray) -> tuple[float, ...]:
    return tuple(float(v) for v in np.asarray(a, dtype=_f32))


# ---------------------------------------------------------------------------
# run-time pieces (jnp, float32, traceable)
# ---------------------------------------------------------------------------


def _keep(*xs):
    """``lax.optimization_barrier``: stops XLA's algebraic simplifier from rewriting float math.

    Without it XLA folds ``(c1 * q) / c2`` into ``q * (c1 / c2)``, ``x / c`` into
    ``x * (1 / c)``, ``1 / pow(b, e)`` into ``pow(b, -e)`` and so on, each of
    which rounds differently from torch's op-by-op float32 evaluation.
    """
    out = lax.optimization_barrier(xs)
    return out[0] if len(xs) == 1 else out


def _pow_f32_double_exponent(s: Array, e: float) -> Array:
    """float32 ``s ** e`` for a Python-float (double) exponent ``e = dim / (dim - 2)`` and ``s >= 1``.

    Approximates torch's ``Tensor(float32) ** float`` on a 0-dim tensor (computed
    in double, rounded once; see ``_torch_scalar_pow``): its special exponents
    exactly, else ``s + s * expm1((e - 1) * log(s))`` with ``e - 1`` split in two
    float32s and expm1 by its Taylor series. The float32 ``log`` leaves a few
    hundredths of an ulp before the final rounding (about ``0.5 * (e - 1) * log(s)``
    ulp), so the result rounds like torch's for all but a few percent of ``s``
    at head_dim 64 (and is 1 ulp off for those).
    """
    if e == 2.0:
        return s * s
    if e == 3.0:
        return _keep(s * s) * s
    if e == -1.0:
        return 1.0 / s
    a = e - 1.0
    a_hi = _f32(a)
    a_lo = _f32(a - float(a_hi))
    log_s = jnp.log(s)
    x = _keep(_keep(log_s * a_hi) + _keep(log_s * a_lo))
    # XLA's float32 expm1 is several ulp off; x(1 + x/2(1 + x/3(...))) to 20 terms is exact to float32 for x < 4
    u = x / 21.0
    for k in range(20, 0, -1):
        u = (x / k) * (1.0 + u)
    u = jnp.where(x < 4.0, u, jnp.expm1(x))
    return s + _keep(s * u)


def rotate_half(x: Array) -> Array:
    """``[-x2, x1]`` for the halves ``x1, x2`` of the last axis (the rotary pairing of transformers' non-interleaved rope)."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


# ---------------------------------------------------------------------------
# public interface
# ---------------------------------------------------------------------------


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
        inv = jnp.asarray(np.asarray(self.inv_freq, dtype=_f32))
        if self.rope_type == "longrope":
            long = jnp.asarray(np.asarray(self.long_inv_freq, dtype=_f32))
            return jnp.where(seq_len > self.original_max_position_embeddings, long, inv)
        if self.rope_type == "dynamic":
            return jnp.where(seq_len > self.original_max_position_embeddings, self._dynamic_inv_freq(seq_len), inv)
        return inv

    def _dynamic_inv_freq(self, seq_len: Int[Array, ""]) -> Float[Array, " half"]:
        """transformers' growth branch: ``_compute_dynamic_ntk_parameters(config, seq_len=seq_len)``.

        ``base' = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))``
        with ``seq_len`` a 0-dim int64 tensor, so each step is a float32 op (the
        scalar ``**`` is evaluated in double and rounded). ``base'`` comes from a
        host table (exactly torch's value) for the first ``_dynamic_table_size``
        lengths past ``max_pos``, from a float32 evaluation beyond it; then
        ``1.0 / base' ** (arange(0, dim, 2) / dim)`` in float32.
        """
        factor, max_pos, dim = self.factor, self.original_max_position_embeddings, self.dim
        seq_len = jnp.maximum(seq_len, max_pos + 1)
        n = _dynamic_table_size(factor, max_pos)
        table = jnp.asarray(_dynamic_base_table(self.rope_theta, factor, max_pos, dim, n))
        index = seq_len - (max_pos + 1)
        tabulated = table[jnp.clip(index, 0, n - 1)]
        if isinstance(factor, int):
            scaled = (seq_len * factor).astype(jnp.float32)  # an int64 product in torch, exact
        else:
            scaled = jnp.float32(factor) * seq_len.astype(jnp.float32)
        scaled, max_pos_f, shift = _keep(scaled, jnp.float32(max_pos), jnp.float32(factor - 1))
        s = _keep(scaled / max_pos_f) - shift
        p = _keep(_pow_f32_double_exponent(_keep(s), dim / (dim - 2)))
        computed = _keep(jnp.float32(self.rope_theta) * p)
        base = _keep(jnp.where(index < n, tabulated, computed))
        # torch: 1.0 / base ** exps, i.e. reciprocal(pow(base, exps)) in float32
        return _keep(1.0 / _keep(jnp.power(base, jnp.asarray(_exponents(dim)))))

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


def mrope_streams(section: tuple[int, ...], half: int, interleaved: bool) -> np.ndarray:
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


def _nested_keys(config, params: dict) -> list[str]:
    labels = getattr(config, "_rope_type_labels", None) or getattr(config, "layer_types", None) or ()
    return [k for k in params if k in labels]


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
    params = dict(params)

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

    base = params.get("rope_theta")
    if base is None:
        base = getattr(config, "rope_theta", None) or getattr(config, "default_theta", 10_000.0)
    partial = params.get("partial_rotary_factor")
    if partial is None:
        partial = getattr(config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim * partial)
    max_pos = getattr(config, "max_position_embeddings", None)

    def original_max() -> int:
        # transformers' standardize_rope_params: for a flat dict a config attribute has priority (Phi3),
        # then the dict, then max_position_embeddings
        attr = None if nested else getattr(config, "original_max_position_embeddings", None)
        if attr is not None:
            return attr
        value = params.get("original_max_position_embeddings")
        return max_pos if value is None else value

    attention_scaling = 1.0
    extra: dict = {}
    if rope_type == "default":
        inv = default_inv_freq(base, dim)
    elif rope_type == "linear":
        inv = _linear_inv_freq(base, dim, params["factor"])
    elif rope_type == "dynamic":
        factor = params["factor"]
        if max_pos is None:
            raise ValueError("dynamic rope needs config.max_position_embeddings")
        inv = default_inv_freq(_dynamic_base_at_init(base, factor, max_pos, dim), dim)
        extra = dict(original_max_position_embeddings=int(max_pos), rope_theta=float(base), factor=factor, dim=dim)
    elif rope_type == "yarn":
        omax = original_max()
        factor = params.get("factor")
        if factor is None:
            factor = max_pos / omax
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale, m=1):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1
        # transformers reads `truncate` from the top-level rope_parameters (so a nested config always truncates)
        top = getattr(config, "rope_parameters", {}) or {}
        truncate = top.get("truncate", True)
        inv = _yarn_inv_freq(base, dim, factor, omax, beta_fast, beta_slow, truncate)
        attention_scaling = attention_factor
    elif rope_type == "longrope":
        omax = original_max()
        factor = params.get("factor")
        if factor is None:
            factor = max_pos / omax
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omax))
        inv = _longrope_inv_freq(base, dim, params["short_factor"])
        long = _longrope_inv_freq(base, dim, params["long_factor"])
        if long.shape != inv.shape:
            raise ValueError(f"longrope long_factor/short_factor lengths differ: {long.shape} vs {inv.shape}")
        extra = dict(long_inv_freq=_as_tuple(long), original_max_position_embeddings=int(omax))
        attention_scaling = attention_factor
    elif rope_type == "llama3":
        inv = _llama3_inv_freq(
            base, dim, params["factor"], params["low_freq_factor"], params["high_freq_factor"], original_max()
        )
    else:  # proportional
        inv = _proportional_inv_freq(base, head_dim, partial, params.get("factor", 1.0))

    if mrope is not None:
        if sum(mrope) != len(inv):
            raise ValueError(f"mrope_section {list(mrope)} must sum to the rotary's {len(inv)} frequencies")
        extra["mrope_section"] = tuple(int(n) for n in mrope)
        extra["mrope_interleaved"] = bool(mrope_interleaved)
    return Rotary(
        rope_type=rope_type,
        inv_freq=_as_tuple(inv),
        attention_scaling=float(attention_scaling),
        rotary_dim=2 * len(inv),
        head_dim=int(head_dim),
        **extra,
    )


def apply_rotary(
    x: Float[Array, "batch heads seq head_dim"],
    cos: Float[Array, "batch seq rotary_dim"],
    sin: Float[Array, "batch seq rotary_dim"],
) -> Float[Array, "batch heads seq head_dim"]:
    """``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` dims of each head.

    cos/sin broadcast over heads (transformers' ``unsqueeze_dim=1``); dims from
    ``rotary_dim`` on pass through unchanged. Same operations, in the same
    order, as transformers' ``apply_rotary_pos_emb`` (the partial-rotary
    version when ``rotary_dim < head_dim``); result in ``x.dtype``.
    """
    rotary_dim = cos.shape[-1]
    cos = cos[:, None]
    sin = sin[:, None]
    x_rot = x[..., :rotary_dim]
    out = x_rot * cos + rotate_half(x_rot) * sin
    if rotary_dim < x.shape[-1]:
        out = jnp.concatenate([out.astype(x.dtype), x[..., rotary_dim:]], axis=-1)
    return out.astype(x.dtype)
