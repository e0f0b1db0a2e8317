"""Llama: every standard value against transformers (float32 and bf16), padded batches, edits."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
from conftest import assert_close, relative_rms
from llama_cases import CASES, config
from reference.cases import Checkpoints, assert_every_value, assert_sites_close, jit_run, random_tokens
from reference.harness import TorchEdit

SEQ = 11


tokens_for = functools.partial(random_tokens, seq=SEQ)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoints(name, dtype="float32") -> (name, folder, jstd model, torch reference), built once on first use;
    checkpoints.every_value(name) -> (tokens, every value jstd serves, every value torch captures) on one batch."""
    return Checkpoints(tmp_path_factory, config, seed=1, tokens=tokens_for)


@pytest.fixture(params=sorted(CASES))
def case(request, checkpoints):
    return checkpoints(request.param)


@pytest.fixture(params=["gqa", "tied"])
def bf16_case(request, checkpoints):
    return checkpoints(request.param, "bfloat16")


@pytest.fixture(params=["gqa", "bias"])
def edit_case(request, checkpoints):
    return checkpoints(request.param)


def test_every_value_float32(case, checkpoints):
    name, _, model, _ = case
    _, out, want = checkpoints.every_value(name)
    assert_every_value(name, model, out, want, 1e-5)


def test_fused_path_matches(case):
    """With no interior read, attention takes the fused path; logits and outputs still match."""
    name, _, model, ref = case
    tokens = tokens_for(model, seed=3)
    out = jstd.run(model, tokens, reads=("layers.self_attn.attention_head_outputs",))
    want = ref.run(tokens, reads=("layers.self_attn.attention_head_outputs", "logits"))
    assert_close(out["layers.self_attn.attention_head_outputs"], want["layers.self_attn.attention_head_outputs"], 1e-5)
    assert_close(out.logits, want["logits"], 1e-5)


def test_bfloat16(bf16_case):
    name, _, model, ref = bf16_case
    tokens = tokens_for(model)
    reads = ("layers.layer_output", "layers.self_attn.attention_probabilities", "layers.mlp.mlp_output")
    out = jstd.run(model, tokens, reads=reads)
    want = ref.run(tokens, reads=reads + ("logits",))
    for site in reads + ("logits",):
        rel = relative_rms(out[site], want[site])
        assert rel < 3e-2, f"{name}:{site} bf16 relative RMS error {rel:.3g}"
    assert out.logits.dtype == jnp.bfloat16


def test_left_padded_batch(case):
    """Each padded row equals its unpadded prompt at the real positions, for every value."""
    name, _, model, ref = case
    rng = np.random.default_rng(5)
    lengths = [SEQ, 7, 4]
    rows = [rng.integers(0, model.config.vocab_size, n) for n in lengths]
    tokens = np.zeros((len(rows), SEQ), np.int64)
    mask = np.zeros((len(rows), SEQ), np.int64)
    for r, row in enumerate(rows):
        tokens[r, SEQ - len(row):] = row
        mask[r, SEQ - len(row):] = 1
    reads = ("layers.layer_output", "layers.self_attn.attention_probabilities", "layers.self_attn.attention_queries",
             "next_token_probs")
    out = jstd.run(model, tokens, reads=reads, attention_mask=mask)
    for r, row in enumerate(rows):
        n = len(row)
        want = ref.run(row[None], reads=reads + ("logits",))
        assert_close(out.logits[r, SEQ - n:], want["logits"][0], 1e-5, f"{name}: row {r} logits")
        assert_close(out["layers.layer_output"][:, r, SEQ - n:], want["layers.layer_output"][:, 0], 1e-5)
        assert_close(out["layers.self_attn.attention_queries"][:, r, :, SEQ - n:],
                     want["layers.self_attn.attention_queries"][:, 0], 1e-5)
        assert_close(out["layers.self_attn.attention_probabilities"][:, r, :, SEQ - n:, SEQ - n:],
                     want["layers.self_attn.attention_probabilities"][:, 0], 1e-5)
        assert_close(out["next_token_probs"][r], want["next_token_probs"][0], 1e-5)


def _edit_cases(model):
    """(name, jstd edits, torch edits): the same edit made both ways."""
    K = model.config.num_kv_heads
    H = model.config.hidden_size
    v = np.random.default_rng(9).normal(size=H).astype(np.float32)
    last = np.arange(SEQ) == SEQ - 1
    uniform = np.tril(np.ones((SEQ, SEQ), np.float32))
    uniform = uniform / uniform.sum(-1, keepdims=True)

    def zero_head(t, j=K - 1):
        t = t.clone()
        t[:, j] = 0
        return t

    def add_last(t):
        t = t.clone()
        t[:, -1] += torch.from_numpy(v)
        return t

    return [
        ("scale mlp_output", [jstd.Scale("layers.mlp.mlp_output", 0.5)],
         [TorchEdit("layers.mlp.mlp_output", lambda t: t * 0.5)]),
        ("zero a key and a value head", [
            jstd.Zero("layers.self_attn.attention_keys", layer=1, where=(np.arange(K) == K - 1)[None, :, None, None]),
            jstd.Zero("layers.1.self_attn.attention_values", where=(np.arange(K) == K - 1)[None, :, None, None])],
         [TorchEdit("layers.self_attn.attention_keys", zero_head, 1),
          TorchEdit("layers.self_attn.attention_values", zero_head, 1)]),
        ("add at the last position", [jstd.Add("layers.layer_output", v, layer=1, where=last[None, :, None])],
         [TorchEdit("layers.layer_output", add_last, 1)]),
        ("set attention_probabilities", [jstd.Set("layers.0.self_attn.attention_probabilities", uniform)],
         [TorchEdit("layers.self_attn.attention_probabilities", lambda t: torch.from_numpy(uniform).expand_as(t).clone(), 0)]),
        ("edit layer_mid and a neuron", [jstd.Add("layers.layer_mid", v, layer=2),
                                         jstd.Zero("layers.mlp.mlp_neurons", layer=0, where=np.arange(96) < 10)],
         [TorchEdit("layers.layer_mid", lambda t: t + torch.from_numpy(v), 2),
          TorchEdit("layers.mlp.mlp_neurons", lambda t: t * torch.from_numpy((np.arange(96) >= 10).astype(np.float32)), 0)]),
    ]


def test_edits_match_torch_hooks(edit_case):
    name, _, model, ref = edit_case
    tokens = tokens_for(model, seed=7)
    reads = ("layers.layer_output", "layers.self_attn.attention_head_outputs", "layers.mlp.mlp_output")
    clean = ref.run(tokens, reads=("logits",))["logits"]
    for label, edits, torch_edits in _edit_cases(model):
        out = jit_run(model, tokens, edits, reads=reads)
        want = ref.run(tokens, reads=reads + ("logits",), edits=torch_edits)
        assert np.abs(want["logits"] - clean).max() > 1e-3, f"{label}: the edit changes nothing"
        assert_sites_close(out, want, reads, 1e-5, f"{name}: {label}")
