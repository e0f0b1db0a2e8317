"""Cross-layer transcoders trained in JAX (jstd.circuits.train_clt): the loss is the documented formula, training
lowers it, a checkpoint resumes exactly, the written CLT is circuit-tracer's format and jstd.attribute uses it,
and a mesh of 8 devices (batch over data, features over model) trains the same CLT."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jstd
from jstd import cli
from jstd.circuits import load_transcoders
from jstd.circuits.train import Settings, _loss, decoder_norms, init_clt, train_clt


def brute_loss(tc, x, y, s: Settings, acts_fn):
    """The module docstring's loss, token by token in float64 numpy: Σ_l ‖ŷ_l - y_l‖² + λ Σ tanh(c‖W_dec‖a) +
    λ_p Σ ReLU(-pre)‖W_dec‖, averaged over tokens. ``x, y [L, B, d]``."""
    L, B, _ = x.shape
    W_enc, b_enc, b_dec = (np.asarray(a, np.float64) for a in (tc.W_enc, tc.b_enc, tc.b_dec))
    W_dec = [np.asarray(w, np.float64) for w in tc.W_dec]
    total = 0.0
    for b in range(B):
        pre = [W_enc[l] @ np.asarray(x[l, b], np.float64) + b_enc[l] for l in range(L)]
        a = [acts_fn(l, p) for l, p in enumerate(pre)]
        for lo in range(L):
            recon = b_dec[lo] + sum(a[l] @ W_dec[l][:, lo - l] for l in range(lo + 1))
            total += ((recon - np.asarray(y[lo, b], np.float64)) ** 2).sum()
        for l in range(L):
            norm = np.sqrt((W_dec[l] ** 2).sum((1, 2)))
            total += s.sparsity * np.tanh(s.c * norm * a[l]).sum() + s.preact * (np.maximum(-pre[l], 0) * norm).sum()
    return total / B


@pytest.mark.parametrize("architecture", ["relu", "jumprelu", "topk"])
def test_loss_is_the_documented_formula(architecture):
    rng = np.random.default_rng(0)
    L, d, F, B = 3, 8, 16, 5
    tc = init_clt(jax.random.key(1), L, d, F, architecture=architecture, threshold=0.05)
    tc = jax.tree.map(lambda a: a + 0.05 * jnp.asarray(rng.normal(size=a.shape), a.dtype), tc)  # biases nonzero too
    x = jnp.asarray(rng.normal(size=(L, B, d)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(L, B, d)), jnp.float32)
    s = Settings(architecture, 3, 0.1, 2.0, 0.01, 0.05, 10)
    theta = None if tc.threshold is None else np.asarray(tc.threshold, np.float64)

    def acts(l, pre):
        if architecture == "relu":
            return np.maximum(pre, 0)
        if architecture == "jumprelu":
            return pre * (pre > np.maximum(theta[l], 1e-6))
        keep = np.argsort(-pre)[:3]
        out = np.zeros_like(pre)
        out[keep] = np.maximum(pre[keep], 0)
        return out

    got = float(_loss(tc, x, y, s)[0])
    want = brute_loss(tc, x, y, s, acts)
    assert abs(got - want) <= 1e-5 * abs(want)
    norms = np.asarray(decoder_norms(tc))
    assert np.allclose(norms[1], np.sqrt((np.asarray(tc.W_dec[1]) ** 2).reshape(F, -1).sum(1)), rtol=1e-6)


@pytest.fixture(scope="module")
def induction_acts(tmp_path_factory):
    model = jstd.load(cli.INDUCTION)
    words = cli.word_ids(jstd.load_processor(cli.INDUCTION), model.config.vocab_size)
    rows = cli.repeated_tokens(np.random.default_rng(0), 24, 8, words)
    folder = tmp_path_factory.mktemp("clt-acts")
    acts = jstd.collect(model, jstd.Inputs(rows), ["layers.mlp_input", "layers.mlp.mlp_output"], folder,
                        batch_size=24, progress=False)
    return model, rows, acts


def test_training_lowers_the_loss_resumes_and_the_clt_serves_attribute(induction_acts, tmp_path):
    model, rows, acts = induction_acts
    args = dict(d_features=32, batch_size=64, learning_rate=3e-3, key=jax.random.key(0), log_every=5, progress=False,
                sparsity=1e-3)
    whole = train_clt(acts, steps=40, out=tmp_path / "clt", scan="local/induction-clt", **args)
    assert whole.log[-1]["loss"] < 0.5 * whole.log[0]["loss"]
    assert whole.log[-1]["explained_variance"] > whole.log[0]["explained_variance"]
    train_clt(acts, steps=15, checkpoint=tmp_path / "ckpt", checkpoint_every=5, **args)
    resumed = train_clt(acts, steps=40, checkpoint=tmp_path / "ckpt", checkpoint_every=5, **args)
    for a, b in zip(jax.tree.leaves(whole.transcoders), jax.tree.leaves(resumed.transcoders)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert [r["step"] for r in resumed.log] == [r["step"] for r in whole.log]
    with pytest.raises(ValueError, match="different call"):
        train_clt(acts, steps=40, checkpoint=tmp_path / "ckpt", **{**args, "d_features": 16})

    tc = load_transcoders(tmp_path / "clt")
    assert tc.cross_layer and tc.scan == "local/induction-clt" and tc.input_site == "layers.mlp_input"
    for a, b in zip(jax.tree.leaves(tc), jax.tree.leaves(whole.transcoders)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    graph = jstd.attribute(model, rows[0], tc)
    x = jstd.run(model, jnp.asarray(rows[:1]), reads=("layers.mlp_input",))["layers.mlp_input"][:, 0]
    active = np.asarray(tc.encode(x))[:, 1:] > 0  # position 0 carries no features
    assert graph.n_features == active.sum() > 0
    replacement, _ = jstd.circuits.graph_scores(graph)
    assert 0 < replacement <= 1


@pytest.mark.parametrize("architecture,kw", [("jumprelu", {}), ("topk", {"k": 4})])
def test_jumprelu_and_topk_train_and_write_jumprelu_clts(architecture, kw, tmp_path):
    rng = np.random.default_rng(0)
    L, d, n = 2, 8, 512
    x = rng.normal(size=(n, L, d)).astype(np.float32)
    y = np.einsum("nld,lde->nle", x, rng.normal(size=(L, d, d)).astype(np.float32) / 3)
    y[:, 1] += y[:, 0]  # block 1's output depends on block 0's input: what cross-layer decoders serve
    tr = train_clt((x, y), d_features=16, steps=60, batch_size=128, learning_rate=1e-2, key=jax.random.key(0),
                   architecture=architecture, log_every=20, progress=False, out=tmp_path, **kw)
    assert tr.log[-1]["mse"] < 0.7 * tr.log[0]["mse"]
    back = load_transcoders(tmp_path)
    assert back.activation == "jump_relu" and back.threshold.shape == (L, 16)
    if architecture == "topk":  # one threshold per block: the mean smallest kept activation
        t = np.asarray(back.threshold)
        assert (t == t[:, :1]).all() and (t > 0).all()
    with pytest.raises(ValueError, match="needs k"):
        train_clt((x, y), d_features=16, steps=1, key=jax.random.key(0), architecture="topk")


def test_bad_datasets_are_named(induction_acts):
    _, _, acts = induction_acts
    with pytest.raises(ValueError, match="holds no layers.mlp_norm_normalized"):
        train_clt(acts, d_features=8, steps=1, key=jax.random.key(0), input_hook="ln2.hook_normalized")
    with pytest.raises(ValueError, match="larger than the dataset"):
        train_clt(acts, d_features=8, steps=1, key=jax.random.key(0), batch_size=10 ** 6)


MESH_CHECK = """
import jax, numpy as np, jstd
from jstd.circuits.train import train_clt
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 2, 16)).astype(np.float32)
y = np.einsum("nld,lde->nle", x, rng.normal(size=(2, 16, 16)).astype(np.float32))
args = dict(d_features=32, steps=8, batch_size=256, key=jax.random.key(0), progress=False, log_every=4,
            architecture="jumprelu")
spread = train_clt((x, y), mesh=jstd.sharding.mesh(data=4, model=2), **args)
alone = train_clt((x, y), **args)
print(max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(spread.transcoders),
                                                                             jax.tree.leaves(alone.transcoders))))
"""


def test_training_data_and_model_parallel_on_8_devices(on_8_devices):
    """The batch over data (4) and the features over model (2) of 8 CPU devices, in a subprocess (the suite has
    one device): the same CLT as on one device."""
    assert on_8_devices(MESH_CHECK) < 1e-5
