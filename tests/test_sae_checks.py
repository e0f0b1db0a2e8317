"""Dictionaries without silent wrong answers (issue 44, item 3 and the dictionary blind spots of item 8): per-block
dictionaries named after their blocks stack and splice; the field that differs is named; a feature edit at a block
without a dictionary, an out-of-range feature (patch sweep, dense latents) and bad training arguments are refused;
load_sae refuses a cfg.json that is not JSON, lacks d_in, leaves the architecture open, stores tensors the
architecture does not use, and a non-floating dtype; a non-default apply_b_dec_to_input and a pre-activation
exactly at a JumpReLU threshold give SAELens' own values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
from jstd.sae import SAE, init, load_sae, save_sae, splice, stack
from jstd.sae.features import dense_latents, feature_patch_sweep, steer_feature
from jstd.sae.train import train
from test_sae import SITE, model, tokens  # noqa: F401 (the tiny model and its tokens, as fixtures)


def random_sae(seed, d_in, d_sae=48, architecture="standard", **kw) -> SAE:
    sae = init(jax.random.key(seed), d_in, d_sae, architecture=architecture, **kw)
    k1, k2, k3 = jax.random.split(jax.random.key(seed + 100), 3)
    threshold = None if sae.threshold is None else jnp.abs(0.2 * jax.random.normal(k3, sae.threshold.shape))
    return eqx_replace(sae, W_enc=sae.W_enc * 10, b_enc=0.1 * jax.random.normal(k1, sae.b_enc.shape),
                       W_dec=sae.W_dec * 5, b_dec=0.1 * jax.random.normal(k2, sae.b_dec.shape), threshold=threshold)


def eqx_replace(sae: SAE, **fields) -> SAE:
    return dataclasses.replace(sae, **fields)


def saelens(folder: Path, x: np.ndarray):
    sae_lens = pytest.importorskip("sae_lens")
    theirs = sae_lens.SAE.load_from_disk(str(folder), device="cpu")
    with torch.no_grad():
        return theirs.encode(torch.from_numpy(x)).numpy(), theirs(torch.from_numpy(x)).numpy()


# ---- stacking per-block dictionaries -------------------------------------------------------------------------------
def test_per_block_dictionaries_named_after_their_blocks_stack_and_splice(model, tokens):
    """Each named blocks.N.hook_resid_post, with its own metadata (as SAELens' per-layer sets and jstd.sae.train
    name them): stacked, each row keeps its name; spliced by name, each runs at its own block (in the order named),
    exactly as the same arrays spliced by site and blocks."""
    d = model.config.hidden_size
    order = (1, 0)
    named = [eqx_replace(random_sae(i, d), hook_name=f"blocks.{b}.hook_resid_post",
                         extra=json.dumps({"metadata": {"hook_name": f"blocks.{b}.hook_resid_post", "seed": i}}))
             for i, b in enumerate(order)]
    stacked = stack(named)
    assert stacked.hook_name == tuple(s.hook_name for s in named)
    assert stacked[1].hook_name == "blocks.0.hook_resid_post" and json.loads(stacked[1].extra)["metadata"]["seed"] == 1
    unnamed = [eqx_replace(s, hook_name=None, extra="{}") for s in named]
    latents = f"{SITE}.sae.latents"
    by_name = jstd.run(model, tokens, splice(model, stacked), reads=(latents,))[latents]
    by_site = jstd.run(model, tokens, splice(model, unnamed, SITE, layer=order), reads=(latents,))[latents]
    np.testing.assert_array_equal(np.asarray(by_name), np.asarray(by_site))
    assert np.asarray(by_name[1]).any() and np.asarray(by_name[0]).any()
    mixed = [named[0], eqx_replace(named[1], hook_name="blocks.0.hook_mlp_out")]
    with pytest.raises(jstd.SiteError, match="the stacked dictionaries name different sites"):
        splice(model, mixed)


@pytest.mark.parametrize("field,change,shown", [
    ("d_sae", dict(d_sae=32), r"W_enc: shape \(64, 32\)"),
    ("k", dict(architecture="topk", k=3), "k: 3 vs 4"),
    ("apply_b_dec_to_input", dict(apply_b_dec_to_input=False), "apply_b_dec_to_input: False vs True"),
    ("architecture", dict(architecture="jumprelu"), "architecture: 'jumprelu' vs 'standard'"),
])
def test_stack_names_the_field_that_differs(field, change, shown):
    base = dict(d_sae=48, architecture="topk" if field == "k" else "standard", k=4 if field == "k" else None)
    first = init(jax.random.key(0), 64, **{**base, "d_sae": base["d_sae"]})
    kw = {**base, **change}
    other = init(jax.random.key(1), 64, kw.pop("d_sae"), **kw)
    with pytest.raises(ValueError, match=rf"dictionary 1 differs from dictionary 0 in {shown}"):
        stack([first, other])


# ---- feature edits and indices -------------------------------------------------------------------------------------
def test_a_feature_edit_at_a_block_without_a_dictionary_is_refused(model, tokens):
    sae = random_sae(0, model.config.hidden_size)
    spliced = splice(model, sae, SITE, layer=1)
    with pytest.raises((jstd.SiteError, ValueError), match=r"no dictionary is spliced at that block of "
                                                           r"layers.layer_output \(spliced at blocks \[1\]\)"):
        jstd.run(model, tokens, [*spliced, steer_feature(SITE, 3, 5.0, sae.d_sae, layer=0)])
    run = jax.jit(lambda layer: jstd.run(model, tokens, [*spliced, steer_feature(SITE, 3, 5.0, sae.d_sae,
                                                                                 layer=layer)]).logits)
    plain = jstd.run(model, tokens, spliced).logits
    assert not np.array_equal(np.asarray(run(jnp.asarray(1))), np.asarray(plain))  # a spliced block: edited
    with pytest.raises(Exception, match="no dictionary is spliced at that block"):
        jax.block_until_ready(run(jnp.asarray(0)))


def test_out_of_range_features_are_refused(model, tokens):
    sae = random_sae(0, model.config.hidden_size)
    spliced = splice(model, sae, SITE)
    metric = lambda logits: logits[:, -1, 5].mean()
    with pytest.raises(jstd.SiteError, match=r"feature_patch_sweep: features=48 is out of range for the sae axis of "
                                             r"size 48"):
        feature_patch_sweep(model, tokens, tokens[::-1], spliced, metric, SITE, [0], [3, 48])
    indices, values = np.array([[1, 48]]), np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match=r"dense_latents: index 48 is outside 0..47 \(d_sae=48\)"):
        dense_latents(indices, values, 48)
    with pytest.raises(Exception, match=r"dense_latents: indices must lie in 0..47"):
        jax.block_until_ready(jax.jit(dense_latents, static_argnums=2)(jnp.asarray(indices), values, 48))
    np.testing.assert_array_equal(np.asarray(dense_latents(np.array([[1, 47]]), values, 48))[0, [1, 47]], [1, 1])


# ---- load_sae --------------------------------------------------------------------------------------------------------
def written(tmp_path, sae: SAE, name="sae", **cfg_changes) -> Path:
    folder = save_sae(sae, tmp_path / name)
    cfg = json.loads((folder / "cfg.json").read_text())
    for key, value in cfg_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def test_a_config_without_architecture_loads_only_when_the_tensors_decide(tmp_path):
    jump = random_sae(0, 16, architecture="jumprelu")
    back = load_sae(written(tmp_path, jump, "jump", architecture=None))
    assert back.architecture == "jumprelu"
    np.testing.assert_array_equal(np.asarray(back.threshold), np.asarray(jump.threshold))
    assert load_sae(written(tmp_path, random_sae(1, 16), "plain", architecture=None)).architecture == "standard"
    with pytest.raises(ValueError, match=r"has no 'architecture' and its fields \(k\) point to a TopK"):
        load_sae(written(tmp_path, random_sae(2, 16, architecture="topk", k=3), "topk", architecture=None))
    # a threshold stored beside a config saying standard: refused, not dropped
    with pytest.raises(ValueError, match=r"stores threshold, which a standard dictionary does not use"):
        load_sae(written(tmp_path, jump, "jump-as-standard", architecture="standard"))


def test_config_and_dtype_errors_name_the_problem(tmp_path):
    folder = written(tmp_path, random_sae(0, 16), "sae")
    with pytest.raises(ValueError, match=r"dtype=int32 is not a floating dtype"):
        load_sae(folder, dtype=jnp.int32)
    missing = written(tmp_path, random_sae(0, 16), "no-d-in", d_in=None)
    with pytest.raises(ValueError, match=r"the field 'd_in' is missing"):
        load_sae(missing)
    (folder / "cfg.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"sae/cfg.json is not JSON"):
        load_sae(folder)


@pytest.mark.parametrize("architecture,setting", [
    ("standard", dict(apply_b_dec_to_input=False)), ("jumprelu", dict(apply_b_dec_to_input=False)),
    ("topk", dict(rescale_acts_by_decoder_norm=True)),
])
def test_non_default_settings_are_read_as_saelens_reads_them(tmp_path, architecture, setting):
    """A value that is not the architecture's default: jstd's latents and output are SAELens' own."""
    sae = random_sae(3, 16, architecture=architecture, k=5 if architecture == "topk" else None)
    sae = eqx_replace(sae, **setting)
    folder = save_sae(sae, tmp_path / "sae")
    back = load_sae(folder)
    assert all(getattr(back, key) == value for key, value in setting.items())
    x = np.random.default_rng(2).normal(size=(3, 5, 16)).astype(np.float32) * 3
    latents, out = saelens(folder, x)
    assert (latents > 0).any() and (latents == 0).any()
    np.testing.assert_allclose(np.asarray(back.encode(x)), latents, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(back(x)), out, rtol=1e-5, atol=1e-4)


