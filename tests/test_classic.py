"""GPT-Neo, GPT-J, Phi, OPT and BLOOM: what the conformance suite (tests/families.py cases) does not already check.

The published configs (TinyStories-33M, GPT-Neo-125M, GPT-J-6B, Phi-2, OPT-125M, OPT-350M, BLOOM-560M) at their
full width with two blocks (one of GPT-J-6B and Phi-2) and a 1024-row vocabulary, stored with the hub's tensor names, load with no ConfigWarning and give transformers'
logits; ``jstd.load("roneneldan/TinyStories-33M")`` resolves through a huggingface_hub cache; each family's quirk
has a direct check (GPT-Neo's local window and unscaled float32 scores, GPT-J's interleaved rotary, BLOOM's ALiBi
positions from the mask of a padded batch, OPT's position offset and its table's end, OPT-350M's post-norm blocks);
``jstd.collect`` on each family; the options jstd does not serve are refused with the reason.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import classic_cases
import jstd
from conftest import assert_close
from jstd.kernels.attention import alibi_slopes
from jstd.kernels.rope import apply_rotary
from jstd.models.bloom import Bloom
from jstd.models.gpt_neo import GPTNeo
from jstd.models.gptj import GPTJ
from jstd.models.opt import OPT
from reference.cases import jit_run, left_padded
from reference.checkpoints import published_matches

# the hub's config.json of each (GPT-J's and BLOOM's vocabularies cut to 1024 rows, and the others' by ``published``:
# the widths are the published ones, and a 50000- or 250880-row table would only add memory)
TINYSTORIES_33M = {
    "activation_function": "gelu_new", "architectures": ["GPTNeoForCausalLM"], "attention_dropout": 0,
    "attention_layers": ["global", "local", "global", "local"], "attention_types": [[["global", "local"], 2]],
    "bos_token_id": 50256, "embed_dropout": 0, "eos_token_id": 50256, "gradient_checkpointing": False,
    "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": None, "layer_norm_epsilon": 1e-05,
    "max_position_embeddings": 2048, "model_type": "gpt_neo", "num_heads": 16, "num_layers": 4, "resid_dropout": 0,
    "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True, "torch_dtype": "float32", "use_cache": True,
    "vocab_size": 50257, "window_size": 256,
}
GPT_NEO_125M = {
    **TINYSTORIES_33M, "attention_layers": ["global", "local"] * 6, "attention_types": [[["global", "local"], 6]],
    "num_heads": 12, "num_layers": 12,
}
GPTJ_6B = {
    "activation_function": "gelu_new", "architectures": ["GPTJForCausalLM"], "attn_pdrop": 0.0, "bos_token_id": 50256,
    "embd_pdrop": 0.0, "eos_token_id": 50256, "gradient_checkpointing": False, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_inner": None, "n_layer": 28,
    "n_positions": 2048, "resid_pdrop": 0.0, "rotary": True, "rotary_dim": 64, "scale_attn_weights": True,
    "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True, "tie_word_embeddings": False,
    "tokenizer_class": "GPT2Tokenizer", "use_cache": True, "vocab_size": 1024,
}
PHI_2 = {
    "architectures": ["PhiForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 50256, "embd_pdrop": 0.0,
    "eos_token_id": 50256, "hidden_act": "gelu_new", "hidden_size": 2560, "initializer_range": 0.02,
    "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048, "model_type": "phi",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "partial_rotary_factor": 0.4,
    "qk_layernorm": False, "resid_pdrop": 0.1, "rope_scaling": None, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float16", "use_cache": True, "vocab_size": 51200,
}
OPT_125M = {
    "activation_dropout": 0.0, "activation_function": "relu", "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2,
    "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>",
    "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}
OPT_350M = {**OPT_125M, "do_layer_norm_before": False, "ffn_dim": 4096, "hidden_size": 1024,
            "num_attention_heads": 16, "num_hidden_layers": 24, "word_embed_proj_dim": 512}
BLOOM_560M = {
    "apply_residual_connection_post_layernorm": False, "architectures": ["BloomForCausalLM"], "attention_dropout": 0.0,
    "attention_softmax_in_fp32": True, "bias_dropout_fusion": True, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_dropout": 0.0, "hidden_size": 1024, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "masked_softmax_fusion": True, "model_type": "bloom", "n_head": 16, "n_inner": None, "n_layer": 24,
    "offset_alibi": 100, "pad_token_id": 3, "pretraining_tp": 1, "skip_bias_add": True, "skip_bias_add_qkv": False,
    "slow_but_exact": False, "unk_token_id": 0, "use_cache": True, "vocab_size": 1024,
}
PUBLISHED = {"tinystories-33m": TINYSTORIES_33M, "gpt-neo-125m": GPT_NEO_125M, "gpt-j-6b": GPTJ_6B, "phi-2": PHI_2,
             "opt-125m": OPT_125M, "opt-350m": OPT_350M, "bloom-560m": BLOOM_560M}
DEPTH = {"gpt_neo": "num_layers", "gptj": "n_layer", "phi": "num_hidden_layers", "opt": "num_hidden_layers",
         "bloom": "n_layer"}
# one block of the two widest (GPT-J-6B's 4096, Phi-2's 2560: a block's weights are most of the test's time); two
# of the others (GPT-Neo's global and local blocks); every family's tiny cases run several blocks
BLOCKS = {"gpt-j-6b": 1, "phi-2": 1}


def published(name: str) -> dict:
    """``PUBLISHED[name]`` cut to its blocks (``BLOCKS``, default 2) and a 1024-row vocabulary, every other key as
    the hub has it."""
    raw = {**PUBLISHED[name], "vocab_size": 1024}
    raw[DEPTH[raw["model_type"]]] = blocks = BLOCKS.get(name, 2)
    if raw["model_type"] == "gpt_neo":
        raw["attention_types"] = [[["global", "local"], blocks // 2]]
        raw["attention_layers"] = ["global", "local"]
    return raw


def hub_spelled(key: str, model_type: str) -> str:
    """A tensor name as the hub's checkpoint of ``model_type`` spells it (OPT's and BLOOM's were saved from their
    base models)."""
    if model_type == "opt":
        return key.removeprefix("model.")
    if model_type == "bloom":
        return key.removeprefix("transformer.")
    return key


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_loads_without_warnings_and_matches(tmp_path, name):
    """The published widths (``published``: one or two blocks), random weights, the hub's names and config.json: no
    ConfigWarning, the logits of transformers (float32, 5e-5), and export writes the hub's names back."""
    raw = published(name)
    folder = tmp_path / "hf"
    model = published_matches(raw, folder, hub_spelled, 5e-5)
    if name == "tinystories-33m":  # export writes the hub's tensors back (the names, the fused c_attn unfused)
        written = jstd.export(model, tmp_path / "exported")
        from safetensors.numpy import load_file

        back = load_file(written / "model.safetensors")
        assert set(back) == {hub_spelled(k, raw["model_type"]) for k in load_file(folder / "model.safetensors")}


