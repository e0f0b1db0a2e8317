"""What the conformance suite does not already say about Gemma, OLMo-2, Qwen3, Phi-3 and SmolLM3
(``tests/text_cases.py``): Gemma's bfloat16 embedding scale and its EOS ids, and the released checkpoints'
config.json (``tests/published_text_configs.py``) read without a ConfigWarning into the model they describe.
``scripts/check_published_configs.py`` runs those configs with random weights against transformers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import jstd
from jstd.families import family_for
from jstd.io.hf import unhandled
from published_text_configs import PUBLISHED
import test_conformance as conformance
import test_convert as convert
from reference.cases import jit_run
from conftest import assert_close
from jstd.cli.inspect import describe


def test_gemma_scales_its_embeddings_in_bfloat16_as_torch(zoo):
    """token_embeddings (the embedding module's output) is the lookup times sqrt(hidden) rounded to bfloat16 first
    (sqrt(48) = 6.93 is 6.9375 there), bit for bit torch's, and is what block 0 reads."""
    _, _, model, ref, spec = zoo("gemma-2b", "bfloat16")
    tokens, _ = spec.inputs(model)
    want = ref.run(tokens, reads=("token_embeddings",))["token_embeddings"]
    out = jit_run(model, tokens, reads=("token_embeddings", "layers.0.layer_input"))
    got = np.asarray(out["token_embeddings"], np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(out["layers.0.layer_input"], np.float32), got)


def test_gemma_generation_stops_at_every_eos_id_of_its_generation_config(zoo, tmp_path):
    """Gemma's instruction-tuned checkpoints list two EOS ids in generation_config.json (``[1, 107]``): the model
    takes both, and generate stops each row at either and pads after it, as transformers' generate does."""
    _, folder, model, ref, _ = zoo("gemma-2b")
    tokens = torch.as_tensor(np.random.default_rng(0).integers(3, model.config.vocab_size, (3, 7)))
    with torch.no_grad():
        free = ref.model.generate(tokens, max_new_tokens=4, min_new_tokens=4, do_sample=False).numpy()
    # (the tiny random Gemma repeats a row's first new token) rows 0 and 1 stop at their first, each at one of the
    # two ids; row 2 runs on
    eos = [int(free[0, 7]), int(free[1, 7])]
    assert len({*eos, *free[2, 7:]}) == 2 + len(set(free[2, 7:]))
    copy = tmp_path / "gemma"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": 0}))
    own = jstd.load(copy)
    assert own.config.eos_token_ids == tuple(eos)
    got = np.asarray(jstd.generate(own, np.asarray(tokens), max_new_tokens=4).tokens)
    torch_model = type(ref.model).from_pretrained(copy, attn_implementation="eager").eval()
    with torch.no_grad():
        want = torch_model.generate(tokens, max_new_tokens=4, do_sample=False).numpy()
    np.testing.assert_array_equal(got, want)
    assert (got[:2, 8:] == 0).all() and (got[2] == free[2]).all()


@pytest.mark.parametrize("name", ["phi3-longrope", "smollm3-sliding"])
def test_context_continues_fused_and_nope_blocks(zoo, name):
    """The conformance suite's continuation check on the families outside ``families.MAIN``: Phi-3's fused
    projections under longrope, SmolLM3's NoPE blocks with a window (of 4) shorter than the cached prefix (6)."""
    conformance.test_context_continues_the_run(zoo, name)


@pytest.mark.parametrize("name", ["phi3-longrope", "smollm3-3b", "mistral-window", "qwen2-window", "gemma2-softcap",
                                  "gemma3_text-local", "olmo3-window", "qwen3-0.6b"])
def test_convert_and_export_round_trip(zoo, name, tmp_path):
    """The conversion round trip of ``families.MAIN`` on Phi-3 (export writes q, k and v back into the one
    qkv_proj, gate and up into gate_up_proj), SmolLM3 (its NoPE attention class in the converted structure) and the
    families with windows, soft-caps and post-norms; transformers loads the exported folder with the original's
    logits (bit for bit), which the converted model's equal, and ``jstd inspect`` describes it."""
    convert.test_round_trip_is_bit_exact(zoo, name, tmp_path)
    _, _, model, ref, spec = zoo(name)
    tokens, _ = spec.inputs(model)
    exported = type(ref.model).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        want = ref.model(torch.as_tensor(np.asarray(tokens))).logits.numpy()
        theirs = exported(torch.as_tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_array_equal(theirs, want)
    ours = np.asarray(jit_run(jstd.load(tmp_path / "jstd"), tokens).logits)
    assert_close(ours, want, 1e-5, f"{name}: the converted model's logits")
    text = describe(jstd.load(tmp_path / "jstd"))
    assert f"model_type {model.config.model_type}" in text and "layers.slots[0].attn.q" in text


@pytest.mark.parametrize("repo", sorted(PUBLISHED))
def test_published_configs_are_read_whole(repo, tmp_path):
    """A released checkpoint's config.json (2 blocks) sets only keys its family reads or knowingly ignores, and
    builds the model it describes (shapes only, no weights)."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[repo]))
    hf = AutoConfig.from_pretrained(tmp_path)
    family = family_for(hf.model_type)
    assert unhandled(hf, family) == {}, repo
    model = family.skeleton(hf, np.float32)
    c = model.config
    assert (c.num_layers, c.hidden_size, c.vocab_size) == (2, hf.hidden_size, hf.vocab_size)
    assert c.head_dim == getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    window = getattr(hf, "sliding_window", None) if hf.model_type == "phi3" else None
    assert {b.attn.sliding_window for b in model.layers.slots} == {window}, repo  # Phi-3's 2047 and 262144


def test_phi3_128k_longrope_has_transformers_short_and_long_frequencies(tmp_path):
    """Phi-3-mini-128k's rotary: the short factors' frequencies, the long factors' past
    original_max_position_embeddings (4096), and the attention factor, all as transformers computes them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED["microsoft/Phi-3-mini-128k-instruct"]))
    hf = AutoConfig.from_pretrained(tmp_path)
    rotary = family_for("phi3").skeleton(hf, np.float32).rotary
    torch_rotary = Phi3RotaryEmbedding(hf)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=4097)
    assert rotary.rope_type == "longrope" and rotary.original_max_position_embeddings == 4096
    # within two units in the last place: torch's float32 ``base ** exponents`` is its vectorized pow, not correctly
    # rounded (on head_dim 96 frequency 20 of 48 is one unit off the correctly rounded power jstd computes, two
    # after the factor and the reciprocal)
    np.testing.assert_array_max_ulp(np.asarray(rotary.inv_freq, np.float32), torch_rotary.inv_freq.numpy(), 2)
    np.testing.assert_array_max_ulp(np.asarray(rotary.long_inv_freq, np.float32), long.numpy(), 2)
    assert not np.allclose(rotary.long_inv_freq, rotary.inv_freq, rtol=0.1)
    assert rotary.attention_scaling == pytest.approx(torch_rotary.attention_scaling, rel=1e-12)
    assert rotary.attention_scaling > 1.1  # sqrt(1 + ln(32) / ln(4096))


def test_configs_these_families_cannot_run_are_refused_by_name():
    """A block kind jstd has no block for, an encoder's bidirectional attention, too few no_rope_layers: each a
    ValueError naming the problem, before any weight is read."""
    from transformers import AutoConfig

    def skeleton(model_type, **kw):
        hf = AutoConfig.for_model(model_type, num_hidden_layers=2, **kw)
        return family_for(model_type).skeleton(hf, np.float32)

    with pytest.raises(ValueError, match=r"qwen3 layer_types holds \['chunked_attention'\]; supported: "
                                         r"full_attention, sliding_attention"):
        skeleton("qwen3", layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match=r"gemma: use_bidirectional_attention .* is not supported"):
        skeleton("gemma", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"smollm3: no_rope_layers has 1 entries for 2 blocks; give one per block"):
        skeleton("smollm3", no_rope_layers=[1], layer_types=["full_attention"] * 2)
    assert skeleton("smollm3", no_rope_layers=[1, 0, 1, 0]).layers.kinds == ("full_attention", "full_attention+nope")
