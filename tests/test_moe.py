"""Mixture-of-experts: the router and expert values against transformers, and their identities.

On every MoE case (``tests/moe_cases.py``: Qwen3-MoE, OLMoE, Mixtral, Qwen3-VL-MoE, Qwen3.5-MoE; gpt-oss, Qwen2-MoE, Phi-3.5-MoE): ``mlp_output``
is the router-weighted sum of ``expert_outputs`` (plus ``shared_expert_output``); bfloat16 is near torch's;
re-routing by a router-logit edit and ablating one expert's output equal the same edits made in transformers
(the logits forced by a hook: ``reference.moe``). Ties in the top-k break as torch's CPU ``topk`` (equal router
rows: equal probabilities). Both checkpoint spellings of the experts load alike; the grouped and the dense product
agree and the grouped one's memory does not grow with the experts. The tools on MoE: generation with a router
edit at every step, a resumed patching sweep at the router logits, ``jstd.collect`` of router values, and the
convert / export round trips.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
from conftest import assert_close, relative_rms
from families import CASES
from reference.cases import assert_sites_close, jit_run
from reference.harness import TorchEdit
from jstd.kernels import moe as moe_kernels

MOE_CASES = tuple(c for c in CASES if c.split("-")[0] in ("qwen3_moe", "olmoe", "mixtral", "qwen3_vl_moe",
                                                            "qwen3_5_moe", "gpt_oss", "qwen2_moe",
                                                            "phimoe"))
M = "layers.mlp."


@pytest.mark.parametrize("name", MOE_CASES)
def test_mlp_output_is_the_weighted_sum_of_the_experts(zoo, name):
    """``mlp_output == Σ_k router_weights[k] · expert_outputs[k] (+ shared_expert_output)`` on every MoE block;
    the indices are distinct experts, the weights the (renormalised) softmax of the logits at them."""
    model = zoo(name).model
    out, _ = zoo.every_value(name)
    blocks = model.blocks_for(M + "router_logits")
    assert blocks and len(blocks) == out[M + "expert_outputs"].shape[0]
    mlp = np.asarray(out[M + "mlp_output"], np.float64)[list(blocks)]
    w = np.asarray(out[M + "router_weights"], np.float64)
    total = (w[..., None] * np.asarray(out[M + "expert_outputs"], np.float64)).sum(-2)
    if M + "shared_expert_output" in model.sites:
        total += np.asarray(out[M + "shared_expert_output"], np.float64)
    assert_close(total, mlp, 1e-6, f"{name}: mlp_output")
    idx, logits = np.asarray(out[M + "expert_indices"]), np.asarray(out[M + "router_logits"], np.float64)
    assert idx.dtype.kind == "i" and (np.sort(idx, -1)[..., 1:] != np.sort(idx, -1)[..., :-1]).all()
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    chosen = np.take_along_axis(probs / probs.sum(-1, keepdims=True), idx, -1)
    moe = next(b.mlp for b in model.stacks["layers"].slots if M + "router_logits" in
               {f"layers.{s}" for s in b.sites()})
    if moe.routing != "sparsemixer":  # sparsemixer's softmax is over the experts near each choice (tests/test_moe_new)
        assert_close(w, chosen / chosen.sum(-1, keepdims=True) if moe.normalize else chosen, 1e-5, f"{name}: weights")
    assert (np.diff(chosen, axis=-1) <= 1e-7).all(), "the top-k is not largest first"


# renormalised weights, float32 weights, a wrapper (qwen3_moe: the conformance suite's edits; qwen3_5_moe's capture
# is the others')
@pytest.mark.parametrize("name", ["qwen3_moe-normed", "mixtral", "qwen3_vl_moe"])
def test_rerouting_and_ablating_an_expert_match_transformers(zoo, name):
    """A token re-routed by a router-logit edit (its logits set: other experts chosen, other weights) and one
    expert's output ablated wherever it was chosen, each equal transformers under the same edits (the logits
    forced into its own router; the expert's output zeroed in its loop)."""
    _, _, model, ref, spec = zoo(name)
    inputs, ref_inputs = spec.inputs(model, seed=7)
    block = model.blocks_for(M + "router_logits")[-1]
    experts, k = model.config.num_experts, model.config.experts_per_token
    clean = jit_run(model, inputs, reads=(M + "expert_indices",))[M + "expert_indices"][-1]
    forced = np.linspace(2.0, -2.0, experts, dtype=np.float32)[::-1].copy()  # the last experts win
    where = np.zeros((1, np.shape(clean)[1], 1), bool)
    where[:, -2] = True  # the second-to-last position of every row

    def set_last(t):
        t = t.clone()
        t[:, -2] = torch.from_numpy(forced)
        return t

    expert = int(np.asarray(clean)[0, -1, 0])  # the first choice at the last position of row 0
    hit = (np.asarray(clean) == expert)[..., None]  # [batch, seq, top_k, 1]

    def ablate(t):
        t = t.clone()
        t[torch.from_numpy(hit[..., 0])] = 0
        return t

    reads = ("layers.layer_output", M + "expert_indices", M + "router_weights")
    for label, edits, torch_edits in (
            ("re-route", [jstd.Set(M + "router_logits", forced, layer=block, where=where)],
             [TorchEdit(M + "router_logits", set_last, block)]),
            ("ablate", [jstd.Zero(M + "expert_outputs", layer=block, where=hit)],
             [TorchEdit(M + "expert_outputs", ablate, block)])):
        out = jit_run(model, inputs, edits, reads=reads)
        want = ref.run(ref_inputs, reads=reads + ("logits",), edits=torch_edits)
        assert_sites_close(out, want, reads, 1e-5, f"{name}: {label}")
    idx = np.asarray(jit_run(model, inputs, [jstd.Set(M + "router_logits", forced, layer=block, where=where)],
                             reads=(M + "expert_indices",))[M + "expert_indices"][-1])
    assert sorted(idx[0, -2]) == list(range(experts - k, experts)) and (idx[:, -1] == np.asarray(clean)[:, -1]).all()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_direct_logit_attribution_per_expert(zoo, name):
    """Per-expert DLA: on every MoE block the experts' parts (and the shared expert's) sum to the block's MLP part,
    and are zero on dense blocks and for experts a row did not choose; one chosen expert's part equals the change
    of the block's MLP part, read through the final norm with its scale frozen at the clean stream and the head,
    when that expert's output is zeroed at its place (and the shared expert's when its output is zeroed).
    qwen3_moe: a dense block among MoE ones, the grouped product; qwen3_5_moe: a shared expert, a hybrid wrapper."""
    model = zoo(name).model
    inputs, _ = CASES[name].inputs(model, seed=3)
    target, other = 5, 7
    dla = jstd.direct_logit_attribution(model, inputs, target, other)
    experts, mlp = np.asarray(dla.experts, np.float64), np.asarray(dla.mlp, np.float64)
    blocks = list(model.blocks_for(M + "expert_outputs"))
    dense = [b for b in range(model.depth()) if b not in blocks]
    has_shared = M + "shared_expert_output" in model.sites
    assert (dla.shared_expert is not None) == has_shared and experts.shape[-1] == model.config.num_experts
    total = experts.sum(-1) + (np.asarray(dla.shared_expert, np.float64) if has_shared else 0)
    assert_close(total[blocks], mlp[blocks], 1e-5, f"{name}: the experts sum to the MLP part")
    assert not experts[dense].any()

    # the clean run and each ablation through one compiled program: zero edits whose masks select nothing, or one
    block, place = blocks[-1], 1
    batch, seq = np.shape(inputs.tokens if isinstance(inputs, jstd.Inputs) else inputs)
    k = model.config.experts_per_token
    none = {"expert": np.zeros((batch, seq, k, 1), bool), "shared expert": np.zeros((batch, seq, 1), bool)}
    sites = {"expert": M + "expert_outputs", "shared expert": M + "shared_expert_output"}
    labels = ("expert", "shared expert") if has_shared else ("expert",)
    reads = (M + "expert_indices", M + "mlp_output", "layers.layer_output")

    def run_zeroing(label=None):
        masks = {name: none[name] if name != label else mask for name, mask in zeroing.items()}
        edits = [jstd.Zero(sites[n], layer=block, where=masks[n]) for n in labels]
        return jit_run(model, inputs, edits, reads=reads)

    zeroing = {"expert": none["expert"].copy(), "shared expert": np.ones_like(none["shared expert"])}
    zeroing["expert"][:, -1, place] = True  # the expert each row chose second at the last position
    clean = run_zeroing()
    indices = np.asarray(clean[M + "expert_indices"])[:, :, -1]  # [MoE blocks, batch, top_k]
    chosen = np.zeros_like(experts[blocks], bool)
    np.put_along_axis(chosen, indices, True, -1)
    assert not experts[blocks][~chosen].any() and np.abs(experts[blocks][chosen]).min() > 0

    final_norm, logits_from_norm = model.readout()
    x = jnp.asarray(clean["layers.layer_output"])[-1, :, -1].astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + final_norm.eps)  # frozen at the clean stream

    def linearized(m):  # the logit difference of the MLP part m [batch, hidden] through the frozen norm and head
        logits = np.asarray(logits_from_norm(m * final_norm.effective_weight * scale), np.float64)
        return logits[:, target] - logits[:, other]

    parts = {"expert": np.take_along_axis(experts[block], indices[-1][:, place:place + 1], -1)[:, 0],
             "shared expert": None if not has_shared else np.asarray(dla.shared_expert, np.float64)[block]}
    for label in labels:
        zeroed = run_zeroing(label)[M + "mlp_output"]
        change = linearized(clean[M + "mlp_output"][block, :, -1]) - linearized(zeroed[block, :, -1])
        assert_close(parts[label], change, 1e-4, f"{name}: the {label}'s part is the change when it is zeroed")


