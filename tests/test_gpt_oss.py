"""gpt-oss (``tests/gpt_oss_cases.py``): what the conformance suite's every-value and fused-path tests (which run
every case) and ``tests/test_moe.py`` (the weighted sum of the experts, bfloat16 near torch) do not already say.
The suite's other checks on the gpt-oss case (the block identity, edits against torch hooks incl. a router
re-route, left padding, continuation) and generation against transformers' ``generate`` past the sliding window; the sinks' own identities and a
sink-probability edit against the same edit in torch; the published configs read whole, MXFP4 refused; the
convert / export round trip (transformers loads the export with the same logits)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
import test_conformance as conformance
import test_conformance_edits as edits
import test_convert as convert
import test_generate as generate
from conftest import assert_close
from reference.cases import jit_run
from reference.harness import TorchEdit

NAME = "gpt_oss"
A = "layers.self_attn."


def test_block_identity_and_edits_match_torch_hooks(zoo):
    """The block identity; scaling mlp_output, adding to a block's output, zeroing a value head, a uniform pattern,
    a router re-route (expert 0 out of every top-k) and ablating each token's first choice, each as torch's hooks
    make it."""
    conformance.test_block_identity(zoo, NAME)
    edits.test_edits_match_torch_hooks(zoo, NAME)


def test_left_padding_and_continuation(zoo):
    """Left-padded rows equal their unpadded prompts (the sinks see no padding key) on the explicit path; a
    Context continues a prefix longer than the window."""
    conformance.test_left_padding(zoo, NAME, "explicit")
    conformance.test_context_continues_the_run(zoo, NAME)


def test_generation_past_the_window_equals_transformers(zoo):
    """Greedy generation (7-token prompts, one left-padded by 2, 6 new tokens: past the window of 4) equals
    transformers' generate, tokens and each step's logits."""
    assert_generation_equals_transformers(zoo, NAME)


def assert_generation_equals_transformers(zoo, name: str) -> None:
    """``jstd.generate`` on left-padded prompts (``test_generate.left_padded``) equals transformers' greedy
    ``generate``: the tokens, and each step's logits at float32 tolerance."""
    _, _, model, ref, _ = zoo(name)
    tokens, mask = generate.left_padded(model)
    gen = jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=generate.NEW)
    want_tokens, want_logits = generate.torch_generate(ref, dict(input_ids=tokens, attention_mask=mask))
    np.testing.assert_array_equal(np.asarray(gen.tokens), want_tokens)
    assert_close(gen.logits, want_logits, 1e-5, f"{name}: step logits")


