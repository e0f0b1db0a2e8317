"""DeepSeek-V2 / V3 (``tests/deepseek_cases.py``): what the conformance suite's every-value and fused-path tests
(which run every case: every value in float32 against transformers) do not already say. The block identity and
edits against torch hooks (incl. a router re-route) and the latents' own edits; left padding and a Context;
generation against transformers' ``generate`` and the cache holding the latent, not per-head keys; DeepSeek's
routing recomputed from the router logits; bfloat16 near torch; the published configs (DeepSeek-V2-Lite run at its
attention sizes against transformers, DeepSeek-V3 read whole, FP8 refused); convert / export; sharding axes."""

from __future__ import annotations

import dataclasses
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
from decoding_hlo import decoding_loop
import test_moe
from test_gpt_oss import assert_aot_preset_is_published
from conftest import assert_close
from reference.cases import assert_sites_close, jit_run
from reference.harness import TorchEdit

V2, V3 = "deepseek_v2", "deepseek_v3"
A, M = "layers.self_attn.", "layers.mlp."


def test_edits_match_torch_hooks(zoo):
    """The block identity on both families; on V3 (low-rank queries, sigmoid routing) in one compiled program, each
    edit switched on by its ``where``, as torch's hooks make them: scaling mlp_output, zeroing a value head, a
    uniform pattern, a router re-route (the expert most chosen at the last block out of every top-k), ablating each
    token's first choice (its lowest expert id), and the latents (q_a_layernorm's and kv_a_layernorm's outputs, the
    rotated shared key the rotary hands on): scaling kv_latent on one block, adding to q_latent at the last
    position, zeroing rope_keys everywhere (every head's key then ends in zeros)."""
    conformance.test_block_identity(zoo, V2)
    conformance.test_block_identity(zoo, V3)
    _, _, model, ref, spec = zoo(V3)
    tokens, _ = spec.inputs(model, seed=7)
    out, _ = zoo.every_value(V3)
    last, c = model.blocks_for(M + "router_logits")[-1], model.config
    drop = np.zeros(c.num_experts, np.float32)
    drop[np.bincount(np.asarray(out[M + "expert_indices"][-1]).ravel(), minlength=c.num_experts).argmax()] = -np.inf
    v = np.random.default_rng(3).normal(size=model.layers.slots[0].attn.q_a.shape[-1]).astype(np.float32)
    pattern = np.tril(np.ones((11, 11), np.float32))
    pattern /= pattern.sum(-1, keepdims=True)

    def at(j, value):
        def edit(t):
            t = t.clone()
            t[j] = value(t[j])
            return t
        return edit

    last_position = lambda t: at((slice(None), -1), lambda x: x + torch.from_numpy(v))(t)
    cases = (
        ([jstd.Scale(M + "mlp_output", 0.5)], [TorchEdit(M + "mlp_output", lambda t: t * 0.5)]),
        ([jstd.Zero(A + "attention_values", layer=1, heads=3)],
         [TorchEdit(A + "attention_values", at((slice(None), 3), torch.zeros_like), 1)]),
        ([jstd.Set(A + "attention_probabilities", pattern, layer=2)],
         [TorchEdit(A + "attention_probabilities", lambda t: torch.from_numpy(pattern).expand_as(t).clone(), 2)]),
        ([jstd.Add(M + "router_logits", drop, layer=last)],
         [TorchEdit(M + "router_logits", lambda t: t + torch.from_numpy(drop), last)]),
        ([jstd.Zero(M + "expert_outputs", layer=last, where=np.arange(c.experts_per_token)[:, None] == 0)],
         [TorchEdit(M + "expert_outputs", at((slice(None), slice(None), 0), torch.zeros_like), last)]),
        ([jstd.Scale(A + "kv_latent", 0.5, layer=1)], [TorchEdit(A + "kv_latent", lambda t: t * 0.5, 1)]),
        ([jstd.Add(A + "q_latent", v, positions=-1)], [TorchEdit(A + "q_latent", last_position)]),
        ([jstd.Zero(A + "rope_keys")], [TorchEdit(A + "rope_keys", torch.zeros_like)]),
    )
    reads = ("layers.layer_output", A + "attention_keys")

    outs = edits.assert_switched_edits_match(model, ref, tokens, cases, reads, V3)
    np.testing.assert_array_equal(np.asarray(outs[len(cases) - 1][A + "attention_keys"])[..., 16:], 0)


