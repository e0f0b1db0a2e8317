"""OLMo-Hybrid: hosts and blocks, the notes' identities, DeltaNet states through padding and edits, the period scan
(the conformance suite compares every value, padding, bfloat16 and edits with transformers)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jstd
from conftest import assert_close
from olmo_hybrid_cases import CASES, FULL, LINEAR, config
from reference.cases import (FamilyCases, assert_hybrid_identities, assert_padded_rows_match, assert_sites_close,
                             jit_run, random_tokens)
from reference.harness import TorchEdit

SEQ = 16
LONG = 70  # crosses the delta rule's 32-token chunk boundaries twice
LA = "layers.linear_attn."

STREAM = ("layers.layer_input", "layers.layer_mid", "layers.layer_output", "layers.self_attn.attention_output",
          "layers.linear_attn.attention_output", "layers.mlp.mlp_output")


tokens_for = functools.partial(random_tokens, seq=SEQ)


@pytest.fixture
def checkpoints(zoo):
    """checkpoints(name, dtype="float32") -> (name, folder, jstd model, torch reference) of an olmo_hybrid case;
    checkpoints.every_value(name) -> (tokens, every value jstd serves, every value torch captures) on one batch."""
    return FamilyCases(zoo, "olmo_hybrid")


@pytest.fixture(params=sorted(CASES))
def case(request, checkpoints):
    return checkpoints(request.param)


@pytest.fixture
def everything(case, checkpoints):
    return checkpoints.every_value(case[0])


# ---- structure ----------------------------------------------------------------------------------


def test_hosts_and_blocks(checkpoints):
    _, _, model, _ = checkpoints("tail")
    kinds = (LINEAR, LINEAR, LINEAR, FULL, LINEAR, LINEAR)
    assert model.family == "olmo_hybrid" and model.config.layer_types == kinds
    assert model.layers_with("linear_attn") == (0, 1, 2, 4, 5)
    assert model.layers_with("self_attn") == (3,)
    assert model.layers_with("mlp") == tuple(range(6))
    assert model.blocks_for("layers.attention_norm_output") == (0, 1, 2, 4, 5)
    assert model.blocks_for("layers.mlp_norm_output") == (0, 1, 2, 4, 5)
    assert model.blocks_for("layers.layer_mid") == tuple(range(6))
    assert model.rotary is None
    assert model.layers.slot_with("linear_attn").attn.o_norm.eps == 1e-5  # not rms_norm_eps (1e-6)
    tokens = tokens_for(model)
    for bad in ("layers.3.attention_norm_output", "layers.3.mlp_norm_output", "layers.3.linear_attn.betas",
                "layers.0.self_attn.attention_queries"):
        with pytest.raises(jstd.SiteError, match="blocks with it"):
            jstd.run(model, tokens, reads=(bad,))
    for read_only in ("layers.linear_attn.states", "layers.linear_attn.state_output"):
        with pytest.raises(jstd.SiteError, match="read-only"):
            jstd.Zero(read_only)
    out = jit_run(model, tokens, reads=("layers.attention_norm_output", "layers.4.attention_norm_output",
                                        "layers.linear_attn.state_output", "layers.5.linear_attn.state_output"))
    assert out["layers.attention_norm_output"].shape == (5, 2, SEQ, 64)
    np.testing.assert_array_equal(out["layers.4.attention_norm_output"], out["layers.attention_norm_output"][3])
    np.testing.assert_array_equal(out["layers.5.linear_attn.state_output"], out["layers.linear_attn.state_output"][4])
    assert out["layers.linear_attn.state_output"].shape == (5, 2, 2, 8, 16)
    for i in (2, 5):  # read alone (kept in the scan's carry): in the period and on the tail
        alone = jit_run(model, tokens, reads=(f"layers.{i}.attention_norm_output", "layers.3.self_attn.attention_keys"))
        row = model.blocks_for("layers.attention_norm_output").index(i)
        np.testing.assert_allclose(alone[f"layers.{i}.attention_norm_output"], out["layers.attention_norm_output"][row],
                                   rtol=1e-6, atol=1e-6)
    # a value stacked over the blocks a site is on: one row per DeltaNet block
    site = "layers.mlp_norm_output"
    factors = np.arange(1, 6, dtype=np.float32)
    stacked = jit_run(model, tokens, [jstd.Scale(site, factors.reshape(5, 1, 1, 1))])
    one_by_one = jit_run(model, tokens, [jstd.Scale(site, f, layer=b) for f, b in zip(factors, model.blocks_for(site))])
    np.testing.assert_allclose(stacked.logits, one_by_one.logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(jstd.SiteError, match="stacked over 8 blocks, but 5 blocks compute"):
        jit_run(model, tokens, [jstd.Scale(site, np.ones((8, 1, 1, 1), np.float32))])


def test_rotary_only_when_transformers_builds_one(checkpoints):
    assert checkpoints("released")[2].rotary is None  # rope_theta null
    _, _, model, ref = checkpoints("rotary_grouped")  # rope_parameters null: transformers fills theta 10000
    assert ref.model.model.rotary_emb is not None and model.rotary is not None


# ---- every value --------------------------------------------------------------------------------


def test_across_a_chunk_boundary(checkpoints):
    """70 tokens: the chunked delta rule carries its state across its chunk boundaries; states equal the token loop."""
    name, _, model, ref = checkpoints("rotary_grouped")
    tokens = tokens_for(model, seq=LONG, seed=1)
    reads = tuple(sorted(model.sites))
    out = jit_run(model, tokens, reads=reads)
    want = ref.run(tokens)
    assert_sites_close(out, want, reads, 1e-5, name)


# ---- the notes' identities ----------------------------------------------------------------------


def test_identities(case, everything):
    name, _, model, ref = case
    tokens, out, want = everything
    full = model.layers_with("self_attn")
    assert_hybrid_identities(model, out)  # the block sum on both kinds, exact, and the stream's identities
    betas = np.asarray(out[LA + "betas"])
    top = 2.0 if CASES[name]["linear_allow_neg_eigval"] else 1.0
    assert betas.min() > 0 and betas.max() < top and (top == 1.0 or betas.max() > 1.0)
    # the attention block has no input norm: the attention reads the raw stream, the MLP reads layer_mid
    np.testing.assert_array_equal(np.asarray(out["layers.mlp_input"])[list(full)], np.asarray(out["layers.layer_mid"])[list(full)])


def test_direct_logit_attribution_on_a_hybrid(checkpoints):
    """DLA reads each block's mixer (DeltaNet or attention) and MLP: the parts sum to the logit difference; by
    default it splits no heads here (not exact), and asking for heads is refused (blocks without self_attn)."""
    _, _, model, _ = checkpoints("tail")
    tokens = tokens_for(model, seed=6)
    dla = jstd.direct_logit_attribution(model, tokens, 5, 9)
    assert dla.heads is None
    assert dla.attention.shape == (6, 2) and np.abs(dla.attention).min() > 0
    assert_close(dla.total(), dla.logit, 1e-4, "parts sum to the logit difference")
    with pytest.raises(NotImplementedError, match="blocks without self_attn"):
        jstd.direct_logit_attribution(model, tokens, 5, 9, heads=True)


def test_queries_are_q_norm_split_into_heads(checkpoints):
    """Without rotary, attention_queries is q_norm's output (one norm over every head) split into heads."""
    _, _, model, ref = checkpoints("released")
    tokens, out, _ = checkpoints.every_value("released")
    i = model.layers_with("self_attn")[0]
    got = {}
    handle = ref.model.model.layers[i].self_attn.q_norm.register_forward_hook(lambda m, a, o: got.update(q=o))
    try:
        ref.run(tokens, reads=("logits",))
    finally:
        handle.remove()
    b, s, _ = got["q"].shape
    q_norm = got["q"].view(b, s, -1, model.config.head_dim).transpose(1, 2).numpy()
    queries = out["layers.self_attn.attention_queries"][0]
    assert_close(queries, q_norm, 1e-5, "queries vs q_norm")
    # and within jstd: the whole-projection norm of the block's input, split into heads, unchanged
    attn = jax.tree.map(lambda a: a[0], model.layers.slot_with("self_attn").attn)
    proj = jnp.einsum("bte,ehd->bthd", out["layers.layer_input"][i], attn.q).reshape(b, s, -1)
    mine = attn.q_norm(proj).reshape(b, s, -1, model.config.head_dim).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(queries, mine, rtol=1e-6, atol=1e-6)


