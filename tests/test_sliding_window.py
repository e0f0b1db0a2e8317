"""Sliding-window attention and soft-capping (Mistral, Qwen2, Gemma 2, Gemma 3, OLMo-3) against transformers.

Windows of 4 keys on sequences of 11 and of 12 keys on generations of 15 tokens: left padding on both attention
paths, ``jstd.Context`` continuing a run past the window, greedy ``generate`` equal to transformers' (whose
sliding cache drops the keys older than the window), bfloat16 and edits through torch hooks on each family,
soft-capped scores and logits, the logit lens and direct logit attribution under the final cap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
import sliding_cases
import test_conformance as conformance
import test_conformance_bfloat16 as bfloat16
import test_conformance_edits as conformance_edits
from conftest import assert_close
from families import Spec
from reference.cases import Zoo, jit_run
from reference.harness import TorchReference
from test_generate import left_padded, torch_generate

# every value of each case in float32 is in test_conformance (families.CASES); here, to keep the suite short, each
# check runs on the cases whose quirk it tests: Mistral (every block sliding), Qwen2 (full and sliding blocks,
# three slots), Gemma 2 (alternating, soft-capped), Gemma 3 (a rotary per kind, (1 + w) head norms)
# a generation past a 12-key window (prompt 7 + 8 new), full and sliding blocks mixed
LONG = {"qwen2-window12": dict(model_type="qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=1)}


@pytest.fixture(scope="module")
def long_zoo(tmp_path_factory):
    config = lambda c: (lambda: sliding_cases.AutoConfig.for_model(
        **{**sliding_cases.BASE, **LONG[c]}))
    specs = {c: Spec(config(c), seed=8, reference=lambda folder, dtype, c=c: TorchReference(
        folder, dtype, sliding_cases.plan(c))) for c in LONG}
    return Zoo(tmp_path_factory, specs)


@pytest.mark.parametrize("name, path", [("mistral-window", "fused"), ("mistral-window", "explicit"),
                                        ("gemma2-softcap", "explicit")])
def test_left_padding_past_the_window(zoo, name, path):
    """Rows of 11, 7 and 4 real tokens, left-padded, equal each unpadded row, on both attention paths."""
    conformance.test_left_padding(zoo, name, path)


@pytest.mark.parametrize("name", ["mistral-window"])
def test_context_continues_past_the_window(zoo, name):
    """A suffix from position 6 continuing a 6-token prefix's cache (window 4: its first keys fall out)."""
    conformance.test_context_continues_the_run(zoo, name)


def test_bfloat16(zoo):
    """Gemma 2's (1 + w) pre- and post-norms bit for bit given torch's bf16 inputs, the sqrt(hidden) embedding
    scale rounded to bf16 (Gemma 1's norms: the gemma-2b case of the suite)."""
    bfloat16.test_bfloat16(zoo, "gemma2-softcap")


def test_edits_match_torch_hooks(zoo):
    conformance_edits.test_edits_match_torch_hooks(zoo, "gemma2-softcap")


def _generates_as_transformers(case, new):
    _, _, model, ref, _ = case
    tokens, mask = left_padded(model)
    gen = jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=new, eos_token_id=(), pad_token_id=0)
    want_tokens, want_logits = torch_generate(ref, dict(input_ids=tokens, attention_mask=mask), new=new)
    np.testing.assert_array_equal(np.asarray(gen.tokens), want_tokens)
    assert_close(gen.logits, want_logits, 1e-5, f"{case.name}: step logits")


@pytest.mark.parametrize("name", ["mistral-window", "gemma3_text-local"])
def test_generation_past_a_window_of_4_equals_transformers(zoo, name):
    _generates_as_transformers(zoo(name), 6)


@pytest.mark.parametrize("name", tuple(LONG))
def test_generation_past_a_window_of_12_equals_transformers(long_zoo, name):
    _generates_as_transformers(long_zoo(name), 8)