FIRST_CASES = tuple(dict.fromkeys(c.split("-")[0] for c in MOE_CASES))


@pytest.mark.parametrize("name", FIRST_CASES)
def test_bfloat16_near_torch(zoo, name):
    """Every value in bfloat16 near torch's bfloat16 value (relative RMS under 5e-2, the conformance suite's bound).
    Routing is discontinuous: a token whose top-k ends in a near-tie may choose another expert than torch after
    one rounding differs upstream, so the chosen experts must agree on 97% of the (token, k) entries, the
    weights and expert outputs are compared where they agree and the MLP's output at the tokens whose every choice
    agrees."""
    _, _, model, ref, spec = zoo(name, "bfloat16")
    inputs, ref_inputs = spec.inputs(model)
    want = ref.run(ref_inputs)
    reads = tuple(sorted(model.sites))
    out = jit_run(model, inputs, reads=reads)
    agree = np.asarray(out[M + "expert_indices"]) == want[M + "expert_indices"]
    # phimoe's second choice is a bare argmax of the other logits (3 of 132 flip here, at gaps of 2 bf16 units)
    floor = 0.96 if name == "phimoe" else 0.97
    assert agree.mean() >= floor, f"{name}: {1 - agree.mean():.1%} of the chosen experts differ from torch's"
    for site in reads + ("logits",):
        a, b = np.asarray(out[site], np.float32), want[site]
        if site in (M + "router_weights", M + "expert_outputs"):
            a, b = a[agree], b[agree]
        if site == M + "mlp_output":  # a token that chose another expert adds another expert's output
            keep = np.ones(a.shape[:-1], bool)
            keep[list(model.blocks_for(M + "expert_indices"))] = agree.all(-1)
            a, b = a[keep], b[keep]
        if site != M + "expert_indices":
            rel = relative_rms(a, b) if b.any() else float(np.abs(a).max())  # zeros (a state_input) stay zeros
            assert rel < 5e-2, f"{name}:{site} bf16 relative RMS error {rel:.3g}"
    assert out.logits.dtype == jnp.bfloat16


