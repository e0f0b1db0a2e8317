"""Llama 4 (``tests/llama4_cases.py``): what the conformance suite's every-value and fused-path tests (which run every
case) do not already say. The suite's other checks on the first case (the block identity, edits against torch hooks
incl. a router re-route, left padding, continuation past a chunk) and bfloat16; generation against transformers'
``generate`` past an attention chunk; the chunk and the temperature themselves (each changes values, as torch's);
the published Scout config read whole, text and image-text, and images refused; the convert / export round trip;
the new weights' sharding axes."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
import test_conformance as conformance
import test_conformance_bfloat16 as bfloat16
import test_conformance_edits as edits
import test_generate as generate
from conftest import assert_close
from published_text_configs import LLAMA4_SCOUT_TEXT
from test_gpt_oss import assert_round_trip_and_export_loads

NAME = "llama4_text"


def test_suite_checks_block_edits_padding_continuation(zoo):
    """The conformance suite's checks on this case: the block identity; edits as torch's hooks make them (scaling
    mlp_output, adding to a block's output, zeroing a value head, a uniform pattern, a router re-route: expert 0
    out of every top-k, ablating each token's first choice); left-padded rows equal their unpadded prompts on both
    paths (the chunks start at a row's first real token, the temperature counts real tokens); a Context continues
    a prefix (6 tokens) past the first chunk (4)."""
    conformance.test_block_identity(zoo, NAME)
    edits.test_edits_match_torch_hooks(zoo, NAME)
    for path in ("explicit", "fused"):
        conformance.test_left_padding(zoo, NAME, path)
    conformance.test_context_continues_the_run(zoo, NAME)


def test_bfloat16(zoo):
    """Every value near torch's in bfloat16 (the conformance suite's bfloat16 check on this case)."""
    bfloat16.test_bfloat16(zoo, NAME)


def test_generation_past_the_chunk_equals_transformers(zoo):
    """Greedy generation (7-token prompts, one left-padded by 2, 6 new tokens: past the chunk of 4 and across the
    temperature's steps) equals transformers' generate, tokens and each step's logits: the unpadded row against the
    batch's, the padded row against its prompt alone (transformers counts a padded row's padding in the NoPE
    blocks' temperature; jstd gives each row its unpadded values: see jstd.models.llama4)."""
    _, _, model, ref, _ = zoo(NAME)
    tokens, mask = generate.left_padded(model)
    gen = jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=generate.NEW)
    want_tokens, want_logits = generate.torch_generate(ref, dict(input_ids=tokens, attention_mask=mask))
    np.testing.assert_array_equal(np.asarray(gen.tokens)[0], want_tokens[0])
    assert_close(gen.logits[0], want_logits[0], 1e-5, f"{NAME}: step logits, row 0")
    pad = int((mask[-1] == 0).sum())
    alone = tokens[-1:, pad:]
    one_tokens, one_logits = generate.torch_generate(ref, dict(input_ids=alone, attention_mask=np.ones_like(alone)))
    np.testing.assert_array_equal(np.asarray(gen.tokens)[-1, pad:], one_tokens[0])
    assert_close(gen.logits[-1], one_logits[0], 1e-5, f"{NAME}: step logits, the padded row")


def test_chunk_and_temperature_change_values_as_in_torch(zoo):
    """The chunk narrows the rotary blocks' patterns (no probability outside a query's chunk; the first query of a
    chunk attends itself alone), the NoPE blocks attend every earlier key, and their queries are the projections
    times the temperature at their position: log1p(floor((p + 1) / floor_scale)) · attn_scale + 1 (the case's
    floor_scale 4 makes it grow along the row); the rotary blocks' queries and keys have unit RMS per head."""
    _, _, model, ref, _ = zoo(NAME)
    hf = ref.model.config
    out, _ = zoo.every_value(NAME)
    a = "layers.self_attn."
    probs = np.asarray(out[a + "attention_probabilities"])  # [blocks, batch, heads, q, k]
    seq, chunk = probs.shape[-1], hf.attention_chunk_size
    index = np.arange(seq)
    same = (index[:, None] // chunk) == (index[None, :] // chunk)
    rope = [i for i, r in enumerate(hf.no_rope_layers[:hf.num_hidden_layers]) if r]
    nope = [i for i in range(hf.num_hidden_layers) if i not in rope]
    assert np.all(probs[rope][..., ~same] == 0), "a chunked block attends outside its chunk"
    starts = index[index % chunk == 0]
    first = probs[rope][..., starts, starts]  # each chunk's first query on itself
    assert_close(first, np.ones_like(first), 1e-6, "a chunk's first query attends itself alone")
    later = np.tril(np.ones((seq, seq), bool)) & ~same
    assert np.all(probs[nope][..., later] > 0), "a NoPE block misses keys of an earlier chunk"
    q = np.asarray(out[a + "attention_queries"], np.float64)  # [blocks, batch, heads, seq, dim]
    assert_close(np.sqrt((q[rope] ** 2).mean(-1)), np.ones(q[rope].shape[:-1]), 1e-4, "L2-normed queries")
    normed = np.asarray(out["layers.attention_norm_output"], np.float64)  # [blocks, batch, seq, embed]
    for b in nope:
        slot = model.layers.slots[b % model.layers.period]
        w = np.asarray(slot.attn.q[b // model.layers.period], np.float64)  # [embed, heads, dim]
        scale = np.log1p(np.floor((index + 1.0) / hf.floor_scale)) * hf.attn_scale + 1.0
        want = np.einsum("bte,ehd->bhtd", normed[b], w) * scale[None, None, :, None]
        assert_close(q[b], want, 1e-5, f"block {b}: tuned queries")
    assert scale[-1] > 1.4, "the case's temperature does not bite"
    from jstd.nn.frozen import frozen

    held = frozen(model).layers.slots[rope[0] % model.layers.period].attn
    assert held.qk_l2_norm.frozen_scale and held.frozen_pattern, "the L2 q/k norm is a norm frozen() holds"
    tuned = jax.tree.map(lambda a: a[0], model.layers.slots[nope[0] % model.layers.period].attn)
    with pytest.raises(ValueError, match=r"tunes its temperature by the tokens' positions.*\(cos_sin, mask, posi"):
        tuned(jnp.ones((1, 3, hf.hidden_size)), (None, None), None)


def test_mlp_output_is_the_experts_on_weighted_inputs_plus_the_shared_expert(zoo):
    """On every MoE block ``mlp_output == Σ_k expert_outputs[k] + shared_expert_output`` (the weights act on the
    experts' inputs, not their outputs); the indices are the top-k logits, largest first; the weights their
    sigmoids."""
    model = zoo(NAME).model
    out, _ = zoo.every_value(NAME)
    m = "layers.mlp."
    blocks = list(model.blocks_for(m + "router_logits"))
    total = np.asarray(out[m + "expert_outputs"], np.float64).sum(-2) + np.asarray(out[m + "shared_expert_output"])
    assert_close(total, np.asarray(out[m + "mlp_output"], np.float64)[blocks], 1e-6, "mlp_output")
    logits, idx = np.asarray(out[m + "router_logits"], np.float64), np.asarray(out[m + "expert_indices"])
    chosen = np.take_along_axis(logits, idx, -1)
    assert (chosen >= np.sort(logits, -1)[..., -idx.shape[-1]:][..., :1] - 1e-7).all() and (
        np.diff(chosen, axis=-1) <= 1e-7).all(), "not the top-k logits, largest first"
    assert_close(np.asarray(out[m + "router_weights"]), 1 / (1 + np.exp(-chosen)), 1e-6, "sigmoid weights")


SCOUT = {  # meta-llama/Llama-4-Scout-17B-16E config.json, cut to 2 blocks
    "architectures": ["Llama4ForConditionalGeneration"], "boi_token_index": 200080, "eoi_token_index": 200081,
    "image_token_index": 200092, "model_type": "llama4",
    "text_config": LLAMA4_SCOUT_TEXT,
    "tie_word_embeddings": False, "transformers_version": "4.51.0",
    "vision_config": {
        "attention_dropout": 0.0, "hidden_act": "gelu", "hidden_size": 1408, "image_size": 336,
        "initializer_range": 0.02, "intermediate_size": 5632, "model_type": "llama4_vision_model",
        "multi_modal_projector_bias": False, "norm_eps": 1e-05, "num_attention_heads": 16, "num_channels": 3,
        "num_hidden_layers": 34, "patch_size": 14, "pixel_shuffle_ratio": 0.5, "projector_dropout": 0.0,
        "projector_input_dim": 4096, "projector_output_dim": 4096, "rope_theta": 10000, "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default", "vision_output_dim": 4096},
}


def test_published_scout_config_is_read_whole(tmp_path):
    """Llama-4-Scout's config.json (2 blocks: a chunked rotary block and a NoPE one, both MoE), as the image-text
    checkpoint and as its text_config alone, sets only keys the families read or knowingly ignore and builds the
    model it describes."""
    from transformers import AutoConfig

    from jstd.families import family_for
    from jstd.io.hf import unhandled

    for name, raw in (("llama4", SCOUT), ("llama4_text", SCOUT["text_config"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        hf = AutoConfig.from_pretrained(tmp_path / name)
        family = family_for(hf.model_type)
        assert unhandled(hf, family) == {}, name  # on llama4: text_config's keys against llama4_text too
        model = family.skeleton(hf, jnp.float32)
        c = model.config
        if name == "llama4":  # the text_config's keys are checked against llama4_text: one it did not read shows
            from unittest import mock

            from jstd.models.llama4 import Llama4Text
            with mock.patch.object(Llama4Text, "handled", Llama4Text.handled - {"no_rope_layers"}):
                assert unhandled(hf, family) == {"text_config.no_rope_layers": [1, 0]}
        assert (c.num_experts, c.experts_per_token, c.head_dim, c.num_kv_heads, c.model_type) == (16, 1, 128, 8, name)
        assert model.config.layer_types == ("chunked_attention", "full_attention+nope")
        rope, nope = (model.layers.slots[i].attn for i in range(2))
        assert (rope.attention_chunk, rope.qk_l2_norm.eps, rope.temperature, rope.rotary_interleaved) == (
            8192, 1e-5, None, True)
        assert (nope.attention_chunk, nope.qk_l2_norm, nope.temperature) == (None, None, (8192.0, 0.1))
        mlp = model.layers.slots[0].mlp
        assert mlp.gate_up.shape == (1, 16, 5120, 16384) and mlp.shared.gate.shape == (1, 5120, 8192)
        assert (mlp.routing, mlp.weights_on_input, mlp.shared_gate) == ("top_k_sigmoid", True, None)
        assert model.rotary_for("full_attention+nope") is None and model.rotary_for("chunked_attention") is not None


def test_bad_llama4_configs_are_refused_clearly():
    """A chunked block without a chunk and a moe_layers entry past the blocks are refused, naming the key."""
    import llama4_cases

    from jstd.models.llama4 import Llama4Text

    hf = llama4_cases.config()
    hf.attention_chunk_size = None
    with pytest.raises(ValueError, match=r"attention_chunk_size=None is not a chunk for the chunked_attention"):
        Llama4Text.skeleton(hf, jnp.float32)
    hf = llama4_cases.config()
    hf.moe_layers = [1, 7]
    with pytest.raises(ValueError, match=r"moe_layers lists \[7\], which are not blocks \(0 \.\. 3\)"):
        Llama4Text.skeleton(hf, jnp.float32)


def test_image_text_checkpoint_serves_its_text_model_and_refuses_images(zoo, tmp_path):
    """A llama4 checkpoint (Llama4ForConditionalGeneration: the text model under language_model., a vision tower and
    projector beside it) loads as its text model with the text checkpoint's logits; images are refused, saying
    why."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    _, _, model, ref, spec = zoo(NAME)
    hf = ref.model.config
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, projector_input_dim=32, projector_output_dim=64, vision_output_dim=32)
    config = Llama4Config(text_config=hf.to_dict(), vision_config=vision, image_token_index=96)
    torch.manual_seed(0)
    whole = Llama4ForConditionalGeneration(config)
    whole.language_model.load_state_dict(ref.model.state_dict())
    whole.save_pretrained(tmp_path)
    loaded = jstd.load(tmp_path)
    assert loaded.family == "llama4" and loaded.config.model_type == "llama4"
    tokens, _ = spec.inputs(model)
    np.testing.assert_array_equal(np.asarray(jstd.run(loaded, tokens).logits), np.asarray(jstd.run(model, tokens).logits))
    with pytest.raises(ValueError, match="llama4 checkpoint's text model only and takes no images.*vision tower"):
        jstd.run(loaded, jstd.Inputs(tokens, None, {"pixel_values": np.zeros((1, 3, 28, 28), np.float32)}))


def test_convert_and_export_round_trip(zoo, tmp_path):
    """Convert and export give back every tensor bit for bit; transformers loads the export with the original's
    logits."""
    assert_round_trip_and_export_loads(zoo, NAME, tmp_path)


def test_new_weights_have_sharding_axes(zoo):
    """The router and experts shard with the experts, the shared expert as an MLP; the model places on a mesh under
    ``EP`` with unchanged values."""
    from jstd.nn.params import logical_axes

    model = zoo(NAME).model
    axes = logical_axes(model)
    moe = next(i for i in range(model.layers.period) if hasattr(model.layers.slots[i].mlp, "router"))
    mlp = axes.layers.slots[moe].mlp
    assert (tuple(mlp.router), tuple(mlp.gate_up), tuple(mlp.down)) == (
        ("layers", "embed", "experts"), ("layers", "experts", "embed", "mlp"), ("layers", "experts", "mlp", "embed"))
    assert tuple(mlp.shared.gate) == ("layers", "embed", "mlp")
    placed = jstd.shard(model, jstd.sharding.mesh(), jstd.sharding.EP)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(model)):
        np.testing.assert_array_equal(got, want)


def test_chunk_mask_is_transformers_and_kernels_take_one_options_record():
    """``kernels.attention.chunk_mask`` with ``left_padding`` equals transformers' chunked causal mask function on
    left-padded rows (chunks counted from each row's first real token); the kernels refuse a bare soft-cap where
    their ``ScoreOptions`` record goes, naming the record."""
    from transformers.masking_utils import chunked_causal_mask_function

    from jstd.kernels import attention as kernels

    seq, chunk = 11, 4
    real = np.ones((3, seq), bool)
    real[1, :3], real[2, :5] = False, False
    causal = np.tril(np.ones((seq, seq), bool))[None, None] & real[:, None, None, :]
    index = jnp.arange(seq)[None]
    got = np.asarray(kernels.chunk_mask(index, index, chunk, kernels.left_padding(jnp.asarray(causal))))
    pads = torch.as_tensor((~real).sum(1))
    fn = chunked_causal_mask_function(chunk, pads)
    t = torch.tensor
    want = np.array([[[[bool(fn(t(b), t(0), t(q), t(k))) for k in range(seq)] for q in range(seq)]] for b in range(3)])
    np.testing.assert_array_equal(got & causal, want & causal)
    assert not np.array_equal(got, np.asarray(kernels.chunk_mask(index, index, chunk, jnp.zeros(3, int)))), \
        "the padding offset changes nothing: the case is weak"
    q = jnp.ones((1, 2, 3, 4))
    with pytest.raises(TypeError, match="ScoreOptions record"):
        kernels.scores(q, q, 0.5, None, 30.0)