def test_window_mask_counts_keys_as_transformers():
    """A query at index i attends keys i - window + 1 .. i (transformers' sliding_window_overlay)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    from jstd.kernels.attention import window_mask

    n, w = 9, 3
    index = jnp.arange(n)[None]
    ours = np.asarray(window_mask(index, index, w)[0, 0]) & np.tril(np.ones((n, n), bool))
    theirs = np.array([[sliding_window_causal_mask_function(w)(0, 0, torch.tensor(q), torch.tensor(k)).item()
                        for k in range(n)] for q in range(n)])
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_rounds_as_torch(dtype):
    """tanh(x / cap) · cap as torch computes it on a tensor of the dtype: bit for bit in bfloat16 (each step rounded
    to it), within an ulp in float32 (XLA's tanh and torch's differ by one)."""
    from jstd.kernels.softcap import softcap

    x = torch.from_numpy(np.random.default_rng(0).normal(scale=40.0, size=4096).astype(np.float32)).to(
        getattr(torch, dtype))
    want = (torch.tanh(x / 30.0) * 30.0).float().numpy()
    got = softcap(jnp.asarray(x.float().numpy(), dtype), 30.0)
    assert got.dtype == jnp.dtype(dtype)
    if dtype == "bfloat16":
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    else:
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_soft_caps_bite(zoo):
    """On the Gemma 2 case the caps change the values (so the every-value check of scores and logits tests them):
    some scores and logits lie past where tanh(x / cap) · cap is near x."""
    values, want = zoo.every_value("gemma2-softcap")
    model = zoo("gemma2-softcap").model
    scores = want["layers.self_attn.attention_scores"]
    real = np.abs(scores[scores > -1e30])
    assert real.max() > 0.9 * model.layers.slots[0].attn.softcap and real.max() <= model.layers.slots[0].attn.softcap
    logits, head = want["logits"], want["lm_head_output"]
    assert np.abs(logits).max() <= model.logit_softcap and np.abs(head).max() > 1.5 * model.logit_softcap


def test_logit_lens_and_attribution_under_the_final_cap(zoo):
    """The logit lens caps as the model does (the last block's lens is the logits); direct logit attribution
    decomposes the logits before the cap, says it is not exact, and its parts sum to them."""
    _, _, model, _, spec = zoo("gemma2-softcap")
    tokens, _ = spec.inputs(model)
    out = jit_run(model, tokens, reads=("layers.layer_output", "lm_head_output"))
    lens = jstd.logit_lens(model, tokens)
    # the same computation, up to one float32 ulp (XLA's tanh compiled in another program)
    assert_close(lens[-1], out.logits, 1e-6, "the last block's lens")
    target, other = 3, 5
    with pytest.warns(UserWarning, match="soft-cap"):
        dla = jstd.direct_logit_attribution(model, tokens, target, other)
    assert not dla.exact
    head = np.asarray(out["lm_head_output"][:, -1], np.float64)
    assert_close(dla.logit, head[:, target] - head[:, other], 1e-5, "the logit before the cap")
    assert_close(dla.total(), dla.logit, 1e-4, "the parts sum to the logit before the cap")
    llama = zoo("llama-gqa").model
    assert jstd.direct_logit_attribution(llama, tokens % llama.config.vocab_size, target, other).exact


@pytest.mark.parametrize("name", ["gemma-2-2b", "gemma-3-1b", "Mistral-7B-v0.1", "Qwen2.5-0.5B", "OLMo-3-7B"])
def test_published_configs_are_read_whole(tmp_path, name):
    """Each published config.json (2 blocks) names no key the family leaves unread (no ConfigWarning), and the
    model's windows, caps and rotaries are the config's (shapes only; benchmarks/published_configs.py runs them at
    their published sizes against transformers)."""
    import json

    from transformers import AutoConfig

    from jstd.families import family_for
    from jstd.io.hf import unhandled
    from published_configs import two_blocks

    config = two_blocks(name)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    family = family_for(hf.model_type)
    assert unhandled(hf, family) == {}
    model = family.skeleton(hf, jnp.float32)
    window = config["sliding_window"] if config.get("use_sliding_window", True) else None
    kinds = model.config.layer_types
    assert kinds == tuple(hf.layer_types) if hasattr(hf, "layer_types") else all(k == kinds[0] for k in kinds)
    for i, kind in enumerate(kinds):
        attn = model.layers.slots[i % model.layers.period].attn
        assert attn.sliding_window == (window if kind == "sliding_attention" else None), (name, i)
        assert attn.softcap == (config.get("attn_logit_softcapping") if hf.model_type == "gemma2" else None)
    assert model.logit_softcap == config.get("final_logit_softcapping")
    local = dict(model.kind_rotary).get("sliding_attention")
    if name == "gemma-3-1b":  # local blocks turn by rope_local_base_freq, global ones by rope_theta
        np.testing.assert_allclose(local.inv_freq[1], config["rope_local_base_freq"] ** (-2 / 256), rtol=1e-6)
        np.testing.assert_allclose(model.rotary.inv_freq[1], config["rope_theta"] ** (-2 / 256), rtol=1e-6)
