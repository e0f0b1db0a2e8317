"""jstd.sae: the dictionary against SAELens' formulas (torch), its folder format both ways, splicing exactness
(bit-identical unedited, edits reaching downstream, gradients equal to finite differences), transcoders, several
dictionaries in one call, the feature toolkit and training."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file

import jstd
from jstd.collect.dataset import SparseRows
from jstd.sae import SAE, init, load_sae, save_sae, splice, stack

TINY = Path(jstd.__file__).parent / "assets" / "tiny-llama"
SITE = "layers.layer_output"


@pytest.fixture(scope="module")
def model():
    return jstd.load(TINY)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(3, 90, (2, 11)), jnp.int32)


def random_sae(key, d_in, d_sae, architecture="standard", **kw) -> SAE:
    """A dictionary with random biases and thresholds (SAELens' init leaves them zero, which tests nothing)."""
    norm = kw.pop("normalize_activations", "none")
    sae = init(key, d_in, d_sae, architecture=architecture, **kw)
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, 7), 3)
    return SAE(sae.W_enc * 10, 0.1 * jax.random.normal(k1, sae.b_enc.shape), sae.W_dec * 5,
               0.1 * jax.random.normal(k2, sae.b_dec.shape),
               None if sae.threshold is None else jnp.abs(0.2 * jax.random.normal(k3, sae.threshold.shape)),
               architecture=sae.architecture, k=sae.k, apply_b_dec_to_input=sae.apply_b_dec_to_input,
               normalize_activations=norm, hook_name=kw.get("hook_name"))


# ---- SAELens' encode/decode, reimplemented in torch from sae_lens 6.54 (saes/sae.py, standard_sae.py,
# topk_sae.py, jumprelu_sae.py, transcoder.py), reading the folder as SAELens does (cfg.json, safetensors) -----------
def saelens_latents_and_recon(folder: Path, x: np.ndarray):
    cfg = json.loads((folder / "cfg.json").read_text())
    w = load_file(folder / "sae_weights.safetensors")
    x = torch.from_numpy(np.asarray(x, np.float32))
    norm = cfg["normalize_activations"]
    sae_in = x
    if norm == "constant_norm_rescale":
        coeff = (cfg["d_in"] ** 0.5) / x.norm(dim=-1, keepdim=True)
        sae_in = x * coeff
    elif norm == "layer_norm":
        mu = x.mean(dim=-1, keepdim=True)
        centred = x - mu
        std = centred.std(dim=-1, keepdim=True)
        sae_in = centred / (std + 1e-5)
    if not cfg["architecture"].endswith("transcoder"):
        sae_in = sae_in - w["b_dec"] * cfg["apply_b_dec_to_input"]
    hidden_pre = sae_in @ w["W_enc"] + w["b_enc"]
    arch = cfg["architecture"]
    if arch in ("standard", "transcoder"):
        acts = torch.relu(hidden_pre)
    elif arch in ("jumprelu", "jumprelu_transcoder"):
        acts = torch.relu(hidden_pre) * (hidden_pre > w["threshold"]).to(hidden_pre)
    else:
        values, indices = torch.topk(hidden_pre, k=cfg["k"], dim=-1, sorted=False)
        acts = torch.zeros_like(hidden_pre).scatter(-1, indices, values.relu())
    out = acts @ w["W_dec"] + w["b_dec"]
    if norm == "constant_norm_rescale":
        out = out / coeff
    elif norm == "layer_norm":
        out = out * std + mu
    return acts.numpy(), out.numpy()