def test_sinks_take_the_mass_the_keys_do_not(zoo):
    """Each row's probabilities over the keys sum to 1 - sink_probability; the sink's share is the softmax of its
    logit against the row's scores; attention_sinks are the checkpoint's."""
    model = zoo(NAME).model
    out, _ = zoo.every_value(NAME)
    probs, sink = np.asarray(out[A + "attention_probabilities"], np.float64), np.asarray(out[A + "sink_probability"])
    assert_close(probs.sum(-1) + sink, np.ones_like(sink), 1e-6, "the mass")
    scores, logits = np.asarray(out[A + "attention_scores"], np.float64), np.asarray(out[A + "attention_sinks"])
    joint = np.concatenate([scores, np.broadcast_to(logits[:, None, :, None, None], sink.shape + (1,))], -1)
    joint = np.exp(joint - joint.max(-1, keepdims=True))
    assert_close(sink, joint[..., -1] / joint.sum(-1), 1e-5, "the sink's share")
    np.testing.assert_array_equal(logits, np.asarray(model.layers.slots[0].attn.sinks if model.layers.period == 1
                                                     else np.stack([model.layers.slots[i % model.layers.period].attn
                                                                    .sinks[i // model.layers.period]
                                                                    for i in range(model.depth())])))
    assert 0.05 < sink.mean() < 0.95, "the sinks take too little or too much: the case is weak"
    with pytest.raises(jstd.SiteError, match="read-only"):
        jstd.Add(A + "attention_sinks", 1.0)


def test_sink_probability_edit_matches_torch(zoo):
    """Setting a block's sink probability to 0.5, and removing the sinks everywhere (0), re-normalise the keys'
    mass in jstd as in torch (the softmax over the keys alone times 1 - the edited value): one compiled program,
    each edit switched on by its ``where``."""
    _, _, model, ref, spec = zoo(NAME)
    tokens, _ = spec.inputs(model, seed=7)
    reads = ("layers.layer_output", A + "attention_probabilities")
    cases = (([jstd.Set(A + "sink_probability", 0.5, layer=1)],
              [TorchEdit(A + "sink_probability", lambda t: torch.full_like(t, 0.5), 1)]),
             ([jstd.Zero(A + "sink_probability")], [TorchEdit(A + "sink_probability", torch.zeros_like)]))

    outs = edits.assert_switched_edits_match(model, ref, tokens, cases, reads, NAME)
    rows = np.asarray(outs[1][A + "attention_probabilities"]).sum(-1)
    assert_close(rows, np.ones_like(rows), 1e-6, "no sinks: every row sums to 1")


PUBLISHED_20B = {  # https://huggingface.co/openai/gpt-oss-20b config.json, cut to 2 blocks
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_published_config_is_read_whole_and_mxfp4_is_refused(tmp_path):
    """gpt-oss-20b's config.json (2 blocks) without its quantization_config (a dequantised copy's) sets only keys
    the family reads or knowingly ignores and builds the model it describes; with it (the hub's MXFP4 experts)
    loading refuses with the fix."""
    from transformers import AutoConfig

    from jstd.families import family_for
    from jstd.io.hf import unhandled

    dequantised = {k: v for k, v in PUBLISHED_20B.items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(dequantised))
    hf = AutoConfig.from_pretrained(tmp_path)
    family = family_for(hf.model_type)
    assert unhandled(hf, family) == {}
    model = family.skeleton(hf, jnp.float32)
    c = model.config
    assert (c.num_experts, c.experts_per_token, c.head_dim, c.num_kv_heads) == (32, 4, 64, 8)
    assert [model.layers.slots[i].attn.sliding_window for i in range(2)] == [128, None]
    slot = model.layers.slots[0]
    assert slot.attn.sinks.shape == (1, 64) and slot.mlp.gate_up.shape == (1, 32, 2880, 5760)
    assert slot.mlp.swiglu == (7.0, 1.702) and slot.mlp.router_bias.shape == (1, 32)
    assert model.rotary.attention_scaling == pytest.approx(0.1 * np.log(32.0) + 1.0)
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps(PUBLISHED_20B))
    with pytest.raises(ValueError, match=r"gpt_oss: the checkpoint is quantised \(quantization_config "
                                         r"quant_method='mxfp4'.*use a dequantised copy"):
        family.skeleton(AutoConfig.from_pretrained(tmp_path / "q"), jnp.float32)


def assert_aot_preset_is_published(preset: str, published: dict, blocks: int):
    """``jstd.aot``'s preset ``preset`` (what ``jstd aot`` compiles for docs/scale.md) has ``blocks`` blocks and, cut
    to ``published``'s, builds the model ``published`` (a hub config.json, any quantization_config dropped) does:
    the same standard config and parameter shapes."""
    from jstd.aot import config
    from jstd.families import family_for

    assert config(preset).num_hidden_layers == blocks
    hub = config({k: v for k, v in published.items() if k != "quantization_config"})
    mine = config(preset, blocks=published["num_hidden_layers"])
    family = family_for(hub.model_type)
    a, b = (family.skeleton(c, jnp.float32) for c in (mine, hub))
    assert a.config == b.config
    assert jax.tree.map(lambda x: x.shape, a) == jax.tree.map(lambda x: x.shape, b)


def test_aot_preset_is_the_published_config():
    """The ``gpt-oss-20b`` preset is gpt-oss-20b's config.json at its 24 blocks."""
    assert_aot_preset_is_published("gpt-oss-20b", PUBLISHED_20B, 24)


def test_convert_and_export_round_trip(zoo, tmp_path):
    """Convert and export give back every tensor bit for bit (the interleaved gate/up columns re-interleaved);
    transformers loads the export with the original's logits."""
    assert_round_trip_and_export_loads(zoo, NAME, tmp_path)


def assert_round_trip_and_export_loads(zoo, name: str, tmp_path) -> None:
    """``test_convert.test_round_trip_is_bit_exact`` on ``name``, and transformers (eager experts) loads the export
    with the original's logits, bit for bit."""
    convert.test_round_trip_is_bit_exact(zoo, name, tmp_path)
    _, _, model, ref, spec = zoo(name)
    tokens, _ = spec.inputs(model)
    exported = type(ref.model).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    exported.set_experts_implementation("eager")
    with torch.no_grad():
        want = ref.model(torch.as_tensor(np.asarray(tokens))).logits.numpy()
        theirs = exported(torch.as_tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_array_equal(theirs, want)


def test_new_weights_have_sharding_axes(zoo):
    """The sinks shard with the heads, the router's bias and the experts' biases with the experts (``EP`` puts them
    on ``model``); the model places on a mesh under ``EP`` with unchanged values. (The 8-device ``EP`` layout, run
    by ``tests/sharded_check.py`` on this case, equals one device.)"""
    from jstd.nn.params import logical_axes

    model = zoo(NAME).model
    axes = logical_axes(model)
    slot = lambda tree: tree.layers.slots[0]
    assert tuple(slot(axes).attn.sinks) == ("layers", "heads")
    mlp = slot(axes).mlp
    assert (tuple(mlp.router_bias), tuple(mlp.gate_up_bias), tuple(mlp.down_bias)) == (
        ("layers", "experts"), ("layers", "experts", "mlp"), ("layers", "experts", "embed"))
    placed = jstd.shard(model, jstd.sharding.mesh(), jstd.sharding.EP)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(model)):
        np.testing.assert_array_equal(got, want)
