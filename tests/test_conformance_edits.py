"""The conformance suite, edits: on one case per family and tower (``families.MAIN``), edits against the same
edits made through torch hooks, and every editable site changing what follows it (``tests/test_conformance.py``
holds the rest; the suite is cut in three files so two test workers share it)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
from conftest import assert_close
from families import MAIN
from reference.cases import assert_sites_close, final, final_site, jit_run
from reference.harness import TorchEdit
from jstd.core.sites import SITES

main_case = pytest.mark.parametrize("name", MAIN)


# ---- edits --------------------------------------------------------------------------------------------------------


def _edit_cases(model, seq: int):
    """(label, jstd edits, torch edits): the same edit made both ways, on every stack the model has (``seq``: the
    text's length)."""
    cases = []
    rng = np.random.default_rng(9)
    for stack in model.stacks:
        c = model.config if stack == "layers" else model.config.vision
        v = rng.normal(size=c.hidden_size).astype(np.float32)
        cases.append((f"scale {stack}.mlp_output", [jstd.Scale(f"{stack}.mlp.mlp_output", 0.5)],
                      [TorchEdit(f"{stack}.mlp.mlp_output", lambda t: t * 0.5)]))

        def add_last(t, v=v):
            t = t.clone()
            t[:, -1] += torch.from_numpy(v)
            return t

        cases.append((f"add at {stack}.1 last position", [jstd.Add(f"{stack}.layer_output", v, layer=1, positions=-1)],
                      [TorchEdit(f"{stack}.layer_output", add_last, 1)]))
        attention = model.layers_with("self_attn", stack)
        if attention:
            b = attention[0]
            kv = c.num_kv_heads if stack == "layers" else c.num_heads

            def zero_head(t, j=kv - 1):
                t = t.clone()
                t[:, j] = 0
                return t

            cases.append((f"zero a value head at {stack}.{b}", [jstd.Zero(f"{stack}.self_attn.attention_values", layer=b,
                                                                           heads=kv - 1)],
                          [TorchEdit(f"{stack}.self_attn.attention_values", zero_head, b)]))
            if f"{stack}.self_attn.attention_probabilities" not in model.sites:  # a packed tower: no one pattern
                continue
            n = seq if stack == "layers" else c.positions
            pattern = np.tril(np.ones((n, n), np.float32)) if stack == "layers" else np.ones((n, n), np.float32)
            pattern /= pattern.sum(-1, keepdims=True)
            cases.append((f"uniform pattern at {stack}.{b}",
                          [jstd.Set(f"{stack}.self_attn.attention_probabilities", pattern, layer=b)],
                          [TorchEdit(f"{stack}.self_attn.attention_probabilities",
                                     lambda t, p=pattern: torch.from_numpy(p).expand_as(t).clone(), b)]))
        routed = model.blocks_for(f"{stack}.mlp.router_logits") if f"{stack}.mlp.router_logits" in model.sites else ()
        if routed:  # a mixture of experts: re-route (expert 0 out of every top-k), ablate each token's first choice
            b, experts = routed[-1], model.config.num_experts
            drop = np.zeros(experts, np.float32)
            drop[0] = -np.inf
            cases.append((f"no expert 0 at {stack}.{b}", [jstd.Add(f"{stack}.mlp.router_logits", drop, layer=b)],
                          [TorchEdit(f"{stack}.mlp.router_logits", lambda t, d=drop: t + torch.from_numpy(d), b)]))

            def zero_first(t):
                t = t.clone()
                t[:, :, 0] = 0
                return t

            first = np.arange(model.config.experts_per_token)[:, None] == 0  # [top_k, 1]: each token's first choice
            cases.append((f"ablate the first choice at {stack}.{b}",
                          [jstd.Zero(f"{stack}.mlp.expert_outputs", layer=b, where=first)],
                          [TorchEdit(f"{stack}.mlp.expert_outputs", zero_first, b)]))
        linear = model.layers_with("linear_attn", stack)
        if linear:
            b = linear[0]
            cases.append((f"halve betas at {stack}.{b}", [jstd.Scale(f"{stack}.linear_attn.betas", 0.5, layer=b)],
                          [TorchEdit(f"{stack}.linear_attn.betas", lambda t: t * 0.5, b)]))
    return cases


@main_case
def test_edits_match_torch_hooks(zoo, name):
    _, _, model, ref, spec = zoo(name)
    inputs, ref_inputs = spec.inputs(model, seed=7)
    reads = tuple(f"{stack}.layer_output" for stack in model.stacks)
    reads += ("vision.tower_output",) if "layers" not in model.stacks else ()
    clean = ref.run(ref_inputs, reads=(final_site(model),))[final_site(model)]
    tokens = inputs.tokens if isinstance(inputs, jstd.Inputs) else inputs
    seq = None if tokens is None else np.shape(tokens)[-1]
    cases = _edit_cases(model, seq)

    @jax.jit
    def edited(on):  # every case's edits in one program, each case switched on by its ``where`` (one compile)
        return jstd.run(model, inputs, [_switched(e, on[i]) for i, (_, edits, _) in enumerate(cases) for e in edits],
                        reads=reads)

    for i, (label, _, torch_edits) in enumerate(cases):
        out = edited(jnp.arange(len(cases)) == i)
        want = ref.run(ref_inputs, reads=reads + ("logits",), edits=torch_edits)
        assert np.abs(want[final_site(model)] - clean).max() > 1e-3, f"{label}: the edit changes nothing"
        assert_sites_close(out, want, reads, 1e-5, f"{name}: {label}")


def assert_switched_edits_match(model, ref, tokens, cases, reads, label: str) -> dict:
    """Each case ``(jstd edits, torch edits)`` of ``cases`` in one compiled program, switched on by its ``where``
    (one compile), against the same edits through torch's hooks: ``reads`` and the logits within 1e-5, and each
    edit changes the logits. Returns each case's jstd output by index."""

    @jax.jit
    def edited(on):
        return jstd.run(model, tokens, [_switched(e, on[i]) for i, (es, _) in enumerate(cases) for e in es],
                        reads=reads)

    clean = ref.run(tokens, reads=("logits",))["logits"]
    outs = {}
    for i, (_, torch_edits) in enumerate(cases):
        outs[i] = edited(jnp.arange(len(cases)) == i)
        want = ref.run(tokens, reads=tuple(reads) + ("logits",), edits=torch_edits)
        assert np.abs(want["logits"] - clean).max() > 1e-3, f"{label}: edit {i} changes nothing"
        assert_sites_close(outs[i], want, reads, 1e-5, f"{label}: edit {i}")
    return outs


def _switched(edit, on):
    """``edit`` applied only where ``on`` (a traced boolean scalar) holds, beside its own ``where``."""
    where = on if edit.where is None else jnp.logical_and(jnp.asarray(edit.where, bool), on)
    return eqx.tree_at(lambda e: e.where, edit, where, is_leaf=lambda x: x is None)


@main_case
def test_every_editable_site_changes_what_follows(zoo, name):
    """An edit at any editable site changes the model's output (or the site is read-only and refuses edits): one
    compiled run holds an Add at every site, switched on one at a time."""
    _, _, model, _, spec = zoo(name)
    inputs, _ = spec.inputs(model)
    values, _ = zoo.every_value(name)
    editable = [s for s in sorted(model.sites) if SITES[s].editable and s not in getattr(model, "discarded", ())]
    for site in sorted(model.sites):
        if not SITES[site].editable:
            with pytest.raises(jstd.SiteError, match="read-only"):
                jstd.Add(site, 1.0)
    rng = np.random.default_rng(0)
    noise = {}
    for site in editable:
        value = np.asarray(values[site], np.float32)
        value = value[0] if SITES[site].per_block else value
        real = np.abs(value[value > -1e30])
        noise[site] = (rng.normal(size=value.shape) * (0.5 * np.sqrt(np.mean(real ** 2)) + 0.1)).astype(np.float32)

    @jax.jit
    def edited(on):
        edits = [jstd.Add(site, noise[site] * on[i]) for i, site in enumerate(editable)]
        return final(model, jstd.run(model, inputs, edits, reads=(final_site(model),)))

    clean = np.asarray(edited(jnp.zeros(len(editable))), np.float64)
    # zero edits change nothing (the explicit attention path runs, as scores are edited: float32-close)
    assert_close(clean, final(model, jit_run(model, inputs, reads=(final_site(model),))), 1e-5, name)
    for i, site in enumerate(editable):
        after = np.asarray(edited(jnp.zeros(len(editable)).at[i].set(1.0)), np.float64)
        assert np.abs(after - clean).max() > 1e-4 * np.abs(clean).max(), f"{name}: an edit at {site} changes nothing"