@pytest.mark.parametrize("architecture,kw", [
    ("standard", {}), ("topk", {"k": 5}), ("jumprelu", {}), ("standard", {"normalize_activations": "layer_norm"}),
    ("standard", {"normalize_activations": "constant_norm_rescale"}), ("transcoder", {"d_out": 24}),
])
def test_format_round_trip_and_saelens_formulas(tmp_path, architecture, kw):
    sae = random_sae(jax.random.key(1), 16, 40, architecture, hook_name="blocks.2.hook_resid_post", **kw)
    folder = save_sae(sae, tmp_path / "sae")
    cfg = json.loads((folder / "cfg.json").read_text())
    assert cfg["architecture"] == sae.architecture and (cfg["d_in"], cfg["d_sae"]) == (16, 40)
    assert cfg["metadata"]["hook_name"] == "blocks.2.hook_resid_post"
    assert cfg["metadata"]["jstd_site"] == "layers.2.layer_output"
    back = load_sae(folder)
    for a, b in zip(jax.tree.leaves(sae), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (back.architecture, back.k, back.normalize_activations) == (sae.architecture, sae.k, sae.normalize_activations)
    x = np.random.default_rng(2).normal(size=(3, 7, 16)).astype(np.float32) * 3
    latents, recon = saelens_latents_and_recon(folder, x)
    assert (latents > 0).any() and (latents == 0).any()
    np.testing.assert_allclose(np.asarray(back.encode(x)), latents, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(back(x)), recon, rtol=1e-5, atol=1e-5)
    assert save_sae(back, tmp_path / "again") and json.loads((tmp_path / "again" / "cfg.json").read_text()) == cfg


@pytest.mark.parametrize("architecture,kw", [
    ("standard", {}), ("topk", {"k": 5}), ("jumprelu", {}), ("standard", {"normalize_activations": "layer_norm"}),
    ("standard", {"normalize_activations": "constant_norm_rescale"}), ("transcoder", {"d_out": 24}),
])
def test_saelens_itself_loads_what_jstd_writes(tmp_path, architecture, kw):
    """SAELens (the test extra pins it) loads a folder jstd wrote and gives jstd's latents and output."""
    sae_lens = pytest.importorskip("sae_lens")
    sae = random_sae(jax.random.key(1), 16, 40, architecture, hook_name="blocks.2.hook_resid_post", **kw)
    theirs = sae_lens.SAE.load_from_disk(str(save_sae(sae, tmp_path / "sae")), device="cpu")
    x = np.random.default_rng(2).normal(size=(3, 7, 16)).astype(np.float32) * 3
    with torch.no_grad():
        latents, out = theirs.encode(torch.from_numpy(x)).numpy(), theirs(torch.from_numpy(x)).numpy()
    assert (latents > 0).any() and (latents == 0).any()
    np.testing.assert_allclose(np.asarray(sae.encode(x)), latents, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sae(x)), out, rtol=1e-5, atol=1e-4)


def test_topk_and_jumprelu_against_their_definitions():
    x = np.random.default_rng(3).normal(size=(4, 16)).astype(np.float32)
    sae = random_sae(jax.random.key(2), 16, 32, "topk", k=4)
    pre = np.asarray(sae.pre_activations(x))
    got = np.asarray(sae.encode(x))
    for row, p in zip(got, pre):
        top = np.argsort(-p)[:4]
        want = np.zeros_like(p)
        want[top] = np.maximum(p[top], 0)
        np.testing.assert_array_equal(row, want)
    j = random_sae(jax.random.key(3), 16, 32, "jumprelu")
    pre = np.asarray(j.pre_activations(x))
    want = np.where(pre > np.asarray(j.threshold), pre, 0) * (pre > 0)
    assert ((pre > 0) & (pre <= np.asarray(j.threshold))).any()  # a latent the threshold zeroes
    np.testing.assert_array_equal(np.asarray(j.encode(x)), want)


def test_fold_decoder_norm_keeps_the_reconstruction():
    sae = random_sae(jax.random.key(4), 16, 32, "jumprelu")
    folded = sae.fold_decoder_norm()
    x = np.random.default_rng(4).normal(size=(5, 16)).astype(np.float32)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(folded.W_dec), axis=-1), 1, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(folded(x)), np.asarray(sae(x)), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="TopK"):
        random_sae(jax.random.key(4), 16, 32, "topk", k=3).fold_decoder_norm()


# ---- splicing ----------------------------------------------------------------------------------------------------
def per_block(model, d_sae=96, architecture="standard", **kw):
    return [random_sae(jax.random.key(10 + i), model.config.hidden_size, d_sae, architecture, **kw)
            for i in range(model.config.num_layers)]


