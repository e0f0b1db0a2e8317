"""Attribution graphs (jstd.circuits) against circuit-tracer 0.5.0's own graphs (tests/data/circuit_tracer, written by
scripts/circuit_tracer/reference.py in circuit-tracer's environment: every expected value is circuit-tracer's), plus
the completeness identity, the frozen model against finite differences, and the hook names."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from jstd.circuits import Graph, attribute, load_transcoders, prune, graph_scores, frontend_json
from jstd.io.safetensors import SafetensorsFiles

DATA = Path(__file__).parent / "data" / "circuit_tracer"
CASES = sorted(p.name for p in DATA.iterdir() if (p / "case.json").exists())


@functools.lru_cache(maxsize=None)
def case(name):
    d = DATA / name
    files = SafetensorsFiles(d / "graph.safetensors")
    ref = {k: np.array(files.mapped(k, lazy=True)) for k in files.keys()}
    pruned = SafetensorsFiles(d / "pruned.safetensors")
    pruned = {k: np.array(pruned.mapped(k, lazy=True)) for k in pruned.keys()}
    spec = json.loads((d / "case.json").read_text())
    return spec, ref, pruned


@functools.lru_cache(maxsize=None)
def graph_of(name):
    spec, ref, _ = case(name)
    d = DATA / name
    model, tok = jstd.load(d / "model"), jstd.load_processor(d / "model")
    tc = load_transcoders(d / "transcoders")
    s, t = spec["settings"], spec["targets"]
    targets = {"salient": None, "token_ids": t.get("token_ids")}.get(t["kind"])
    if t["kind"] == "custom":
        targets = [(c["token_str"], c["prob"], ref["custom_target_vectors"][i]) for i, c in enumerate(t["custom"])]
    g = attribute(model, spec["prompt_ids_given"], tc, targets=targets, max_n_logits=s["max_n_logits"],
                  desired_logit_prob=s["desired_logit_prob"], max_feature_nodes=s["max_feature_nodes"],
                  batch_size=s["batch_size"], update_interval=s["update_interval"], tokenizer=tok)
    return model, tok, tc, g


@pytest.mark.parametrize("name", CASES)
def test_graph_equals_circuit_tracer(name):
    spec, ref, _ = case(name)
    _, _, _, g = graph_of(name)
    np.testing.assert_array_equal(g.input_tokens, ref["input_tokens"])
    np.testing.assert_array_equal(g.active_features, ref["active_features"])
    np.testing.assert_allclose(g.activation_values, ref["activation_values"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(g.selected_features, ref["selected_features"])
    np.testing.assert_array_equal(g.logit_token_ids, ref["logit_token_ids"])
    assert g.logit_strings == [t["token_str"] for t in spec["logit_targets"]]
    np.testing.assert_allclose(g.logit_probabilities, ref["logit_probabilities"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g.logit_vectors, ref["logit_vectors"], rtol=1e-5, atol=1e-5)
    A, want = g.adjacency, ref["adjacency_matrix"]
    assert A.shape == want.shape
    scale = np.abs(want).max()
    assert np.abs(A - want).max() <= 1e-5 * scale, np.abs(A - want).max() / scale
    assert g.vocab_size == spec["vocab_size"] and g.input_string == spec["input_string"]


@pytest.mark.parametrize("name", CASES)
def test_pruned_scores_and_json_equal_circuit_tracer(name):
    spec, ref, want = case(name)
    _, _, _, g = graph_of(name)
    s = spec["settings"]
    got = prune(g, s["node_threshold"], s["edge_threshold"])
    np.testing.assert_array_equal(got.node_mask, want["node_mask"])
    np.testing.assert_array_equal(got.edge_mask, want["edge_mask"])
    # a node's cumulative score is the share of influence up to its rank: two nodes whose influences tie to float
    # error (llama_clt_relu_resid_mid has such a pair) may take each other's rank, so the scores agree as a set and
    # node by node everywhere else
    cumulative, reference = got.cumulative_scores, want["cumulative_scores"]
    np.testing.assert_allclose(np.sort(cumulative), np.sort(reference), rtol=1e-5, atol=1e-6)
    swapped = ~np.isclose(cumulative, reference, rtol=1e-5, atol=1e-6)
    assert swapped.sum() <= 2, np.flatnonzero(swapped)
    scores = json.loads((DATA / name / "scores.json").read_text())
    replacement, completeness = graph_scores(g)
    np.testing.assert_allclose([replacement, completeness], [scores["replacement_score"], scores["completeness_score"]],
                               rtol=1e-5)
    ref_json = json.loads((DATA / name / "graph.json").read_text())
    for ids in (True, False):
        mine = frontend_json(g, spec["slug"], node_threshold=s["node_threshold"], edge_threshold=s["edge_threshold"],
                             circuit_tracer_ids=ids)
        assert mine["metadata"] == ref_json["metadata"] and mine["qParams"] == ref_json["qParams"]
        rename = {} if ids else {f"0_{l}_{p}": f"{l}_error_{p}" for l in range(g.num_layers) for p in range(g.n_pos)}
        _same_json(mine, ref_json, rename, collisions=not ids and bool(spec["summary"].get("json_duplicate_node_ids")))


def _same_json(mine, ref, rename, collisions):
    """``mine`` equals circuit-tracer's JSON with its error ids renamed (``rename``); where circuit-tracer's ids
    collide (an error and a layer-0 feature), its node list and links cannot be told apart, so only the others
    are compared."""
    close = lambda a, b: (a is None and b is None) or abs(a - b) <= 1e-5 * max(1.0, abs(b))
    errors = lambda n: n["feature_type"] == "mlp reconstruction error"
    ref_nodes = [dict(n, node_id=rename.get(n["node_id"], n["node_id"]) if errors(n) else n["node_id"])
                 for n in ref["nodes"]]
    if collisions:
        dup = {n["node_id"] for n in ref["nodes"]}
        counts = {}
        for n in ref["nodes"]:
            counts[n["node_id"]] = counts.get(n["node_id"], 0) + 1
        dup = {k for k, c in counts.items() if c > 1}
        assert dup, "the case is said to collide"
        keep = lambda n: n["node_id"] not in dup and not n["node_id"].endswith(tuple(f"_error_{k.split('_')[2]}" for k in dup))
        ref_nodes = [n for n in ref_nodes if n["node_id"] not in dup and not any(n["node_id"] == rename.get(k) for k in dup)]
        mine_nodes = [n for n in mine["nodes"] if n["node_id"] not in dup and not any(n["node_id"] == rename.get(k) for k in dup)]
    else:
        mine_nodes = mine["nodes"]
    assert [n["node_id"] for n in mine_nodes] == [n["node_id"] for n in ref_nodes]
    for a, b in zip(mine_nodes, ref_nodes):
        for key in b:
            if key in ("influence", "activation", "token_prob"):
                assert close(a[key], b[key]), (key, a, b)
            else:
                assert a[key] == b[key], (key, a, b)
    if collisions:
        return
    assert [(e["source"], e["target"]) for e in mine["links"]] == [
        (rename.get(e["source"], e["source"]), rename.get(e["target"], e["target"])) for e in ref["links"]]
    scale = max(abs(e["weight"]) for e in ref["links"])
    assert all(abs(a["weight"] - b["weight"]) <= 1e-5 * scale for a, b in zip(mine["links"], ref["links"]))


# ---- identities -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama_clt_relu_skip", "gemma2_plt_jumprelu", "llama_plt_relu_skip"])
def test_rows_sum_to_the_target_minus_the_constants(name):
    """Completeness: a target's input ⟨v, x⟩ = Σ_s A[t, s] + Σ_{l, p>=1} ⟨g_{l,p}, b_dec_l⟩ + Σ_l ⟨g_{l,0}, y_{l,0} -
    skip_l(x_{l,0})⟩ (g: the target's gradient at the MLP outputs in the linearised model), for every logit row and
    a spread of feature rows."""
    model, _, tc, g = graph_of(name)
    _, total, target = completeness(model, jnp.asarray(g.input_tokens[None], jnp.int32), tc, g)
    np.testing.assert_allclose(total, target, rtol=1e-4, atol=1e-4 * np.abs(target).max())


def completeness(model, tokens, tc, g):
    """``(rows, Σ_s A[t, s] + constants, ⟨v, x⟩)`` for a spread of ``g``'s feature rows and every logit row
    (``tokens``: the prompt's ids ``[1, n]``, or a ``jstd.circuits.inputs.ImagePrompt`` with its features held)."""
    from jstd.circuits.replacement import gradients, prompt_values

    v = prompt_values(model, tokens, tc.input_site, tc.output_site)
    x, y, final = v["x"][:, 0], v["y"][:, 0], v["final"][0]
    L, n = g.num_layers, g.n_pos
    picks = np.linspace(0, g.n_features - 1, 6).astype(int)
    feats = g.active_features[g.selected_features[picks]]
    layers = np.concatenate([feats[:, 0], np.full(g.n_logits, L)])
    positions = np.concatenate([feats[:, 1], np.full(g.n_logits, n - 1)])
    vectors = np.concatenate([np.asarray(tc.W_enc)[feats[:, 0], feats[:, 2]], g.logit_vectors])
    g_y, _ = gradients(model, tokens, tc, jnp.asarray(layers), jnp.asarray(positions), jnp.asarray(vectors))
    g_y = np.asarray(g_y, np.float64)
    rows = np.concatenate([picks, np.arange(g.logit_start, g.n_nodes)])
    read = np.concatenate([np.asarray(x)[feats[:, 0], feats[:, 1]], np.repeat(np.asarray(final)[n - 1:], g.n_logits, 0)])
    target = (read.astype(np.float64) * vectors).sum(1)
    x0 = np.asarray(x)[:, 0]
    constant0 = np.asarray(y)[:, 0] - np.asarray(tc.skip(x[:, :1]))[:, 0]
    constants = (np.einsum("tlpd,ld->t", g_y[:, :, 1:], np.asarray(tc.b_dec, np.float64))
                 + np.einsum("tld,ld->t", g_y[:, :, 0], constant0))
    return rows, g.adjacency[rows].astype(np.float64).sum(1) + constants, target


def test_frozen_norms_and_attention_are_fixed_linear_maps():
    """jstd.nn.frozen: a frozen RMSNorm's / LayerNorm's Jacobian is the fixed diagonal (its weight / rms, times the
    centring for LayerNorm), checked in float64 against the formula; a frozen attention's output has no derivative
    through its pattern; forward values are unchanged."""
    from jstd.nn.frozen import frozen
    from jstd.nn.norms import LayerNorm, RMSNorm

    jax.config.update("jax_enable_x64", True)
    try:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=6) * 3)
        w, b = jnp.asarray(rng.normal(size=6)), jnp.asarray(rng.normal(size=6))
        rms = RMSNorm(w, 1e-6, weight_in_float32=True)
        fr = frozen(rms)
        np.testing.assert_array_equal(fr(x), rms(x))
        x32 = x.astype(jnp.float32)
        r = 1 / np.sqrt(np.mean(np.asarray(x32, np.float64) ** 2) + 1e-6)
        np.testing.assert_allclose(jax.jacobian(lambda v: fr(v.astype(jnp.float32)))(x32), np.diag(np.asarray(w) * r),
                                   rtol=1e-5)
        assert not np.allclose(jax.jacobian(lambda v: rms(v.astype(jnp.float32)))(x32), np.diag(np.asarray(w) * r),
                               rtol=1e-3)
        ln = frozen(LayerNorm(w, b, 1e-5))
        c = np.eye(6) - 1 / 6
        std = np.std(np.asarray(x32, np.float64))
        np.testing.assert_allclose(jax.jacobian(ln)(x32), (np.asarray(w)[:, None] * c) / np.sqrt(std ** 2 + 1e-5),
                                   rtol=1e-4, atol=1e-6)
    finally:
        jax.config.update("jax_enable_x64", False)
    model, _, _, g = graph_of("llama_plt_relu")
    from jstd.nn.frozen import frozen as frz

    tokens = jnp.asarray(g.input_tokens[None], jnp.int32)
    q = lambda m, e: jstd.run(m, tokens, [jstd.Add("layers.self_attn.attention_queries", e, layer=1)]).logits.sum()
    e = jnp.zeros((1, 4, g.n_pos, 8))
    np.testing.assert_array_equal(jax.grad(q, 1)(frz(model), e), 0)  # queries act only through the held pattern
    assert np.abs(np.asarray(jax.grad(q, 1)(model, e))).max() > 0
    want = np.asarray(jstd.run(model, tokens).logits)  # the same values: two programs, a few roundings apart
    np.testing.assert_allclose(jstd.run(frz(model), tokens).logits, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_hook_names_mean_what_transformerlens_means():
    """lnX.hook_normalized is x / rms(x) before the gain; hook_mlp_in the stream before the MLP's norm;
    circuit-tracer's mlp.hook_in / mlp.hook_out the MLP's input (with the gain) and output."""
    from jstd.sae import site_of

    assert site_of("blocks.2.ln2.hook_normalized") == ("layers.mlp_norm_normalized", 2)
    assert site_of("blocks.0.ln1.hook_normalized") == ("layers.attention_norm_normalized", 0)
    assert site_of("blocks.1.hook_mlp_in") == ("layers.layer_mid", 1)
    assert site_of("blocks.1.mlp.hook_in") == ("layers.mlp_input", 1)
    assert site_of("blocks.1.mlp.hook_out") == ("layers.mlp.mlp_output", 1)
    model, _, _, g = graph_of("llama_plt_relu")
    reads = ("layers.mlp_norm_normalized", "layers.mlp_norm_output", "layers.layer_mid")
    out = jstd.run(model, jnp.asarray(g.input_tokens[None]), reads=reads)
    mid = np.asarray(out["layers.layer_mid"], np.float64)
    normed = mid / np.sqrt((mid ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out["layers.mlp_norm_normalized"], normed, rtol=1e-5, atol=1e-6)
    weight = np.asarray(model.layers.slots[0].mlp_norm.weight)[:, None, None]
    np.testing.assert_allclose(out["layers.mlp_norm_output"], weight * normed, rtol=1e-5, atol=1e-6)


# ---- files ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama_plt_jumprelu_skip", "llama_clt_relu_skip"])
def test_transcoder_files_round_trip_and_are_found_in_caches(name, tmp_path, monkeypatch):
    from jstd.circuits import find_transcoders, save_transcoders

    tc = load_transcoders(DATA / name / "transcoders")
    saved = save_transcoders(tc, tmp_path / "plain")
    again = load_transcoders(saved)
    for a, b in zip(jax.tree.leaves(tc), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    assert (again.cross_layer, again.input_hook, again.output_hook, again.scan) == (
        tc.cross_layer, tc.input_hook, tc.output_hook, tc.scan)
    # circuit-tracer's cache: $CIRCUIT_TRACER_CACHE_DIR/<ref>/config.yaml
    monkeypatch.setenv("CIRCUIT_TRACER_CACHE_DIR", str(tmp_path / "ct"))
    save_transcoders(tc, tmp_path / "ct" / "org" / "set")
    assert find_transcoders("org/set") == tmp_path / "ct" / "org" / "set"
    # a populated HuggingFace cache (no network): hub/models--org--name/snapshots/<rev>/
    hub = tmp_path / "hf" / "hub"
    snap = hub / "models--org--hfset" / "snapshots" / ("0" * 40)
    save_transcoders(tc, snap)
    (hub / "models--org--hfset" / "refs").mkdir(parents=True)
    (hub / "models--org--hfset" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(hub))
    assert Path(find_transcoders("org/hfset")).resolve() == snap.resolve()
    with pytest.raises(FileNotFoundError, match="no transcoder set"):
        find_transcoders("org/missing")


def test_saelens_transcoders_give_the_same_graph(tmp_path):
    """A per-layer set written as SAELens transcoders (jstd.sae.save_sae) and read back (from_saes) gives the
    graph circuit-tracer gives for the set."""
    from jstd.circuits import from_saes
    from jstd.sae import SAE, load_sae, save_sae

    name = "llama_plt_relu"
    model, tok, tc, g = graph_of(name)
    saes = []
    for l in range(tc.num_layers):
        sae = SAE(tc.W_enc[l].T, tc.b_enc[l], tc.W_dec[l], tc.b_dec[l], None, architecture="transcoder",
                  apply_b_dec_to_input=False, hook_name=f"blocks.{l}.mlp.hook_in",
                  hook_name_out=f"blocks.{l}.mlp.hook_out")
        saes.append(load_sae(save_sae(sae, tmp_path / f"l{l}")))
    again = from_saes(saes, scan=tc.scan)
    spec = case(name)[0]
    g2 = attribute(model, spec["prompt_ids_given"], again, tokenizer=tok, batch_size=spec["settings"]["batch_size"])
    np.testing.assert_array_equal(g2.active_features, g.active_features)
    np.testing.assert_allclose(g2.adjacency, g.adjacency, rtol=0, atol=1e-6 * np.abs(g.adjacency).max())
    with pytest.raises(ValueError, match="blocks.1"):
        from_saes([saes[1], saes[0], saes[2]])


def test_graph_save_load_round_trip(tmp_path):
    _, _, _, g = graph_of("llama_targets_custom")
    again = Graph.load(g.save(tmp_path / "g"))
    for field in ("adjacency", "active_features", "activation_values", "selected_features", "input_tokens",
                  "logit_token_ids", "logit_probabilities", "logit_vectors"):
        np.testing.assert_array_equal(getattr(again, field), getattr(g, field))
    assert (again.logit_strings, again.scan, again.prompt_tokens, again.num_layers) == (
        g.logit_strings, g.scan, g.prompt_tokens, g.num_layers)
    assert not list((tmp_path / "g").glob("*.pt")) and not list((tmp_path / "g").glob("*.pkl"))


def test_cli_writes_the_frontend_json(tmp_path, capsys):
    """``jstd attribute MODEL --transcoders DIR --prompt TEXT --out DIR`` writes circuit-tracer's JSON for the
    prompt (the case's prompt as text: the same graph) and the graph itself."""
    from jstd.cli.main import main

    name = "llama_plt_relu"
    spec, ref, _ = case(name)
    d = DATA / name
    text = spec["input_string"].split(" ", 1)[1]  # without the BOS, which the command prepends
    status = main(["attribute", str(d / "model"), "--transcoders", str(d / "transcoders"), "--prompt", text,
                   "--out", str(tmp_path), "--slug", name, "--batch-size", str(spec["settings"]["batch_size"])])
    assert status == 0
    mine = json.loads((tmp_path / f"{name}.json").read_text())
    ref_json = json.loads((d / "graph.json").read_text())
    assert mine["metadata"] == ref_json["metadata"]
    assert len(mine["nodes"]) == len(ref_json["nodes"]) and len(mine["links"]) == len(ref_json["links"])
    assert json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"] == [ref_json["metadata"]]
    np.testing.assert_array_equal(Graph.load(tmp_path / name).input_tokens, ref["input_tokens"])
    assert main(["attribute", str(d / "model"), "--transcoders", str(tmp_path / "none"), "--prompt", text,
                 "--out", str(tmp_path)]) == 1
    assert "no transcoder set" in capsys.readouterr().err


def test_cli_keeps_the_top_edges_per_row(tmp_path):
    """``--edges-per-row K``: the graph saved is ``attribute(..., edges_per_row=K)``'s, each row's K largest edges of
    the dense graph with each row's full sum, and its JSON is written."""
    from jstd.circuits import SparseAdjacency
    from jstd.cli.main import main

    name = "llama_plt_relu"
    spec, _, _ = case(name)
    d = DATA / name
    text = spec["input_string"].split(" ", 1)[1]
    status = main(["attribute", str(d / "model"), "--transcoders", str(d / "transcoders"), "--prompt", text,
                   "--out", str(tmp_path), "--slug", name, "--batch-size", str(spec["settings"]["batch_size"]),
                   "--max-n-logits", str(spec["settings"]["max_n_logits"]), "--desired-logit-prob",
                   str(spec["settings"]["desired_logit_prob"]), "--edges-per-row", "3"])
    assert status == 0 and (tmp_path / f"{name}.json").exists()
    A = Graph.load(tmp_path / name).adjacency
    dense = graph_of(name)[3].adjacency  # the same prompt and settings, dense
    assert isinstance(A, SparseAdjacency) and A.shape == dense.shape and np.diff(A.indptr).max() == 3
    kept = np.abs(A.toarray())
    assert (np.sort(np.abs(dense), 1)[:, -3:].sum(1) - kept.sum(1) <= 1e-5 * np.abs(dense).max()).all()
    np.testing.assert_allclose(A.row_abs_sums, np.abs(dense).sum(1), rtol=1e-5, atol=1e-6 * np.abs(dense).max())


# ---- interventions --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama_clt_relu_skip", "gemma2_plt_jumprelu"])
def test_graph_predicts_a_frozen_intervention(name):
    """Steering three feature nodes in the frozen model moves every target's input by Σ_s Δ_s / a_s · A[t, s]."""
    from jstd.circuits.interventions import frozen_effect

    model, _, tc, g = graph_of(name)
    nodes = [0, g.n_features // 2, g.n_features - 1]
    items, weights = [], np.zeros(g.n_nodes)
    for i, step in zip(nodes, (0.05, -0.1, 0.02)):
        _, l, p, f = g.node(i)
        a = float(g.activation_values[g.selected_features[i]])
        items.append((l, p, f, a + step))
        weights[i] = step / a
    predicted = g.adjacency.astype(np.float64) @ weights
    effect = frozen_effect(model, g.input_tokens, tc, items)
    n = g.n_pos
    logit_moves = np.asarray(g.logit_vectors, np.float64) @ np.asarray(effect["final"][n - 1], np.float64)
    np.testing.assert_allclose(logit_moves, predicted[g.logit_start:], rtol=1e-4,
                               atol=1e-5 * np.abs(predicted).max())
    feats = g.active_features[g.selected_features]
    enc = np.asarray(tc.W_enc, np.float64)[feats[:, 0], feats[:, 2]]
    moves = (enc * np.asarray(effect["inputs"], np.float64)[feats[:, 0], feats[:, 1]]).sum(1)
    np.testing.assert_allclose(moves, predicted[:g.n_features], rtol=1e-4, atol=1e-5 * np.abs(predicted).max())
    assert np.abs(predicted).max() > 1e-3


def test_free_interventions_reuse_the_splice():
    from jstd.circuits.interventions import intervene

    model, _, tc, g = graph_of("llama_plt_jumprelu")
    tokens = g.input_tokens
    clean = np.asarray(jstd.run(model, jnp.asarray(tokens[None])).logits[0])
    _, l, p, f = g.node(g.n_features - 1)
    a = float(g.activation_values[g.selected_features[-1]])
    np.testing.assert_allclose(intervene(model, tokens, tc, [(l, p, f, a)]), clean, rtol=1e-5, atol=1e-5)
    ablated = np.asarray(intervene(model, tokens, tc, [(l, p, f, 0.0)]))
    assert np.abs(ablated - clean).max() > 1e-4
    np.testing.assert_allclose(ablated[:p], clean[:p], rtol=1e-5, atol=1e-5)  # nothing before the position moves
    frozen = np.asarray(intervene(model, tokens, tc, [(l, p, f, 0.0)], frozen=True))
    assert np.abs(frozen - clean).max() > 1e-4
    _, _, clt, _ = graph_of("llama_clt_relu_skip")
    with pytest.raises(ValueError, match="cross-layer"):
        intervene(model, tokens, clt, [(0, 1, 0, 0.0)])
    with pytest.raises(ValueError, match="position 0"):
        intervene(model, tokens, tc, [(0, 0, 0, 0.0)])


def test_programs_that_skip_blocks_and_positions_give_the_same_graph(monkeypatch):
    """With more active features than 4 batches, a batch of features read before block D runs only the first D
    blocks (Stack.first, here on Gemma 2's alternating sliding and global blocks: a period of two) and the first P
    positions its targets need (prompts of 16 or more), batches straddling two blocks included: the graph is the
    one program's. (Five batches of 48 of the 210 features: few programs to compile.)"""
    import sys

    module = sys.modules["jstd.circuits.attribute"]  # the module (jstd.circuits.attribute: the function)
    inner, ran = module.target_gradients, set()

    def spy(model, tokens, tc, layers, positions, vectors, outputs, depth=None):
        ran.add((depth, tokens.shape[1]))
        return inner(model, tokens, tc, layers, positions, vectors, outputs, depth=depth)

    model, tok, tc, g = graph_of("gemma2_plt_jumprelu")
    spec = case("gemma2_plt_jumprelu")[0]
    prompt = (spec["prompt_ids_given"] * 4)[:17]
    one = attribute(model, prompt, tc, batch_size=1024, tokenizer=tok)
    assert one.n_features > 4 * 48 and one.n_pos == 18
    monkeypatch.setattr(module, "target_gradients", spy)
    parts = attribute(model, prompt, tc, batch_size=48, tokenizer=tok)
    L = tc.num_layers
    assert {d for d, _ in ran} >= {1, 2, L} and min(P for _, P in ran) < 18, ran
    np.testing.assert_allclose(parts.adjacency, one.adjacency, rtol=0, atol=2e-6 * np.abs(one.adjacency).max())


def test_prompts_of_different_lengths_in_one_call():
    """A list of prompts is padded on the right to the longest and runs as one batch; each graph is the prompt's
    own (its positions only) and equals the prompt attributed alone."""
    model, tok, tc, g = graph_of("llama_clt_relu_skip")
    spec = case("llama_clt_relu_skip")[0]
    short = list(reversed(spec["prompt_ids_given"]))[:-3]
    graphs = attribute(model, [short, spec["prompt_ids_given"]], tc, tokenizer=tok,
                       batch_size=spec["settings"]["batch_size"])
    alone = attribute(model, short, tc, tokenizer=tok, batch_size=spec["settings"]["batch_size"])
    assert graphs[0].n_pos == alone.n_pos < graphs[1].n_pos
    for a, b in ((graphs[0], alone), (graphs[1], g)):
        np.testing.assert_array_equal(a.input_tokens, b.input_tokens)
        np.testing.assert_array_equal(a.active_features, b.active_features)
        np.testing.assert_array_equal(a.logit_token_ids, b.logit_token_ids)
        np.testing.assert_allclose(a.logit_probabilities, b.logit_probabilities, rtol=1e-5, atol=1e-7)
        assert a.adjacency.shape == b.adjacency.shape
        np.testing.assert_allclose(a.adjacency, b.adjacency, rtol=0, atol=1e-6 * np.abs(b.adjacency).max())


@pytest.mark.parametrize("name", ["llama_clt_relu_skip", "llama_plt_relu_maxnodes"])
def test_top_edges_per_row(name, tmp_path):
    """``edges_per_row``: with room for every nonzero the sparse graph is the dense one (its entries, pruning,
    scores, JSON, files); with fewer, each row keeps exactly its largest edges of the dense row, with the dense
    row's full sum of magnitudes."""
    from jstd.circuits.graph import SparseAdjacency

    spec, _, _ = case(name)
    model, tok, tc, g = graph_of(name)
    s = spec["settings"]
    kw = dict(targets=None, max_n_logits=s["max_n_logits"], desired_logit_prob=s["desired_logit_prob"],
              max_feature_nodes=s["max_feature_nodes"], batch_size=s["batch_size"],
              update_interval=s["update_interval"], tokenizer=tok)
    dense = g.adjacency
    scale = np.abs(dense).max()
    every = attribute(model, spec["prompt_ids_given"], tc, edges_per_row=dense.shape[1], **kw)
    A = every.adjacency
    assert isinstance(A, SparseAdjacency)
    np.testing.assert_array_equal(every.selected_features, g.selected_features)
    np.testing.assert_allclose(A.toarray(), dense, rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(A.row_abs_sums, np.abs(dense).sum(1), rtol=1e-5, atol=1e-6 * scale)
    want, got = prune(g, s["node_threshold"], s["edge_threshold"]), prune(every, s["node_threshold"],
                                                                          s["edge_threshold"])
    np.testing.assert_array_equal(got.node_mask, want.node_mask)
    np.testing.assert_array_equal(got.edge_mask.toarray(), want.edge_mask)
    np.testing.assert_allclose(got.cumulative_scores, want.cumulative_scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(graph_scores(every), graph_scores(g), rtol=1e-5)
    mine, ref = (frontend_json(x, "s", node_threshold=s["node_threshold"], edge_threshold=s["edge_threshold"])
                 for x in (every, g))
    assert [n["node_id"] for n in mine["nodes"]] == [n["node_id"] for n in ref["nodes"]]
    assert [(e["source"], e["target"]) for e in mine["links"]] == [(e["source"], e["target"]) for e in ref["links"]]
    loaded = Graph.load(every.save(tmp_path / "g")).adjacency
    np.testing.assert_array_equal(loaded.toarray(), A.toarray())
    np.testing.assert_array_equal(loaded.row_abs_sums, A.row_abs_sums)

    few_graph = attribute(model, spec["prompt_ids_given"], tc, edges_per_row=3, **kw)
    few = few_graph.adjacency
    assert few.nnz <= 3 * few.shape[0] and few.nnz < np.count_nonzero(dense)
    assert prune(few_graph).node_mask[-g.n_logits:].all()
    if not np.array_equal(few_graph.selected_features, g.selected_features):
        # with max_feature_nodes the visiting order ranks influence through the kept edges: other features may win
        assert s["max_feature_nodes"] is not None and few_graph.n_features == g.n_features
        return
    np.testing.assert_allclose(few.row_abs_sums, A.row_abs_sums, rtol=1e-6)
    for t in range(dense.shape[0]):
        kept = few.indices[few.indptr[t]:few.indptr[t + 1]]
        np.testing.assert_allclose(few.data[few.indptr[t]:few.indptr[t + 1]], dense[t, kept], atol=1e-6 * scale)
        third = np.sort(np.abs(dense[t]))[::-1][min(2, dense.shape[1] - 1)]
        assert len(kept) == min(3, np.count_nonzero(dense[t]))
        assert (np.abs(dense[t, kept]) >= third - 1e-6 * scale).all()
