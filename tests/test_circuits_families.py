"""The local replacement model of every block shape jstd serves, against brute force.

For each family's tiny random model and random per-layer transcoders (with a skip path), the graph's edges
(``jstd.attribute``: reverse-mode derivatives, batched and gathered) are compared with *finite differences of the
frozen model*: the model run with every held quantity replaced by its value on the prompt — norm scales, attention
probabilities and gates, DeltaNet queries / keys / decays / betas / gates, MoE routing weights, and each MLP's
output but its transcoder skip. The substitution is done by recording every ``jax.lax.stop_gradient`` of the frozen
forward (``jstd.nn.frozen`` and the transcoders' edits) on the prompt and returning the recorded values on the
perturbed runs (eagerly, in call order), so the perturbed runs really hold those values: nothing in them is a
derivative. A source's vector (a feature's activation-scaled decoder row, an error vector, a token embedding) is
added at its place (``h`` times it, in float64) and every target's input (a feature's encoder row at its block's
transcoder input, a logit's demeaned unembedding at the final norm's output) is read back:

* ``(F(h·u) - F(-h·u)) / 2h`` equals the edge ``A[t, s]`` (the direct effect);
* ``(F(8·u) - F(0)) / 8`` equals it too: the frozen model is *linear* in its sources (no nonlinearity left unheld — an
  output gate or a DeltaNet β that were not held would fail here, though derivatives alone would agree).
"""

from __future__ import annotations

import sys
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from jstd.circuits import Transcoders
from jstd.circuits.replacement import linearised, prompt_values

# one case per block shape (tests/families.py): MoE, gated DeltaNet + gated attention (Qwen3.5), DeltaNet + post-
# normed attention (OLMo-Hybrid, whose attention blocks are OLMo-2/3's: post-norms only, whole-projection q/k norms),
# post-norms and multipliers (HyperCLOVA X, Gemma 2 with its soft-caps, Gemma 3), parallel blocks (GPT-NeoX's two
# norms, GPT-J's and Phi's one), attention sinks and a biased router (gpt-oss)
FAMILIES = ("qwen3_moe", "qwen3_5_text-released", "olmo_hybrid-rotary_grouped", "hyperclovax-residual",
            "gemma2-softcap", "gemma3_text-local", "gpt_neox-parallel", "gptj-6b", "phi-2", "gpt_oss")
N_TOKENS = 6
FAR = 8.0  # the linearity check's step: far outside any local linear regime of a nonlinearity left unheld
H = 0.1  # the frozen model is affine, so the step only bounds rounding (jstd computes norms in float32)


class Held:
    """``jax.lax.stop_gradient`` replaced: while ``recording``, the identity that keeps each value (traced, returned
    by the recording program); then each call returns the value kept at the same place in the call order (the
    frozen model's held quantities, inputs of the replaying program)."""

    def __init__(self):
        self.values, self.recording, self.at = [], True, 0

    def __call__(self, x):
        if self.recording:
            self.values.append(x)
            return x
        held = self.values[self.at]
        self.at += 1
        assert jax.tree.structure(held) == jax.tree.structure(x)
        for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(x)):
            assert a.shape == b.shape, (a.shape, b.shape)
        return held


def held_forward(f, zeros, deltas, monkeypatch):
    """``f(deltas)`` with every ``stop_gradient`` of ``f`` returning its value at ``f(zeros)``: two programs, one
    that records the held values and one that replays them (the model must run unrolled: no held value inside a
    ``lax.scan``)."""
    held = Held()
    with monkeypatch.context() as m:
        m.setattr(jax.lax, "stop_gradient", held)
        runner = sys.modules["jstd.run"]  # its cached inner jit traced inline, so the held values reach the outside
        m.setattr(runner, "_jit_forward", runner._jit_forward.__wrapped__)

        def record(d):
            held.values, held.recording = [], True
            f(d)
            return list(held.values)

        def replay(d, values):
            held.values, held.recording, held.at = values, False, 0
            out = f(d)
            assert held.at == len(values) > 0
            return out

        values = jax.jit(record)(zeros)
        return jax.jit(replay)(deltas, values)


def transcoders(model, rng, features: int = 8) -> Transcoders:
    c = model.config
    L, d = c.num_layers, c.hidden_size
    r = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    return Transcoders(W_enc=r(L, features, d) / np.sqrt(d) * 2, b_enc=jnp.full((L, features), 0.2, jnp.float32),
                       W_dec=r(L, features, d) / np.sqrt(features), b_dec=r(L, d) * 0.1, threshold=None,
                       W_skip=r(L, d, d) * 0.1 / np.sqrt(d), cross_layer=False, scan="local/random")