# ---- padding ------------------------------------------------------------------------------------


def test_left_padded_batch(checkpoints):
    """Padding is zeroed before the DeltaNet, so the state stays zero through it: padded rows equal their prompts
    (positions count real tokens only, so the rotary sees each prompt's own positions)."""
    name, _, model, ref = checkpoints("rotary_grouped")
    rng = np.random.default_rng(5)
    rows = [rng.integers(2, model.config.vocab_size, n) for n in (SEQ, 9, 4)]
    reads = ("layers.layer_output", LA + "attention_queries", LA + "states", LA + "state_output",
             "layers.self_attn.attention_probabilities", "next_token_probs")
    assert_padded_rows_match(model, ref, rows, reads, SEQ, 1e-5, name)


# ---- edits --------------------------------------------------------------------------------------


def _edit_cases(model, other_states):
    """(name, jstd edits, torch edits): the same edit made both ways. other_states: another prompt's state_output."""
    delta = model.layers_with("linear_attn")
    full = model.layers_with("self_attn")
    heads = other_states.shape[2]
    head = lambda h: (np.arange(heads) == h)[None, :, None, None]
    t_other = torch.from_numpy(np.array(other_states))

    def patched(rank, h=None):
        def fn(t):
            t = t_other[rank].clone()
            if h is not None:
                t[:, h] = 0
            return t
        return fn

    return [
        ("scale betas, the post-norm contributions and a decay",
         [jstd.Scale(LA + "betas", 0.5), jstd.Scale("layers.self_attn.attention_output", 0.5),
          jstd.Scale("layers.mlp.mlp_output", 0.5, layer=full[0]), jstd.Add(LA + "decays", -0.5, layer=delta[0])],
         [TorchEdit(LA + "betas", lambda t: t * 0.5), TorchEdit("layers.self_attn.attention_output", lambda t: t * 0.5),
          TorchEdit("layers.mlp.mlp_output", lambda t: t * 0.5, full[0]),
          TorchEdit(LA + "decays", lambda t: t - 0.5, delta[0])]),
        ("patch every state from another prompt (one edit stacked over the DeltaNet blocks)",
         [jstd.Set(LA + "state_input", other_states)],
         [TorchEdit(LA + "state_input", patched(r), i) for r, i in enumerate(delta)]),
        ("zero a head of a patched state_input",
         [jstd.Set(LA + "state_input", other_states[1], layer=delta[1]),
          jstd.Zero(f"layers.{delta[1]}.linear_attn.state_input", where=head(0))],
         [TorchEdit(LA + "state_input", patched(1, h=0), delta[1])]),
    ]


