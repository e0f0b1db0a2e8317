"""Rotary embeddings (jstd.kernels.rope) against transformers' torch modules, float32.

Every rope type transformers has for a plain rotary module, built from real
transformers configs, compared with the torch rotary module of a fresh model
(its first forward) at rtol = atol = 1e-6, under jax.jit, for plain and
left-padded position ids and for lengths below, at and beyond the original
maximum.

About the head widths used: torch's float32 ``pow`` on CPU runs 32-lane chunks
through SLEEF (within 1 ulp, not correctly rounded in ~2% of lanes) and shorter
tails through libm; jstd's ``pow`` is correctly rounded. For the static
frequencies the configs below are ones where torch's SLEEF result happens to be
correctly rounded (checked, not assumed: ``test_inv_freq_within_one_ulp``
sweeps more). ``dynamic`` recomputes its frequencies from the run-time length,
so its exact comparisons use head_dim 32 (16 lanes: torch's libm path); wider
heads are checked to within 1 ulp of torch's frequencies.
"""

import ast
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Phi3Config
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

from jstd.kernels.rope import Rotary, apply_rotary
from jstd.kernels.rope_config import SUPPORTED_ROPE_TYPES, rotary_from_config

TOL = dict(rtol=1e-6, atol=1e-6)

logging.getLogger("transformers").setLevel(logging.ERROR)  # rope validation chatter about test configs


def llama_config(rope_parameters, head_dim=64, max_pos=128, heads=2, **kw):
    return LlamaConfig(
        hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        intermediate_size=32, num_hidden_layers=1, vocab_size=32, max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters), **kw,
    )


def positions(length, pad=3, width=24):
    """A (3, width) batch whose largest position is length - 1 (so seq_len = length); fixed shape spares compiles.

    Row 0: the last ``width`` positions of a plain 0..length-1 sequence. Row 1: the same sequence
    left-padded by ``pad`` tokens, as transformers builds it (cumsum - 1, pads set to 1), also its
    tail. Shorter sequences are left-padded up to ``width``. Row 2: positions spread over 0..length-1.
    """
    rows = []
    for p in (0, pad):
        n = max(length - p, 1)
        mask = np.concatenate([np.zeros(max(width, n + p) - n, np.int64), np.ones(n, np.int64)])
        pos = np.cumsum(mask) - 1
        pos[mask == 0] = 1
        rows.append(pos[-width:])
    rows.append(np.linspace(0, length - 1, width).round().astype(np.int64))
    pos = np.stack(rows)
    assert pos.max() + 1 == max(length, 2)
    return pos


def torch_cos_sin(module, pos, **kw):
    with torch.no_grad():
        cos, sin = module(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos), **kw)
    return cos.numpy(), sin.numpy()


@jax.jit
def _jit_cos_sin(rotary: Rotary, pos):
    return *rotary.cos_sin(pos, jnp.float32), rotary.inv_freq_for(jnp.max(pos) + 1)


def jax_cos_sin(rotary, pos, with_inv_freq=False):
    cos, sin, inv = _jit_cos_sin(rotary, jnp.asarray(pos, jnp.int32))
    return (np.array(cos), np.array(sin)) + ((np.array(inv),) if with_inv_freq else ())


def check(rotary, module, pos, **kw):
    tc, ts = torch_cos_sin(module, pos, **kw)
    jc, js = jax_cos_sin(rotary, pos)
    assert jc.shape == tc.shape and jc.dtype == np.float32
    np.testing.assert_allclose(jc, tc, **TOL, err_msg="cos")
    np.testing.assert_allclose(js, ts, **TOL, err_msg="sin")