def test_tinystories_from_the_hub_cache(zoo, tmp_path, monkeypatch):
    """``jstd.load("roneneldan/TinyStories-33M")`` finds the checkpoint in huggingface_hub's cache, offline (a
    folder laid out as the cache holds it: refs/main naming a snapshot)."""
    folder = zoo("gpt_neo-tinystories").folder
    cache = tmp_path / "hub"
    repo = cache / "models--roneneldan--TinyStories-33M"
    commit = "1" * 40
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    import huggingface_hub.constants as c

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    model = jstd.load("roneneldan/TinyStories-33M")
    assert model.family == "gpt_neo" and model.config.layer_types == ("full_attention", "sliding_attention",
                                                                      "sliding_attention")
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(zoo("gpt_neo-tinystories").model)):
        np.testing.assert_array_equal(a, b)


def test_gpt_neo_local_window_and_unscaled_float32_scores(zoo):
    """A local block's query sees exactly the ``window_size`` keys up to itself (none before, whatever the padding);
    scores are the unscaled q·kᵀ; in bfloat16 they are computed in float32 as torch's ``_attn`` does."""
    model = zoo("gpt_neo-tinystories").model
    window = model.layers.slots[1].attn.sliding_window
    tokens, mask = left_padded([np.arange(1, 12), np.arange(3, 10)], 11)
    reads = ("layers.self_attn.attention_probabilities", "layers.self_attn.attention_scores",
             "layers.self_attn.attention_queries", "layers.self_attn.attention_keys")
    out = jit_run(model, jstd.Inputs(tokens, mask), reads=reads)
    p = np.asarray(out[reads[0]])  # [layers, batch, heads, q, k]
    i, j = np.arange(11)[:, None], np.arange(11)[None]
    inside = (j <= i) & (j > i - window)
    assert (p[1:, 0][..., ~inside] == 0).all() and (p[1:, 0][..., inside] > 0).all()
    assert (p[0, 0][..., (j <= i) & ~inside] > 0).all()  # the global block sees past the window
    q, k = (np.asarray(out[s], np.float64) for s in reads[2:])
    raw = np.einsum("lbhqd,lbhkd->lbhqk", q, k)
    s = np.asarray(out[reads[1]], np.float64)
    np.testing.assert_allclose(s[0, 0][..., j <= i], raw[0, 0][..., j <= i], rtol=1e-5, atol=1e-4)  # global
    np.testing.assert_allclose(s[1:, 0][..., inside], raw[1:, 0][..., inside], rtol=1e-5, atol=1e-4)  # local
    bf16 = zoo("gpt_neo-tinystories", "bfloat16").model
    scores = jit_run(bf16, tokens, reads=("layers.self_attn.attention_scores", "layers.self_attn.attention_values"))
    assert scores["layers.self_attn.attention_scores"].dtype == jnp.float32
    assert scores["layers.self_attn.attention_values"].dtype == jnp.bfloat16


