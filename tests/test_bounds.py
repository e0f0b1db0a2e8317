"""No lookup past a table, no window that is not a window, no load error that hides its cause (issue 44, items 1,
2, 5 and the limits of item 8): GPT-2's learned positions bound generate (refused before compiling, with the
numbers; exactly at the bound it equals transformers) and a Context's positions (negative or past the table:
concrete and traced); a run of exactly n_positions tokens equals transformers; generate checks its prompt's ids
before compiling; sliding_window 0 or negative and decoder_sparse_step 0 are refused at load naming the key; a MoE
config asking for more experts than stored names both counts and the spelling the checkpoint uses."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jstd
import moe_cases
import sliding_cases
from conftest import assert_close
from gpt2_neox_cases import GPT2_BASE
from jstd.families import family_for

N = GPT2_BASE["n_positions"]


def prompt(length: int, batch: int = 1) -> np.ndarray:
    return np.random.default_rng(3).integers(1, 96, (batch, length))  # no pad (0) and no eos (96) among them


def test_exactly_n_positions_tokens_run_as_transformers(zoo):
    """The limit at the limit: n_positions tokens are allowed (and equal transformers), one more is refused."""
    case = zoo("gpt2-small")
    tokens = prompt(N)
    with torch.no_grad():
        want = case.ref.model(torch.as_tensor(tokens)).logits.numpy()
    assert_close(jstd.run(case.model, tokens).logits, want, 1e-5, f"logits of {N} tokens")
    with pytest.raises(ValueError, match=f"{N + 1} tokens are more than this gpt2 model's {N} learned positions"):
        jstd.run(case.model, prompt(N + 1))


def test_generate_stops_at_the_learned_positions_as_transformers(zoo):
    """prompt + new - 2 is the last position a generation runs: at n_positions - 1 jstd's tokens equal
    transformers'; one more is refused before compiling, with the numbers (transformers' IndexError)."""
    case = zoo("gpt2-small")
    tokens = prompt(N - 3)
    new = 4  # runs positions up to N - 1
    with torch.no_grad():
        want = case.ref.model.generate(torch.as_tensor(tokens), max_new_tokens=new, do_sample=False,
                                       eos_token_id=None, pad_token_id=0).numpy()
        with pytest.raises(IndexError):
            case.ref.model.generate(torch.as_tensor(tokens), max_new_tokens=new + 1, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    got = jstd.generate(case.model, tokens, max_new_tokens=new, eos_token_id=())
    np.testing.assert_array_equal(np.asarray(got.tokens), want)
    with pytest.raises(ValueError, match=rf"a prompt of {N - 3} tokens and max_new_tokens={new + 1} run positions up "
                                         rf"to {N}, past this gpt2 model's {N} learned positions .*pass "
                                         rf"max_new_tokens={new} or fewer"):
        jstd.generate(case.model, tokens, max_new_tokens=new + 1)
    with pytest.raises(ValueError, match=f"shorten the prompt to at most {N} tokens"):
        jstd.generate(case.model, prompt(N + 1), max_new_tokens=1)


def test_context_positions_inside_the_table(zoo):
    """A Context's positions: negative or past the learned table refused (concrete: ValueError with the values;
    traced: the compiled call fails); at the table's last row the value is transformers' at that position."""
    case = zoo("gpt2-small")
    model = case.model
    tokens = prompt(1)
    run = jax.jit(lambda p: jstd.run(model, tokens, context=jstd.Context(p)).logits)
    with torch.no_grad():
        want = case.ref.model(torch.as_tensor(tokens), position_ids=torch.tensor([[N - 1]])).logits.numpy()
    assert_close(jstd.run(model, tokens, context=jstd.Context(np.array([[N - 1]]))).logits, want, 1e-5, "last row")
    assert_close(run(jnp.array([[N - 1]])), want, 1e-5, "last row, traced")
    for bad in (N, -3):
        with pytest.raises(ValueError, match=rf"context.positions must be positions in the sequence, 0 \.\. {N - 1} "
                                             rf"\(this gpt2 model's learned position table holds {N} positions.*got "
                                             f"{bad}"):
            jstd.run(model, tokens, context=jstd.Context(np.array([[bad]])))
        with pytest.raises(Exception, match="context.positions must be positions in the sequence"):
            jax.block_until_ready(run(jnp.array([[bad]])))


def test_negative_context_positions_are_refused_on_a_rotary_model(zoo):
    model = zoo("llama-gqa").model
    with pytest.raises(ValueError, match=r"context.positions must be positions in the sequence, 0; got -1"):
        jstd.run(model, prompt(2), context=jstd.Context(np.array([[-1, 0]])))


def test_generate_checks_the_prompt_ids_before_compiling(zoo):
    model = zoo("gpt2-small").model
    with pytest.raises(ValueError, match=r"token id 500 is out of range: token ids must lie in \[0, 97\)"):
        jstd.generate(model, np.array([[1, 2, 500]]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token id -1 is out of range"):
        jstd.generate(model, np.array([[1, -1]]), max_new_tokens=2)


@pytest.mark.parametrize("case", sorted(sliding_cases.CASES))
@pytest.mark.parametrize("window", [0, -2])
def test_a_window_that_is_not_a_window_is_refused(case, window):
    config = sliding_cases.config(case)
    config.sliding_window = window
    with pytest.raises(ValueError, match=rf"sliding_window={window} is not a window.*positive number of keys"):
        family_for(config.model_type).skeleton(config, np.float32)  # what jstd.load builds first


def test_a_qwen3_moe_window_and_sparse_step_are_checked():
    config = moe_cases.TEXT["qwen3_moe"]()
    family = family_for("qwen3_moe")
    config.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window=0 is not a window"):
        family.skeleton(config, np.float32)
    config = moe_cases.TEXT["qwen3_moe-normed"]()
    config.decoder_sparse_step = 0
    with pytest.raises(ValueError, match=r"decoder_sparse_step=0 must be a positive int"):
        family.skeleton(config, np.float32)


def test_more_experts_than_stored_names_the_counts_and_the_spelling(zoo, tmp_path):
    """A config asking for 10 experts of a checkpoint storing 8 (Qwen3-MoE's per-expert tensors) or 4 (Mixtral's
    w1/w2/w3): the error names both counts and the spelling stored, not a spelling the checkpoint never uses."""
    for name, key, stored, spelled in (("qwen3_moe", "num_local_experts", 8, r"model\.layers\.0\.mlp\.experts\.\{e\}\."),
                                       ("mixtral", "num_local_experts", 4,
                                        r"model\.layers\.0\.block_sparse_moe\.experts\.\{e\}\.w")):
        folder = tmp_path / name
        shutil.copytree(zoo(name).folder, folder)
        config = json.loads((folder / "config.json").read_text())
        config[key] = 10
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(jstd.CheckpointError, match=rf"missing tensor .*the config asks for 10 experts, the "
                                                       rf"checkpoint stores {stored} spelled {spelled}"):
            jstd.load(folder)