STATIC_CASES = {
    "default": (dict(rope_type="default", rope_theta=10000.0), 64, 128, [9, 200]),
    "default_theta5e5_d128": (dict(rope_type="default", rope_theta=500000.0), 128, 128, [9, 300]),
    "linear": (dict(rope_type="linear", factor=4.0, rope_theta=10000.0), 64, 128, [9, 300]),
    "linear_int_factor": (dict(rope_type="linear", factor=3, rope_theta=10000.0), 32, 128, [9, 300]),
    "llama3": (
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=32, rope_theta=500000.0), 64, 128, [9, 300],
    ),
    "yarn": (
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0),
        64, 128, [9, 300],
    ),
    "yarn_explicit": (
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0,
             attention_factor=0.9, beta_fast=16, beta_slow=2, truncate=False), 64, 128, [9, 300],
    ),
    "yarn_truncate_true": (
        dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=48, rope_theta=10000.0,
             beta_fast=24.0, beta_slow=1.5, truncate=True), 64, 144, [9, 300],
    ),
    "yarn_mscale": (
        dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=32, rope_theta=10000.0,
             mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1), 64, 1280, [9, 300],
    ),
    "proportional": (
        dict(rope_type="proportional", rope_theta=10000.0, partial_rotary_factor=0.25, factor=2.0), 64, 128, [9, 300],
    ),
}


@pytest.mark.parametrize("name", sorted(STATIC_CASES))
def test_static_types_match_torch(name):
    params, head_dim, max_pos, lengths = STATIC_CASES[name]
    config = llama_config(params, head_dim=head_dim, max_pos=max_pos)
    module = LlamaRotaryEmbedding(config)
    rotary = rotary_from_config(config, head_dim)
    assert rotary.rope_type == params["rope_type"]
    np.testing.assert_array_equal(np.asarray(rotary.inv_freq, np.float32), module.inv_freq.numpy())
    assert rotary.attention_scaling == module.attention_scaling
    for length in lengths:
        check(rotary, module, positions(length))


def test_yarn_attention_factor_derivations():
    cfg = llama_config(STATIC_CASES["yarn"][0])
    assert rotary_from_config(cfg, 64).attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    cfg = llama_config(STATIC_CASES["yarn_explicit"][0])
    assert rotary_from_config(cfg, 64).attention_scaling == 0.9
    cfg = llama_config(dict(STATIC_CASES["yarn_mscale"][0], mscale=1.0, mscale_all_dim=0.5), max_pos=1280)
    r, m = rotary_from_config(cfg, 64), LlamaRotaryEmbedding(cfg)
    assert r.attention_scaling == m.attention_scaling != 1.0
    check(r, m, positions(50))


@pytest.mark.parametrize(
    "factor,max_pos,lengths",
    [
        (2.0, 64, [5, 40, 63, 64, 65, 100, 129, 250, 256]),  # within, at, just past and well past the original max
        (3, 100, [50, 100, 101, 173, 399]),  # int factor, max_pos not a power of two
        (1.7, 48, [48, 49, 77, 190]),
    ],
)
def test_dynamic_first_call_matches_torch(factor, max_pos, lengths):
    config = llama_config(dict(rope_type="dynamic", factor=factor, rope_theta=10000.0), head_dim=32, max_pos=max_pos)
    rotary = rotary_from_config(config, 32)
    for length in lengths:
        module = LlamaRotaryEmbedding(config)  # fresh: its cached length starts at max_position_embeddings
        check(rotary, module, positions(length))
        # torch keeps the unscaled frequencies up to and including the original max, rescales beyond
        assert torch.equal(module.inv_freq, module.original_inv_freq) == (length <= max_pos), length