def test_edits_match_torch_hooks(checkpoints):
    name, _, model, ref = checkpoints("released")
    tokens = tokens_for(model, seed=7)
    other = jstd.run(model, tokens_for(model, seed=8), reads=(LA + "state_output",))[LA + "state_output"]
    reads = ("layers.layer_output", LA + "state_output", LA + "attention_head_outputs",
             "layers.self_attn.attention_head_outputs", "layers.mlp.mlp_output")
    clean = ref.run(tokens, reads=("logits",))["logits"]
    for label, edits, torch_edits in _edit_cases(model, other):
        out = jit_run(model, tokens, edits, reads=reads)
        want = ref.run(tokens, reads=reads + ("logits",), edits=torch_edits)
        assert np.abs(want["logits"] - clean).max() > 1e-3, f"{label}: the edit changes nothing"
        assert_sites_close(out, want, reads, 1e-5, f"{name}: {label}")


def test_an_edit_changes_only_what_it_edits(checkpoints):
    """A post-norm contribution edited at the last position: every earlier position is bit-identical."""
    _, _, model, _ = checkpoints("tail")
    tokens = tokens_for(model, seed=4)
    i = model.layers_with("self_attn")[0]
    last = (np.arange(SEQ) == SEQ - 1)[None, :, None]
    reads = ("layers.layer_output", "layers.self_attn.attention_output", "layers.mlp.mlp_output")
    clean = jit_run(model, tokens, reads=reads)
    edits = [jstd.Add("layers.self_attn.attention_output", 0.25, layer=i, where=last),
             jstd.Scale("layers.mlp.mlp_output", 2.0, layer=i, where=last)]
    out = jit_run(model, tokens, edits, reads=reads)
    for site in reads:
        np.testing.assert_array_equal(out[site][..., :-1, :], clean[site][..., :-1, :])
    np.testing.assert_array_equal(out["layers.self_attn.attention_output"][0, :, -1],
                                  clean["layers.self_attn.attention_output"][0, :, -1] + np.float32(0.25))
    assert not np.array_equal(out.logits[:, -1], clean.logits[:, -1])


