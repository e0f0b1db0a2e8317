"""Gated delta rule kernels against transformers' torch reference (OLMo-Hybrid).

Covers the recurrent form, the chunked (WY/UT) form and the Pallas kernel (interpret
mode on the CPU): float32 and bf16 agreement with ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule``, initial states, odd lengths, grouped heads,
l2norm on/off, per-token states, exact padding, gradients, linear memory; and the kernel
selection (``jstd.kernels.select``): chunked XLA on this CPU, Pallas on GPU / TPU, the forced
Pallas kernel on the test model's shapes, the DeltaNet mixer calling the dispatcher.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.models.olmo_hybrid.modeling_olmo_hybrid")

from jstd.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402
from jstd.kernels.triangular import unit_lower_inverse  # noqa: E402
from jstd.kernels.pallas.gated_delta import pallas_chunk_gated_delta_rule  # noqa: E402
from jstd.kernels.select import ENV_VAR, gated_delta_rule, select_gated_delta_kernel  # noqa: E402


def pallas_interp(*args, **kwargs):
    return pallas_chunk_gated_delta_rule(*args, interpret=True, **kwargs)


_STATIC = ("use_qk_l2norm", "chunk_size", "return_states")
# jitted once each: calls with the same shapes and options share a compilation
FORMS = {
    "recurrent": jax.jit(recurrent_gated_delta_rule, static_argnames=_STATIC[::2]),
    "chunk": jax.jit(chunk_gated_delta_rule, static_argnames=_STATIC),
    "pallas": jax.jit(pallas_interp, static_argnames=_STATIC),
}


def rel_max(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def make_inputs(seed, B, T, Hk, Hv, Dk, Dv, *, l2norm, with_state, neg_eig=False):
    """Random inputs in the regime the model produces.

    Without the in-kernel l2norm the keys are drawn with norm ~1: the delta rule is only
    stable for beta |k|^2 < 2 (otherwise the state blows up and every form, the torch
    reference included, disagrees with itself in float32).
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((B, T, Hk, Dk)).astype(np.float32)
    if not l2norm:
        q /= np.sqrt(Dk)
        k /= np.sqrt(Dk)
    v = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    # g = -exp(A_log) * softplus(.): log decays in roughly [-2, 0]
    g = (-np.exp(rng.uniform(-1.5, 0.5, (1, 1, Hv))) * np.log1p(np.exp(rng.standard_normal((B, T, Hv)) - 1.0))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, Hv))))).astype(np.float32)
    if neg_eig:
        beta *= 2.0
    s0 = rng.standard_normal((B, Hv, Dk, Dv)).astype(np.float32) * 0.5 if with_state else None
    return q, k, v, g, beta, s0