def test_keys_are_the_shared_rotary_key_broadcast(zoo):
    """Every head's key ends with rope_keys (the same numbers in each head); the values are v_head_dim wide, not
    the keys' width; V2-Lite's form has no q_latent (a full q_proj)."""
    model = zoo(V2).model
    out, _ = zoo.every_value(V2)
    keys, rope = np.asarray(out[A + "attention_keys"]), np.asarray(out[A + "rope_keys"])
    attn = model.layers.slots[0].attn
    np.testing.assert_array_equal(keys[..., attn.nope:], np.broadcast_to(rope[:, :, None], keys[..., attn.nope:].shape))
    assert out[A + "attention_values"].shape[-1] == 12 and keys.shape[-1] == 24
    assert out[A + "kv_latent"].shape[-1] == 32 and A + "q_latent" not in model.sites
    assert A + "q_latent" in zoo(V3).model.sites


def test_generation_caches_the_latent_and_equals_transformers(zoo):
    """The cache holds each block's kv_latent and rope_keys (kv_lora_rank + qk_rope_head_dim numbers a position,
    not heads · (qk_head_dim + v_head_dim)); a generation with a kv_latent edit equals jstd.run on the whole sequence
    with that edit, step by step; the budget counts the cache and the head-major copies of kv_b; an edit of attention_keys in generate is refused, naming the latent. A Context
    continues a prefix through the latent too (its 5 tokens over 6 cached positions attend in latent space). The
    generation against transformers' generate: test_decoding_attends_in_latent_space."""
    from jstd.generate.budget import preallocated_bytes
    from jstd.generate.cache import prefill

    _, _, model, _, _ = zoo(V2)
    tokens, mask = generate.left_padded(model)

    _, cache = jax.eval_shape(lambda m: prefill(m, jstd.Inputs(tokens, mask), (), generate.NEW), model)
    blocks, total = model.config.num_layers, tokens.shape[1] + generate.NEW
    assert cache.keys.shape == (blocks, 2, 1, total, 32) and cache.values.shape == (blocks, 2, 1, total, 8)
    attn = model.layers.slots[0].attn
    kv_b = attn.kv_lora_rank * attn.o.shape[-3] * (attn.nope + attn.v_head_dim)  # its head-major copies, a block
    assert preallocated_bytes(model, 2, tokens.shape[1], generate.NEW) == (
        blocks * (32 + 8) * 2 * total * 4 + 2 * generate.NEW * 2 * 97 * 4 + 2 * total * 4 + blocks * kv_b * 4)

    edit = jstd.Scale(A + "kv_latent", 0.25, layer=2, positions=(3, 8))
    gen = jstd.generate(model, tokens, [edit], attention_mask=mask, max_new_tokens=generate.NEW)
    whole = jit_run(model, jstd.Inputs(np.asarray(gen.tokens), np.concatenate([mask, np.ones((2, generate.NEW),
                                                                                             int)], 1)), [edit])
    assert_close(gen.logits, whole.logits[:, tokens.shape[1] - 1:-1], 1e-5, "the edited generation")
    with pytest.raises(ValueError, match="caches kv_latent and rope_keys.*Edit layers.self_attn.kv_latent"):
        jstd.generate(model, tokens, [jstd.Zero(A + "attention_keys", layer=0)], attention_mask=mask,
                      max_new_tokens=2)
    conformance.test_context_continues_the_run(zoo, V2)


