"""Rotary frequencies (``inv_freq``) for each ``rope_type``, equal to transformers 5.x's float32 values.

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
* ``dynamic``'s rescaled base (``dynamic_inv_freq``, at run time) is torch's
  exact float32 value (a host table) for lengths up to ``max(2 * ceil(factor),
  4) * max_position_embeddings`` (at most 65536 entries past it); beyond, it is
  evaluated in float32 and is 1 ulp off for a few percent of lengths. The
  run-time float math is fenced with ``lax.optimization_barrier`` because XLA's
  algebraic simplifier otherwise rewrites it (``(c1 * q) / c2`` -> ``q * (c1 /
  c2)``, ``1 / pow(b, e)`` -> ``pow(b, -e)``), which rounds differently.

The host functions take the config's Python scalars (``base`` the rope theta,
``dim`` the rotary width ``int(head_dim * partial_rotary_factor)``) and return
float32 numpy arrays of ``dim // 2`` frequencies; ``jstd.kernels.rope_config``
reads a config and calls the one its ``rope_type`` names.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
import numpy as np
from jaxtyping import Array, Float, Int

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


def default_inv_freq(base: float, dim: int) -> Float[np.ndarray, " half"]:
    """The default rotary frequencies ``1 / base ** (2i / dim)``, rounded as torch computes them in float32."""
    return _recip(_pow(base, _exponents(dim)))


def linear_inv_freq(base: float, dim: int, factor: float) -> Float[np.ndarray, " half"]:
    """``linear``: the default frequencies divided by ``factor`` (float32)."""
    return (default_inv_freq(base, dim) / _f32(factor)).astype(_f32)


def dynamic_base_at_init(base: float, factor: float, max_pos: int, dim: int) -> float:
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


def yarn_inv_freq(base: float, dim: int, factor: float, original_max: int, beta_fast: float, beta_slow: float,
                  truncate: bool) -> Float[np.ndarray, " half"]:
    """``yarn``: interpolated and extrapolated frequencies blended by a linear ramp between the correction dims.

    Raises ValueError for an odd ``dim``.
    """
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


def longrope_inv_freq(base: float, dim: int, ext_factors) -> Float[np.ndarray, " half"]:
    """``longrope``: ``1 / (ext_factors * base ** (2i / dim))`` for one factor list (``short_factor`` or
    ``long_factor``)."""
    ext = np.asarray(ext_factors, dtype=np.float64).astype(_f32)
    denom = (ext * _pow(base, _exponents(dim))).astype(_f32)
    return _recip(denom)


def llama3_inv_freq(base: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                    old_context_len: int) -> Float[np.ndarray, " half"]:
    """``llama3``: long wavelengths divided by ``factor``, short ones kept, the band between smoothed."""
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


def proportional_inv_freq(base: float, head_dim: int, partial_rotary_factor: float,
                          factor: float) -> Float[np.ndarray, " half"]:
    """``proportional``: the first ``int(partial_rotary_factor * head_dim // 2)`` frequencies over the whole
    ``head_dim``, zeros for the rest of the ``head_dim // 2``, all divided by ``factor``."""
    rope_angles = int(partial_rotary_factor * head_dim // 2)
    rotated = _recip(_pow(base, _exponents(2 * rope_angles, head_dim)))
    nope = head_dim // 2 - rope_angles
    inv = np.concatenate([rotated, np.zeros(max(nope, 0), _f32)]) if nope > 0 else rotated
    return (inv / _f32(factor)).astype(_f32)


def static_freqs(a: Float[np.ndarray, " half"]) -> tuple[float, ...]:
    """The float32 values of ``a`` as a tuple of Python floats (a static field of ``Rotary``)."""
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


def dynamic_inv_freq(seq_len: Int[Array, ""], theta: float, factor: float | int, max_pos: int,
                     dim: int) -> Float[Array, " half"]:
    """transformers' growth branch: ``_compute_dynamic_ntk_parameters(config, seq_len=seq_len)``.

    ``base' = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))``
    with ``seq_len`` a 0-dim int64 tensor, so each step is a float32 op (the
    scalar ``**`` is evaluated in double and rounded). ``base'`` comes from a
    host table (exactly torch's value) for the first ``_dynamic_table_size``
    lengths past ``max_pos``, from a float32 evaluation beyond it; then
    ``1.0 / base' ** (arange(0, dim, 2) / dim)`` in float32. A ``seq_len`` of
    ``max_pos`` or less is taken as ``max_pos + 1``. Traceable.
    """
    seq_len = jnp.maximum(seq_len, max_pos + 1)
    n = _dynamic_table_size(factor, max_pos)
    table = jnp.asarray(_dynamic_base_table(theta, factor, max_pos, dim, n))
    index = seq_len - (max_pos + 1)
    tabulated = table[jnp.clip(index, 0, n - 1)]
    if isinstance(factor, int):
        scaled = (seq_len * factor).astype(jnp.float32)  # an int64 product in torch, exact
    else:
        scaled = jnp.float32(factor) * seq_len.astype(jnp.float32)
    scaled, max_pos_f, shift = _keep(scaled, jnp.float32(max_pos), jnp.float32(factor - 1))
    s = _keep(scaled / max_pos_f) - shift
    p = _keep(_pow_f32_double_exponent(_keep(s), dim / (dim - 2)))
    computed = _keep(jnp.float32(theta) * p)
    base = _keep(jnp.where(index < n, tabulated, computed))
    # torch: 1.0 / base ** exps, i.e. reciprocal(pow(base, exps)) in float32
    return _keep(1.0 / _keep(jnp.power(base, jnp.asarray(_exponents(dim)))))