def test_dynamic_depends_on_batch_max_only():
    """seq_len is max(position_ids) + 1 over the batch: a short row rides along with a long one."""
    config = llama_config(dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0), head_dim=32, max_pos=64)
    rotary = rotary_from_config(config, 32)
    pos = np.stack([np.arange(90), np.concatenate([np.ones(60, np.int64), np.arange(30)])])  # row 1 reaches 29
    check(rotary, LlamaRotaryEmbedding(config), pos)
    jc_batch, _ = jax_cos_sin(rotary, pos)
    jc_rows, _ = jax_cos_sin(rotary, pos[::-1].copy())
    jc_alone, _ = jax_cos_sin(rotary, np.stack([pos[1], pos[1]]))
    np.testing.assert_array_equal(jc_rows[0], jc_batch[1])
    assert not np.allclose(jc_alone[0], jc_batch[1], atol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dynamic_wide_heads_within_one_ulp(head_dim):
    """Wide heads: torch's SLEEF pow, so frequencies are compared to 1 ulp (and cos/sin at the lengths's scale)."""
    max_pos = 64
    config = llama_config(dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0), head_dim=head_dim, max_pos=max_pos)
    rotary = rotary_from_config(config, head_dim)
    for length in [64, 65, 100, 200, 256, 2000]:  # 2000 lies beyond the exact-base table
        module = LlamaRotaryEmbedding(config)
        tc, _ = torch_cos_sin(module, positions(length))
        jc, _, ours = jax_cos_sin(rotary, positions(length), with_inv_freq=True)
        theirs = module.inv_freq.numpy()
        assert np.all(np.abs(ours.astype(np.float64) - theirs) <= np.spacing(theirs)), length
        np.testing.assert_allclose(jc, tc, rtol=0, atol=4 * length * 2.0**-24)


@pytest.mark.parametrize("head_dim,explicit", [(64, False), (32, True)])
def test_longrope_short_and_long(head_dim, explicit):
    half = head_dim // 2
    params = dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
        short_factor=[float(x) for x in np.linspace(1.0, 1.3, half)],
        long_factor=[float(x) for x in np.linspace(1.0, 9.5, half)],
    )
    if explicit:
        params.update(factor=2.5, attention_factor=1.1)
    config = llama_config(params, head_dim=head_dim, max_pos=128)
    rotary = rotary_from_config(config, head_dim)
    expected = 1.1 if explicit else math.sqrt(1 + math.log(128 / 32) / math.log(32))
    assert rotary.attention_scaling == pytest.approx(expected)
    assert rotary.attention_scaling == LlamaRotaryEmbedding(config).attention_scaling
    for length in [10, 32, 33, 100]:  # short, at the original max (short), long, long
        module = LlamaRotaryEmbedding(config)
        check(rotary, module, positions(length))
        jc, _ = jax_cos_sin(rotary, positions(length))
        short = np.cos(positions(length)[..., None] * np.asarray(rotary.inv_freq, np.float32)) * np.float32(
            rotary.attention_scaling
        )
        assert np.allclose(jc[..., :half], short, atol=1e-5) == (length <= 32)


def phi3_config(rope_parameters, partial_rotary_factor, head_dim=64, max_pos=128):
    return Phi3Config(
        hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
        num_hidden_layers=1, vocab_size=32, max_position_embeddings=max_pos,
        original_max_position_embeddings=rope_parameters.get("original_max_position_embeddings", max_pos),
        partial_rotary_factor=partial_rotary_factor, rope_parameters=dict(rope_parameters), pad_token_id=0,
    )


@pytest.mark.parametrize("partial", [0.5, 0.75, 0.3])
def test_partial_rotary_default(partial):
    config = phi3_config(dict(rope_type="default", rope_theta=10000.0), partial)
    module = Phi3RotaryEmbedding(config)
    rotary = rotary_from_config(config, 64)
    dim = int(64 * partial)
    assert rotary.rotary_dim == 2 * math.ceil(dim / 2) == module.inv_freq.shape[0] * 2
    for length in [9, 150]:
        check(rotary, module, positions(length))
    check_apply(rotary, positions(20), phi3_apply_rotary_pos_emb, heads=3, head_dim=64)


