"""The interventions toolkit, each tool against a direct computation with jstd.run and the core edits."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from jstd.interventions.patching import bytes_per_run, chunk_size_for
from jstd.interventions.reading import read as jitted_run

ASSET = Path(jstd.__file__).parent / "assets" / "tiny-llama"
SEQ = 7


def read(model, tokens, edits=(), *, reads=(), attention_mask=None):
    """jax.jit(jstd.run) (the toolkit's own jitted run, so the two share compiles)."""
    return jitted_run(model, tokens, reads, edits, attention_mask)



@pytest.fixture(scope="module")
def model():
    return jstd.load(ASSET)


@pytest.fixture(scope="module")
def tokenizer():
    return jstd.load_processor(ASSET)


@pytest.fixture(scope="module")
def pair(model):
    rng = np.random.default_rng(1)
    clean = rng.integers(3, model.config.vocab_size, (2, SEQ))
    corrupt = clean.copy()
    corrupt[:, 2] = rng.integers(3, model.config.vocab_size, 2)
    return clean, corrupt


def close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


def mask_along(shape, axis, index):
    m = np.zeros(shape[axis], bool)
    m[index] = True
    return m.reshape([-1 if i == axis else 1 for i in range(len(shape))])


# ---- positions, heads and ablation ------------------------------------------------------


def test_positions_and_heads_equal_an_explicit_where_mask(model, pair):
    tokens = pair[0]
    site = "layers.self_attn.attention_head_outputs"  # [batch, seq, heads, head_dim]
    value = jnp.full((2, SEQ, 4, 16), 0.5)
    where = jnp.asarray(mask_along((2, SEQ, 4, 16), 1, [1, 5]) & mask_along((2, SEQ, 4, 16), 2, [3]))
    want = read(model, tokens, [jstd.Set(site, value, layer=2, where=where)]).logits
    got = read(model, tokens, [jstd.Set(site, value, layer=2, positions=[1, -2], heads=3)]).logits
    np.testing.assert_array_equal(got, want)
    keys = "layers.self_attn.attention_keys"  # [batch, kv_heads, seq, dim]: heads index kv heads
    where = jnp.asarray(mask_along((2, 2, SEQ, 16), 2, 4) & mask_along((2, 2, SEQ, 16), 1, 1))
    np.testing.assert_array_equal(read(model, tokens, [jstd.zero_ablation(keys, layer=1, positions=4, heads=1)]).logits,
                                  read(model, tokens, [jstd.Zero(keys, layer=1, where=where)]).logits)
    with pytest.raises(jstd.SiteError, match="no head axis"):
        jstd.Set("layers.layer_output", 0.0, heads=1)
    with pytest.raises(jstd.SiteError, match="no position axis"):
        jstd.zero_ablation("layers.linear_attn.state_input", positions=1)


def test_mean_ablation_excludes_position_zero_and_padding(model, pair):
    tokens = pair[0]
    site = "layers.mlp.mlp_output"
    values = read(model, tokens, reads=(site,))[site]  # [layers, batch, seq, hidden]
    close(jstd.site_mean(model, site, tokens, layer=2)[0, 0], values[2][:, 1:].mean((0, 1)))
    close(jstd.site_mean(model, site, tokens, layer=2, exclude_first=False)[0, 0], values[2].mean((0, 1)))
    close(jstd.site_mean(model, site, tokens)[:, 0, 0], values[:, :, 1:].mean((1, 2)))
    close(jstd.site_mean(model, site, tokens, layer=2, per_position=True)[0], values[2].mean(0))
    # left padding: row 1 has two pads; its first real token (position 2) is excluded, as are the pads
    mask = np.ones((2, SEQ), int)
    mask[1, :2] = 0
    padded = read(model, tokens, reads=(site,), attention_mask=mask)[site][2]
    counted = np.concatenate([padded[0, 1:], padded[1, 3:]])
    close(jstd.site_mean(model, site, tokens, layer=2, attention_mask=mask)[0, 0], counted.mean(0))

    # the edit puts the mean at the chosen positions of block 2 and nothing else there
    edit = jstd.mean_ablation(model, site, tokens, layer=2, positions=[3, 4])
    got = read(model, pair[1], [edit], reads=(site,))[site]
    base = read(model, pair[1], reads=(site,))[site]
    close(got[2][:, 3:5], np.broadcast_to(values[2][:, 1:].mean((0, 1)), (2, 2, 64)))
    np.testing.assert_array_equal(got[2][:, :3], base[2][:, :3])
    np.testing.assert_array_equal(got[:2], base[:2])


def test_resample_ablation_takes_shuffled_source_rows(model, pair):
    clean, corrupt = pair
    site = "layers.layer_mid"
    key = jax.random.key(3)
    source = read(model, clean, reads=(site,))[site][1]
    perm = np.asarray(jax.random.permutation(key, 2))
    edit = jstd.resample_ablation(model, site, clean, layer=1, positions=-1, key=key)
    got = read(model, corrupt, [edit], reads=(site,))[site][1]
    np.testing.assert_array_equal(got[:, -1], source[perm, -1])
    np.testing.assert_array_equal(got[:, :-1], read(model, corrupt, reads=(site,))[site][1][:, :-1])


# ---- patching ---------------------------------------------------------------------


def test_sweep_entries_equal_single_patched_runs(model, pair):
    clean, corrupt = pair
    metric = jstd.logit_difference(5, 9)
    site = "layers.layer_output"
    grid = jstd.patch_sweep(model, clean, corrupt, site, metric, chunk_size=5, progress=False)
    assert grid.shape == (4, SEQ)
    for layer, pos in [(0, 0), (1, 2), (3, SEQ - 1)]:
        edit = jstd.Set(site, read(model, clean, reads=(site,))[site][layer], layer=layer,
                        where=jnp.asarray(mask_along((2, SEQ, 64), 1, pos)))
        direct = metric(read(model, corrupt, [edit]).logits)
        close(grid[layer, pos], direct, 1e-4)
        close(jstd.patch(model, clean, corrupt, site, layer=layer, positions=pos, metric=metric), direct, 1e-4)
    # a patch before the changed token (position 2) changes nothing
    base = metric(read(model, corrupt).logits)
    close(grid[:, :2], np.full((4, 2), base), 1e-4)
    # the whole last block patched is the clean run
    close(jstd.patch(model, clean, corrupt, "layers.-1.layer_output", metric=metric), metric(read(model, clean).logits), 1e-4)


def test_head_sweep_compiles_once_and_matches(model, pair):
    clean, corrupt = pair
    traces = []

    def metric(logits):  # a plain function metric: counted once per trace
        traces.append(1)
        return jax.nn.log_softmax(logits[:, -1])[:, 7].mean()

    site = "layers.self_attn.attention_head_outputs"
    grid = jstd.patch_sweep(model, clean, corrupt, site, metric, layers=[1, 3], positions=[2, 6], chunk_size=3,
                            progress=False)
    # 8 entries, 3 chunks, one trace (which traces the metric twice: the segments', and the corrupted run's own)
    assert grid.shape == (2, 2, 4) and len(traces) == 2
    one = jstd.patch(model, clean, corrupt, site, layer=3, positions=2, heads=1, metric=metric)
    close(grid[1, 0, 1], one, 1e-4)
    together = jstd.patch_sweep(model, clean, corrupt, site, metric, layers=[3], positions=[2], heads=False, progress=False)
    close(together[0, 0], jstd.patch(model, clean, corrupt, site, layer=3, positions=2, metric=metric), 1e-4)


def test_a_cold_residual_sweep_compiles_two_programs(model):
    """A resumed sweep compiles one run over the clean and corrupted prompts side by side (the clean run's values,
    the corrupted run's caches) and the chunk, nothing else (host data goes to the device through ``device_put``,
    which compiles nothing: ``jnp.asarray`` of numpy compiled a program for each new shape and dtype, seven more
    here)."""
    rng = np.random.default_rng(3)
    clean = rng.integers(3, model.config.vocab_size, (1, 13))  # a shape no other test compiles
    corrupt = clean.copy()
    corrupt[0, 4] = 5
    compiles = []
    listener = lambda event, secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jstd.patch_sweep(model, clean, corrupt, "layers.layer_output", jstd.logit_difference(5, 9), progress=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 2, compiles


def test_chunks_fit_the_memory_budget(model):
    per = bytes_per_run(model, 2, SEQ)
    for budget in (1, per * 3 + 1, per * 100):
        size = chunk_size_for(model, 2, SEQ, 28, budget)
        assert size == 1 or size * per <= budget
    assert chunk_size_for(model, 2, SEQ, 28, per * 10) == 10  # 28 entries in 3 chunks of 10, 10, 8


def test_metrics(model, pair):
    logits = read(model, pair[0]).logits
    close(jstd.logit_difference(5, 9)(logits), (logits[:, -1, 5] - logits[:, -1, 9]).mean())
    close(jstd.logit_difference(jnp.array([1, 2]), 3, position=4)(logits), (logits[jnp.arange(2), 4, jnp.array([1, 2])] - logits[:, 4, 3]).mean())
    close(jstd.target_probability(5)(logits), jax.nn.softmax(logits[:, -1])[:, 5].mean())
    other = read(model, pair[1]).logits
    p, q = jax.nn.log_softmax(other[:, -1]), jax.nn.log_softmax(logits[:, -1])
    close(jstd.kl_divergence(other)(logits), (jnp.exp(p) * (p - q)).sum(-1).mean())
    assert abs(float(jstd.kl_divergence(logits)(logits))) < 1e-6


# ---- steering -----------------------------------------------------------------------


def test_steer_equals_the_explicit_add(model, pair):
    tokens = pair[0]
    v = jnp.linspace(-1, 1, 64)
    want = read(model, tokens, [jstd.Add("layers.layer_output", 3.0 * v, layer=1),
                                jstd.Add("layers.layer_output", 3.0 * v, layer=2)]).logits
    np.testing.assert_array_equal(read(model, tokens, jstd.steer([1, 2], v, factor=3.0)).logits, want)
    where = jnp.asarray(mask_along((2, SEQ, 64), 1, [4, 6]))
    want = read(model, tokens, [jstd.Add("layers.mlp.mlp_output", v, layer=0, where=where)]).logits
    got = read(model, tokens, jstd.steer(0, v, positions=[4, 6], site="layers.mlp.mlp_output")).logits
    np.testing.assert_array_equal(got, want)


def test_contrastive_vector_is_the_mean_difference_without_position_zero(model, pair):
    pos, neg = pair[0], pair[1][:, :5]  # batches of different lengths
    site = "layers.layer_output"
    a, b = read(model, pos, reads=(site,))[site], read(model, neg, reads=(site,))[site]
    close(jstd.contrastive_vector(model, pos, neg, 2), a[2][:, 1:].mean((0, 1)) - b[2][:, 1:].mean((0, 1)))
    close(jstd.contrastive_vector(model, pos, neg), a[:, :, 1:].mean((1, 2)) - b[:, :, 1:].mean((1, 2)))


def test_optimize_a_steering_vector_and_gradients_match_finite_differences(model, pair):
    tokens = pair[0]

    def loss(v, model, tokens):
        out = jstd.run(model, tokens, jstd.steer(1, v, positions=-1))
        return -jax.nn.log_softmax(out.logits[:, -1])[:, 5].mean()

    v0 = jnp.zeros(64)
    value_and_grad = jax.jit(jax.value_and_grad(loss))  # one compile for the gradient and the values
    f = lambda v: value_and_grad(v, model, tokens)[0]
    g = value_and_grad(v0, model, tokens)[1]
    eps = 1e-2
    for i in (0, 17, 63):
        e = jnp.zeros(64).at[i].set(eps)
        fd = (f(v0 + e) - f(v0 - e)) / (2 * eps)
        np.testing.assert_allclose(g[i], fd, rtol=2e-2, atol=2e-3)
    v, losses = jstd.optimize(loss, v0, args=(model, tokens), steps=15, learning_rate=0.1)
    assert losses.shape == (15,) and float(losses[-1]) < float(losses[0])
    close(losses[0], f(v0), 1e-4)
    assert float(f(v)) < float(losses[0])


# ---- lens and readout ------------------------------------------------------------------


def test_logit_lens(model, pair):
    tokens = pair[0]
    lens = jstd.logit_lens(model, tokens)
    out = read(model, tokens, reads=("layers.layer_output",))
    assert lens.shape == (4, 2, SEQ, model.config.vocab_size)
    np.testing.assert_array_equal(lens[-1], out.logits)  # exact at the last block
    close(lens[1], jstd.project_on_vocab(model, out["layers.layer_output"][1]))
    np.testing.assert_array_equal(jstd.logit_lens(model, tokens, positions=[-1, 0]), lens[:, :, [SEQ - 1, 0]])
    mid = jstd.logit_lens(model, tokens, site="layers.layer_mid", positions=-1)
    assert mid.shape == (4, 2, 1, model.config.vocab_size)
    with pytest.raises(jstd.SiteError, match="residual-stream"):
        jstd.logit_lens(model, tokens, site="layers.self_attn.attention_queries")


def test_first_tokens_top_k_next_token_probs(model, tokenizer, pair):
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    assert jstd.get_first_tokens("Paris", tokenizer) == [enc("Paris")[0], enc(" Paris")[0]]
    assert jstd.get_first_tokens(["Paris", "Paris"], tokenizer) == jstd.get_first_tokens("Paris", tokenizer)

    class PrefixSpace:  # a tokenizer that adds a prefix space itself: "word" and " word" collide
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": enc(text if text.startswith((" ", "🍐")) else " " + text)}

    assert jstd.get_first_tokens("Paris", PrefixSpace()) == [enc("🍐Paris")[len(enc("🍐"))], enc(" Paris")[0]]

    tokens = pair[0]
    probs = jstd.next_token_probs(model, tokens)
    close(probs, jax.nn.softmax(read(model, tokens).logits[:, -1].astype(jnp.float32)), 1e-6)
    padded = np.concatenate([np.zeros((2, 2), int), tokens], 1)
    mask = np.concatenate([np.zeros((2, 2), int), np.ones_like(tokens)], 1)
    close(jstd.next_token_probs(model, padded, attention_mask=mask), probs, 1e-5)
    top = jstd.top_k(read(model, tokens).logits[:, -1], 3, tokenizer)
    logits = np.asarray(read(model, tokens).logits[:, -1])
    np.testing.assert_array_equal(top.ids, np.argsort(-logits, -1)[:, :3])
    assert top.tokens[1][0] == tokenizer.decode([int(top.ids[1, 0])])


# ---- attribution ----------------------------------------------------------------------------


def test_direct_logit_attribution(model, pair):
    tokens = pair[0]
    target, other = jnp.array([5, 11]), 9
    dla = jstd.direct_logit_attribution(model, tokens, target, other)
    logits = read(model, tokens).logits[:, -1]
    want = logits[jnp.arange(2), target] - logits[:, other]
    close(dla.logit, want)
    close(dla.total(), want, 1e-4)  # the parts sum to the logit difference
    close(dla.heads.sum(-1), dla.attention, 1e-4)  # the heads sum to the attention (no o_proj bias here)
    # block 2's MLP by hand: through the final norm's weight and frozen scale, then the tied head
    out = read(model, tokens, reads=("layers.layer_output", "layers.mlp.mlp_output"))
    x = out["layers.layer_output"][-1, :, -1]
    s = 1 / jnp.sqrt((x * x).mean(-1, keepdims=True) + model.final_norm.eps)
    part = out["layers.mlp.mlp_output"][2, :, -1] * model.final_norm.weight * s @ model.embed.T
    close(dla.mlp[2], part[jnp.arange(2), target] - part[:, other], 1e-4)
    alone = jstd.direct_logit_attribution(model, tokens, 5, heads=False, position=3)
    assert alone.heads is None
    assert dla.experts is None and dla.shared_expert is None  # a dense model: no per-expert split
    with pytest.raises(NotImplementedError, match="needs a mixture-of-experts MLP"):
        jstd.direct_logit_attribution(model, tokens, 5, experts=True)
    close(alone.total(), read(model, tokens).logits[:, 3, 5], 1e-4)


def test_attribution_patching_is_gradient_times_difference(model, pair):
    clean, corrupt = pair
    metric = jstd.logit_difference(5, 9)
    sites = ("layers.layer_output", "layers.self_attn.attention_head_outputs")
    est = jstd.attribution_patching(model, clean, corrupt, sites, metric)
    assert est[sites[0]].shape == (4, SEQ) and est[sites[1]].shape == (4, SEQ, 4)
    assert est["layers.layer_output"][:, :2].max() == 0  # clean and corrupt agree before position 2
    for site, (layer, pos, *head) in ((sites[1], (2, 5, 3)),):
        clean_v = read(model, clean, reads=(site,))[site][layer]
        corrupt_v = read(model, corrupt, reads=(site,))[site][layer]

        def patched(t):  # the metric with the entry moved a fraction t of the way to its clean value
            value = corrupt_v + t * (clean_v - corrupt_v)
            return metric(jstd.run(model, corrupt, [jstd.Set(site, value, layer=layer, positions=pos,
                                                                heads=head[0] if head else None)]).logits)

        _, slope = jax.jit(lambda t: jax.jvp(patched, (t,), (jnp.ones(()),)))(jnp.zeros(()))
        entry = est[site][layer, pos] if not head else est[site][layer, pos, head[0]]
        close(entry, slope, 1e-4)


# ---- resumed sweeps -----------------------------------------------------------------


@pytest.mark.parametrize("site,heads", [
    ("layers.layer_input", None), ("layers.layer_mid", None), ("layers.self_attn.attention_keys", None),
    ("layers.self_attn.attention_queries", None), ("layers.mlp.mlp_neurons", None),
])
def test_resumed_sweeps_equal_recomputed_sweeps(model, pair, site, heads, monkeypatch):
    """The resumed sweep against the sweep that recomputes every block and position, unpadded and left-padded."""
    from jstd.interventions import patching

    clean, corrupt = pair
    mask = np.ones_like(clean)
    mask[1, :2] = 0  # row 1 is left-padded: its prompt starts at position 2
    # reads every position where both rows are real (values at padding are unspecified)
    every_position = lambda logits: jax.nn.log_softmax(logits[:, 2:], -1)[:, :, 7].mean(0)
    # two of the four (metric, padding) pairs per site: every pair and every site is still covered
    for metric, attention_mask in ((jstd.target_probability(11), None), (every_position, mask)):
        sweep = lambda: jstd.patch_sweep(model, clean, corrupt, site, metric, positions=[0, 2, 3, 6],
                                         attention_mask=attention_mask, progress=False)
        resumed = sweep()
        with monkeypatch.context() as m:
            m.setattr(patching, "resumable", lambda site: False)
            recomputed = sweep()
        assert resumed.shape == recomputed.shape
        close(resumed, recomputed, 1e-4)


def test_a_sweep_runs_only_what_can_change_the_metric(model, pair, monkeypatch):
    """Entries at positions the prompts share (before position 2) and after the metric's position (4) are the
    corrupted run's metric and get no tokens; the rest are the patched runs', suffixes ending at position 4."""
    from jstd.interventions import resume

    clean, corrupt = pair
    metric = jstd.logit_difference(5, 9, position=4)
    packed = []
    pack = resume.pack
    monkeypatch.setattr(resume, "pack", lambda *a, **k: packed.append(pack(*a, **k)) or packed[-1])
    site = "layers.layer_output"
    grid = jstd.patch_sweep(model, clean, corrupt, site, metric, layers=[0, 2], progress=False)
    rows = packed[0]
    live = rows.entries >= 0  # the rows hold the entries that can change the metric, nothing else
    assert rows.positions.shape == (2, 4) and np.sort(rows.starts[live]).tolist() == [2, 3, 4]
    base = metric(read(model, corrupt).logits)
    close(grid[:, [0, 1, 5, 6]], np.full((2, 4), base), 1e-4)
    for i, layer in enumerate([0, 2]):
        for pos in (2, 3, 4):
            close(grid[i, pos], jstd.patch(model, clean, corrupt, site, layer=layer, positions=pos, metric=metric), 1e-4)


def test_hybrid_sweep_resumes_states(tmp_path_factory, monkeypatch):
    from olmo_hybrid_cases import SHORT_TAIL, config, make_checkpoint

    hybrid = jstd.load(make_checkpoint(config("tail", **SHORT_TAIL), tmp_path_factory.mktemp("hybrid")))
    rng = np.random.default_rng(3)
    clean = rng.integers(0, hybrid.config.vocab_size, (1, SEQ))
    corrupt = clean.copy()
    corrupt[0, 1] = (clean[0, 1] + 1) % hybrid.config.vocab_size
    metric = jstd.logit_difference(3, 4)
    for site in ("layers.layer_output", "layers.linear_attn.attention_values"):  # a block boundary, a DeltaNet interior
        grid = jstd.patch_sweep(hybrid, clean, corrupt, site, metric, heads=False, progress=False)
        blocks = hybrid.blocks_for(site)
        for i, layer in enumerate(blocks):
            for pos in (0, 1, 4, SEQ - 1):
                close(grid[i, pos], jstd.patch(hybrid, clean, corrupt, site, layer=layer, positions=pos, metric=metric),
                      1e-4)
    # the corrupted run's states at every position past the memory budget: each patched run computed whole
    from jstd.interventions import patching
    from jstd.interventions.resume import corrupted_run_bytes

    need = corrupted_run_bytes(hybrid, corrupt, site)
    with monkeypatch.context() as m:
        m.setattr(patching, "resumed_sweep", lambda *a, **k: pytest.fail("resumed past the memory budget"))
        whole = jstd.patch_sweep(hybrid, clean, corrupt, site, metric, heads=False, positions=[0, 4],
                                 memory_budget=need - 1, progress=False)
    close(whole, grid[:, [0, 4]], 1e-4)
    # a left-padded batch: states and convolutions start from the padded run's
    clean2, corrupt2 = np.concatenate([clean, clean]), np.concatenate([corrupt, corrupt])
    mask = np.ones_like(clean2)
    clean2[1, 2:], corrupt2[1, 2:], mask[1, :2] = clean[0, :-2], corrupt[0, :-2], 0
    site = "layers.linear_attn.attention_values"
    grid = jstd.patch_sweep(hybrid, clean2, corrupt2, site, metric, positions=[2, 3, 6], heads=False,
                            attention_mask=mask, progress=False)
    blocks = hybrid.blocks_for(site)
    for i, layer in [(0, blocks[0]), (len(blocks) - 1, blocks[-1])]:
        for j, pos in enumerate([2, 3, 6]):
            close(grid[i, j], jstd.patch(hybrid, clean2, corrupt2, site, layer=layer, positions=pos, metric=metric,
                                         attention_mask=mask), 1e-4)


def test_chunks_are_fitted_by_the_compiled_working_memory():
    import equinox as eqx

    from jstd.interventions.chunking import fit, working_memory

    sort_rows = eqx.filter_jit(lambda x: jnp.sort(x * 2.0, axis=-1).sum(-1))
    lower = lambda n: sort_rows.lower(jnp.ones((n, 20000)))
    one = working_memory(lower(1).compile())
    budget = 10 * one
    size, compiled = fit(lower, 100, 100, budget)
    assert 1 < size < 100 and working_memory(compiled) <= budget
    assert fit(lower, 100, 100, budget, size=7)[0] == 7
    with pytest.warns(UserWarning, match="more than the memory_budget"):
        assert fit(lower, 100, 100, one // 2)[0] == 1
