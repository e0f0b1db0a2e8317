"""The run/edit contract: jit as written, reads, edit semantics, vmap, grad, identities, errors."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd

ASSET = Path(jstd.__file__).parent / "assets" / "tiny-llama"


@pytest.fixture(scope="module")
def model():
    return jstd.load(ASSET)


@pytest.fixture(scope="module")
def tokens(model):
    return np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9))


run = jax.jit(jstd.run, static_argnames="reads")


def test_jit_literally(model, tokens):
    edits = [jstd.Scale("layers.mlp.mlp_output", 0.5, layer=2)]
    out = jax.jit(jstd.run)(model, tokens, edits)
    assert out.logits.shape == (2, 9, model.config.vocab_size)
    eager = jstd.run(model, tokens, edits)
    np.testing.assert_allclose(out.logits, eager.logits, rtol=1e-5, atol=1e-5)


def test_reads_stacked_and_single(model, tokens):
    out = run(model, tokens, reads=("layers.layer_output", "layers.2.layer_output", "layers.-1.layer_output"))
    L = model.config.num_layers
    assert out["layers.layer_output"].shape == (L, 2, 9, model.config.hidden_size)
    np.testing.assert_array_equal(out["layers.2.layer_output"], out["layers.layer_output"][2])
    np.testing.assert_array_equal(out["layers.-1.layer_output"], out["layers.layer_output"][L - 1])
    with pytest.raises(KeyError, match="was not read"):
        out["layers.mlp.mlp_output"]


def test_single_block_reads_keep_only_their_block(model, tokens):
    L = model.config.num_layers
    stack = run(model, tokens, reads=("layers.layer_output", "layers.self_attn.attention_probabilities"))
    for i in (0, 2, -1):
        reads = (f"layers.{i}.layer_output", f"layers.{i}.self_attn.attention_probabilities")
        out = run(model, tokens, reads=reads)
        np.testing.assert_allclose(out[reads[0]], stack["layers.layer_output"][i], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out[reads[1]], stack["layers.self_attn.attention_probabilities"][i], rtol=1e-6, atol=1e-6)

    def output_bytes(reads):
        compiled = jax.jit(functools.partial(jstd.run, reads=reads)).lower(model, tokens).compile()
        return compiled.memory_analysis().output_size_in_bytes

    one = output_bytes(("layers.1.self_attn.attention_probabilities",))
    every = output_bytes(("layers.self_attn.attention_probabilities",))
    probs = stack["layers.self_attn.attention_probabilities"][0].nbytes
    assert every - one == (L - 1) * probs  # the other blocks' patterns are never kept


def test_block_identities(model, tokens):
    out = run(model, tokens, reads=("layers.layer_input", "layers.self_attn.attention_output", "layers.mlp.mlp_output",
                                    "layers.layer_mid", "layers.layer_output", "token_embeddings",
                                    "layers.attention_norm_output", "layers.mlp_norm_output", "layers.mlp_input",
                                    "layers.self_attn.attention_head_outputs", "layers.self_attn.attention_premix"))
    x, a, m = out["layers.layer_input"], out["layers.self_attn.attention_output"], out["layers.mlp.mlp_output"]
    np.testing.assert_array_equal(x + a + m, out["layers.layer_output"])
    np.testing.assert_array_equal(x + a, out["layers.layer_mid"])
    np.testing.assert_array_equal(out["layers.layer_input"][0], out["token_embeddings"])
    np.testing.assert_array_equal(out["layers.layer_input"][1:], out["layers.layer_output"][:-1])
    np.testing.assert_array_equal(out["layers.mlp_input"], out["layers.mlp_norm_output"])
    np.testing.assert_array_equal(out["layers.self_attn.attention_premix"], out["layers.self_attn.attention_head_outputs"])


def test_logit_lens_at_last_block_is_logits(model, tokens):
    out = run(model, tokens, reads=("layers.layer_output",))
    lens = jax.jit(jstd.project_on_vocab)(model, out["layers.layer_output"])
    np.testing.assert_allclose(lens[-1], out.logits, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_share_one_array(model, tokens):
    assert model.lm_head is None  # the asset ties its head to the embedding
    out = run(model, tokens, reads=("final_norm_output",))
    np.testing.assert_allclose(out["final_norm_output"] @ model.embed.T, out.logits, rtol=1e-6, atol=1e-5)
    grads = jax.grad(lambda m: jstd.run(m, tokens).logits[0, -1, 5])(model)
    assert grads.lm_head is None and np.abs(grads.embed[5]).sum() > 0


def test_softmax_of_scores_is_probabilities(model, tokens):
    out = run(model, tokens, reads=("layers.self_attn.attention_scores", "layers.self_attn.attention_probabilities"))
    p = jax.nn.softmax(out["layers.self_attn.attention_scores"], axis=-1)
    np.testing.assert_allclose(p, out["layers.self_attn.attention_probabilities"], rtol=1e-6, atol=1e-7)


def test_next_token_probs(model, tokens):
    out = run(model, tokens, reads=("next_token_probs",))
    np.testing.assert_allclose(out["next_token_probs"], jax.nn.softmax(out.logits[:, -1], -1), rtol=1e-6, atol=1e-7)


def test_edit_ops(model, tokens):
    site = "layers.layer_output"
    base = run(model, tokens, reads=(site,))[site]
    v = jnp.arange(model.config.hidden_size, dtype=jnp.float32)
    cases = {
        "set": (jstd.Set(site, v, layer=1), jnp.broadcast_to(v, base[1].shape)),
        "add": (jstd.Add(site, v, layer=1), base[1] + v),
        "scale": (jstd.Scale(site, 3.0, layer=1), base[1] * 3.0),
        "zero": (jstd.Zero(site, layer=1), jnp.zeros_like(base[1])),
        "apply": (jstd.Apply(site, jnp.tanh, layer=1), jnp.tanh(base[1])),
    }
    for name, (edit, want) in cases.items():
        got = run(model, tokens, [edit], reads=(site,))[site]
        np.testing.assert_allclose(got[1], want, rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(got[0], base[0])  # blocks before are untouched
        assert not np.allclose(got[2], base[2]), name  # blocks after compute from the edited value


def test_where_mask_and_composition_order(model, tokens):
    site = "layers.1.mlp.mlp_output"
    base = run(model, tokens, reads=(site,))[site]
    last = (jnp.arange(9) == 8)[None, :, None]
    got = run(model, tokens, [jstd.Add(site, 1.0, where=last), jstd.Scale(site, 2.0)], reads=(site,))[site]
    np.testing.assert_allclose(got[:, 8], (base[:, 8] + 1) * 2, rtol=1e-6)
    np.testing.assert_allclose(got[:, :8], base[:, :8] * 2, rtol=1e-6)
    swapped = run(model, tokens, [jstd.Scale(site, 2.0), jstd.Add(site, 1.0, where=last)], reads=(site,))[site]
    np.testing.assert_allclose(swapped[:, 8], base[:, 8] * 2 + 1, rtol=1e-6)


def test_position_edit_leaves_earlier_positions_bit_identical(model, tokens):
    out0 = run(model, tokens, reads=("layers.layer_output",))
    last = (jnp.arange(9) == 8)[None, :, None]
    out1 = run(model, tokens, [jstd.Add("layers.mlp.mlp_output", 5.0, layer=0, where=last)], reads=("layers.layer_output",))
    np.testing.assert_array_equal(out1["layers.layer_output"][:, :, :8], out0["layers.layer_output"][:, :, :8])
    assert not np.allclose(out1.logits[:, 8], out0.logits[:, 8])


def test_stacked_edit_values(model, tokens):
    """A value stacked over blocks sets each block's own entry."""
    site = "layers.attention_norm_output"
    base = run(model, tokens, reads=(site,))[site]
    got = run(model, tokens, [jstd.Set(site, base * 0.5)], reads=(site,))[site]
    np.testing.assert_allclose(got[0], base[0] * 0.5, rtol=1e-6)