def torch_ref(q, k, v, g, beta, s0, *, l2norm, fn=None):
    fn = fn or hf.torch_chunk_gated_delta_rule
    t = lambda x: None if x is None else torch.from_numpy(np.asarray(x))
    with torch.no_grad():
        o, s = fn(t(q), t(k), t(v), t(g), t(beta), initial_state=t(s0), output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    return o, s


CASES = [
    # B, T, Hk, Hv, Dk, Dv, l2norm, with_state, neg_eig
    (2, 1, 1, 1, 16, 16, True, True, False),  # single token (decode)
    (2, 150, 2, 4, 16, 32, True, True, True),  # grouped heads, 3 chunks with padding, beta in [0, 2]
    (1, 77, 3, 3, 32, 16, False, False, False),  # no l2norm, 3 heads, no initial state, 2 chunks
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}Hk{c[2]}Hv{c[3]}l2{int(c[6])}s0{int(c[7])}")
@pytest.mark.parametrize("form", list(FORMS))
def test_float32_matches_torch(form, case):
    B, T, Hk, Hv, Dk, Dv, l2, with_state, neg = case
    q, k, v, g, beta, s0 = make_inputs(CASES.index(case), B, T, Hk, Hv, Dk, Dv, l2norm=l2, with_state=with_state, neg_eig=neg)
    ref_fn = hf.torch_recurrent_gated_delta_rule if form == "recurrent" else hf.torch_chunk_gated_delta_rule
    ro, rs = torch_ref(q, k, v, g, beta, s0, l2norm=l2, fn=ref_fn)
    kw = {"chunk_size": 64} if form != "recurrent" else {}
    o, s = FORMS[form](q, k, v, g, beta, initial_state=s0, use_qk_l2norm=l2, **kw)
    assert o.shape == (B, T, Hv, Dv) and o.dtype == jnp.float32
    assert s.shape == (B, Hv, Dk, Dv) and s.dtype == jnp.float32
    assert rel_max(o, ro.numpy()) <= 1e-5
    assert rel_max(s, rs.numpy()) <= 1e-5


@pytest.mark.parametrize("form", list(FORMS))
def test_bfloat16_matches_torch(form):
    B, T, Hk, Hv, Dk, Dv = 2, 100, 2, 4, 32, 32
    q, k, v, g, beta, s0 = make_inputs(7, B, T, Hk, Hv, Dk, Dv, l2norm=True, with_state=True)
    bf = lambda x: torch.from_numpy(x).to(torch.bfloat16)
    # as in the model: q, k, v, beta in the model dtype, g in float32, float32 cache state
    tq, tk, tv, tb = bf(q), bf(k), bf(v), bf(beta)
    with torch.no_grad():
        ro, rs = hf.torch_chunk_gated_delta_rule(
            tq, tk, tv, torch.from_numpy(g), tb,
            initial_state=torch.from_numpy(s0), output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
    assert ro.dtype == torch.bfloat16 and rs.dtype == torch.float32
    j = lambda x: jnp.asarray(x.float().numpy(), jnp.bfloat16)
    o, s = FORMS[form](j(tq), j(tk), j(tv), jnp.asarray(g), j(tb), initial_state=jnp.asarray(s0), use_qk_l2norm=True)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_rms(o.astype(jnp.float32), ro.float().numpy()) <= 5e-3
    assert rel_rms(s, rs.numpy()) <= 5e-3


def test_states_match_recurrent():
    q, k, v, g, beta, s0 = make_inputs(3, 2, 45, 1, 2, 16, 8, l2norm=True, with_state=True)
    o_r, s_r, st_r = FORMS["recurrent"](q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True, return_states=True)
    assert st_r.shape == (2, 45, 2, 16, 8) and st_r.dtype == jnp.float32
    np.testing.assert_array_equal(st_r[:, -1], s_r)
    for fn in (FORMS["chunk"], FORMS["pallas"]):
        o, s, st = fn(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True, chunk_size=16, return_states=True)
        assert st.shape == st_r.shape
        assert rel_max(st, st_r) <= 1e-5
        assert rel_max(o, o_r) <= 1e-5
        assert rel_max(st[:, -1], s) <= 1e-6
        # the states reproduce the outputs: o_t = S_t^T q_t (q normalised and scaled)
        qn = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) / np.sqrt(16)
        qn = np.repeat(qn, 2, axis=2)
        assert rel_max(np.einsum("bthkv,bthk->bthv", np.asarray(st), qn), o_r) <= 1e-5


def test_padding_is_exact():
    """The chunked forms pad to a multiple of the chunk with g = beta = 0 (and zero q, k, v):
    the same as appending such tokens with arbitrary q, k, v, which leave the state alone."""
    q, k, v, g, beta, s0 = make_inputs(5, 1, 128, 2, 2, 16, 16, l2norm=True, with_state=True)
    T = 100
    g[:, T:] = 0.0
    beta[:, T:] = 0.0
    fn = FORMS["chunk"]  # (the Pallas form pads alike; its odd lengths are checked against torch)
    o_short, s_short = fn(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], initial_state=s0, use_qk_l2norm=True)
    o_long, s_long = fn(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    assert rel_max(s_long, s_short) <= 1e-6
    assert rel_max(o_long[:, :T], o_short) <= 1e-6


def test_strong_decay_stays_finite():
    """Log decays down to ~-100 per token: exp(gamma_i - gamma_j) of the excluded (upper)
    pairs would overflow; the masked exp keeps every form finite and in agreement.
    (Same shapes as test_padding_is_exact: the compilations are shared.)"""
    q, k, v, g, beta, s0 = make_inputs(6, 1, 100, 2, 2, 16, 16, l2norm=True, with_state=True)
    g = g * 50.0
    o_r, s_r = FORMS["recurrent"](q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    for name in ("chunk", "pallas"):
        o, s = FORMS[name](q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
        assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all(), name
        assert rel_max(o, o_r) <= 1e-5 and rel_max(s, s_r) <= 1e-5, name


def test_chunk_sizes():
    q, k, v, g, beta, s0 = make_inputs(11, 1, 45, 2, 2, 16, 8, l2norm=True, with_state=True)
    o_r, s_r = FORMS["recurrent"](q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    for C in (1, 128):  # one-token chunks; one chunk longer than the sequence
        o, s = FORMS["chunk"](q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True, chunk_size=C)
        assert rel_max(o, o_r) <= 1e-5 and rel_max(s, s_r) <= 1e-5
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=48)


def test_unit_lower_inverse_is_stable():
    """A strongly coupled UT system (beta = 2, near-collinear unit keys, no decay; condition
    ~5e3): the recursive block inverse is about as accurate as float32 forward
    substitution, where the product of (I + N^(2^k)) terms is off by ~1e20."""
    scipy_linalg = pytest.importorskip("scipy.linalg")
    rng = np.random.default_rng(0)
    n = 64
    keys = rng.standard_normal(16) + 0.05 * rng.standard_normal((n, 16))
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
    a = np.tril(2.0 * keys @ keys.T, -1)
    m = np.eye(n) + a
    exact = np.linalg.inv(m)
    ours = np.asarray(jax.jit(unit_lower_inverse)(jnp.asarray(a, jnp.float32)), np.float64)
    subst = scipy_linalg.solve_triangular(m.astype(np.float32), np.eye(n, dtype=np.float32), lower=True, unit_diagonal=True)
    err = lambda x: np.max(np.abs(x - exact)) / np.max(np.abs(exact))
    assert err(ours) <= 10 * err(subst) + 1e-6
    np.testing.assert_array_equal(np.triu(ours, 1), 0.0)
    np.testing.assert_array_equal(np.diag(ours), 1.0)


def _loss(fn, **kw):
    def f(q, k, v, g, beta, s0):
        o, s = fn(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True, **kw)
        w = jnp.cos(jnp.arange(o.size, dtype=o.dtype).reshape(o.shape))
        return jnp.sum(o * w) + jnp.sum(jnp.sin(s))

    return f


def test_gradients_float64():
    """Recurrent-form gradients match central finite differences (float64); the chunked
    form's and the Pallas kernel's gradients match the recurrent form's."""
    with jax.enable_x64(True):
        inputs = make_inputs(1, 1, 21, 1, 2, 8, 4, l2norm=True, with_state=True)
        args = tuple(jnp.asarray(x, jnp.float64) for x in inputs)
        argnums = tuple(range(6))
        f = jax.jit(_loss(recurrent_gated_delta_rule))
        ref = jax.jit(jax.grad(f, argnums=argnums))(*args)
        assert all(gr.dtype == jnp.float64 for gr in ref)
        rng = np.random.default_rng(2)
        for _ in range(2):  # directional derivatives along random directions
            dirs = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in args)
            eps = 1e-6
            plus = f(*(x + eps * d for x, d in zip(args, dirs)))
            minus = f(*(x - eps * d for x, d in zip(args, dirs)))
            numeric = float((plus - minus) / (2 * eps))
            analytic = float(sum(jnp.vdot(gr, d) for gr, d in zip(ref, dirs)))
            assert abs(analytic - numeric) <= 1e-7 * max(1.0, abs(numeric))
        for fn in (chunk_gated_delta_rule, pallas_interp):  # 21 tokens in chunks of 8: padding too
            grads = jax.jit(jax.grad(_loss(fn, chunk_size=8), argnums=argnums))(*args)
            for gr, rf in zip(grads, ref):
                assert gr.dtype == jnp.float64
                assert rel_max(gr, rf) <= 1e-10


def test_memory_is_linear_in_sequence_length():
    sd = jax.ShapeDtypeStruct
    args = lambda T: (sd((1, T, 2, 32), jnp.float32),) * 3 + (sd((1, T, 2), jnp.float32),) * 2

    def footprint(T):
        f = jax.jit(lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm=True))
        m = f.lower(*args(T)).compile().memory_analysis()
        return m.temp_size_in_bytes + m.output_size_in_bytes

    small, large = footprint(1024), footprint(4096)
    assert large <= 4.5 * small  # linear (quadratic would be 16x)
    assert large < 4096 * 2 * 32 * 32 * 4  # far below per-token states: none are formed unless asked
    states = jax.eval_shape(lambda *a: chunk_gated_delta_rule(*a, return_states=True), *args(1024))[2]
    assert states.shape == (1, 1024, 2, 32, 32) and states.dtype == jnp.float32


def test_pallas_tpu_layout_interpreted(monkeypatch):
    """The TPU variant of the kernel (sequence-blocked grid, state in VMEM scratch), run by
    the Pallas interpreter: same results as the chunked form, states included."""
    from jstd.kernels.pallas import gated_delta as pgd

    monkeypatch.setattr(pgd, "_default_backend", lambda: "tpu")
    q, k, v, g, beta, s0 = make_inputs(8, 1, 40, 1, 2, 16, 16, l2norm=True, with_state=True)  # 3 chunks, padded
    f = jax.jit(lambda *a: pallas_interp(*a, initial_state=s0, use_qk_l2norm=True, chunk_size=16, return_states=True))
    o, s, st = f(q, k, v, g, beta)
    o_c, s_c, st_c = FORMS["chunk"](q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True, chunk_size=16, return_states=True)
    assert rel_max(o, o_c) <= 1e-6 and rel_max(s, s_c) <= 1e-6 and rel_max(st, st_c) <= 1e-6


def test_pallas_split_layout_column_blocks_interpreted(monkeypatch):
    """The split layout with every tile smaller than the heads (two column blocks in each kernel's products, a
    state carried as two row blocks, two value blocks per state and output program), interpreted: the same
    results as the chunked form, states included."""
    from jstd.kernels.pallas import gated_delta as pgd

    monkeypatch.setattr(pgd, "GPU", pgd.SplitConfig(ut_block=8, state_block_v=8, state_block_k=8, out_block_v=8))
    q, k, v, g, beta, s0 = make_inputs(8, 1, 40, 1, 2, 16, 16, l2norm=True, with_state=True)  # 3 chunks, padded
    f = jax.jit(lambda *a: pallas_interp(*a, initial_state=s0, use_qk_l2norm=True, chunk_size=16, return_states=True))
    o, s, st = f(q, k, v, g, beta)
    o_c, s_c, st_c = FORMS["chunk"](q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True, chunk_size=16, return_states=True)
    assert rel_max(o, o_c) <= 1e-6 and rel_max(s, s_c) <= 1e-6 and rel_max(st, st_c) <= 1e-6


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_pallas_kernel_lowers_for_accelerators(platform, monkeypatch):
    """No accelerator here: check that the kernel lowers to Mosaic TPU / Triton IR (the
    backend compilers themselves, libtpu and Triton-to-PTX, do not run)."""
    from jax import export

    from jstd.kernels.pallas import gated_delta as pgd

    if platform == "cuda":
        try:
            importlib.import_module("jax._src.pallas.triton.pallas_call_registration")  # not loaded without a GPU
        except ImportError as e:
            pytest.skip(f"no Triton lowering in this jaxlib: {e}")
        monkeypatch.setattr(pgd, "_default_backend", lambda: "gpu")
    else:
        monkeypatch.setattr(pgd, "_default_backend", lambda: "tpu")
    sd = jax.ShapeDtypeStruct
    args = (sd((1, 200, 2, 128), jnp.bfloat16),) * 3 + (sd((1, 200, 2), jnp.float32),) * 2
    f = jax.jit(lambda *a: pallas_chunk_gated_delta_rule(*a, use_qk_l2norm=True))
    triton_call = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")  # (no stability guarantee)
    exported = export.export(f, platforms=[platform], disabled_checks=[triton_call])(*args)
    text = exported.mlir_module()
    assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in text


SHARDED_KERNEL = """
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
from jstd.kernels.pallas.gated_delta import pallas_chunk_gated_delta_rule as pk
from jstd.kernels.gated_delta import chunk_gated_delta_rule as ck
jax.config.update("jax_default_matmul_precision", "highest")
rng = np.random.default_rng(0)
B, T, Hk, H, D = 2, 24, 2, 4, 16
x = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
q, k, v = x(B, T, Hk, D), x(B, T, Hk, D), x(B, T, H, D)
g, b = -jnp.asarray(rng.uniform(0.01, 0.5, (B, T, H)), jnp.float32), jnp.asarray(rng.uniform(size=(B, T, H)), jnp.float32)
kw = dict(use_qk_l2norm=True, chunk_size=16)
f = lambda q, v: pk(q, k, v, g, b, interpret=True, **kw)
r = lambda q, v: ck(q, k, v, g, b, **kw)
with jax.set_mesh(Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))):
    text = jax.jit(f).lower(q, v).as_text()
    out = jax.jit(f)(q, v)
    grads = jax.jit(jax.grad(lambda q, v: f(q, v)[0].sum(), argnums=(0, 1)))(q, v)
    swept = jax.jit(jax.vmap(lambda s: f(q * s, v)[0]))(jnp.array([1.0, 0.5]))
assert "shard_map" in text or "manual" in text, "the kernel is not mapped over the mesh"
err = lambda a, e: float(jnp.max(jnp.abs(a - e)) / jnp.max(jnp.abs(e)))
ref, ref_grads = r(q, v), jax.grad(lambda q, v: r(q, v)[0].sum(), argnums=(0, 1))(q, v)
assert max(err(out[0], ref[0]), err(out[1], ref[1])) < 1e-6, (err(out[0], ref[0]), err(out[1], ref[1]))
assert max(err(a, e) for a, e in zip(grads, ref_grads)) < 1e-6
assert err(swept[1], r(q * 0.5, v)[0]) < 1e-6
print("sharded kernel ok")
"""


def test_pallas_kernel_per_shard_on_a_mesh():
    """On a 2 x 2 mesh (jax.set_mesh; 4 simulated CPU devices, interpreted) the kernel runs under shard_map, rows
    over "data" and heads over "model" (grouped key heads with their value heads): outputs, final state, the
    custom-vjp gradients and a vmapped sweep equal the plain chunked form's."""
    import os

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SHARDED_KERNEL], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "sharded kernel ok" in done.stdout, done.stderr[-3000:]