@pytest.mark.parametrize("site", [SITE, "layers.mlp.mlp_output", "layers.mlp_norm_output"])
def test_unedited_splice_is_the_plain_run_bit_for_bit(model, tokens, site):
    plain = jstd.run(model, tokens, reads=(site,))
    saes = per_block(model)
    out = jstd.run(model, tokens, splice(model, saes, site), reads=(site, f"{site}.sae.latents", f"{site}.sae.error"))
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(plain.logits))
    latents = out[f"{site}.sae.latents"]
    assert latents.shape == (model.config.num_layers, 2, 11, 96) and (latents > 0).any()
    want = jnp.stack([s.encode(v) for s, v in zip(saes, plain[site])])
    np.testing.assert_allclose(np.asarray(latents), np.asarray(want), rtol=1e-5, atol=1e-5)
    recon = jnp.stack([s.decode(lat) for s, lat in zip(saes, latents)])
    np.testing.assert_allclose(np.asarray(out[f"{site}.sae.error"]), np.asarray(plain[site] - recon), rtol=1e-5,
                               atol=1e-5)


def test_latent_edit_reaches_downstream_exactly(model, tokens):
    saes = per_block(model)[:2]
    edits = splice(model, saes, SITE, layer=(1, 3))
    plain = jstd.run(model, tokens, reads=(SITE,))
    ablate = jstd.Zero(f"{SITE}.sae.latents", layer=3, where=jnp.arange(96) < 40)
    out = jstd.run(model, tokens, [*edits, ablate], reads=(SITE, f"{SITE}.sae.latents"))
    latents = out[f"{SITE}.sae.latents"]
    assert not latents[0].any() and not latents[2].any() and latents[1].any()  # zeros where nothing is spliced
    np.testing.assert_array_equal(np.asarray(out[SITE][:3]), np.asarray(plain[SITE][:3]))  # blocks before: x
    x = plain[SITE][3]
    lat = saes[1].encode(x)
    want = x + (saes[1].decode(jnp.where(jnp.arange(96) < 40, 0.0, lat)) - saes[1].decode(lat))
    np.testing.assert_allclose(np.asarray(out[SITE][3]), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(out[SITE][3]), np.asarray(x), atol=1e-3)
    # downstream reads exactly what the site passed on: the same logits as setting that value there
    again = jstd.run(model, tokens, [jstd.Set(f"layers.3.{SITE[len('layers.'):]}", out[SITE][3])])
    np.testing.assert_array_equal(np.asarray(again.logits), np.asarray(out.logits))


def test_error_edit_runs_on_the_reconstruction(model, tokens):
    saes = per_block(model)
    edits = splice(model, saes[2], f"layers.2.{SITE[len('layers.'):]}")
    out = jstd.run(model, tokens, [*edits, jstd.Zero(f"{SITE}.sae.error", layer=2)], reads=(SITE,))
    plain = jstd.run(model, tokens, reads=(SITE,))
    np.testing.assert_allclose(np.asarray(out[SITE][2]), np.asarray(saes[2](plain[SITE][2])), rtol=1e-5, atol=1e-6)


def test_gradient_with_respect_to_latents_equals_finite_differences(model, tokens):
    edits = splice(model, per_block(model)[1], SITE, layer=1)

    def metric(delta):
        out = jstd.run(model, tokens, [*edits, jstd.Add(f"{SITE}.sae.latents", delta, layer=1)])
        return out.logits[0, -1, 5] - out.logits[1, 4, 7]

    zero = jnp.zeros((2, 11, 96))
    grad = np.asarray(jax.jit(jax.grad(metric))(zero))
    assert np.abs(grad).max() > 0
    f = jax.jit(metric)
    for b, p, j in [(0, 10, 3), (1, 4, 50)]:
        eps = 1e-2
        e = zero.at[b, p, j].set(eps)
        fd = (float(f(e)) - float(f(-e))) / (2 * eps)
        np.testing.assert_allclose(grad[b, p, j], fd, rtol=2e-2, atol=1e-4)