def _spied_generate(model, tokens, mask, reads=()) -> tuple[object, set]:
    """``jstd.generate`` traced afresh, and which attention paths its blocks took: ``("attend_latent", True)`` for a
    continued call attending in latent space, ``("attend_expanded", past)`` over expanded keys (``past``: whether it
    continued a cache)."""
    from jstd.nn.latent_attention import LatentAttention

    taken, real = set(), (LatentAttention.attend_latent, LatentAttention.attend_expanded)

    def latent(self, q, past, new, mask):
        taken.add(("attend_latent", True))
        return real[0](self, q, past, new, mask)

    def expanded(self, q, kv_latent, rope_keys, mask, s, past):
        taken.add(("attend_expanded", past is not None))
        return real[1](self, q, kv_latent, rope_keys, mask, s, past)

    jax.clear_caches()  # trace again: the paths are chosen while tracing
    LatentAttention.attend_latent, LatentAttention.attend_expanded = latent, expanded
    try:
        gen = jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=generate.NEW, reads=reads)
        jax.block_until_ready(gen.logits)
    finally:
        LatentAttention.attend_latent, LatentAttention.attend_expanded = real
    return gen, taken


@pytest.mark.parametrize("name", [V2, V3])
def test_decoding_attends_in_latent_space(zoo, name):
    """Greedy generation (7-token prompts, one left-padded by 2, 6 new tokens; the cases have no EOS id) equals
    transformers' generate, tokens and each step's logits at float32 tolerance, along both attention paths: its
    decoding steps attend in latent space (``attend_latent``: kv_b absorbed into the queries and after the
    probabilities, no per-head keys or values of the cached positions), the prompt over expanded keys and values;
    a generation reading attention_values (a per-head site: the step's own token's values) keeps every step on
    the expanded path, its reads equal jstd.run's on the whole sequence at each step's position, and the two
    paths' step logits agree within float32 roundings."""
    _, _, model, ref, _ = zoo(name)
    tokens, mask = generate.left_padded(model)
    want_tokens, want_logits = generate.torch_generate(ref, dict(input_ids=tokens, attention_mask=mask))
    latent, taken = _spied_generate(model, tokens, mask)
    assert taken == {("attend_expanded", False), ("attend_latent", True)}, taken
    site = A + "attention_values"
    expanded, taken = _spied_generate(model, tokens, mask, reads=(site,))
    assert taken == {("attend_expanded", False), ("attend_expanded", True)}, taken
    for gen, path in ((latent, "latent"), (expanded, "expanded")):
        np.testing.assert_array_equal(np.asarray(gen.tokens), want_tokens, f"{name}: {path} tokens")
        assert_close(gen.logits, want_logits, 1e-5, f"{name}: {path} step logits")
    assert_close(latent.logits, expanded.logits, 1e-5, f"{name}: latent vs expanded steps")
    grown = np.concatenate([mask, np.ones((mask.shape[0], generate.NEW), mask.dtype)], 1)
    whole = jit_run(model, jstd.Inputs(np.asarray(expanded.tokens), grown), reads=(site,))
    steps = slice(tokens.shape[1] - 1, -1)  # [blocks, batch, heads, seq, v] at each step's position
    assert_close(expanded[site], np.moveaxis(np.asarray(whole[site])[:, :, :, steps], 3, 2), 1e-5,
                 f"{name}: attention_values read while generating")


