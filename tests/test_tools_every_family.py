"""Every tool of ``jstd.interventions`` on one case of every text family and wrapper (``families.MAIN``; the tools
but DLA on one of the two hybrids, which share their stack).

Each tool is checked against a property that holds on any model, so a tool that reads the wrong host, drops a
family's scaling or breaks on images fails here: DLA's parts sum to the logit difference; the logit lens at the
last block is the run's logits; patching the last block's stream at the last position from the clean
run gives the clean metric; a zero-sized (clean == corrupt) patch gives zero attribution; an ablation or steering
edit equals the same edit passed to ``jstd.run``; a resample from the run's own inputs changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from conftest import assert_close
from families import CASES, MAIN

TOOL_CASES = tuple(c for c in MAIN if not CASES[c].tower)
# the tools other than DLA run on one hybrid (Qwen3.5; OLMo-Hybrid shares its stack); DLA runs on every case, since
# where it splits heads depends on each family's norms (OLMo-Hybrid's post-norms); mixture-of-experts blocks get the
# other tools in tests/test_moe.py (a resumed sweep at the router, generation with router edits, collect)
STACK_CASES = tuple(c for c in TOOL_CASES if not c.startswith(("olmo_hybrid", "qwen3_moe")))
TARGET, OTHER = 5, 7
metric = jstd.logit_difference(TARGET, OTHER)


def pair(zoo, name):
    """(model, clean inputs, corrupted inputs): the corrupted batch changes the text (text families) or the
    pixels (wrappers), keeping every shape and the padding."""
    spec = CASES[name]
    model = zoo(name).model
    clean, _ = spec.inputs(model, seed=0)
    if spec.wrapper:
        images = dict(clean.images)
        images["pixel_values"] = np.asarray(images["pixel_values"]) * -1.0 + 0.5
        corrupt = jstd.Inputs(clean.tokens, clean.attention_mask, images, clean.layout)
    else:
        corrupt = np.asarray(clean).copy()
        corrupt[:, 1:-1] = (corrupt[:, 1:-1] + 11) % model.config.vocab_size
    return model, clean, corrupt


@pytest.fixture(scope="module", params=STACK_CASES)
def case(request, zoo):
    return pair(zoo, request.param)


@pytest.fixture(scope="module", params=TOOL_CASES)
def every_case(request, zoo):
    return pair(zoo, request.param)


def logits(model, inputs, edits=()):
    return np.asarray(jax.jit(jstd.run)(model, inputs, edits).logits, np.float32)


def test_direct_logit_attribution(every_case):
    model, clean, _ = every_case
    dla = jstd.direct_logit_attribution(model, clean, TARGET, OTHER)
    got = logits(model, clean)[:, -1]
    assert_close(dla.logit, got[:, TARGET] - got[:, OTHER], 1e-5, "the model's logit difference")
    assert_close(dla.total(), dla.logit, 1e-4, "parts sum to the logit difference")
    assert np.abs(dla.mlp).min() > 0 and np.abs(dla.attention).min() > 0


def test_logit_lens_ends_at_the_logits(case):
    model, clean, _ = case
    lens = np.asarray(jstd.logit_lens(model, clean, positions=-1))  # [layers, batch, 1, vocab]
    assert lens.shape[0] == model.config.num_layers
    assert_close(lens[-1, :, 0], logits(model, clean)[:, -1], 1e-5, "the last block's lens is the logits")
    probs = np.asarray(jstd.next_token_probs(model, clean))
    assert_close(probs, jax.nn.softmax(logits(model, clean)[:, -1]), 1e-5, "next-token probabilities")


def test_patching(case):
    """The sweep's last block at the last position is the clean run; its other entries are single patches."""
    model, clean, corrupt = case
    last = model.config.num_layers - 1
    seq = np.shape(clean.tokens if isinstance(clean, jstd.Inputs) else clean)[1]
    sweep = np.asarray(jstd.patch_sweep(model, clean, corrupt, "layers.layer_output", metric,
                                        positions=[seq - 3, seq - 1], progress=False))  # [layers, 2]
    assert sweep.shape == (model.config.num_layers, 2)
    assert_close(sweep[last, 1], metric(jnp.asarray(logits(model, clean))), 1e-4, "clean stream at the end")
    one = jstd.patch(model, clean, corrupt, "layers.0.layer_output", metric=metric, positions=seq - 3)
    assert_close(sweep[0, 0], one, 1e-5, "an entry is one patch")
    assert abs(float(metric(jnp.asarray(logits(model, clean)))) - float(metric(jnp.asarray(logits(model, corrupt))))) > 1e-4


def test_attribution_patching(case):
    model, clean, corrupt = case
    same = np.asarray(jstd.attribution_patching(model, clean, clean, "layers.layer_output", metric))
    assert same.shape[0] == model.config.num_layers and not same.any()
    est = np.asarray(jstd.attribution_patching(model, clean, corrupt, "layers.layer_output", metric))
    assert est.shape == same.shape and np.isfinite(est).all() and np.abs(est).max() > 0


def test_ablation_and_steering(case):
    model, clean, corrupt = case
    site = "layers.mlp.mlp_output"
    mean = jstd.mean_ablation(model, site, corrupt, layer=0)
    by_hand = jstd.Set(site, jstd.site_mean(model, site, corrupt, layer=0), layer=0)
    assert_close(logits(model, clean, [mean]), logits(model, clean, [by_hand]), 1e-6, "mean ablation")
    same = jstd.resample_ablation(model, site, clean, layer=0)
    assert_close(logits(model, clean, [same]), logits(model, clean), 1e-5, "resampling the run's own rows")
    vector = jstd.contrastive_vector(model, clean, corrupt, 0)
    steered = logits(model, clean, jstd.steer(0, vector, factor=2.0))
    assert_close(steered, logits(model, clean, [jstd.Add("layers.0.layer_output", 2.0 * vector)]), 1e-6, "steer")
    assert np.abs(steered - logits(model, clean)).max() > 1e-4
