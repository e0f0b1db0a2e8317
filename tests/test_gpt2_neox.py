"""GPT-2 and GPT-NeoX / Pythia: what the conformance suite (tests/families.py cases) does not already check.

The published configs (GPT-2 small, Pythia-160M) at their full width with two blocks, stored with the hub's tensor
names (GPT-2 without the ``transformer.`` prefix and with its causal-mask buffers; Pythia's head as ``embed_out``),
load with no ConfigWarning and give transformers' logits. The learned positions: ``token_embeddings +
position_embeddings`` is block 0's input exactly, a left-padded row's positions count its real tokens, and an edit
at ``position_embeddings`` equals transformers run at those positions. The parallel residual: its identity holds
exactly, ``layer_mid`` is refused with the reason, an edit at ``attention_output`` leaves the block's own MLP as it
was (it does not on a sequential block). The GPT-2 flags jstd does not honour are refused.
"""

from __future__ import annotations


import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jstd
from conftest import assert_close
from gpt2_neox_cases import GPT2_BASE, gpt2_config
from jstd.models.gpt2 import GPT2
from reference.cases import jit_run, left_padded
from reference.checkpoints import published_matches

GPT2_SMALL = {  # openai-community/gpt2's config.json
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257,
}
PYTHIA_160M = {  # EleutherAI/pythia-160m's config.json
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
    "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 12, "num_hidden_layers": 12,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.24.0", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304,
}


def hub_spelled(key: str, model_type: str) -> str:
    """A tensor name as the hub's checkpoint of ``model_type`` spells it."""
    if model_type == "gpt2":
        return key.removeprefix("transformer.")
    return "embed_out.weight" if key == "lm_head.weight" else key


@pytest.mark.parametrize("published", [GPT2_SMALL, PYTHIA_160M], ids=["gpt2-small", "pythia-160m"])
def test_published_config_loads_without_warnings_and_matches(tmp_path, published):
    """Two blocks of the published widths (the vocabulary cut to 1024 rows: a 50000-row table would only add
    memory), random weights, the hub's names and config.json: no ConfigWarning, the logits of transformers."""
    raw = {**published, ("n_layer" if "n_layer" in published else "num_hidden_layers"): 2, "vocab_size": 1024}
    # the causal-mask buffers the hub's GPT-2 files hold
    buffers = {f"h.{i}.attn.bias": np.tril(np.ones((1, 1, 1024, 1024), np.float32))
               for i in range(2)} if raw["model_type"] == "gpt2" else {}
    published_matches(raw, tmp_path / "hf", hub_spelled, 1e-5, buffers)


@pytest.mark.parametrize("name", ["gpt2-small", "gpt_neox-parallel"])
def test_hub_spelled_checkpoint_exports_as_stored(zoo, tmp_path, name):
    """A checkpoint with the hub's names (and GPT-2's mask buffers) loads to the same model, and export writes
    every tensor back under its stored name, bit for bit (the fused c_attn / query_key_value rebuilt from q, k, v)."""
    case = zoo(name)
    model_type = case.model.family
    tensors = {hub_spelled(k, model_type): v for k, v in load_file(case.folder / "model.safetensors").items()}
    if model_type == "gpt2":  # the causal-mask buffers the hub's GPT-2 files hold
        for i in range(case.model.config.num_layers):
            tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    folder = tmp_path / "hub"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_bytes((case.folder / "config.json").read_bytes())
    model = jstd.load(folder)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(case.model)):
        np.testing.assert_array_equal(a, b)
    written = load_file(jstd.export(model, tmp_path / "exported") / "model.safetensors")
    assert set(written) == set(tensors)
    for key in written:
        np.testing.assert_array_equal(written[key], tensors[key], err_msg=key)