def test_transcoder_replaces_the_mlp_output(model, tokens, tmp_path):
    H = model.config.hidden_size
    tc = random_sae(jax.random.key(5), H, 80, "transcoder", hook_name="blocks.1.ln2.hook_normalized")
    tc = SAE(tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec, None, architecture="transcoder", apply_b_dec_to_input=False,
             hook_name="blocks.1.ln2.hook_normalized", hook_name_out="blocks.1.hook_mlp_out")
    tc = load_sae(save_sae(tc, tmp_path / "tc"))
    edits = splice(model, tc)  # the sites from the hooks: ln2.hook_normalized -> mlp_norm_normalized, hook_mlp_out
    assert [e.site for e in edits] == ["layers.mlp_norm_normalized", "layers.mlp.mlp_output"]
    reads = ("layers.mlp_norm_normalized", "layers.mlp.mlp_output")
    plain = jstd.run(model, tokens, reads=reads)
    out = jstd.run(model, tokens, edits, reads=reads + ("layers.1.mlp.mlp_output.sae.latents",))
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(plain.logits))
    np.testing.assert_allclose(np.asarray(out["layers.1.mlp.mlp_output.sae.latents"]),
                               np.asarray(tc.encode(plain["layers.mlp_norm_normalized"][1])), rtol=1e-5, atol=1e-5)
    zeroed = jstd.run(model, tokens, [*edits, jstd.Zero("layers.mlp.mlp_output.sae.error", layer=1)], reads=reads)
    np.testing.assert_allclose(np.asarray(zeroed["layers.mlp.mlp_output"][1]),
                               np.asarray(tc(zeroed["layers.mlp_norm_normalized"][1])), rtol=1e-5, atol=1e-6)


def test_several_dictionaries_at_several_sites_in_one_call(model, tokens):
    H = model.config.hidden_size
    saes = per_block(model)
    tc = random_sae(jax.random.key(6), H, 64, "transcoder", apply_b_dec_to_input=False)
    topks = [random_sae(jax.random.key(20 + i), H, 48, "topk", k=4) for i in range(2)]
    edits = (*splice(model, saes[:2], SITE, layer=(0, 2)), *splice(model, tc, "layers.mlp.mlp_output", layer=1,
                                                                    source="layers.mlp_norm_output"),
             *splice(model, topks, "layers.layer_input", layer=(1, 3)))
    reads = (f"{SITE}.sae.latents", "layers.mlp.mlp_output.sae.latents", "layers.layer_input.sae.latents")
    plain = jstd.run(model, tokens)
    out = jstd.run(model, tokens, edits, reads=reads)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(plain.logits))
    assert out[reads[0]].shape == (4, 2, 11, 96) and out[reads[1]].shape == (4, 2, 11, 64)
    assert ((out[reads[2]][np.array([1, 3])] > 0).sum(-1) <= 4).all() and not out[reads[2]][0].any()


def test_refusals(model, tokens):
    saes = per_block(model)
    with pytest.raises(jstd.SiteError, match="no dictionary is spliced"):
        jstd.run(model, tokens, reads=(f"{SITE}.sae.latents",))
    with pytest.raises(jstd.SiteError, match="no dictionary is spliced"):
        jstd.run(model, tokens, [jstd.Zero(f"{SITE}.sae.latents")])
    with pytest.raises(jstd.SiteError, match="wide"):
        splice(model, random_sae(jax.random.key(0), 32, 40), SITE, layer=0)
    with pytest.raises(jstd.SiteError, match="2 dictionaries"):
        jstd.run(model, tokens, [*splice(model, saes[0], SITE, layer=0), *splice(model, saes[1], SITE, layer=1)])
    with pytest.raises(jstd.SiteError, match="for 4 blocks"):
        splice(model, saes[:3], SITE)
    with pytest.raises(jstd.SiteError, match="cannot be spliced"):
        splice(model, saes[0], "layers.self_attn.attention_queries", layer=0)


