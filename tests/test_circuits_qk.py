"""QK attributions and head loadings (jstd.circuits.qk) on the induction model (Llama: rotary, 4 heads) with a random
cross-layer transcoder: the terms sum to the forward's own score, each source's query/key vector and the bias
equal forward-mode derivatives of the local replacement model, and head loadings sum to the graph's edge."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from jstd import cli
from jstd.circuits import frontend_json
from jstd.circuits.qk import QUERIES, KEYS, _replacement, graph_json_extras, head_loadings, qk_attribution
from jstd.circuits.train import init_clt


@pytest.fixture(scope="module")
def case():
    model = jstd.load(cli.INDUCTION)
    c = model.config
    tc = init_clt(jax.random.key(3), c.num_layers, c.hidden_size, 16)
    rng = np.random.default_rng(0)
    tc = jax.tree.map(lambda a: a * 8.0, tc)  # features that fire at the model's scale
    import equinox as eqx
    tc = eqx.tree_at(lambda t: t.b_dec, tc, jnp.asarray(rng.normal(size=tc.b_dec.shape) * 0.1, jnp.float32))
    tok = jstd.load_processor(cli.INDUCTION)
    words = cli.word_ids(tok, c.vocab_size)
    prompt = cli.repeated_tokens(rng, 1, 4, words)[0]  # 9 tokens
    graph = jstd.attribute(model, prompt, tc, tokenizer=tok)
    assert graph.n_pos == len(prompt)
    assert graph.n_features > 10
    return model, tc, graph


def test_terms_sum_to_the_forward_score(case):
    model, tc, graph = case
    scores = jstd.run(model, jnp.asarray(graph.input_tokens[None], jnp.int32),
                      reads=("layers.self_attn.attention_scores",))["layers.self_attn.attention_scores"]
    for layer, head, qp, kp in [(1, 2, 8, 5), (0, 1, 6, 2), (1, 0, 7, 7)]:
        qk = qk_attribution(model, graph, tc, layer=layer, head=head, query_pos=qp, key_pos=kp)
        want = float(scores[layer, 0, head, qp, kp])
        S = graph.logit_start
        assert qk.terms.shape == (S + 1, S + 1)
        assert abs(float(qk.terms.astype(np.float64).sum()) - want) <= 1e-5 * max(abs(want), 1.0)
        assert abs(qk.score - want) <= 1e-5 * max(abs(want), 1.0)
        # block 0's query reads only the tokens (and constants): no feature or error reaches it
        if layer == 0:
            assert np.abs(qk.query_vectors[:graph.token_start]).max() == 0


def test_source_vectors_and_bias_are_forward_mode_derivatives(case):
    """Each q_s is the forward-mode derivative (jvp) of the query along source s's vectors; the bias is the jvp
    along the constants (every block's b_dec at positions >= 1, the BOS position's MLP output), as Llama has no
    attention bias."""
    model, tc, graph = case
    layer, head, qp, kp = 1, 3, 8, 4
    qk = qk_attribution(model, graph, tc, layer=layer, head=head, query_pos=qp, key_pos=kp)
    L, n, d = tc.num_layers, graph.n_pos, tc.d_out
    tokens = jnp.asarray(graph.input_tokens[None], jnp.int32)
    f = _replacement(model, tokens, tc, (QUERIES, KEYS))
    zeros = (jnp.zeros((L, 1, n, d)), jnp.zeros((1, n, d)))

    def along(d_y, d_e):
        _, (tq, tk) = jax.jvp(f, (zeros,), ((jnp.asarray(d_y, jnp.float32), jnp.asarray(d_e, jnp.float32)),))
        return np.asarray(tq[layer, 0, head, qp]), np.asarray(tk[layer, 0, head, kp])

    active = graph.active_features[graph.selected_features]
    values = graph.activation_values[graph.selected_features]
    rng = np.random.default_rng(1)
    for i in rng.choice(graph.n_features, 4, replace=False):
        l, p, feat = active[i]
        d_y = np.zeros((L, 1, n, d), np.float32)
        for k in range(L - l):
            d_y[l + k, 0, p] = values[i] * np.asarray(tc.W_dec[l][feat, k])
        tq, tk = along(d_y, np.zeros((1, n, d)))
        np.testing.assert_allclose(qk.query_vectors[i], tq, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(qk.key_vectors[i], tk, rtol=1e-4, atol=1e-5)
    tokens_x = jstd.run(model, tokens, reads=(tc.input_site, tc.output_site))
    y0 = np.asarray(tokens_x[tc.output_site][:, 0, 0])  # the BOS position's MLP output (no skip)
    const = np.zeros((L, 1, n, d), np.float32)
    const[:, 0, 1:] = np.asarray(tc.b_dec)[:, None]
    const[:, 0, 0] = y0
    bq, bk = along(const, np.zeros((1, n, d)))
    np.testing.assert_allclose(qk.query_vectors[-1], bq, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(qk.key_vectors[-1], bk, rtol=1e-4, atol=2e-5)
    assert np.abs(bq).max() > 1e-3  # the bias is there (b_dec is not zero)


def crossing_edge(graph):
    """The largest edge from a block-0 feature to a block-1 feature at a later position: every path crosses block
    1's attention."""
    active, A = graph.active_features[graph.selected_features], graph.adjacency
    pairs = [(t, s) for t in range(graph.n_features) for s in range(graph.n_features)
             if active[t, 0] == 1 and active[s, 0] == 0 and active[s, 1] < active[t, 1] and abs(A[t, s]) > 1e-3]
    return max(pairs, key=lambda ts: abs(A[ts]))