def to64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if isinstance(a, jax.Array) and a.dtype == jnp.float32 else a,
                        tree)


def two_blocks(config):
    """``config`` cut to two blocks, one of each kind where it has two (a hybrid's DeltaNet and attention blocks,
    sliding and full attention), for the suite's time."""
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or ()))
    config.num_hidden_layers = 2
    if kinds:
        config.layer_types = (kinds * 2)[:2]
    return config


def builder(tmp_path_factory, config=two_blocks):
    """``build(name)``: the tiny model of case ``name`` (tests/families.py) with ``config`` applied to its
    config, made and loaded once."""
    import families

    cache = {}

    def build(name):
        if name not in cache:
            spec = families.CASES[name]
            folder = spec.make(config(spec.config()), tmp_path_factory.mktemp(name.replace(".", "_")),
                               seed=spec.seed)
            cache[name] = jstd.load(folder)
        return cache[name]

    return build


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return builder(tmp_path_factory)


def frozen_effects(model, tc, ids, sources, targets, monkeypatch):
    """``(derivative, difference)`` ``[targets, sources]``: the brute-force direct effects (module docstring).
    ``sources``: ``(kind, block or None, position, vector [d])`` with kind ``"y"`` (added at block's MLP output) or
    ``"e"`` (at the token embeddings); ``targets``: ``(block or L, position, vector [d])``."""
    L, n, d = tc.num_layers, len(ids), tc.d_out
    S = len(sources)
    B = 1 + 3 * S  # row 0 the prompt; per source +FAR·u, +h·u, -h·u
    d_y, d_e = np.zeros((L, B, n, d)), np.zeros((B, n, d))
    for i, (kind, layer, pos, u) in enumerate(sources):
        for j, scale in enumerate((FAR, H, -H)):
            row = 1 + 3 * i + j
            if kind == "y":
                d_y[layer, row, pos] = scale * u
            else:
                d_e[row, pos] = scale * u
    tokens = jnp.asarray(np.repeat(np.asarray(ids)[None], B, 0), jnp.int32)
    f = linearised(model.unstacked(lambda a, j: a[j]), tokens, tc)
    zeros = (jnp.zeros((L, B, n, d), jnp.float64), jnp.zeros((B, n, d), jnp.float64))
    x, final = held_forward(f, zeros, (jnp.asarray(d_y), jnp.asarray(d_e)), monkeypatch)
    x, final = np.asarray(x, np.float64), np.asarray(final, np.float64)
    read = np.stack([np.einsum("bd,d->b", x[l, :, p] if l < L else final[:, p], v) for l, p, v in targets])  # [T, B]
    base = read[:, :1]
    plus, small, minus = read[:, 1::3], read[:, 2::3], read[:, 3::3]
    return (small - minus) / (2 * H), (plus - base) / FAR


def graph_sources(graph, tc, values64, picks):
    """The brute-force sources for graph nodes ``picks`` (feature, error and token nodes), float64 vectors."""
    L, n = graph.num_layers, graph.n_pos
    out = []
    for i in picks:
        kind, *rest = graph.node(i)
        if kind == "feature":
            l, p, f = rest
            a = values64["acts"][l, p, f]
            out.append(("y", l, p, a * np.asarray(tc.W_dec[l, f], np.float64)))
        elif kind == "error":
            l, p = rest
            out.append(("y", l, p, values64["errors"][l, p]))
        else:
            p, _ = rest
            out.append(("e", None, p, values64["embeddings"][p]))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_edges_are_the_frozen_models_finite_differences(name, built, monkeypatch):
    model = built(name)
    rng = np.random.default_rng(0)
    tc = transcoders(model, rng)
    ids = rng.integers(1, model.config.vocab_size, N_TOKENS)
    graph = jstd.attribute(model, ids, tc, max_n_logits=2, desired_logit_prob=0.99)
    L, n = graph.num_layers, graph.n_pos
    assert graph.n_features >= 2 * L, graph.n_features
    A = graph.adjacency.astype(np.float64)

    with jax.enable_x64(True):
        model64, tc64 = to64(model), to64(tc)
        v = prompt_values(model64, jnp.asarray(ids[None], jnp.int32), tc.input_site, tc.output_site)
        x = np.asarray(v["x"][:, 0], np.float64)
        acts = np.array(tc64.encode(jnp.asarray(x)))
        acts[:, 0] = 0
        errors = np.asarray(v["y"][:, 0], np.float64) - np.asarray(tc64.decode(jnp.asarray(acts)) + tc64.skip(
            jnp.asarray(x)))
        errors[:, 0] = 0
        values64 = {"acts": acts, "errors": errors, "embeddings": np.asarray(v["embeddings"][0], np.float64)}
        # sources: features of the first blocks, errors and tokens; targets: features of later blocks and the logits
        feats = [i for i in range(graph.n_features) if graph.node(i)[1] < L - 1]
        picks = list(rng.choice(feats, min(4, len(feats)), replace=False))
        picks += [graph.error_start + l * n + p for l, p in [(0, n - 2), (L - 2, 1)]]
        picks += [graph.token_start + p for p in (1, n - 1)]
        later = [i for i in range(graph.n_features) if graph.node(i)[1] >= 1]
        rows = list(rng.choice(later, min(6, len(later)), replace=False))
        targets = []
        for t in rows:
            _, l, p, f = graph.node(t)
            targets.append((l, p, np.asarray(tc.W_enc[l, f], np.float64)))
        rows += list(range(graph.logit_start, graph.n_nodes))
        targets += [(L, n - 1, np.asarray(vec, np.float64)) for vec in graph.logit_vectors]
        derivative, difference = frozen_effects(model64, tc64, ids, graph_sources(graph, tc, values64, picks),
                                                targets, monkeypatch)
    want = A[np.ix_(rows, picks)]
    scale = np.abs(A[rows]).max(1, keepdims=True)
    assert np.abs(want).max() > 1e-3  # edges that are there
    err_d = np.abs(derivative - want) / scale
    err_l = np.abs(difference - want) / scale
    assert err_l.max() <= 2e-5, (name, "the frozen model is not linear in its sources", err_l.max())
    assert err_d.max() <= 2e-5, (name, "edges differ from the frozen model's finite differences", err_d.max())