def test_jumprelu_at_its_threshold_is_off_as_in_saelens(tmp_path):
    """JumpReLU fires where pre > threshold: a pre-activation exactly at the threshold gives 0 (SAELens)."""
    d = 8
    eye = jnp.eye(d, dtype=jnp.float32)
    threshold = jnp.linspace(0.25, 2.0, d, dtype=jnp.float32)
    sae = SAE(eye, jnp.zeros(d), eye, jnp.zeros(d), threshold, architecture="jumprelu", apply_b_dec_to_input=False)
    x = np.stack([np.asarray(threshold), np.asarray(threshold) * 1.5])[None]  # [1, 2, d]: at the threshold, above
    ours = np.asarray(sae.encode(x))
    np.testing.assert_array_equal(ours[0, 0], np.zeros(d))
    np.testing.assert_array_equal(ours[0, 1], x[0, 1])
    np.testing.assert_array_equal(ours, saelens(save_sae(sae, tmp_path / "sae"), x.astype(np.float32))[0])


# ---- training arguments ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,message", [
    (dict(d_sae=0), r"d_sae=0 must be an int of at least 1"),
    (dict(steps=-1), r"steps=-1 must be an int of at least 0"),
    (dict(batch_size=0), r"batch_size=0 must be an int of at least 1"),
    (dict(log_every=0), r"log_every=0 must be an int of at least 1"),
    (dict(init_sae="wide"), r"d_sae=32 but init_sae has 40 latents; pass d_sae=40"),
    (dict(init_sae="narrow"), r"init_sae reads 12 and writes 12 features, but the rows it trains on are 16 wide"),
])
def test_training_arguments_are_checked_before_anything_runs(kw, message):
    rows = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    inits = {"wide": init(jax.random.key(0), 16, 40), "narrow": init(jax.random.key(0), 12, 32)}
    if "init_sae" in kw:
        kw = dict(init_sae=inits[kw["init_sae"]])
    args = dict(d_sae=32, steps=2, key=jax.random.key(0), batch_size=16, log_every=1, progress=False)
    with pytest.raises(ValueError, match=message):
        train(rows, **{**args, **kw})