def test_latent_path_choice_and_products(zoo):
    """``absorbs``: a decoding step (one token) attends in latent space unless attention_keys, attention_values, the
    scores or the probabilities are read or edited there, or the pattern is frozen; a continued segment long enough
    that scoring ``kv_lora + rope`` wide costs more than expanding (64 tokens here) takes the expanded path. The
    absorbed products (``absorb``, ``unabsorb``: through kv_b's head-major copies) are kv_b's key and value parts
    per head."""
    from jstd.core.tap import Tap

    attn = zoo(V2).model.layers.slots[0].attn
    attn = jax.tree.map(lambda a: a[0] if isinstance(a, jax.Array) else a, attn)  # one block's weights
    scope = lambda reads=(), edits=(): Tap(frozenset(reads), tuple(edits), {"layers": 3}, {}).scope("layers.")
    assert attn.absorbs(scope(), 1, 100) and attn.absorbs(scope(("layers.layer_output", A + "attention_queries",
                                                                  A + "kv_latent", A + "attention_head_outputs")), 1, 9)
    for site in ("attention_keys", "attention_values", "attention_scores", "attention_probabilities"):
        assert not attn.absorbs(scope((A + site,)), 1, 100), site
        assert not attn.absorbs(scope(edits=[jstd.Zero(A + site)]), 1, 100), site
    assert not dataclasses.replace(attn, frozen_pattern=True).absorbs(scope(), 1, 100)
    assert attn.absorbs(scope(), 5, 6) and not attn.absorbs(scope(), 64, 0)

    rng = np.random.default_rng(0)
    kv_b = np.asarray(attn.kv_b, np.float64)
    q_nope = jnp.asarray(rng.normal(size=(2, 4, 3, attn.nope)), jnp.float32)
    mixed = jnp.asarray(rng.normal(size=(2, 4, 3, attn.kv_lora_rank)), jnp.float32)
    got = jax.jit(lambda a, q, m: (a.absorb(q), a.unabsorb(m)))(attn, q_nope, mixed)
    assert_close(got[0], np.einsum("bhsn,lhn->bhsl", q_nope, kv_b[..., :attn.nope]), 1e-6, "absorb")
    assert_close(got[1], np.einsum("bhsl,lhv->bshv", mixed, kv_b[..., attn.nope:]), 1e-6, "unabsorb")


def test_decoding_step_flops_do_not_expand_the_cache(zoo):
    """The compiled decoding step's FLOPs (XLA's ``cost_analysis``) per cached position and block: in latent space
    the scores and the mix over the latent (``2 · heads · (2 · kv_lora + rope)``, plus the softmax's elementwise
    work), an order of magnitude under the expanded path's expansion alone (``2 · kv_lora · heads · (nope + v)``,
    what every step computed before): the cache's latents are not expanded."""
    from deepseek_cases import decode_step_flops

    model = zoo(V2).model
    attn, blocks = model.layers.slots[0].attn, model.config.num_layers
    L, H, n, r, v = attn.kv_lora_rank, attn.o.shape[-3], attn.nope, attn.rope, attn.v_head_dim
    slope = lambda reads: (decode_step_flops(model, 64, reads) - decode_step_flops(model, 32, reads)) / 32 / blocks
    latent, expanded = slope(()), slope((A + "attention_values",))
    assert 2 * H * (2 * L + r) <= latent <= 2 * H * (2 * L + r) + 16 * H, latent
    assert expanded >= 2 * L * H * (n + v) > 10 * latent, (expanded, latent)


def test_the_decoding_loop_copies_no_part_of_kv_b(zoo):
    """The absorbed products read kv_b's head-major parts (``LatentAttention.head_major``) made once a generate call,
    outside its decoding loop: inside the loop nothing but a product touches a value of their shapes (no transposed
    or sliced copy of kv_b at every step)."""
    import re

    model = zoo(V2).model
    attn = model.layers.slots[0].attn
    H, L, n, v = attn.o.shape[-3], attn.kv_lora_rank, attn.nope, attn.v_head_dim
    parts = {f"{H},{n},{L}", f"{H},{L},{v}", f"{L},{H},{n}", f"{L},{H},{v}", f"{H},{L},{n}", f"{H},{v},{L}"}
    tokens, mask = generate.left_padded(model)
    loop = decoding_loop(generate.compiled_generate(model, tokens, mask).as_text(),
                                   f"f32[{generate.NEW},{tokens.shape[0]},{model.config.vocab_size}]")
    made = [line.strip()[:160] for line in loop
            if (m := re.match(r"\s+%\S+ = \w+\[([\d,]*)\]\S* ([\w-]+)\(", line))
            and m.group(1) in parts and m.group(2) not in ("get-tuple-element", "bitcast", "dot", "tuple")]
    assert not made, "the decoding loop copies kv_b:\n" + "\n".join(made)


