"""HyperCLOVA X: the notes' identities, exact edits through the multipliers (the conformance suite compares every
value, padding, bfloat16 and edits with transformers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
from conftest import assert_close
from families import HYPERCLOVAX_CASES as CASES, HYPERCLOVAX_HEAD_DIM as HEAD_DIM, SEQ
from reference.cases import FamilyCases, assert_sites_close, jit_run, random_tokens
from reference.harness import TorchEdit

# the residual stream and what the blocks add; read without the attention interior (the fused path)
STREAM = ("layers.layer_output", "layers.self_attn.attention_output", "layers.mlp.mlp_output")


def tokens_for(model, seed=0, batch=2):
    return random_tokens(model, SEQ, batch, seed)


@pytest.fixture
def checkpoints(zoo):
    """checkpoints(name, dtype="float32") -> (name, folder, jstd model, torch reference) of a hyperclovax case;
    checkpoints.every_value(name) -> (tokens, every value jstd serves, every value torch captures)."""
    return FamilyCases(zoo, "hyperclovax")


@pytest.fixture(params=sorted(CASES))
def case(request, checkpoints):
    return checkpoints(request.param)


@pytest.fixture
def full(case, checkpoints):
    return checkpoints.every_value(case[0])


@pytest.fixture
def residual_case(checkpoints):
    """The case with every multiplier != 1 (residual_multiplier 0.3): edits, gradients, bfloat16."""
    return checkpoints("residual")


def test_serves_the_family_sites(case):
    _, _, model, _ = case
    assert model.family == "hyperclovax"
    assert {"layers.self_attn.attention_raw_output", "layers.mlp.mlp_raw_output"} <= model.sites
    assert jstd.SITES["layers.mlp.mlp_raw_output"].family == "hyperclovax"
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (3, 64, 4, 2, HEAD_DIM)


def test_identities(case, full):
    """The notes' identities, on jstd's own values."""
    name, _, model, _ = case
    cfg = CASES[name]
    _, out, _ = full
    m = cfg["residual_multiplier"]
    x, a, mlp = out["layers.layer_input"], out["layers.self_attn.attention_output"], out["layers.mlp.mlp_output"]
    # the block adds the contributions as they are: exact
    np.testing.assert_array_equal(x + a, out["layers.layer_mid"])
    np.testing.assert_array_equal(x + a + mlp, out["layers.layer_output"])
    # what the block adds is the post-norm's output (or the raw output) times residual_multiplier
    for raw_site, norm, added in (("layers.self_attn.attention_raw_output", model.layers.slots[0].attention_post_norm, a),
                                  ("layers.mlp.mlp_raw_output", model.layers.slots[0].mlp_post_norm, mlp)):
        raw = out[raw_site]
        if norm is None:
            np.testing.assert_array_equal(raw * np.float32(m), added)
        else:
            normed = jax.vmap(lambda n, r: n(r))(norm, raw)
            assert_close(added, normed * np.float32(m), 1e-6, f"{name}: {raw_site} post-norm")
    # token_embeddings is the unscaled lookup
    np.testing.assert_array_equal(out["token_embeddings"] * np.float32(cfg["embedding_multiplier"]),
                                  out["layers.layer_input"][0])
    np.testing.assert_array_equal(out["token_embeddings"], np.asarray(model.embed)[full[0]])
    # logits are the head's output times logits_scaling; the lens at the last block equals them
    np.testing.assert_array_equal(out["lm_head_output"] * np.float32(cfg["logits_scaling"]), out.logits)
    lens = jax.jit(jstd.project_on_vocab)(model, out["layers.layer_output"][-1])
    np.testing.assert_array_equal(lens, out.logits)
    # scores: q·kᵀ times attention_multiplier, causally masked; softmax(scores) == probabilities
    q, k = out["layers.self_attn.attention_queries"], out["layers.self_attn.attention_keys"]
    k = np.repeat(k, model.config.num_heads // model.config.num_kv_heads, axis=2)
    qk = np.einsum("lbhqd,lbhkd->lbhqk", q, k) * cfg["attention_multiplier"]
    scores = out["layers.self_attn.attention_scores"]
    causal = np.tril(np.ones((SEQ, SEQ), bool))
    assert_close(scores[..., causal], qk[..., causal], 1e-5, f"{name}: scores from q, k")
    assert (scores[..., ~causal] == np.finfo(np.float32).min).all()
    probs = jax.nn.softmax(scores, axis=-1)
    assert_close(probs, out["layers.self_attn.attention_probabilities"], 1e-6, f"{name}: softmax(scores)")


def test_raw_output_scale(case, full):
    """Scaling the sublayer's own output by 0.5 leaves the stream unchanged up to the norm's eps
    (with post-norms); without them it halves what the block adds."""
    name, _, model, _ = case
    tokens, _, _ = full
    clean = jit_run(model, tokens, reads=STREAM)
    out = jit_run(model, tokens, [jstd.Scale("layers.1.mlp.mlp_raw_output", 0.5)], reads=STREAM)
    if CASES[name]["use_post_norm"]:
        assert_close(out["layers.layer_output"], clean["layers.layer_output"], 1e-4, f"{name}: post-norm rescales")
        assert_close(out.logits, clean.logits, 1e-4, f"{name}: post-norm rescales")
    else:
        np.testing.assert_array_equal(out["layers.mlp.mlp_output"][1], 0.5 * clean["layers.mlp.mlp_output"][1])
        assert np.abs(out.logits - clean.logits).max() > 1e-2


def _edit_cases(model):
    """(label, jstd edits, torch edits, changes logits): the same edit made both ways."""
    H = model.config.hidden_size
    v = np.random.default_rng(9).normal(size=H).astype(np.float32)
    last = np.arange(SEQ) == SEQ - 1
    third = np.arange(SEQ) == 3
    post_norm = model.layers.slots[0].mlp_post_norm is not None

    def add_at(where):
        def fn(t):
            t = t.clone()
            t[:, where] += torch.from_numpy(v)
            return t
        return fn

    return [
        ("scale mlp_output", [jstd.Scale("layers.mlp.mlp_output", 0.5)],
         [TorchEdit("layers.mlp.mlp_output", lambda t: t * 0.5)], True),
        ("add to attention_output at the last position",
         [jstd.Add("layers.self_attn.attention_output", v, layer=1, where=last[None, :, None])],
         [TorchEdit("layers.self_attn.attention_output", add_at(-1), 1)], True),
        ("scale mlp_raw_output", [jstd.Scale("layers.1.mlp.mlp_raw_output", 0.5)],
         [TorchEdit("layers.mlp.mlp_raw_output", lambda t: t * 0.5, 1)], not post_norm),
        ("add to token_embeddings", [jstd.Add("token_embeddings", v, where=third[None, :, None])],
         [TorchEdit("token_embeddings", add_at(3))], True),
    ]


def test_edits_match_torch_hooks(residual_case):
    name, _, model, ref = residual_case
    tokens = tokens_for(model, seed=7)
    reads = STREAM
    clean = ref.run(tokens, reads=("logits",))["logits"]
    for label, edits, torch_edits, changes in _edit_cases(model):
        out = jit_run(model, tokens, edits, reads=reads)
        want = ref.run(tokens, reads=reads + ("logits",), edits=torch_edits)
        moved = np.abs(want["logits"] - clean).max()
        assert (moved > 1e-3) if changes else (moved < 1e-3), f"{label}: logits moved by {moved:.3g}"
        assert_sites_close(out, want, reads, 1e-5, f"{name}: {label}")


@pytest.mark.parametrize("name,dtype", [("think14b", "float32"), ("residual", "float32"), ("residual", "bfloat16"),
                                        ("text32b", "float32")])
def test_edit_at_one_position_is_exact(checkpoints, name, dtype):
    """An edit to mlp_output at one position leaves every other position bit-identical, for any
    residual_multiplier and in bfloat16: the edit is what the block adds, with no round trip."""
    _, _, model, _ = checkpoints(name, dtype)
    tokens = tokens_for(model, seed=4)
    p = 5
    v = jnp.asarray(np.random.default_rng(2).normal(size=model.config.hidden_size), dtype)
    at = (np.arange(SEQ) == p)[None, :, None]
    reads = STREAM
    clean = jit_run(model, tokens, reads=reads)
    out = jit_run(model, tokens, [jstd.Add("layers.1.mlp.mlp_output", v, where=at)], reads=reads)
    same = np.arange(SEQ) != p
    for site in reads:
        np.testing.assert_array_equal(np.asarray(out[site][1][:, same], np.float32),
                                      np.asarray(clean[site][1][:, same], np.float32), f"{name}: {site}")
        np.testing.assert_array_equal(np.asarray(out[site][:, :, :p], np.float32),
                                      np.asarray(clean[site][:, :, :p], np.float32), f"{name}: {site} before {p}")
    np.testing.assert_array_equal(out["layers.mlp.mlp_output"][1][:, p], clean["layers.mlp.mlp_output"][1][:, p] + v)
    np.testing.assert_array_equal(out.logits[:, :p], clean.logits[:, :p])
    assert np.abs(np.asarray(out.logits[:, p:], np.float32) - np.asarray(clean.logits[:, p:], np.float32)).max() > 1e-2


def test_gradients_flow_through_the_multipliers(residual_case):
    """jax.grad reaches an edit's array through the contributions and the scaled embeddings."""
    _, _, model, _ = residual_case
    tokens = tokens_for(model, batch=1)

    def loss(v):
        edits = [jstd.Add("layers.0.mlp.mlp_output", v), jstd.Add("token_embeddings", v)]
        return jstd.run(model, tokens, edits).logits[0, -1].max()

    g = jax.jit(jax.grad(loss))(jnp.zeros(model.config.hidden_size))
    assert np.isfinite(g).all() and np.abs(g).max() > 0