def _tied(folder: Path, out: Path, rows: list[int]) -> Path:
    """A copy of the checkpoint ``folder`` whose router rows ``rows`` (every MoE block) equal the first of them:
    those experts' logits, hence probabilities, are equal in any dtype."""
    from safetensors.numpy import load_file, save_file

    out.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    for key, w in tensors.items():
        if key.endswith("mlp.gate.weight"):
            w = w.copy()
            w[rows] = w[rows[0]]
            tensors[key] = w
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_ties_break_as_torch_topk(zoo, tmp_path, dtype):
    """Four of eight experts with equal router rows tie on every token; the chosen experts (which and in what
    order) are torch's, as its CPU topk picks among equal values (neither the lowest index nor any fixed
    rule)."""
    from reference.moe import MoEReference

    folder = _tied(zoo("olmoe").folder, tmp_path / "tied", [1, 3, 4, 6])
    model = jstd.load(folder, dtype=dtype)
    ref = MoEReference(folder, getattr(torch, dtype))
    tokens = np.random.default_rng(3).integers(0, 97, (2, 11))
    reads = (M + "expert_indices", M + "router_weights")
    out = jit_run(model, tokens, reads=reads)
    want = ref.run(tokens, reads=reads + ("logits",))
    np.testing.assert_array_equal(np.asarray(out[M + "expert_indices"]), want[M + "expert_indices"])
    probs = jax.nn.softmax(jnp.asarray(np.asarray(jit_run(model, tokens, reads=(M + "router_logits",))
                                                  [M + "router_logits"], np.float32)), -1)
    lowest = np.asarray(jax.lax.top_k(probs, 2)[1])
    assert (lowest != want[M + "expert_indices"]).any(), "no tie where the lowest index loses: the test is weak"
    assert_close(out.logits, want["logits"], 1e-5 if dtype == "float32" else 3e-2, "logits")