# ---- the toolkit on features -------------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture,kw", [("jumprelu", {}), ("topk", {"k": 6})])
def test_feature_edits_compute_only_their_features(model, tokens, architecture, kw):
    """Ablating, steering and clamping by feature index where nothing reads the dictionary's values computes
    only those features (``FeatureEdit``): the same site values and logits as the same edits by feature mask,
    which run the whole dictionary; a feature named twice counts once."""
    saes = per_block(model, architecture=architecture, **kw)[:2]
    edits = splice(model, saes, SITE, layer=(1, 2))
    lat = f"{SITE}.sae.latents"
    base = jstd.run(model, tokens, edits, reads=(lat,))[lat]
    live = [int(j) for j in np.flatnonzero(np.asarray(base[1]).reshape(-1, 96).any(0))[:3]]
    tools = jstd.sae
    by_index = [tools.ablate_features(SITE, [live[0], live[1], live[0]], 96, layer=1),
                tools.steer_feature(SITE, live[2], 2.5, 96, positions=[3, 7]),
                tools.clamp_features(SITE, [live[1], 40], [1.5, 3.0], 96, layer=2)]
    mask = lambda fs: np.isin(np.arange(96), fs)
    by_mask = [tools.ablate_features(SITE, mask(live[:2]), 96, layer=1),
               tools.steer_feature(SITE, mask([live[2]]), 2.5, 96, positions=[3, 7]),
               jstd.Set(lat, np.where(np.arange(96) == 40, 3.0, 1.5).astype(np.float32), layer=2,
                        where=mask([live[1], 40]))]
    assert all(isinstance(e, tools.FeatureEdit) for e in by_index) and not any(
        isinstance(e, tools.FeatureEdit) for e in by_mask)
    fast = jstd.run(model, tokens, [*edits, *by_index], reads=(SITE,))
    whole = jstd.run(model, tokens, [*edits, *by_mask], reads=(SITE,))
    plain = jstd.run(model, tokens, reads=(SITE,))
    np.testing.assert_array_equal(np.asarray(fast[SITE][:1]), np.asarray(plain[SITE][:1]))  # before: x itself
    assert np.abs(np.asarray(fast[SITE][1:3] - plain[SITE][1:3])).max() > 1e-2
    np.testing.assert_allclose(np.asarray(fast[SITE]), np.asarray(whole[SITE]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(fast.logits), np.asarray(whole.logits), rtol=1e-5, atol=1e-5)
    # reading the latents runs the whole dictionary: the feature edits there are the masked ones
    read = jstd.run(model, tokens, [*edits, *by_index], reads=(lat,))[lat]
    np.testing.assert_array_equal(np.asarray(read), np.asarray(jstd.run(model, tokens, [*edits, *by_mask],
                                                                          reads=(lat,))[lat]))



def test_feature_tools(model, tokens, tmp_path):
    sae = per_block(model)[2]
    edits = splice(model, sae, SITE, layer=2)
    lat = f"{SITE}.sae.latents"
    metric = lambda logits: logits[:, -1, 5].sum()
    base = jstd.run(model, tokens, edits, reads=(lat,))[lat][2]
    live = np.flatnonzero(np.asarray(base).reshape(-1, 96).any(0))[:6]
    # ablation over features, vmapped: one compile; each entry equals the single edit
    f = jax.jit(jax.vmap(lambda j: metric(jstd.run(model, tokens, [*edits, jstd.sae.ablate_features(SITE, j, 96, layer=2)]).logits)))
    swept = np.asarray(f(jnp.asarray(live)))
    one = float(metric(jstd.run(model, tokens, [*edits, jstd.sae.ablate_features(SITE, int(live[1]), 96, layer=2)]).logits))
    np.testing.assert_allclose(swept[1], one, rtol=1e-5)
    assert f._cache_size() == 1 and np.ptp(swept) > 0
    # steering a feature moves the site by amount · W_dec[feature]
    plain = jstd.run(model, tokens, reads=(SITE,))[SITE][2]
    steered = jstd.run(model, tokens, [*edits, jstd.sae.steer_feature(SITE, 7, 3.0, 96, layer=2)], reads=(SITE,))[SITE][2]
    np.testing.assert_allclose(np.asarray(steered - plain), np.broadcast_to(3.0 * np.asarray(sae.W_dec[7]), plain.shape),
                               atol=2e-5)
    # clamping: the latent reads the clamped value; generate keeps it clamped at every new token
    clamp = jstd.sae.clamp_features(SITE, [3, 9], 4.0, 96, layer=2)
    out = jstd.run(model, tokens, [*edits, clamp], reads=(lat,))[lat][2]
    assert (np.asarray(out[..., [3, 9]]) == 4.0).all()
    gen = jstd.generate(model, tokens, [*edits, clamp], max_new_tokens=2, reads=(f"layers.2.{lat[7:]}",))
    whole = jstd.run(model, gen.tokens[:, :-1], [*edits, clamp])
    np.testing.assert_allclose(np.asarray(gen.logits), np.asarray(whole.logits[:, -2:]), rtol=1e-4, atol=1e-4)
    assert (np.asarray(gen.values[f"layers.2.{lat[7:]}"][..., [3, 9]]) == 4.0).all()
    # attribution patching at feature granularity approximates the (layer, feature) patching sweep
    corrupt = tokens.at[:, 3].set(11)
    sweep = np.asarray(jstd.sae.feature_patch_sweep(model, tokens, corrupt, edits, metric, SITE, [2], live))
    ap = np.asarray(jstd.sae.feature_attribution_patching(model, tokens, corrupt, edits, metric, SITE))
    corrupt_metric = float(metric(jstd.run(model, corrupt, edits).logits))
    effects = sweep[0] - corrupt_metric
    assert np.abs(effects).max() > 0 and not ap[[0, 1, 3]].any()  # nothing spliced at blocks 0, 1, 3
    np.testing.assert_allclose(ap[2, live], effects, rtol=0.3, atol=0.05 * np.abs(effects).max())
    # sparse rows: indices + values restore the latents exactly
    idx, val = jstd.sae.sparse_latents(base, int((base > 0).sum(-1).max()))
    np.testing.assert_array_equal(np.asarray(jstd.sae.dense_latents(idx, val, 96)), np.asarray(base))


def test_collect_writes_latents_sparse_resumably(model, tokens, tmp_path):
    """Latents collected under a splice are stored as counts + indices + values: densified, they equal the dense
    collection and the run's latents; random reads, batches, a resume after an interruption and a reader with
    only safetensors and json give the same rows."""
    saes = per_block(model)[:2]
    edits = splice(model, saes, SITE, layer=(1, 3))  # blocks 0 and 2: no dictionary, all-zero rows
    lat = f"{SITE}.sae.latents"
    sites = (lat, "layers.1.layer_output")
    kw = dict(edits=edits, batch_size=1, shard_bytes=8000, progress=False)
    ds = jstd.collect(model, jstd.Inputs(tokens, None), sites, tmp_path / "sparse", **kw)
    dense = jstd.collect(model, jstd.Inputs(tokens, None), sites, tmp_path / "dense", sparse=(), **kw)
    assert ds.sparse == (lat,) and dense.sparse == () and len(ds.index["shards"]) >= 3
    want = dense.read(lat)
    run = jstd.run(model, tokens, edits, reads=(lat,))[lat]  # [blocks, batch, seq, d_sae]
    np.testing.assert_allclose(want, np.asarray(run).transpose(1, 2, 0, 3).reshape(-1, 4, 96), rtol=1e-5, atol=1e-5)
    assert not want[:, [0, 2]].any() and (want > 0).any() and (want[:, [1, 3]] == 0).mean() > 0.2
    got = ds.read(lat)
    assert isinstance(got, SparseRows) and got.counts.shape == (len(ds), 4)
    assert len(got.values) == (want != 0).sum() < want.size / 2
    np.testing.assert_array_equal(got.dense(), want)
    np.testing.assert_array_equal(ds.read("layers.1.layer_output"), dense.read("layers.1.layer_output"))
    rows = np.random.default_rng(0).permutation(len(ds))[:9]
    np.testing.assert_array_equal(ds.read(lat, rows, dense=True), want[rows])
    key = jax.random.key(3)
    for a, b in zip(ds.batches(5, key=key, sites=[lat]), dense.batches(5, key=key, sites=[lat])):
        np.testing.assert_array_equal(a[lat].dense(), b[lat])
    # without jstd: each shard's counts, indices and values, and the index's names for them
    index = json.loads((ds.folder / "index.json").read_text())
    names = index["sites"][lat]["sparse"]
    parts = []
    for shard in index["shards"]:
        t = load_numpy(str(ds.folder / shard["file"]))
        counts, indices, values = t[names["counts"]], t[names["indices"]], t[names["values"]]
        assert len(values) == shard["nnz"][lat] == counts.sum()
        flat = np.zeros((counts.size, 96), np.float32)
        flat[np.repeat(np.arange(counts.size), counts.ravel()), indices] = values
        parts.append(flat.reshape(counts.shape + (96,)))
    np.testing.assert_array_equal(np.concatenate(parts), want)
    # resume: a run stopped after two shards continues from the third
    cut = dict(index, complete=False, shards=index["shards"][:2], rows=sum(s["rows"] for s in index["shards"][:2]))
    (ds.folder / "index.json").write_text(json.dumps(cut))
    before = (ds.folder / "shard-00000.safetensors").stat().st_mtime_ns
    resumed = jstd.collect(model, jstd.Inputs(tokens, None), sites, ds.folder, **kw)
    assert (ds.folder / "shard-00000.safetensors").stat().st_mtime_ns == before
    np.testing.assert_array_equal(resumed.read(lat, dense=True), want)
    with pytest.raises(ValueError, match="sparse='token_embeddings' is not among the sites"):
        jstd.collect(model, jstd.Inputs(tokens, None), sites, tmp_path / "bad", sparse="token_embeddings", **kw)


# ---- training ----------------------------------------------------------------------------------------------------
def synthetic(rows=12000, d=24, features=32, seed=0):
    """Rows that are sums of ~3 of ``features`` unit directions with magnitudes in [1, 2]: the known features."""
    rng = np.random.default_rng(seed)
    dirs = rng.normal(size=(features, d))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    coef = (rng.random((rows, features)) < 3 / features) * rng.uniform(1, 2, (rows, features))
    return (coef @ dirs).astype(np.float32), dirs


@pytest.mark.parametrize("architecture,kw", [("jumprelu", dict(l0=0.3, threshold=0.1)), ("topk", dict(k=3))])
def test_training_recovers_known_features(architecture, kw):
    x, dirs = synthetic()
    mesh = jstd.sharding.mesh(data=1, model=1)  # the batch over data, the latents over model (one device here)
    trained = jstd.sae.train(x, d_sae=64, steps=700, batch_size=256, key=jax.random.key(0), architecture=architecture,
                             learning_rate=3e-3, log_every=100, dead_after=20000, progress=False, mesh=mesh, **kw)
    log = trained.log
    assert log[-1]["mse"] < log[0]["mse"] and log[-1]["explained_variance"] > 0.8  # vs ~0 for the rows' mean
    W = np.asarray(trained.sae.W_dec)
    cos = (dirs @ (W / np.linalg.norm(W, axis=1, keepdims=True)).T).max(1)
    assert cos.min() >= 0.9, cos


@pytest.mark.parametrize("architecture,k", [("standard", None), ("topk", 4), ("jumprelu", None)])
def test_training_gradient_is_the_plain_loss(architecture, k, monkeypatch):
    """The training loss's gradient (its encoder's cheap b_dec gradient, the L1 term summed over rows first) equals
    plain autodiff of SAELens' formulas: ``((x - b_dec) @ W_enc + b_enc)``, ``Σ‖x - x̂‖²`` and ``l1 · Σ fᵢ‖W_dec[i]‖``
    per row, averaged."""
    import importlib

    train = importlib.import_module("jstd.sae.train")
    rng = np.random.default_rng(3)
    sae = init(jax.random.key(2), 12, 40, architecture=architecture, k=k, threshold=0.05)
    sae = jax.tree.map(lambda a: a + 0.05 * jnp.asarray(rng.normal(size=a.shape), a.dtype), sae)  # b_dec, b_enc != 0
    x = jnp.asarray(rng.normal(size=(32, 12)), jnp.float32)
    s = train.Settings(architecture, k, 5.0, 0.3, 0.05, 6, 0.5, 1)
    since = jnp.asarray(rng.integers(0, 3, 40), jnp.float32)  # some latents dead: TopK's auxiliary loss runs

    def plain(sae, x, since, s):
        if architecture != "standard":  # the same loss, its encoder differentiated plainly
            monkeypatch.setattr(train, "_pre_activations", lambda sae, x: sae.pre_activations(x))
            try:
                return train._loss(sae, x, since, s)
            finally:
                monkeypatch.undo()
        latents = jax.nn.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc)
        recon = latents @ sae.W_dec + sae.b_dec
        l1 = (latents * jnp.linalg.norm(sae.W_dec, axis=-1)).sum(-1).mean()
        return ((x - recon) ** 2).sum(-1).mean() + s.l1 * l1, None

    got = jax.grad(lambda m: train._loss(m, x, since, s)[0])(sae)
    want = jax.grad(lambda m: plain(m, x, since, s)[0])(sae)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=2e-5, atol=2e-6, err_msg=name)