def test_block_identity_is_exact_in_bfloat16(checkpoints):
    """The block adds exactly the contributions read (and edited), in bfloat16 too."""
    _, _, model, _ = checkpoints("residual", "bfloat16")
    tokens = tokens_for(model)
    block = jit_run(model, tokens, reads=("layers.layer_input", "layers.layer_mid") + STREAM)
    x, a, m = block["layers.layer_input"], block["layers.self_attn.attention_output"], block["layers.mlp.mlp_output"]
    np.testing.assert_array_equal(np.asarray(x + a, np.float32), np.asarray(block["layers.layer_mid"], np.float32))
    np.testing.assert_array_equal(np.asarray(x + a + m, np.float32), np.asarray(block["layers.layer_output"], np.float32))


def test_other_families_refuse_the_raw_outputs():
    from pathlib import Path

    llama = jstd.load(Path(jstd.__file__).parent / "assets" / "tiny-llama")
    with pytest.raises(jstd.SiteError, match="specific to the hyperclovax family"):
        jstd.run(llama, np.zeros((1, 3), np.int64), reads=("layers.mlp.mlp_raw_output",))


def test_a_continued_or_resumed_run_keeps_the_multipliers(residual_case):
    """jstd.Context on HyperCLOVA X: a suffix continuing its prefix's cache (the embedding multiplier applies
    to its tokens), and a run resumed at block 1 from the stream (no multiplier: the stream is a block's
    input), both equal the whole run; so does a patching sweep, which resumes runs, against single patches."""
    _, _, model, _ = residual_case
    tokens = tokens_for(model, seed=5)
    start = 4
    full = jit_run(model, tokens, reads=jstd.Context.sites_for(model) + ("layers.layer_input",))
    positions = np.broadcast_to(np.arange(start, SEQ), (tokens.shape[0], SEQ - start))
    rest = jstd.run(model, tokens[:, start:], context=jstd.Context.continuing(model, full, positions))
    assert_close(rest.logits, full.logits[:, start:], name="continued")
    context = jstd.Context.continuing(model, full, positions, block=1, stream=full["layers.layer_input"][1][:, start:])
    assert_close(jstd.run(model, tokens[:, start:], context=context).logits, full.logits[:, start:], name="resumed")
    corrupt = tokens.copy()
    corrupt[:, 2] = (tokens[:, 2] + 1) % model.config.vocab_size
    metric = jstd.logit_difference(3, 4)
    site = "layers.mlp.mlp_raw_output"
    grid = jstd.patch_sweep(model, tokens, corrupt, site, metric, positions=[1, 2, 6], progress=False)
    for layer, j, p in [(0, 1, 2), (1, 2, 6), (1, 0, 1)]:
        one = jstd.patch(model, tokens, corrupt, site, layer=layer, positions=p, metric=metric)
        np.testing.assert_allclose(grid[layer, j], one, rtol=1e-4, atol=1e-4 * max(1.0, abs(float(one))))