def test_torch_topk_row_is_torchs_order():
    """The host replay of torch's selection on tie-heavy rows (few distinct values) equals torch.topk."""
    rng = np.random.default_rng(0)
    for n, k in ((8, 2), (16, 4), (60, 4), (128, 8), (256, 8)):
        for _ in range(40):
            v = torch.from_numpy(rng.integers(0, 3, n).astype(np.float32))
            assert moe_kernels.torch_topk_row(v.numpy(), k) == torch.topk(v, k).indices.tolist(), (n, k)


def test_grouped_and_dense_products_agree_and_memory_is_per_chosen_pair():
    """The grouped product (pairs sorted by expert, each expert's rows together) equals every expert for every token,
    gathered, also under ``vmap``; its working memory stays O(tokens · top_k) (plus each expert's last tile), far
    below the dense product's."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(40, 16)), jnp.float32)
    for experts in (4, 9):
        gate_up = jnp.asarray(rng.normal(size=(experts, 16, 12)) / 4, jnp.float32)
        down = jnp.asarray(rng.normal(size=(experts, 6, 16)) / 3, jnp.float32)
        idx = jnp.asarray(np.stack([rng.choice(experts, 3, replace=False) for _ in range(40)]), jnp.int32)
        grouped = moe_kernels.expert_outputs(x, idx, gate_up, down, "silu", dense=False)
        dense = moe_kernels.expert_outputs(x, idx, gate_up, down, "silu", dense=True)
        assert_close(grouped, dense, 1e-6, f"{experts} experts")
        batched = jax.vmap(lambda i: moe_kernels.expert_outputs(x, i, gate_up, down, "silu", dense=False))(
            jnp.stack([idx, idx[::-1]]))
        other = moe_kernels.expert_outputs(x, idx[::-1], gate_up, down, "silu", dense=True)
        assert_close(batched, jnp.stack([dense, other]), 1e-6, f"{experts} experts, vmap")

    def temp(experts):
        args = (jax.ShapeDtypeStruct((256, 64), jnp.float32), jax.ShapeDtypeStruct((256, 2), jnp.int32),
                jax.ShapeDtypeStruct((experts, 64, 64), jnp.float32),
                jax.ShapeDtypeStruct((experts, 32, 64), jnp.float32))
        fn = jax.jit(lambda x, i, g, d: moe_kernels.expert_outputs(x, i, g, d, "silu"))
        return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

    # O(pairs + experts · tile) rows: the padding bound grows with the experts, the rows do not multiply by them
    small, large, dense = temp(8), temp(512), 256 * 512 * 64 * 4  # the dense product's one [tokens, experts, 64]
    assert small < dense / 64 and large < dense / 8, (small, large)


def test_grouped_product_windows_and_derivatives_match_the_dense_product():
    """The grouped product's values at any window size (windows that overrun their expert's rows, experts no token
    chose, one token) and its derivatives (``jax.grad``, ``jax.jvp``, with biases and gpt-oss' clamped product,
    under ``vmap``) equal the dense product's."""
    rng = np.random.default_rng(1)
    experts, product = 7, moe_kernels.clamped(1.5, 1.7)
    x = jnp.asarray(rng.normal(size=(30, 16)), jnp.float32)
    w = (jnp.asarray(rng.normal(size=(experts, 16, 12)) / 4, jnp.float32),
         jnp.asarray(rng.normal(size=(experts, 6, 16)) / 3, jnp.float32),
         jnp.asarray(rng.normal(size=(experts, 12)), jnp.float32), jnp.asarray(rng.normal(size=(experts, 16)), jnp.float32))
    idx = jnp.asarray(np.stack([rng.choice(experts - 2, 2, replace=False) for _ in range(30)]), jnp.int32)
    expert = lambda e: lambda xs: moe_kernels._expert(xs, w[0][e], w[1][e], product, w[2][e], w[3][e])
    dense = moe_kernels.expert_outputs(x, idx, *w[:2], "silu", True, *w[2:], product=product)
    for window in (1, 3, 16, 64):
        assert_close(moe_kernels.segments(x, idx, expert, experts, window), dense, 1e-6, f"window {window}")
    assert_close(moe_kernels.expert_outputs(x[:1], idx[:1], *w[:2], "silu", False, *w[2:], product=product),
                 dense[:1], 1e-6, "one token")

    def loss(dense, x, *w):
        return jnp.sum(jnp.sin(moe_kernels.expert_outputs(x, idx, *w[:2], "silu", dense, *w[2:], product=product)))

    want = jax.grad(lambda *a: loss(True, *a), argnums=tuple(range(5)))(x, *w)
    got = jax.jit(jax.grad(lambda *a: loss(False, *a), argnums=tuple(range(5))))(x, *w)
    for name, g, h in zip(("x", "gate_up", "down", "gate_up_bias", "down_bias"), got, want):
        assert_close(g, h, 1e-5, f"grad {name}")
    tangents = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), (x, *w))
    (v, t), (v0, t0) = (jax.jvp(lambda *a: loss(d, *a), (x, *w), tangents) for d in (False, True))
    assert_close(jnp.stack([v, t]), jnp.stack([v0, t0]), 1e-5, "jvp")
    batched = jax.vmap(jax.grad(lambda x: loss(False, x, *w)))(jnp.stack([x, -x]))
    assert_close(batched[0], want[0], 1e-5, "vmap of grad")
    # vmap: the batch's rows in one call; weights batched too (a vmap over models): item by item
    of = lambda dense, x, gate_up: moe_kernels.expert_outputs(x, idx, gate_up, w[1], "silu", dense, *w[2:],
                                                            product=product)
    xs, gate_ups = jnp.stack([x, -x, 2 * x]), jnp.stack([w[0], -w[0], w[0] / 2])
    for gate_up in (w[0], gate_ups):
        batched = gate_up.ndim == 4
        want = jnp.stack([of(True, xs[i], gate_up[i] if batched else gate_up) for i in range(3)])
        assert_close(jax.vmap(lambda *a: of(False, *a), (0, 0 if batched else None))(xs, gate_up), want, 1e-6,
                     f"vmap, weights batched {batched}")