def test_training_on_a_collection_resumes_and_writes_saelens(model, tmp_path):
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 90, (16, 24)), jnp.int32)
    ds = jstd.collect(model, jstd.Inputs(tokens, None), "layers.layer_output", tmp_path / "acts", batch_size=8,
                      progress=False)
    args = dict(d_sae=128, batch_size=64, key=jax.random.key(1), layer=2, log_every=5, checkpoint_every=10,
                progress=False, learning_rate=1e-3, dead_after=640, resample_every=10)
    whole = jstd.sae.train(ds, "layers.layer_output", steps=20, **args)
    first = jstd.sae.train(ds, "layers.layer_output", steps=10, checkpoint=tmp_path / "ckpt", **args)
    resumed = jstd.sae.train(ds, "layers.layer_output", steps=20, checkpoint=tmp_path / "ckpt", out=tmp_path / "sae", **args)
    assert len(first.log) == 2 and [r["step"] for r in resumed.log] == [5, 10, 15, 20]
    for a, b in zip(jax.tree.leaves(whole.sae), jax.tree.leaves(resumed.sae)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert whole.log[-1]["mse"] < whole.log[0]["mse"]
    back = load_sae(tmp_path / "sae")
    assert back.hook_name == "blocks.2.hook_resid_post"
    out = jstd.run(model, tokens, splice(model, back), reads=("layers.2.layer_output.sae.latents",))
    assert out["layers.2.layer_output.sae.latents"].shape == (16, 24, 128)
    with pytest.raises(ValueError, match="different call"):
        jstd.sae.train(ds, "layers.layer_output", steps=20, checkpoint=tmp_path / "ckpt", **{**args, "d_sae": 64})


MESH_CHECK = """
import jax, numpy as np, jstd
x = np.random.default_rng(0).normal(size=(4096, 32)).astype(np.float32)
args = dict(d_sae=64, steps=12, batch_size=512, key=jax.random.key(0), progress=False, log_every=4)
spread = jstd.sae.train(x, mesh=jstd.sharding.mesh(data=4, model=2), **args)
alone = jstd.sae.train(x, **args)
print(max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(spread.sae),
                                                                             jax.tree.leaves(alone.sae))))
"""


def test_training_data_and_model_parallel_on_8_devices(on_8_devices):
    """The batch over data (4) and the latents over model (2) of 8 CPU devices, in a subprocess (the suite has
    one device): the same dictionary as on one device."""
    assert on_8_devices(MESH_CHECK) < 1e-6