class Quiet:
    """Taps that serve nothing and return ``held[site]`` where given (a layer called alone, some values held)."""

    def __init__(self, **held):
        self.held = {f"mlp.{k}": v for k, v in held.items()}
        self.seen = {}

    def __call__(self, site, value):
        self.seen[site] = value
        return self.held.get(site, value)

    def touches(self, *sites):
        return False


def test_frozen_routing_is_a_fixed_weighted_sum_of_experts(built):
    """A frozen MoE MLP (Qwen2-MoE: top-k experts and a gated shared expert) differentiates as ``Σ_k w_k ·
    expert_k(x) + g · shared(x)`` with the router's weights and choices ``w`` and the shared gate ``g`` held at the
    prompt's: its forward-mode derivative equals the finite differences (float64) of that sum, built from the
    experts with the prompt's weights and choices substituted; unfrozen, the derivative also moves the weights, and
    differs."""
    import dataclasses

    from jstd.nn.frozen import frozen
    from jstd.nn.moe import MoEMLP

    model = built("qwen2_moe")
    mlp = jax.tree.map(lambda a: a[0], model.layers.slots[0].mlp)  # block 0's
    assert isinstance(mlp, MoEMLP) and mlp.shared is not None
    held_mlp = frozen(mlp)
    assert held_mlp.frozen_routing and not frozen(mlp, routing=False).frozen_routing
    rng = np.random.default_rng(1)
    d = mlp.router.shape[0]
    with jax.enable_x64(True):
        mlp64, held64 = to64(mlp), to64(held_mlp)
        routed = dataclasses.replace(mlp64, shared=None, shared_gate=None)
        x = jnp.asarray(rng.normal(size=(1, 5, d)))
        dx = jnp.asarray(rng.normal(size=(1, 5, d)))
        taps = Quiet()
        mlp64(x, taps)
        w, i = taps.seen["mlp.router_weights"], taps.seen["mlp.expert_indices"]
        g = jax.nn.sigmoid(x @ mlp64.shared_gate)

        def brute(x):
            return routed(x, Quiet(router_weights=w, expert_indices=i)) + g * mlp64.shared(x, Quiet())

        np.testing.assert_allclose(np.asarray(brute(x)), np.asarray(mlp64(x, Quiet())), rtol=1e-12, atol=1e-12)
        h = 1e-4
        fd = np.asarray((brute(x + h * dx) - brute(x - h * dx)) / (2 * h))
        _, held_jvp = jax.jvp(lambda x: held64(x, Quiet()), (x,), (dx,))
        _, free_jvp = jax.jvp(lambda x: mlp64(x, Quiet()), (x,), (dx,))
    scale = np.abs(fd).max()
    np.testing.assert_allclose(np.asarray(held_jvp), fd, atol=1e-7 * scale)
    assert np.abs(np.asarray(free_jvp) - fd).max() > 1e-3 * scale  # the routing's own derivative is left out