def test_vmap_over_layer_compiles_once(model, tokens):
    traces = []
    v = jnp.ones(model.config.hidden_size)

    @jax.jit
    def sweep(layers):
        def one(layer):
            traces.append(1)
            return jstd.run(model, tokens, [jstd.Add("layers.layer_output", v, layer=layer)]).logits[:, -1]
        return jax.vmap(one)(layers)

    L = model.config.num_layers
    swept = sweep(jnp.arange(L))
    assert len(traces) == 1
    for layer in range(L):
        single = run(model, tokens, [jstd.Add("layers.layer_output", v, layer=layer)]).logits[:, -1]
        np.testing.assert_allclose(swept[layer], single, rtol=1e-5, atol=1e-5)


def test_vmap_over_edit_values(model, tokens):
    vs = jnp.stack([jnp.zeros(model.config.hidden_size), jnp.ones(model.config.hidden_size)])
    f = jax.jit(jax.vmap(lambda v: jstd.run(model, tokens, [jstd.Add("layers.2.layer_mid", v)]).logits))
    got = f(vs)
    np.testing.assert_allclose(got[0], run(model, tokens).logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], run(model, tokens, [jstd.Add("layers.2.layer_mid", vs[1])]).logits, rtol=1e-5, atol=1e-5)


def test_grad_into_edit_matches_finite_differences(model, tokens):
    H = model.config.hidden_size

    def loss(v):
        out = jstd.run(model, tokens, [jstd.Add("layers.1.layer_output", v)])
        return jax.nn.log_softmax(out.logits[0, -1])[3]

    v0 = jnp.zeros(H)
    g = jax.jit(jax.grad(loss))(v0)
    eps = 1e-2
    f = jax.jit(loss)
    for i in (0, 7, H - 1):
        e = jnp.zeros(H).at[i].set(eps)
        fd = (f(v0 + e) - f(v0 - e)) / (2 * eps)
        np.testing.assert_allclose(g[i], fd, rtol=2e-2, atol=2e-3)