def test_bfloat16_decoding_in_latent_space(zoo):
    """In bfloat16 (V2), the latent path's step logits are as near the float32 generation's as the expanded path's
    (a read of attention_values) and within bfloat16 roundings of them (relative RMS under 2e-2); the tokens are the
    float32 generation's."""
    tokens, mask = generate.left_padded(zoo(V2).model)
    f32 = jstd.generate(zoo(V2).model, tokens, attention_mask=mask, max_new_tokens=generate.NEW)
    model = zoo(V2, "bfloat16").model
    run = lambda reads=(): jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=generate.NEW, reads=reads)
    latent, expanded = run(), run((A + "attention_values",))
    rms = lambda a, b: float(np.sqrt(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
                                     / np.mean(np.asarray(b, np.float64) ** 2)))
    for gen in (latent, expanded):
        np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(f32.tokens))
    assert rms(latent.logits, f32.logits) <= 1.25 * rms(expanded.logits, f32.logits), (
        rms(latent.logits, f32.logits), rms(expanded.logits, f32.logits))
    assert rms(latent.logits, expanded.logits) < 2e-2


def test_routing_from_the_router_logits(zoo):
    """mlp_output is the weighted sum of the chosen experts plus the shared experts; the chosen experts are distinct,
    in ascending order, and their weights are DeepSeek's function of the router logits (V2: softmax times
    routed_scaling_factor; V3: sigmoid, renormalised, times routed_scaling_factor), the router logits float32."""
    for name, weight in ((V2, lambda l: np.exp(l) / np.exp(l).sum(-1, keepdims=True)),
                         (V3, lambda l: 1 / (1 + np.exp(-l)))):
        model = zoo(name).model
        out, _ = zoo.every_value(name)
        blocks = list(model.blocks_for(M + "router_logits"))
        w = np.asarray(out[M + "router_weights"], np.float64)
        total = (w[..., None] * np.asarray(out[M + "expert_outputs"], np.float64)).sum(-2)
        total += np.asarray(out[M + "shared_expert_output"], np.float64)
        assert_close(total, np.asarray(out[M + "mlp_output"], np.float64)[blocks], 1e-6, f"{name}: mlp_output")
        idx = np.asarray(out[M + "expert_indices"])
        assert (np.diff(idx, axis=-1) > 0).all(), f"{name}: the chosen experts are not in ascending order"
        scores = np.take_along_axis(weight(np.asarray(out[M + "router_logits"], np.float64)), idx, -1)
        moe = model.layers.slots[1].mlp
        if moe.normalize:
            scores = scores / scores.sum(-1, keepdims=True)
        assert_close(w, scores * moe.routed_scaling_factor, 1e-5, f"{name}: weights")
        assert out[M + "router_logits"].dtype == jnp.float32


@pytest.mark.parametrize("name", [V2, V3])
def test_bfloat16_near_torch(zoo, name):
    """Every value in bfloat16 near torch's (``test_moe.test_bfloat16_near_torch``: relative RMS under 5e-2, the
    chosen experts agreeing on 97%), the router kept float32 as transformers keeps it."""
    test_moe.test_bfloat16_near_torch(zoo, name)
    assert zoo(name, "bfloat16").model.layers.slots[1].mlp.router.dtype == jnp.float32


