"""Qwen1.5/2-MoE (``qwen2_moe``) and Phi-3.5-MoE (``phimoe``), ``tests/moe_cases.py``: what the conformance suite's
every-value and fused-path tests and ``tests/test_moe.py`` (the weighted sum of the experts, bfloat16 near torch) do
not already say. Edits against torch hooks (a router re-route, a first-choice ablation, a uniform pattern …), left
padding and continuation, ``generate`` against transformers' (past Phi-3.5-MoE's window of 6), sparsemixer's own
identities, the published configs read whole (and Phi-MoE's mscale refusal), the convert / export round trips
(Phi-3.5-MoE's hub spelling written back as it came; transformers loads both exports with the same logits)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import test_conformance as conformance
import test_conformance_edits as edits
from conftest import assert_close
from test_gpt_oss import assert_generation_equals_transformers, assert_round_trip_and_export_loads

FAMILIES = ("qwen2_moe", "phimoe")
# qwen2_moe's attention is Qwen2's and its shared expert Qwen3.5-MoE's (each already run through edits, padding,
# continuation and generate): what is its own (routing without renormalisation) the conformance suite's every-value
# test and tests/test_moe.py's re-routing cover; the suite's time goes to phimoe's sparsemixer and window
OWN_PATHS = ("phimoe",)
M = "layers.mlp."


@pytest.mark.parametrize("name", OWN_PATHS)
def test_edits_padding_and_continuation(zoo, name):
    """Scaling mlp_output, adding to a block's output, zeroing a value head, a uniform pattern, a router re-route
    (expert 0 out of every top-k) and ablating each token's first choice, each as torch's hooks make it; left-padded
    rows equal their prompts; a Context continues its prefix."""
    edits.test_edits_match_torch_hooks(zoo, name)
    conformance.test_left_padding(zoo, name, "explicit")
    conformance.test_context_continues_the_run(zoo, name)


@pytest.mark.parametrize("name", OWN_PATHS)
def test_generation_equals_transformers(zoo, name):
    """Greedy generation (7-token prompts, one left-padded by 2, 6 new tokens: past phimoe's window of 6) equals
    transformers' generate, tokens and each step's logits."""
    assert_generation_equals_transformers(zoo, name)


def test_sparsemixer_weights(zoo):
    """Phi-3.5-MoE's weights: the first choice is the argmax of the logits and its weight its softmax probability over
    the experts within 2 · router_jitter_noise (relative) of the maximum; the second the best of the others, weighted
    among the experts near it without the first. Some weights are 1 (no expert near), some below (several)."""
    model = zoo("phimoe-jitter").model
    out, _ = zoo.every_value("phimoe-jitter")
    logits = np.asarray(out[M + "router_logits"], np.float64)
    idx, w = np.asarray(out[M + "expert_indices"]), np.asarray(out[M + "router_weights"], np.float64)
    eps = model.layers.slots[0].mlp.jitter_eps
    np.testing.assert_array_equal(idx[..., 0], logits.argmax(-1))
    first = np.take_along_axis(logits, idx[..., :1], -1)
    rest = np.where(np.arange(logits.shape[-1]) == idx[..., :1], -np.inf, logits)
    np.testing.assert_array_equal(idx[..., 1], rest.argmax(-1))
    for k, (top, scores) in enumerate(((first, logits), (np.take_along_axis(logits, idx[..., 1:], -1), rest))):
        near = (top - logits) / np.maximum(np.abs(logits), top) <= 2 * eps
        e = np.where(near, np.exp(scores - top), 0)
        assert_close(w[..., k], np.take_along_axis(e, idx[..., k:k + 1], -1)[..., 0] / e.sum(-1), 1e-5, f"w{k}")
    assert (w == 1).any() and (w < 0.9).any(), "the case never or always shares a softmax: weak"


QWEN1_5_MOE_A2_7B = {  # https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B config.json, cut to 2 blocks
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 2, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
PHI3_5_MOE = {  # https://huggingface.co/microsoft/Phi-3.5-MoE-instruct config.json, cut to 2 blocks (the 64 long /
    # short factors of the published form, rising from 1, not the published digits)
    "architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 32000, "hidden_act": "silu", "hidden_dropout": 0.0, "hidden_size": 4096,
    "initializer_range": 0.02, "input_jitter_noise": 0.01, "intermediate_size": 6400, "lm_head_bias": True,
    "max_position_embeddings": 131072, "model_type": "phimoe", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 8, "num_local_experts": 16,
    "original_max_position_embeddings": 4096, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": {"long_factor": [round(1.0 + 0.9 * j, 4) for j in range(64)], "long_mscale": 1.243163121016122,
                     "original_max_position_embeddings": 4096,
                     "short_factor": [round(1.0 + 0.02 * j, 4) for j in range(64)], "short_mscale": 1.243163121016122,
                     "type": "longrope"},
    "rope_theta": 10000.0, "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.01, "sliding_window": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.3", "use_cache": True,
    "vocab_size": 32064,
}


def _read(tmp_path, config: dict):
    from transformers import AutoConfig

    from jstd.families import family_for
    from jstd.io.hf import unhandled

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    family = family_for(hf.model_type)
    return hf, family, unhandled(hf, family)


def test_published_configs_are_read_whole(tmp_path):
    """Qwen1.5-MoE-A2.7B's and Phi-3.5-MoE's config.json (2 blocks) set only keys the families read or knowingly
    ignore and build the models they describe (shapes only); a Phi-MoE config whose two mscales differ, or with a
    top-k other than sparsemixer's 2, is refused."""
    hf, family, missed = _read(tmp_path / "qwen", QWEN1_5_MOE_A2_7B)
    assert missed == {}
    model = family.skeleton(hf, jnp.float32)
    mlp = model.layers.slots[0].mlp
    assert (mlp.num_experts, mlp.top_k, mlp.normalize, mlp.shared.gate.shape[-1]) == (60, 4, False, 5632)
    assert model.layers.slots[0].attn.q_bias is not None and model.layers.slots[0].attn.o_bias is None
    hf, family, missed = _read(tmp_path / "phi", PHI3_5_MOE)
    assert missed == {}
    model = family.skeleton(hf, jnp.float32)
    mlp, attn = model.layers.slots[0].mlp, model.layers.slots[0].attn
    assert (mlp.routing, mlp.jitter_eps, mlp.num_experts) == ("sparsemixer", 0.01, 16)
    assert attn.o_bias is not None and attn.sliding_window == 131072 and model.lm_head_bias.shape == (32064,)
    assert model.rotary.attention_scaling == pytest.approx(1.243163121016122) and model.rotary.long_inv_freq is None
    np.testing.assert_allclose(model.rotary.inv_freq[1], 1 / (1.02 * 10000 ** (2 / 128)), rtol=1e-6)
    other = json.loads(json.dumps(PHI3_5_MOE))
    other["rope_scaling"]["long_mscale"] = 1.3
    hf, family, _ = _read(tmp_path / "phi2", other)
    with pytest.raises(ValueError, match="phimoe: rope short_mscale=1.24.* and long_mscale=1.3 differ"):
        family.skeleton(hf, jnp.float32)
    hf, family, _ = _read(tmp_path / "phi4", dict(PHI3_5_MOE, num_experts_per_tok=4))
    with pytest.raises(ValueError, match=r"num_experts_per_tok=4: sparsemixer routing \(Phi-3.5-MoE\) chooses "
                                         "exactly 2 experts"):
        family.skeleton(hf, jnp.float32)


@pytest.mark.parametrize("name", FAMILIES)
def test_convert_and_export_round_trip(zoo, name, tmp_path):
    """Convert and export give back every tensor bit for bit, in the spelling it came in (Phi-3.5-MoE's hub
    ``block_sparse_moe.gate`` / ``experts.{e}.w1``; Qwen2-MoE's per-expert tensors); transformers loads the export
    with the original's logits."""
    assert_round_trip_and_export_loads(zoo, name, tmp_path)