def json_feature_link(graph, data):
    """A link of the frontend JSON ``data`` between two features, and its ``(target, source)`` graph nodes."""
    kinds = {n["node_id"]: n for n in data["nodes"]}
    link = next(e for e in data["links"] if kinds[e["source"]]["feature_type"] == kinds[e["target"]]["feature_type"]
                == "cross layer transcoder")
    node = lambda n: graph.feature_node(int(n["layer"]), n["ctx_idx"], int(n["node_id"].split("_")[1]))
    return link, node(kinds[link["target"]]), node(kinds[link["source"]])


def test_head_loadings_sum_to_the_edge(case):
    model, tc, graph = case
    active = graph.active_features[graph.selected_features]
    A = graph.adjacency
    t, s = crossing_edge(graph)
    loads = head_loadings(model, graph, tc, t, s)
    assert loads.shape == (2, 4)
    assert np.abs(loads[0]).max() < 1e-6 * abs(A[t, s])  # block 0's attention comes before the source writes
    assert abs(loads[1].sum() - A[t, s]) <= 1e-4 * abs(A[t, s])
    # a token source at the target's own position: the residual path skips block 1's attention
    p = int(active[t, 1])
    tok = graph.token_start + p
    loads_tok = head_loadings(model, graph, tc, t, tok)
    assert abs(loads_tok[1].sum() - A[t, tok]) > 1e-6
    with pytest.raises(ValueError, match="not a feature node"):
        head_loadings(model, graph, tc, graph.token_start, s)

    data = frontend_json(graph, "qk-test", node_threshold=1.0, edge_threshold=1.0, scan="local/random-clt")
    link, t2, s2 = json_feature_link(graph, data)
    loads2 = head_loadings(model, graph, tc, t2, s2)
    qk = qk_attribution(model, graph, tc, layer=1, head=2, query_pos=8, key_pos=5)
    data = graph_json_extras(data, graph, [qk], {(t2, s2): loads2, (t, s): loads}, top=5)
    assert len(data["qk"]) == 1 and len(data["qk"][0]["terms"]) == 5
    (qs, ks, v), = qk.top(1)
    assert data["qk"][0]["terms"][0]["value"] == v and data["qk"][0]["score"] == qk.score
    assert [e["head_loadings"] for e in data["links"] if "head_loadings" in e] == [loads2.tolist()]
    assert link["head_loadings"] == loads2.tolist()