LITE = {  # https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite config.json (auto_map dropped), cut to 2 blocks
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 2,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}
V3_PUBLISHED = {  # https://huggingface.co/deepseek-ai/DeepSeek-V3 config.json (auto_map dropped), cut to 2 blocks
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 2,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def _config(folder, published: dict):
    from transformers import AutoConfig

    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(published))
    return AutoConfig.from_pretrained(folder)


def test_aot_preset_is_the_published_config():
    """The ``deepseek-v2-lite`` preset is DeepSeek-V2-Lite's config.json at its 27 blocks."""
    assert_aot_preset_is_published("deepseek-v2-lite", LITE, 27)


def test_published_configs_are_read_whole_and_fp8_is_refused(tmp_path):
    """DeepSeek-V2-Lite's and DeepSeek-V3's config.json (2 blocks; V3's without its quantization_config, a bfloat16
    copy's) set only keys the families read or knowingly ignore and build the models they describe; with it (the
    hub's FP8 weights) loading refuses with the fix."""
    from jstd.families import family_for
    from jstd.io.hf import unhandled

    lite = _config(tmp_path / "lite", LITE)
    family = family_for(lite.model_type)
    assert unhandled(lite, family) == {}
    model = family.skeleton(lite, jnp.float32)
    c, attn, moe = model.config, model.layers.slots[0].attn, model.layers.slots[1].mlp
    assert (c.head_dim, c.qk_head_dim, c.num_experts, c.experts_per_token) == (128, 192, 64, 6)
    assert attn.q_a is None and attn.q.shape == (1, 2048, 16, 192) and attn.kv_b.shape == (1, 512, 16, 256)
    assert attn.cache_layout() == ((A + "kv_latent", (1, 512)), (A + "rope_keys", (1, 64)))
    assert attn.rotary == "complex" and attn.scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * np.log(40) + 1) ** 2)
    assert moe.groups is None and moe.shared.gate.shape == (1, 2048, 2816) and moe.gate_up.shape == (1, 64, 2048, 2816)
    assert model.rotary.attention_scaling == 1.0 and model.layers.slots[0].mlp.gate.shape == (1, 2048, 10944)

    dequantised = {k: v for k, v in V3_PUBLISHED.items() if k != "quantization_config"}
    v3 = _config(tmp_path / "v3", dequantised)
    family = family_for(v3.model_type)
    assert unhandled(v3, family) == {}
    model = family.skeleton(v3, jnp.bfloat16)
    attn = model.layers.slots[0].attn
    assert model.config.layer_types == ("dense_mlp_full_attention",) * 2  # first_k_dense_replace 3 > 2 blocks
    assert attn.q_b.shape == (2, 1536, 128, 192) and attn.rotary == "deinterleaved"
    assert "model.layers.2.*" in family.ignored(v3)  # the multi-token-prediction layer
    sparse = family.skeleton(_config(tmp_path / "v3sparse", {**dequantised, "first_k_dense_replace": 1}), jnp.bfloat16)
    moe = sparse.layers.slots[1].mlp
    assert (moe.routing, moe.groups, moe.normalize, moe.routed_scaling_factor) == (
        "group_limited_sigmoid", (8, 4), True, 2.5)
    assert moe.router.dtype == jnp.float32 and moe.score_correction_bias.shape == (1, 256)
    with pytest.raises(ValueError, match=r"deepseek_v3: the checkpoint is quantised \(quantization_config "
                                         r"quant_method='fp8'.*bfloat16 copy"):
        family.skeleton(_config(tmp_path / "fp8", V3_PUBLISHED), jnp.bfloat16)