def _fused(folder: Path, out: Path) -> Path:
    """The checkpoint ``folder`` rewritten with transformers 5's fused experts (``experts.gate_up_proj``
    ``[experts, 2·mlp, hidden]``, ``experts.down_proj`` ``[experts, hidden, mlp]``) for the per-expert tensors."""
    from safetensors.numpy import load_file, save_file

    out.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors, fused = load_file(folder / "model.safetensors"), {}
    groups: dict[str, dict] = {}
    for key, w in tensors.items():
        if ".experts." in key:
            prefix, rest = key.split(".experts.")
            e, part = rest.split(".", 1)
            groups.setdefault(prefix, {})[(int(e), part.split(".")[0])] = w
        else:
            fused[key] = w
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        fused[prefix + ".experts.gate_up_proj"] = np.stack(
            [np.concatenate([parts[e, "gate_proj"], parts[e, "up_proj"]]) for e in range(n)])
        fused[prefix + ".experts.down_proj"] = np.stack([parts[e, "down_proj"] for e in range(n)])
    save_file(fused, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_fused_and_per_expert_checkpoints_load_alike_and_round_trip(zoo, tmp_path):
    """transformers 5's fused experts and the per-expert tensors transformers saves load into the same model,
    as transformers loads both; export writes each back as it came, convert's layout reloads the same."""
    from transformers import AutoModelForCausalLM

    case = zoo("qwen3_moe")
    fused = _fused(case.folder, tmp_path / "fused")
    model = jstd.load(fused)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(case.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.random.default_rng(1).integers(0, 97, (1, 9))
    torch_model = AutoModelForCausalLM.from_pretrained(fused).eval()
    with torch.no_grad():
        assert_close(jit_run(model, tokens).logits, torch_model(torch.from_numpy(tokens)).logits.numpy(), 1e-5,
                     "fused vs transformers")
    for source, name in ((model, "fused"), (case.model, "per-expert")):
        back = jstd.export(source, tmp_path / f"export-{name}")
        again = jstd.load(back)
        np.testing.assert_array_equal(np.asarray(jit_run(again, tokens).logits),
                                      np.asarray(jit_run(source, tokens).logits))
    from safetensors import safe_open

    with safe_open(tmp_path / "export-fused" / "model.safetensors", "np") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    from jstd.io.stacked import convert

    converted = jstd.load(convert(case.folder, tmp_path / "converted"))
    np.testing.assert_array_equal(np.asarray(jit_run(converted, tokens).logits),
                                  np.asarray(jit_run(case.model, tokens).logits))


def test_mixtral_hub_spelling_loads(zoo, tmp_path):
    """Mixtral's hub names (``block_sparse_moe.``, experts' ``w1`` / ``w3`` / ``w2``) are what transformers saves;
    the fused transformers-5 spelling under ``mlp.`` loads the same model."""
    case = zoo("mixtral")
    from safetensors import safe_open

    with safe_open(case.folder / "model.safetensors", "np") as f:
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in f.keys()
    from safetensors.numpy import load_file, save_file

    tensors = load_file(case.folder / "model.safetensors")
    out = tmp_path / "fused"
    out.mkdir()
    (out / "config.json").write_text((case.folder / "config.json").read_text())
    renamed = {}
    for key, w in tensors.items():
        key = key.replace(".block_sparse_moe.", ".mlp.").replace(".w1.", ".gate_proj.").replace(
            ".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
        renamed[key] = w
    save_file(renamed, tmp_path / "renamed.safetensors", metadata={"format": "pt"})
    (tmp_path / "per").mkdir()
    (tmp_path / "per" / "config.json").write_text((case.folder / "config.json").read_text())
    (tmp_path / "renamed.safetensors").rename(tmp_path / "per" / "model.safetensors")
    model = jstd.load(_fused(tmp_path / "per", tmp_path / "fused2"))
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(case.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generation_with_a_router_edit_equals_the_whole_run(zoo):
    """Expert 0 removed from every top-k of every block at every step: each generated step's logits equal
    ``jstd.run`` on the whole sequence with the same edit (and differ from the unedited generation)."""
    model = zoo("olmoe").model
    tokens = np.random.default_rng(2).integers(0, 97, (2, 6))
    drop = np.zeros(model.config.num_experts, np.float32)
    drop[0] = -np.inf
    edits = [jstd.Add(M + "router_logits", drop)]
    gen = jstd.generate(model, tokens, edits, max_new_tokens=4, reads=(M + "expert_indices",))
    whole = jit_run(model, gen.tokens[:, :-1], edits, reads=(M + "expert_indices",))
    assert_close(gen.logits, whole.logits[:, tokens.shape[1] - 1:], 1e-5, "generated logits")
    assert (np.asarray(gen.values[M + "expert_indices"]) != 0).all()
    plain = jstd.generate(model, tokens, max_new_tokens=4)
    assert np.abs(np.asarray(plain.logits) - np.asarray(gen.logits)).max() > 1e-3


def test_resumed_patching_sweep_at_the_router_logits(zoo):
    """A patching sweep over blocks and positions at ``router_logits`` (resumed from the corrupted run) equals
    ``jstd.patch`` entry by entry."""
    model = zoo("qwen3_moe").model
    rng = np.random.default_rng(4)
    clean = rng.integers(0, 97, (1, 7))
    corrupt = (clean + 5) % 97
    metric = jstd.logit_difference(5, 7)
    grid = jstd.patch_sweep(model, clean, corrupt, M + "router_logits", metric, positions=[2, 6], progress=False)
    blocks = model.blocks_for(M + "router_logits")
    assert np.shape(grid)[:2] == (len(blocks), 2)
    for i, b in enumerate(blocks):
        for j, p in enumerate((2, 6)):
            one = jstd.patch(model, clean, corrupt, M + "router_logits", layer=b, positions=p, metric=metric)
            assert_close(grid[i, j], one, 1e-5, f"block {b} position {p}")


def test_collect_router_values(zoo, tmp_path):
    """``jstd.collect`` writes the router's logits and weights and the chosen experts as ``jstd.run`` reads them."""
    model = zoo("mixtral").model
    tokens = np.random.default_rng(5).integers(2, 97, (3, 7))
    sites = (M + "router_logits", M + "router_weights", M + "expert_indices")
    data = jstd.collect(model, jstd.Inputs(tokens, np.ones_like(tokens)), list(sites), tmp_path / "acts",
                        batch_size=2, progress=False)
    whole = jit_run(model, tokens, reads=sites)
    for site in sites:
        want = np.moveaxis(np.asarray(whole[site]), 0, 2).reshape(21, *np.shape(whole[site])[:1],
                                                                   *np.shape(whole[site])[3:])
        if site.endswith("expert_indices"):
            np.testing.assert_array_equal(np.asarray(data.read(site)), want, err_msg=site)
        else:  # batches of two rows: another compile than the run's, float32-close
            assert_close(np.asarray(data.read(site)), want, 1e-5, site)


def test_refusals_name_the_problem():
    """docs/errors.md's MoE rows: OLMoE's clip_qkv, and more experts per token than experts."""
    from transformers import OlmoeConfig

    from jstd.models.olmoe import Olmoe

    base = dict(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                num_experts=8)
    with pytest.raises(ValueError, match=r"olmoe: clip_qkv=8.0 \(a clamp of the queries, keys and values\) is not "
                                         "supported; use a checkpoint whose config has clip_qkv null"):
        Olmoe.skeleton(OlmoeConfig(**base, clip_qkv=8.0, num_experts_per_tok=2), jnp.float32)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 must be between 1 and the number of experts \(8\)"):
        Olmoe.skeleton(OlmoeConfig(**base, num_experts_per_tok=9), jnp.float32)