def test_partial_rotary_longrope():
    """Phi-4-mini style: partial_rotary_factor 0.75 with longrope."""
    half = int(64 * 0.75) // 2
    params = dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
        short_factor=[float(x) for x in np.linspace(1.0, 1.2, half)],
        long_factor=[float(x) for x in np.linspace(1.0, 6.0, half)],
    )
    config = phi3_config(params, 0.75)
    rotary = rotary_from_config(config, 64)
    assert rotary.rotary_dim == 48
    for length in [20, 70]:
        check(rotary, Phi3RotaryEmbedding(config), positions(length))
        check_apply(rotary, positions(length), phi3_apply_rotary_pos_emb, heads=2, head_dim=64)


def test_nested_layer_types():
    config = Gemma3TextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=32,
        num_hidden_layers=2, vocab_size=32, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    module = Gemma3RotaryEmbedding(config)
    with pytest.raises(ValueError, match="layer_type"):
        rotary_from_config(config, 32)
    for layer_type in ["full_attention", "sliding_attention"]:
        rotary = rotary_from_config(config, 32, layer_type=layer_type)
        check(rotary, module, positions(40), layer_type=layer_type)


def check_apply(rotary, pos, torch_apply, heads=4, head_dim=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((pos.shape[0], heads, pos.shape[1], head_dim)).astype(np.float32)
    cos, sin = jax_cos_sin(rotary, pos)
    ours = np.asarray(jax.jit(apply_rotary)(jnp.asarray(q), jnp.asarray(cos), jnp.asarray(sin)))
    tq = torch.from_numpy(q)
    theirs = torch_apply(tq, tq, torch.from_numpy(cos), torch.from_numpy(sin))[0].numpy()
    assert ours.shape == q.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, **TOL)
    rd = rotary.rotary_dim
    np.testing.assert_array_equal(ours[..., rd:], q[..., rd:])  # the pass-through dims are untouched


@pytest.mark.parametrize("name", ["default", "llama3", "yarn"])
def test_apply_rotary_matches_transformers(name):
    params, head_dim, max_pos, _ = STATIC_CASES[name]
    rotary = rotary_from_config(llama_config(params, head_dim=head_dim, max_pos=max_pos), head_dim)
    check_apply(rotary, positions(37), apply_rotary_pos_emb, heads=4, head_dim=head_dim)


def test_apply_rotary_bfloat16():
    rotary = rotary_from_config(llama_config(STATIC_CASES["default"][0]), 64)
    pos = positions(33)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((pos.shape[0], 3, pos.shape[1], 64)).astype(np.float32)
    cos, sin = jax.jit(lambda p: rotary.cos_sin(p, jnp.bfloat16))(jnp.asarray(pos, jnp.int32))
    assert cos.dtype == jnp.bfloat16
    ours = jax.jit(apply_rotary)(jnp.asarray(q, jnp.bfloat16), cos, sin)
    assert ours.dtype == jnp.bfloat16
    tc, ts = torch_cos_sin(LlamaRotaryEmbedding(llama_config(STATIC_CASES["default"][0])), pos)
    tq = torch.from_numpy(q).bfloat16()
    theirs = apply_rotary_pos_emb(tq, tq, torch.from_numpy(tc).bfloat16(), torch.from_numpy(ts).bfloat16())[0]
    np.testing.assert_allclose(np.asarray(ours, np.float32), theirs.float().numpy(), rtol=2.0**-8, atol=2.0**-8)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("theta", [10000.0, 500000.0, 1e6, 5e6])
def test_inv_freq_within_one_ulp(head_dim, theta):
    """Any head width and base: jstd's correctly rounded pow is within 1 ulp of torch's (platform) pow."""
    config = llama_config(dict(rope_type="default", rope_theta=theta), head_dim=head_dim)
    theirs = LlamaRotaryEmbedding(config).inv_freq.numpy()
    ours = np.asarray(rotary_from_config(config, head_dim).inv_freq, np.float32)
    assert np.all(np.abs(ours.astype(np.float64) - theirs) <= np.spacing(theirs))