def test_bad_requests_are_named(case):
    model, tc, graph = case
    with pytest.raises(ValueError, match="causal"):
        qk_attribution(model, graph, tc, layer=1, head=0, query_pos=3, key_pos=5)
    with pytest.raises(ValueError, match="outside the model"):
        qk_attribution(model, graph, tc, layer=2, head=0, query_pos=3, key_pos=1)


def test_aggregate_edges_over_prompts(case):
    """Edges summed by position-free node keys in each graph, then averaged over graphs: against a loop over every
    entry of both adjacency matrices."""
    from jstd.circuits.sweep import aggregate_edges, node_keys

    model, tc, graph = case
    other = jstd.attribute(model, graph.input_tokens[::-1].copy()[np.r_[-1, :len(graph.input_tokens) - 1]], tc)
    table = aggregate_edges([graph, other])
    want: dict = {}
    present: dict = {}
    for g in (graph, other):
        keys = node_keys(g)
        per: dict = {}
        for t, s in zip(*np.nonzero(g.adjacency)):
            per[(keys[t], keys[s])] = per.get((keys[t], keys[s]), 0.0) + float(g.adjacency[t, s])
        for k, v in per.items():
            want[k] = want.get(k, 0.0) + v / 2
            present[k] = present.get(k, 0) + 1
    assert len(table.mean) == len(want)
    for j in np.random.default_rng(0).choice(len(table.mean), 50, replace=False):
        k = (table.keys[table.targets[j]], table.keys[table.sources[j]])
        assert abs(table.mean[j] - want[k]) <= 1e-9 + 1e-6 * abs(want[k]) and table.count[j] == present[k]
    (t, s, v, c), = table.top(1)
    assert table.weight(t, s) == v and v == max(want.values(), key=abs)