# ---- the period scan and loading ----------------------------------------------------------------


def _traced_size(name, layers):
    from jstd.models.olmo_hybrid import OlmoHybrid

    kinds = config(name).layer_types
    hf = config(name, num_hidden_layers=layers, layer_types=[kinds[i % 4] for i in range(layers)])
    skeleton = OlmoHybrid.skeleton(hf, jnp.float32)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    reads = ("layers.layer_output", LA + "states", "layers.self_attn.attention_probabilities")
    text = str(jax.make_jaxpr(functools.partial(jstd.run, reads=reads))(skeleton, tokens))
    return sum(" = " in line for line in text.splitlines())  # equations: the header's wrapping varies with shapes


def test_trace_does_not_grow_with_depth():
    """One scan step runs one period (LLLA): 8 and 32 blocks trace to the same program, and so do 6 and 10 (tail LL)."""
    assert _traced_size("released", 8) == _traced_size("released", 32)
    assert _traced_size("tail", 6) == _traced_size("tail", 10)


def test_equal_slots_trace_one_mixer(monkeypatch):
    """A period's consecutive equal slots (LLL) run as one inner scan: the DeltaNet mixer is traced once for the
    period and once for a tail of DeltaNet blocks (LL), not once per slot (3, 5)."""
    from jstd.nn.deltanet import GatedDeltaNet
    from jstd.models.olmo_hybrid import OlmoHybrid

    traces = []
    mixer = GatedDeltaNet.__call__
    monkeypatch.setattr(GatedDeltaNet, "__call__", lambda self, *a, **k: traces.append(1) or mixer(self, *a, **k))
    tokens = jax.ShapeDtypeStruct((3, 5), jnp.int32)  # a shape no other test traces, so no cached trace
    for name, expected in (("released", 1), ("tail", 2)):
        traces.clear()
        run = functools.partial(jstd.run, reads=("layers.layer_output", LA + "betas"))
        jax.eval_shape(run, OlmoHybrid.skeleton(config(name), jnp.float32), tokens)
        assert len(traces) == expected, name


def test_conv_stored_in_either_split(checkpoints, tmp_path):
    """transformers saves the q|k|v convolution in equal thirds; OLMo-core's files split it q|k|v. Both load."""
    _, folder, model, _ = checkpoints("released")
    tensors = load_file(folder / "model.safetensors")
    key_dim = 2 * 8
    for i in model.layers_with("linear_attn"):
        p = f"model.layers.{i}.linear_attn."
        whole = np.concatenate([tensors.pop(p + f"{x}_conv1d.weight") for x in "qkv"])
        assert whole.shape[0] == 2 * key_dim + 2 * 16
        for x, part in zip("qkv", np.split(whole, [key_dim, 2 * key_dim])):
            tensors[p + f"{x}_conv1d.weight"] = part
    other = tmp_path / "split"
    other.mkdir()
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    (other / "config.json").write_text((folder / "config.json").read_text())
    again = jstd.load(other)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model)):
        np.testing.assert_array_equal(a, b)