def test_unsupported_rope_type_raises():
    config = llama_config(dict(rope_type="mystery", rope_theta=10000.0))
    with pytest.raises(ValueError, match="mystery") as info:
        rotary_from_config(config, 64)
    for name in SUPPORTED_ROPE_TYPES:
        assert name in str(info.value)


def test_mrope_equals_qwen2_vl():
    """Multimodal RoPE: three position streams folded by mrope_section, as Qwen2-VL's rotary module does; three
    equal streams are the ordinary rotary."""
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    config = Qwen2VLTextConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                               rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[8, 12, 12]))
    rotary = rotary_from_config(config, 64)
    pos = np.random.default_rng(0).integers(0, 200, (3, 2, 9))
    cos, sin = jax.jit(lambda p: rotary.cos_sin(p, jnp.float32))(jnp.asarray(pos, jnp.int32))
    tc, ts = Qwen2VLRotaryEmbedding(config)(torch.zeros(1), torch.from_numpy(pos))
    np.testing.assert_allclose(np.asarray(cos), tc.numpy(), **TOL)
    np.testing.assert_allclose(np.asarray(sin), ts.numpy(), **TOL)
    flat = rotary_from_config(llama_config(dict(rope_type="default", rope_theta=1e6)), 64)
    same = np.broadcast_to(pos[:1], pos.shape)
    for ours, plain in zip(rotary.cos_sin(same, jnp.float32), flat.cos_sin(pos[0], jnp.float32)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))
    with pytest.raises(ValueError, match="mrope_section"):
        rotary_from_config(Qwen2VLTextConfig(hidden_size=128, num_attention_heads=2, rope_parameters=dict(
            rope_type="default", rope_theta=1e6, mrope_section=[8, 12, 10])), 64)


def test_interleaved_mrope_equals_qwen3_vl():
    """Interleaved multimodal RoPE (Qwen3-VL): frequency j turns with the height or width on every third frequency
    of their sections, with the time elsewhere, as Qwen3-VL's text rotary recomposes them; a family that sections
    the frequencies refuses a config asking for interleaving."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    params = dict(rope_type="default", rope_theta=5e5, mrope_section=[12, 10, 10], mrope_interleaved=True)
    config = Qwen3VLTextConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                               head_dim=64, rope_parameters=params)
    rotary = rotary_from_config(config, 64, mrope_interleaved=True)
    pos = np.stack([np.random.default_rng(s).integers(0, 200, (2, 9)) for s in range(3)])
    cos, sin = jax.jit(lambda p: rotary.cos_sin(p, jnp.float32))(jnp.asarray(pos, jnp.int32))
    tc, ts = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1), torch.from_numpy(pos))
    np.testing.assert_allclose(np.asarray(cos), tc.numpy(), **TOL)
    np.testing.assert_allclose(np.asarray(sin), ts.numpy(), **TOL)
    with pytest.raises(ValueError, match="interleaved"):
        rotary_from_config(config, 64)


def test_no_rope_config_gives_none():
    assert rotary_from_config(GPT2Config(n_embd=32, n_head=2, n_layer=1), 16) is None


def test_rotary_is_static_and_hashable():
    rotary = rotary_from_config(llama_config(STATIC_CASES["llama3"][0]), 64)
    assert jax.tree_util.tree_leaves(rotary) == []
    assert hash(rotary) == hash(rotary_from_config(llama_config(STATIC_CASES["llama3"][0]), 64))
    assert rotary == rotary_from_config(llama_config(STATIC_CASES["llama3"][0]), 64)


def test_module_does_not_import_torch():
    """jstd must not import torch (or transformers) at run time: the rope modules (rope.py, rope_init.py,
    rope_config.py) import only these, anywhere in the files."""
    imported = set()
    for path in (Path(__file__).resolve().parents[1] / "jstd" / "kernels").glob("rope*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add((node.module or "").split(".")[0])
    allowed = {"__future__", "dataclasses", "functools", "math", "typing", "equinox", "jax", "numpy", "jaxtyping"}
    assert imported <= allowed | {"jstd"}, imported