def test_gptj_rotary_is_interleaved_on_the_first_rotary_dims():
    """``apply_rotary(interleaved=True)`` equals GPT-J's own ``apply_rotary_pos_emb`` on its sinusoid table, on the
    first ``rotary_dim`` dims (the rest untouched), and differs from the halves' pairing."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    config = classic_cases.gptj_config("6b")
    rotary = GPTJ.rotary(config, GPTJ.standard_config(config))
    x = np.random.default_rng(0).normal(size=(2, 4, 5, 16)).astype(np.float32)  # [batch, heads, seq, head_dim]
    positions = np.array([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    cos, sin = rotary.cos_sin(positions, jnp.float32)
    got = np.asarray(apply_rotary(jnp.asarray(x), cos, sin, interleaved=True))
    sincos = create_sinusoidal_positions(64, config.rotary_dim)[torch.as_tensor(positions)]
    s, c = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    t = torch.from_numpy(x).transpose(1, 2)  # GPT-J rotates [batch, seq, heads, dim]
    want = torch.cat([apply_rotary_pos_emb(t[..., :8], s, c), t[..., 8:]], -1).transpose(1, 2).numpy()
    assert_close(got, want, 1e-6, "interleaved rotary")
    np.testing.assert_array_equal(got[..., 8:], x[..., 8:])
    halves = np.asarray(apply_rotary(jnp.asarray(x), cos, sin))
    assert np.abs(halves - want).max() > 1e-2


def test_bloom_alibi_positions_come_from_the_mask(zoo):
    """On a left-padded batch BLOOM's scores at the real positions equal torch's run on the same padded batch (its
    ALiBi built from the mask: padding is not counted), and what a head adds to its scores is slope_h times the
    key's position among the real tokens."""
    _, _, model, ref, _ = zoo("bloom-560m")
    tokens, mask = left_padded([np.arange(1, 12), np.arange(3, 9)], 11)
    site = "layers.self_attn.attention_scores"
    out = jit_run(model, jstd.Inputs(tokens, mask), reads=(site, "layers.self_attn.attention_queries",
                                                           "layers.self_attn.attention_keys"))
    want = ref.run(tokens, reads=(site, "logits"), attention_mask=mask)
    pad = 11 - 6
    assert_close(out[site][:, 1, :, pad:, pad:], want[site][:, 1, :, pad:, pad:], 1e-5, "padded row's scores")
    assert_close(out.logits[1, pad:], want["logits"][1, pad:], 1e-5, "padded row's logits")
    q, k = (np.asarray(out[f"layers.self_attn.attention_{s}"], np.float64) for s in ("queries", "keys"))
    scale = model.config.head_dim ** -0.5
    bias = np.asarray(out[site], np.float64)[:, 1, :, pad:, pad:] - scale * np.einsum(
        "lhqd,lhkd->lhqk", q[:, 1, :, pad:], k[:, 1, :, pad:])
    slopes = np.asarray(alibi_slopes(model.config.num_heads))
    expected = slopes[:, None, None] * np.arange(6)[None, None, :]  # [heads, 1, key]
    causal = np.tril(np.ones((6, 6), bool))
    np.testing.assert_allclose(bias[..., causal], np.broadcast_to(expected, bias.shape)[..., causal], atol=1e-4)
    np.testing.assert_allclose(alibi_slopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3], rtol=1e-7)