def test_v2_lite_attention_sizes_match_transformers(tmp_path):
    """DeepSeek-V2-Lite's config at 2 blocks with random weights, its attention at the published sizes (16 heads,
    kv_lora_rank 512, 128 + 64 query/key dims, 128 value dims, YaRN factor 40) and its 64 experts top-6, the
    vocabulary and the MLP widths cut (for the suite's memory): the stream, the latents, queries, the pattern and
    the routing within 5e-5 of transformers in float32 on 2 × 9 tokens."""
    from deepseek_cases import DeepseekReference, make

    config = _config(tmp_path / "cfg", {**LITE, "vocab_size": 512, "intermediate_size": 256,
                                        "moe_intermediate_size": 64})
    folder = make(config, tmp_path / "lite", seed=5)
    model, ref = jstd.load(folder), DeepseekReference(folder)
    tokens = np.random.default_rng(2).integers(0, 512, (2, 9))
    reads = ("layers.layer_output", A + "kv_latent", A + "rope_keys", A + "attention_queries",
             A + "attention_probabilities", M + "router_weights", M + "expert_indices", M + "shared_expert_output")
    assert_sites_close(jit_run(model, tokens, reads=reads), ref.run(tokens, reads=reads + ("logits",)), reads, 5e-5,
                       "DeepSeek-V2-Lite")


def test_v3_without_rope_interleave_matches_transformers(tmp_path):
    """V3 with ``rope_interleave`` off (Llama's rotary on the rope dims), one group (no group limit) and 2 blocks:
    queries, keys, the stream and the logits within 1e-5 of transformers."""
    from transformers import DeepseekV3Config

    from deepseek_cases import BASE, DeepseekReference, make

    config = DeepseekV3Config(**{**BASE, "num_hidden_layers": 2}, q_lora_rank=24, n_group=1, topk_group=1,
                              rope_interleave=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    folder = make(config, tmp_path / "halves", seed=4)
    model, ref = jstd.load(folder), DeepseekReference(folder)
    assert model.layers.slots[0].attn.rotary == "halves"
    tokens = np.random.default_rng(1).integers(0, 97, (2, 9))
    reads = ("layers.layer_output", A + "attention_queries", A + "attention_keys", A + "rope_keys")
    assert_sites_close(jit_run(model, tokens, reads=reads), ref.run(tokens, reads=reads + ("logits",)), reads, 1e-5,
                       "rope_interleave off")


def test_convert_and_export_round_trip(zoo, tmp_path):
    """Convert and export give back every tensor bit for bit (the float32 router and score-correction bias in
    their dtype); transformers loads the export with the original's logits."""
    from deepseek_cases import sorted_routers

    convert.test_round_trip_is_bit_exact(zoo, V3, tmp_path)
    _, _, model, ref, spec = zoo(V3)
    tokens = torch.as_tensor(np.asarray(spec.inputs(model)[0]))
    exported = type(ref.model).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    exported.set_experts_implementation("eager")
    sorted_routers(exported)  # as the reference's (the experts loop's row order moves float32 sums)
    with torch.no_grad():
        np.testing.assert_array_equal(exported(tokens).logits.numpy(), ref.model(tokens).logits.numpy())


def test_new_weights_have_sharding_axes(zoo):
    """The latent projections shard their heads (q_b, kv_b, o over ``model`` under TP) and keep the latent ranks
    whole; the score-correction bias shards with the experts; the model places on a mesh under ``EP`` and
    ``FSDP_TP`` with unchanged values."""
    from jstd.nn.params import logical_axes

    model = zoo(V3).model
    axes = logical_axes(model)
    attn, mlp = axes.layers.slots[0].attn, axes.layers.slots[1].mlp
    assert tuple(attn.q_a) == ("layers", "embed", "q_lora") and tuple(attn.q_b) == ("layers", "q_lora", "heads",
                                                                                     "head_dim")
    assert tuple(attn.kv_a) == ("layers", "embed", "kv_lora") and tuple(attn.kv_b) == ("layers", "kv_lora", "heads",
                                                                                        "head_dim")
    assert tuple(mlp.score_correction_bias) == ("layers", "experts")
    for rules in (jstd.sharding.EP, jstd.sharding.FSDP_TP):
        placed = jstd.shard(model, jstd.sharding.mesh(), rules)
        for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(model)):
            np.testing.assert_array_equal(got, want)