def test_apply_with_module_gets_gradients(model, tokens):
    import equinox as eqx

    class Gain(eqx.Module):
        g: jax.Array

        def __call__(self, x):
            return x * self.g

    def loss(gain):
        return jstd.run(model, tokens, [jstd.Apply("layers.mlp.mlp_output", gain)]).logits[0, -1, 3]

    grad = jax.grad(loss)(Gain(jnp.ones(())))
    assert np.isfinite(grad.g) and grad.g != 0


# ---- errors -------------------------------------------------------------------


def test_token_ids_out_of_range_raise_before_the_gather(model, tokens):
    bad = tokens.copy()
    bad[0, 3] = model.config.vocab_size
    with pytest.raises(ValueError, match="out of range"):
        jstd.run(model, bad)
    with pytest.raises(Exception, match="token ids must lie in"):
        jax.jit(jstd.run)(model, bad).logits.block_until_ready()
    with pytest.raises(ValueError, match="out of range"):
        jstd.run(model, -tokens - 1)


def test_unknown_site_lists_near_names(model, tokens):
    with pytest.raises(jstd.SiteError, match="layers.layer_output"):
        jstd.run(model, tokens, reads=("layers.layer_ouput",))
    with pytest.raises(jstd.SiteError, match="attention_probabilities"):
        jstd.Zero("layers.self_attn.attention_probs")


def test_unavailable_site_says_why(model, tokens):
    with pytest.raises(jstd.SiteError, match="llama blocks have no linear_attn"):
        jstd.run(model, tokens, reads=("layers.linear_attn.decays",))
    with pytest.raises(jstd.SiteError, match="text model"):
        jstd.run(model, tokens, reads=("vision.image_features",))


def test_read_only_site_refuses_edits():
    with pytest.raises(jstd.SiteError, match="read-only"):
        jstd.Set("next_token_probs", 0.0)


def test_wrong_shapes_raise_with_expected_shape(model, tokens):
    with pytest.raises(jstd.SiteError, match=r"does not broadcast to the site's shape \(2, 9, 64\)"):
        jstd.run(model, tokens, [jstd.Add("layers.layer_output", jnp.ones(63), layer=0)])
    with pytest.raises(jstd.SiteError, match="where"):
        jstd.run(model, tokens, [jstd.Zero("layers.layer_output", layer=0, where=jnp.ones((9, 2), bool))])
    with pytest.raises(jstd.SiteError, match="stacked over 3 blocks"):
        jstd.run(model, tokens, [jstd.Add("layers.layer_output", jnp.ones((3, 2, 9, 64)))])


def test_bad_layers_raise(model, tokens):
    with pytest.raises(jstd.SiteError, match="block 7 does not exist"):
        jstd.run(model, tokens, [jstd.Zero("layers.layer_output", layer=7)])
    with pytest.raises(jstd.SiteError, match="block 9 does not exist"):
        jstd.run(model, tokens, reads=("layers.9.layer_output",))
    with pytest.raises(jstd.SiteError, match="not a block site"):
        jstd.Zero("logits", layer=1)
    with pytest.raises(jstd.SiteError, match="already names block"):
        jstd.Zero("layers.1.layer_output", layer=1)


def test_bad_inputs_raise(model, tokens):
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        jstd.run(model, tokens[0])
    with pytest.raises(ValueError, match="attention_mask"):
        jstd.run(model, tokens, attention_mask=np.ones((2, 8)))
    with pytest.raises(ValueError, match="takes no images"):
        jstd.run(model, tokens, images=np.zeros((1, 3, 8, 8)))
    with pytest.raises(TypeError, match="jstd edits"):
        jstd.run(model, tokens, ["layers.layer_output"])