def test_opt_positions_offset_and_table_end(zoo):
    """OPT's position p reads row p + 2; a position past the table fails the call, also traced (never clamped)."""
    model = zoo("opt-125m").model
    tokens, mask = left_padded([np.arange(1, 12), np.arange(3, 10)], 11)
    out = jit_run(model, jstd.Inputs(tokens, mask), reads=("position_embeddings",))
    table = np.asarray(model.position_embed)
    np.testing.assert_array_equal(out["position_embeddings"][0], table[2:13])
    np.testing.assert_array_equal(out["position_embeddings"][1, 4:], table[2:9])
    most = table.shape[0] - 2
    with pytest.raises(ValueError, match=f"more than this opt model's {most} learned positions"):
        jstd.run(model, np.zeros((1, most + 1), np.int64))
    prefix = jit_run(model, tokens[:, :3], reads=jstd.Context.sites_for(model))
    context = jstd.Context.continuing(model, prefix, np.full((2, 1), most))
    with pytest.raises(Exception, match=f"this opt model's learned position table holds {most} positions"):
        jax.block_until_ready(jax.jit(jstd.run)(model, tokens[:, 3:4], context=context).logits)


def test_opt_post_norm_blocks(zoo):
    """OPT-350M's post-norm blocks: layer_mid is self_attn_layer_norm(layer_input + attention_output) and
    layer_output is final_layer_norm(layer_mid + mlp_output); no pre-norm or final norm values, the lens at the last
    block is the logits, and direct logit attribution is refused with the reason."""
    model = zoo("opt-350m").model
    tokens = np.random.default_rng(2).integers(0, 97, (2, 11))
    reads = ("layers.layer_input", "layers.self_attn.attention_output", "layers.layer_mid", "layers.mlp.mlp_output",
             "layers.layer_output")
    out = jit_run(model, tokens, reads=reads)
    x, a, mid, m, y = (np.asarray(out[s]) for s in reads)
    block = model.layers.slots[0]
    first = jax.tree.map(lambda w: w[0] if hasattr(w, "ndim") and w.ndim else w, block)
    assert_close(mid[0], first.attention_post_norm(jnp.asarray(x[0] + a[0])), 1e-6, "layer_mid")
    assert_close(y[0], first.mlp_post_norm(jnp.asarray(mid[0] + m[0])), 1e-6, "layer_output")
    for site in ("final_norm_output", "layers.attention_norm_output", "layers.mlp_norm_output"):
        assert site not in model.sites
    with pytest.raises(jstd.SiteError, match="no final norm: its post-norm blocks"):
        jstd.run(model, tokens, reads=("final_norm_output",))
    np.testing.assert_array_equal(jax.jit(jstd.project_on_vocab)(model, y[-1]), out.logits)
    with pytest.raises(NotImplementedError, match="post-norm blocks norm it after every add"):
        jstd.direct_logit_attribution(model, tokens, 5, 7)


@pytest.mark.parametrize("name", ["gpt_neo-tinystories", "phi-2", "opt-350m"])  # the rest: MAIN's tools
def test_collect(zoo, tmp_path, name):
    """``jstd.collect`` on left-padded rows writes each real token's stream as the padded run computes it."""
    model = zoo(name).model
    tokens, mask = left_padded([np.arange(1, 12), np.arange(3, 8)], 11)
    site = "layers.layer_output"
    ds = jstd.collect(model, jstd.Inputs(tokens, mask), (site,), tmp_path / "acts", batch_size=2, progress=False)
    out = jit_run(model, jstd.Inputs(tokens, mask), reads=(site,))
    pad = mask.shape[1] - mask.sum(1)
    d, p = ds.rows.document, ds.rows.position
    assert_close(ds.read(site), np.moveaxis(np.asarray(out[site]), 0, 2)[d, pad[d] + p], 1e-6, f"{name}: collected")


@pytest.mark.parametrize("family,config,flag,match", [
    (Bloom, lambda: classic_cases.bloom_config("560m"), dict(apply_residual_connection_post_layernorm=True),
     "apply_residual_connection_post_layernorm=True"),
    (Bloom, lambda: classic_cases.bloom_config("560m"), dict(slow_but_exact=True, pretraining_tp=2),
     "slow_but_exact=True"),
    (OPT, lambda: classic_cases.opt_config("125m"), dict(enable_bias=False), "enable_bias=False"),
    (OPT, lambda: classic_cases.opt_config("125m"), dict(layer_norm_elementwise_affine=False),
     "layer_norm_elementwise_affine=False"),
    (GPTNeo, lambda: classic_cases.gpt_neo_config("tinystories"), dict(attention_layers=["global", "sparse", "local"]),
     "attention_layers holds"),
])
def test_options_jstd_does_not_serve_are_refused(family, config, flag, match):
    c = config()
    for key, value in flag.items():
        setattr(c, key, value)
    with pytest.raises(ValueError, match=match):
        family.skeleton(c, np.float32)  # what jstd.load builds first