def test_no_torch_import():
    code = (
        "import sys, jstd; before = 'torch' in sys.modules\n"
        "import jstd.kernels.gated_delta, jstd.kernels.pallas.gated_delta, jstd.kernels.select\n"
        "assert before or 'torch' not in sys.modules, 'gated_delta imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- kernel selection (jstd/kernels/select.py) ----------------------------------------------------


def test_kernel_selection(monkeypatch):
    """Chunked XLA on this CPU, Pallas on GPU / TPU (tileable head dims), recurrent for one token;
    the argument beats the environment variable, which beats the backend."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert select_gated_delta_kernel(2048, 128, 128) == ("chunk" if jax.default_backend() == "cpu" else "pallas")
    assert select_gated_delta_kernel(70, 8, 16, backend="cpu") == "chunk"
    assert select_gated_delta_kernel(1, 128, 128) == "recurrent"
    for backend in ("gpu", "tpu"):
        assert select_gated_delta_kernel(2048, 128, 128, backend=backend) == "pallas"
        assert select_gated_delta_kernel(8192, 16, 64, backend=backend) == "pallas"
        assert select_gated_delta_kernel(1, 128, 128, backend=backend) == "recurrent"
        assert select_gated_delta_kernel(2048, 96, 192, backend=backend) == "chunk"  # not powers of two
        assert select_gated_delta_kernel(2048, 8, 16, backend=backend) == "chunk"  # below Triton's 16
    assert select_gated_delta_kernel(2048, kernel="pallas_interpret") == "pallas_interpret"
    monkeypatch.setenv(ENV_VAR, "recurrent")
    assert select_gated_delta_kernel(2048, backend="gpu") == "recurrent"
    assert select_gated_delta_kernel(2048, kernel="auto", backend="gpu") == "pallas"
    monkeypatch.setenv(ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="unknown gated delta rule kernel"):
        select_gated_delta_kernel(2048)


def test_forced_pallas_matches_torch_on_model_shapes():
    """The Pallas kernel picked by name (interpreted here) on the test OLMo-Hybrid's DeltaNet
    shapes (2 key heads of 8 serving 4 value heads of 16, 70 tokens: chunk boundaries and padding,
    the mixer's chunk of 32): outputs and final state equal transformers' chunked reference, the
    gradients (its custom vjp) the recurrent form's."""
    q, k, v, g, beta, s0 = make_inputs(12, 2, 70, 2, 4, 8, 16, l2norm=True, with_state=True)
    args = tuple(jnp.asarray(x) for x in (q, k, v, g, beta, s0))

    def grads(name):  # (out, final state) and the gradients of a loss of both, in one program
        def f(*a):
            o, s = gated_delta_rule(*a[:5], initial_state=a[5], use_qk_l2norm=True, chunk_size=32, kernel=name)
            w = jnp.cos(jnp.arange(o.size, dtype=o.dtype).reshape(o.shape))
            return jnp.sum(o * w) + jnp.sum(jnp.sin(s)), (o, s)

        return jax.jit(jax.grad(f, argnums=tuple(range(6)), has_aux=True))(*args)

    got, (o, s) = grads("pallas_interpret")
    ro, rs = torch_ref(q, k, v, g, beta, s0, l2norm=True)
    assert rel_max(o, ro.numpy()) <= 1e-5 and rel_max(s, rs.numpy()) <= 1e-5
    for gr, rf in zip(got, grads("recurrent")[0]):
        assert rel_max(gr, rf) <= 1e-4


def test_mixer_runs_the_selected_kernel(zoo, monkeypatch):
    """The DeltaNet mixer calls the dispatcher: no Pallas call in the traced model by default
    (the chunked XLA form: on the CPU, and for these 8 / 16 head dims anywhere), one when the
    environment variable asks for the kernel."""
    model = zoo("olmo_hybrid-rotary_grouped").model
    tokens = np.zeros((1, 40), np.int32)
    traced = lambda: str(jax.make_jaxpr(lambda m, t: jstd.run(m, t).logits)(model, tokens))
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert "pallas_call" not in traced()
    # the choice is made at trace time and jstd.run keeps its traces: drop them around the forced trace
    monkeypatch.setenv(ENV_VAR, "pallas_interpret")
    jax.clear_caches()
    try:
        assert "pallas_call" in traced()
    finally:
        monkeypatch.delenv(ENV_VAR)
        jax.clear_caches()
