"""Qwen3.5 text: hosts and blocks, zero-centred norms, the gated attention's query|gate split, the interleaved
multimodal rotary, the identities, DeltaNet states through padding, and edits against torch hooks (the conformance
suite compares every value, padding, bfloat16 and edits with transformers)."""

import functools

import numpy as np
import pytest
import torch

import jstd
from conftest import assert_close
from qwen3_5_cases import FULL, LINEAR, config
from reference.cases import (FamilyCases, assert_hybrid_identities, assert_padded_rows_match, assert_sites_close,
                             jit_run, random_tokens)
from reference.harness import TorchEdit

SEQ = 16
LA = "layers.linear_attn."
SA = "layers.self_attn."

tokens_for = functools.partial(random_tokens, seq=SEQ)


@pytest.fixture
def checkpoints(zoo):
    """checkpoints(name) -> (name, folder, jstd model, torch reference) of a qwen3_5_text case;
    checkpoints.every_value(name) -> (tokens, every value jstd serves, every value torch captures) on one batch."""
    return FamilyCases(zoo, "qwen3_5_text")


# ---- structure ----------------------------------------------------------------------------------


def test_hosts_norms_and_refusals(checkpoints):
    _, _, model, _ = checkpoints("tail")
    assert model.family == "qwen3_5_text"
    assert model.config.layer_types == (LINEAR, LINEAR, LINEAR, FULL, LINEAR, LINEAR)
    assert model.layers_with("linear_attn") == (0, 1, 2, 4, 5) and model.layers_with("self_attn") == (3,)
    # pre-norm on both kinds, every stream norm and q_norm / k_norm zero-centred; the DeltaNet's gated norm not
    assert model.blocks_for("layers.attention_norm_output") == tuple(range(6))
    delta, full = model.layers.slot_with("linear_attn"), model.layers.slot_with("self_attn")
    assert model.final_norm.unit_offset and delta.attention_norm.unit_offset and full.mlp_norm.unit_offset
    assert full.attn.q_norm.unit_offset and full.attn.q_norm.weight.shape[-1] == model.config.head_dim
    assert not delta.attn.o_norm.unit_offset and delta.attn.o_norm.eps == config("tail").rms_norm_eps
    # the quarter rotary; multimodal (interleaved) only with mrope_section, and then positions are served
    assert model.rotary.rotary_dim == 4 and model.rotary.mrope_section is None and "positions" not in model.sites
    released = checkpoints("released")[2]
    assert released.rotary.mrope_interleaved and released.rotary.rotary_dim == 16 and "positions" in released.sites
    from jstd.families import family_for

    for moe in ("qwen3_5_moe", "qwen3_5_moe_text"):  # the MoE line is served (tests/test_moe.py)
        assert family_for(moe).model_types == (moe,)