def test_learned_positions(zoo):
    """Block 0 reads token_embeddings + position_embeddings exactly; a left-padded row's position embeddings are
    the rows of wpe its real tokens count; an edit there equals transformers at those positions."""
    _, _, model, ref, _ = zoo("gpt2-small")
    tokens, mask = left_padded([np.arange(1, 12), np.arange(3, 10)], 11)
    out = jit_run(model, jstd.Inputs(tokens, mask), reads=("token_embeddings", "position_embeddings",
                                                            "layers.0.layer_input"))
    np.testing.assert_array_equal(out["token_embeddings"] + out["position_embeddings"], out["layers.0.layer_input"])
    wpe = np.asarray(model.position_embed)
    np.testing.assert_array_equal(out["position_embeddings"][0], wpe[:11])
    np.testing.assert_array_equal(out["position_embeddings"][1, 4:], wpe[:7])

    shifted = np.broadcast_to(wpe[5:16], (2, 11, wpe.shape[1]))
    edited = jit_run(model, tokens, [jstd.Set("position_embeddings", shifted)])
    with torch.no_grad():
        want = ref.model(input_ids=torch.as_tensor(tokens), position_ids=torch.arange(5, 16)[None]).logits.numpy()
    assert_close(edited.logits, want, 1e-5, "logits at positions 5..15")


def test_parallel_residual(zoo):
    """layer_input + attention_output + mlp_output == layer_output bit for bit (torch's order); layer_mid is
    refused with the reason; an attention edit reaches the next block but not the block's own MLP, which it does
    on a sequential block."""
    for name, parallel in (("gpt_neox-parallel", True), ("gpt_neox-sequential", False)):
        model = zoo(name).model
        tokens = np.random.default_rng(1).integers(0, 97, (2, 11))
        reads = ("layers.layer_input", "layers.self_attn.attention_output", "layers.mlp.mlp_output",
                 "layers.layer_output")
        out = jit_run(model, tokens, reads=reads)
        x, a, m, y = (np.asarray(out[s]) for s in reads)
        if parallel:
            np.testing.assert_array_equal((m + a) + x, y)
            with pytest.raises(jstd.SiteError, match="parallel residual blocks.*layer_input"):
                jstd.run(model, tokens, reads=("layers.layer_mid",))
        edited = jit_run(model, tokens, [jstd.Scale("layers.self_attn.attention_output", 0.5, layer=1)], reads=reads)
        same = np.array_equal(edited["layers.mlp.mlp_output"][1], m[1])
        assert same == parallel, f"{name}: block 1's MLP {'changed' if parallel else 'kept its value'}"
        assert not np.array_equal(edited["layers.layer_output"][2], y[2])


@pytest.mark.parametrize("flag", ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                                  "add_cross_attention"])
def test_gpt2_flags_jstd_does_not_honour_are_refused(flag):
    config = gpt2_config("small")
    setattr(config, flag, True)
    with pytest.raises(ValueError, match=f"{flag}=True .* not supported"):
        GPT2.skeleton(config, np.float32)  # what jstd.load builds first


def test_gpt2_names_its_position_limit():
    skeleton = GPT2.skeleton(gpt2_config("small"), np.float32)
    model = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), skeleton)
    with pytest.raises(ValueError, match=f"more than this gpt2 model's {GPT2_BASE['n_positions']} learned"):
        jstd.run(model, np.zeros((1, GPT2_BASE["n_positions"] + 1), np.int64))


def test_collect_learned_positions(zoo, tmp_path):
    """``jstd.collect`` on left-padded GPT-2 rows writes each real token's position embedding and stream as the
    padded run computes them (the positions count the real tokens)."""
    model = zoo("gpt2-small").model
    tokens, mask = left_padded([np.arange(1, 12), np.arange(3, 8)], 11)
    sites = ("position_embeddings", "layers.layer_output")
    ds = jstd.collect(model, jstd.Inputs(tokens, mask), sites, tmp_path / "acts", batch_size=2, progress=False)
    out = jit_run(model, jstd.Inputs(tokens, mask), reads=sites)
    pad = mask.shape[1] - mask.sum(1)
    d, p = ds.rows.document, ds.rows.position
    np.testing.assert_array_equal(ds.read("position_embeddings"), np.asarray(model.position_embed)[p])
    assert_close(ds.read("layers.layer_output"), np.moveaxis(np.asarray(out["layers.layer_output"]), 0, 2)[d, pad[d] + p],
                 1e-6, "collected streams")
