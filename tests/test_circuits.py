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
    np.testing.assert_allclose(got.cumulative_scores, want["cumulative_scores"], rtol=1e-5, atol=1e-6)
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