def test_interleaved_rotary_matches_torch(checkpoints):
    """Three different position streams: the interleaved sections give torch's cos and sin."""
    _, _, model, ref = checkpoints("released")
    positions = np.stack([np.arange(SEQ), np.arange(SEQ) // 2 + 3, np.arange(SEQ) % 5]).astype(np.int64)[:, None]
    x = torch.zeros(1, SEQ, model.config.hidden_size)
    cos, sin = ref.model.model.rotary_emb(x, torch.from_numpy(positions))
    mine = model.rotary.cos_sin(positions, np.float32)
    for a, b in zip(mine, (cos, sin)):
        assert_close(a, b.numpy(), 1e-6, "cos / sin")
    assert not np.allclose(mine[0], model.rotary.cos_sin(positions[:1], np.float32)[0])  # the streams matter


# ---- the notes' identities ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["released", "tail"])
def test_identities(checkpoints, name):
    _, _, model, _ = checkpoints(name)
    tokens, out, _ = checkpoints.every_value(name)
    assert_hybrid_identities(model, out)
    betas = np.asarray(out[LA + "betas"])
    assert betas.min() > 0 and betas.max() < 1  # sigmoid(b), not doubled
    if "positions" in model.sites:  # a text prompt: three equal streams counting the tokens
        np.testing.assert_array_equal(out["positions"], np.broadcast_to(np.arange(tokens.shape[1]), (3, *tokens.shape)))


def test_gated_attention_against_torch_modules(checkpoints):
    """q_proj's rows are each head's query then its gate: attention_premix is attention_head_outputs times the
    sigmoid of torch's gate half, and past the rotary's channels the queries are torch's per-head q_norm output."""
    _, _, model, ref = checkpoints("released")
    tokens, out, want = checkpoints.every_value("released")
    i = model.layers_with("self_attn")[0]
    attn, got = ref.model.model.layers[i].self_attn, {}
    handles = [attn.q_proj.register_forward_hook(lambda m, a, o: got.update(q_proj=o)),
               attn.q_norm.register_forward_hook(lambda m, a, o: got.update(q_norm=o))]
    try:
        ref.run(tokens, reads=("logits",))
    finally:
        for h in handles:
            h.remove()
    b, s, _ = got["q_proj"].shape
    D, R = model.config.head_dim, model.rotary.rotary_dim
    gate = got["q_proj"].view(b, s, -1, 2 * D)[..., D:]
    assert_close(out[SA + "attention_premix"][0], want[SA + "attention_head_outputs"][0] * torch.sigmoid(gate).numpy(),
                 1e-5, "premix = head outputs · sigmoid(gate)")
    q_norm = got["q_norm"].transpose(1, 2).numpy()  # [batch, heads, seq, head_dim]
    assert_close(out[SA + "attention_queries"][0][..., R:], q_norm[..., R:], 1e-5, "unrotated channels = q_norm")


# ---- padding ------------------------------------------------------------------------------------


def test_left_padded_batch(checkpoints):
    """Padding is zeroed before the DeltaNet, so the state stays zero through it: padded rows equal their prompts
    (positions count real tokens only)."""
    name, _, model, ref = checkpoints("released")
    rng = np.random.default_rng(5)
    rows = [rng.integers(2, model.config.vocab_size, n) for n in (SEQ, 9, 4)]
    reads = ("layers.layer_output", LA + "states", LA + "state_output", SA + "attention_probabilities",
             "next_token_probs")
    assert_padded_rows_match(model, ref, rows, reads, SEQ, 1e-5, name)


# ---- edits --------------------------------------------------------------------------------------


def test_edits_match_torch_hooks(checkpoints):
    """The same edits through jstd and through torch hooks, together in one compiled run: betas scaled on one
    DeltaNet block, the gated heads (premix) scaled on an attention block, every state patched from another prompt
    (one edit stacked over the DeltaNet blocks) and a head of one patched state zeroed."""
    name, _, model, ref = checkpoints("released")
    tokens = tokens_for(model, seed=7)
    other = ref.run(tokens_for(model, seed=8), reads=(LA + "state_output",))[LA + "state_output"]
    delta, full = model.layers_with("linear_attn"), model.layers_with("self_attn")

    def patched(rank):
        def fn(t):
            t = torch.from_numpy(other[rank]).clone()
            if rank == 2:
                t[:, 0] = 0
            return t
        return fn

    first_head = (np.arange(other.shape[2]) == 0)[None, :, None, None]
    edits = [jstd.Scale(LA + "betas", 0.5, layer=delta[1]), jstd.Scale(SA + "attention_premix", 0.5, layer=full[1]),
             jstd.Set(LA + "state_input", other), jstd.Zero(f"layers.{delta[2]}.linear_attn.state_input",
                                                            where=first_head)]
    torch_edits = [TorchEdit(LA + "betas", lambda t: t * 0.5, delta[1]),
                   TorchEdit(SA + "attention_premix", lambda t: t * 0.5, full[1]),
                   *(TorchEdit(LA + "state_input", patched(r), i) for r, i in enumerate(delta))]
    reads = ("layers.layer_output", LA + "state_output", LA + "attention_head_outputs", SA + "attention_premix")
    clean = ref.run(tokens, reads=reads)
    out = jit_run(model, tokens, edits, reads=reads)
    want = ref.run(tokens, reads=reads + ("logits",), edits=torch_edits)
    for site in reads:  # each edit reaches what it changes
        assert np.abs(want[site] - clean[site]).max() > 1e-3, f"the edits change nothing at {site}"
    assert_sites_close(out, want, reads, 1e-5, name)