def test_grouped_query_heads_and_a_skip(tmp_path):
    """circuit-tracer's reference case llama_clt_relu_skip (3 blocks, 4 query heads on 2 key-value heads, a CLT
    with a skip path): every head's terms sum to the forward's score; a soft-capped model is refused."""
    import json
    from pathlib import Path

    from jstd.circuits import load_transcoders

    d = Path(__file__).parent / "data" / "circuit_tracer" / "llama_clt_relu_skip"
    model, tc = jstd.load(d / "model"), load_transcoders(d / "transcoders")
    assert tc.W_skip is not None
    ids = json.loads((d / "case.json").read_text())["prompt_ids_given"]
    graph = jstd.attribute(model, ids, tc)
    n = graph.n_pos
    scores = jstd.run(model, jnp.asarray(graph.input_tokens[None], jnp.int32),
                      reads=("layers.self_attn.attention_scores",))["layers.self_attn.attention_scores"]
    for layer, head in [(2, 0), (2, 3), (1, 2)]:
        qk = qk_attribution(model, graph, tc, layer=layer, head=head, query_pos=n - 1, key_pos=n // 2)
        want = float(scores[layer, 0, head, n - 1, n // 2])
        assert abs(qk.terms.sum() - want) <= 1e-5 * max(abs(want), 1.0), (layer, head)
    gemma = Path(__file__).parent / "data" / "circuit_tracer" / "gemma2_clt_relu"
    g_model, g_tc = jstd.load(gemma / "model"), load_transcoders(gemma / "transcoders")
    g_ids = json.loads((gemma / "case.json").read_text())["prompt_ids_given"]
    with pytest.raises(ValueError, match="soft-caps"):
        qk_attribution(g_model, jstd.attribute(g_model, g_ids, g_tc), g_tc, layer=0, head=0, query_pos=2, key_pos=1)


def test_qk_in_the_graph_saved_loaded_and_in_the_json(case, tmp_path):
    """``qk_graph`` attaches QK attributions and head loadings to a graph: each head's terms sum to the forward's
    own score (rel err <= 1e-5) and so do each side's per-source totals, the loadings of a block-1 feature's edge
    from an earlier block-0 feature sum to the edge; a save / load round trip keeps them exactly; the frontend JSON
    carries them (nodes' parts, links' loadings)."""
    from jstd.circuits import Graph, qk_graph
    from jstd.circuits.qk import _node_id

    model, tc, graph = case
    A = graph.adjacency
    t, s = crossing_edge(graph)
    # and an edge the pruned JSON keeps, between two features
    plain = frontend_json(graph, "qk-graph", node_threshold=1.0, edge_threshold=1.0, scan="local/random-clt")
    _, t2, s2 = json_feature_link(graph, plain)
    asked = [(1, 2, 8, 5), (0, 1, 6, 2), (1, 3, 8, 8)]
    g = qk_graph(model, graph, tc, heads=asked, loadings=[(t, s), (t2, s2)])
    assert graph.qk is None and g.adjacency is graph.adjacency
    scores = jstd.run(model, jnp.asarray(graph.input_tokens[None], jnp.int32),
                      reads=("layers.self_attn.attention_scores",))["layers.self_attn.attention_scores"]
    for a, (layer, head, qp, kp) in zip(g.qk.attributions, asked):
        assert (a.layer, a.head, a.query_pos, a.key_pos) == (layer, head, qp, kp)
        want = float(scores[layer, 0, head, qp, kp])
        for total in (a.terms.sum(), a.query_totals.sum(), a.key_totals.sum()):
            assert abs(total - want) <= 1e-5 * max(abs(want), 1.0), (layer, head, total, want)
    loads = g.qk.loadings[t, s]
    assert loads.shape == (2, 4) and abs(loads[1].sum() - A[t, s]) <= 1e-4 * abs(A[t, s])
    again = qk_graph(model, g, tc, heads=[asked[0]])  # asked again: replaced, not duplicated
    assert len(again.qk.attributions) == 3 and set(again.qk.loadings) == {(t, s), (t2, s2)}
    with pytest.raises(ValueError, match="query_pos, key_pos"):
        qk_graph(model, graph, tc, heads=[(1, 2)])

    back = Graph.load(g.save(tmp_path / "g"))
    assert len(back.qk.attributions) == 3 and set(back.qk.loadings) == {(t, s), (t2, s2)}
    for a, b in zip(g.qk.attributions, back.qk.attributions):
        assert (a.layer, a.head, a.query_pos, a.key_pos, a.score, a.scale) == (b.layer, b.head, b.query_pos,
                                                                                b.key_pos, b.score, b.scale)
        for k in ("terms", "query_vectors", "key_vectors"):
            np.testing.assert_array_equal(getattr(a, k), getattr(b, k))
    np.testing.assert_array_equal(back.qk.loadings[t, s], loads)
    np.testing.assert_array_equal(back.adjacency, graph.adjacency)
    assert Graph.load(graph.save(tmp_path / "g")).qk is None  # saved without: the old QK files are gone

    data = frontend_json(back, "qk-graph", node_threshold=1.0, edge_threshold=1.0, scan="local/random-clt")
    assert [(q["layer"], q["head"], q["query_pos"], q["key_pos"]) for q in data["qk"]] == asked
    errors = {(n["layer"], n["ctx_idx"]): n["node_id"] for n in data["nodes"]
              if n["feature_type"] == "mlp reconstruction error"}
    index = {_node_id(back, i, errors): i for i in range(back.logit_start)}
    with_parts = [n for n in data["nodes"] if "qk" in n]
    assert with_parts
    for n in with_parts:
        for part in n["qk"]:
            a = back.qk.attributions[part["qk"]]
            i = index[n["node_id"]]
            assert part["query"] == float(a.query_totals[i]) and part["key"] == float(a.key_totals[i])
    link = [e for e in data["links"] if (e["target"], e["source"]) == (_node_id(back, t2, errors),
                                                                       _node_id(back, s2, errors))]
    assert link and link[0]["head_loadings"] == back.qk.loadings[t2, s2].tolist()
    assert sum("head_loadings" in e for e in data["links"]) == 1 + any(
        (e["target"], e["source"]) == (_node_id(back, t, errors), _node_id(back, s, errors)) for e in data["links"])
