"""The conformance suite: every family and tower (``families.CASES``) against its torch reference.

Each test runs on every case or on one case per family and tower (``families.MAIN``): every value in float32,
the fused attention path, each value's shape against its ``Site.layout``, the block identity, edits against the
same edits made through torch hooks, left padding on both attention paths, ``jstd.Context`` continuation,
bfloat16 (norms bit-exact given torch's inputs, so one rounding in a different place fails), and every editable
site changing what follows it. A new family gets all of it by adding its cases to ``tests/families.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
from conftest import assert_close, relative_rms
from families import CASES, FAMILY_CASES, MAIN, SEQ, TEXT_MAIN
from reference.cases import assert_every_value, assert_sites_close, jit_run
from reference.harness import TorchEdit
from jstd.core.sites import SITES

every_case = pytest.mark.parametrize("name", sorted(CASES))
main_case = pytest.mark.parametrize("name", MAIN)
text_case = pytest.mark.parametrize("name", TEXT_MAIN)


def layout_sizes(model, site: str, inputs) -> dict[str, int]:
    """Each layout axis name's size for ``site`` on this model and these inputs."""
    from jstd.cli.inspect import axis_sizes

    spec = SITES[site]
    sizes = axis_sizes(model.config, spec.stack or site)
    tokens = inputs.tokens if isinstance(inputs, jstd.Inputs) else inputs
    if tokens is not None:
        batch, seq = np.shape(tokens)
        sizes.update(batch=batch, seq=seq, query=seq, key=seq, streams=3)
    if getattr(inputs, "images", None) is not None:
        if (spec.stack or site).startswith("vision"):
            n = model.config.vision.positions
            sizes.update(query=n, key=n)
        towered = model.tower_images(inputs)[0] if hasattr(model, "tower_images") else inputs.images["pixel_values"]
        sizes.update(images=towered.shape[0],
                     image_tokens=int((np.asarray(tokens) == getattr(model, "image_token_id", -1)).sum()))
        if hasattr(model, "grids"):  # a packed row: every image's patches on one axis
            sizes.update(images=1, patches=towered.shape[0], grid=towered.shape[0])
    if spec.host.endswith("linear_attn"):
        mixer = model.stacks[spec.stack].slot_with("linear_attn").attn
        width, qk_heads, key_dim = mixer.q_conv.shape[-3:]
        sizes.update(heads=mixer.v_conv.shape[-2], key_dim=key_dim, value_dim=mixer.v_conv.shape[-1])
        if site.endswith(("attention_queries", "attention_keys")):
            sizes["heads"] = qk_heads
    return sizes


def final_site(model) -> str:
    """What a run returns: the logits, or a tower's output."""
    return "logits" if "layers" in model.stacks else "vision.tower_output"


def final(model, out):
    return out.logits if out.logits is not None else out["vision.tower_output"]


# ---- every value --------------------------------------------------------------------------------------------------


@every_case
def test_every_value_float32(zoo, name):
    model = zoo(name).model
    out, want = zoo.every_value(name)
    assert_every_value(name, model, out, want, 1e-5)


@pytest.mark.parametrize("name", FAMILY_CASES)
def test_fused_path(zoo, name):
    """With no attention interior read, attention takes the fused path; the stream and the output still match
    (one case per family: the cases within a family differ in what both paths share)."""
    _, _, model, ref, spec = zoo(name)
    inputs, ref_inputs = spec.inputs(model, seed=3)
    reads = tuple(f"{stack}.layer_output" for stack in model.stacks)
    if "layers" in model.stacks:
        reads += ("layers.mlp.mlp_output",)
    else:
        reads += ("vision.tower_output",)
    out = jit_run(model, inputs, reads=reads)
    want = ref.run(ref_inputs, reads=reads + ("logits",))
    assert_sites_close(out, want, reads, 1e-5, name)


@main_case
def test_layouts(zoo, name):
    """Each value's shape is its Site.layout with this model's sizes (block sites: a leading block axis)."""
    _, _, model, _, spec = zoo(name)
    inputs, _ = spec.inputs(model)
    reads = tuple(sorted(model.sites))
    shapes = jax.eval_shape(lambda m, x: jstd.run(m, x, reads=reads), model, inputs)
    for site in reads:
        sizes = layout_sizes(model, site, inputs)
        if site.startswith("projector."):  # a projector's rows and width are its own (the every-value test has torch's)
            # (a packed tower's projector runs on the row itself: [patches, width] -> [tokens, hidden])
            assert len(shapes[site].shape) == (2 if hasattr(model, "grids") else 3), f"{name}:{site} has shape {shapes[site].shape}"
            continue
        want = tuple(sizes[a] for a in SITES[site].layout)
        if SITES[site].per_block:
            want = (len(model.blocks_for(site)),) + want
        assert shapes[site].shape == want, f"{name}:{site} has shape {shapes[site].shape}, layout says {want}"


@main_case
def test_block_identity(zoo, name):
    """layer_input + attention_output == layer_mid and layer_mid + mlp_output == layer_output on every block of every
    stack (each block's mixer, whichever host it has)."""
    model = zoo(name).model
    out, _ = zoo.every_value(name)
    for stack in model.stacks:
        x, mid, y = (np.asarray(out[f"{stack}.{s}"], np.float64) for s in ("layer_input", "layer_mid", "layer_output"))
        mixer = np.zeros_like(x)
        for host in ("self_attn", "linear_attn"):
            site = f"{stack}.{host}.attention_output"
            if site in model.sites:
                mixer[list(model.blocks_for(site))] = out[site]
        np.testing.assert_allclose(x + mixer, mid, rtol=1e-6, atol=1e-6 * np.abs(mid).max())
        np.testing.assert_allclose(mid + np.asarray(out[f"{stack}.mlp.mlp_output"]), y, rtol=1e-6,
                                   atol=1e-6 * np.abs(y).max())


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
    for label, edits, torch_edits in _edit_cases(model, seq):
        out = jit_run(model, inputs, edits, reads=reads)
        want = ref.run(ref_inputs, reads=reads + ("logits",), edits=torch_edits)
        assert np.abs(want[final_site(model)] - clean).max() > 1e-3, f"{label}: the edit changes nothing"
        assert_sites_close(out, want, reads, 1e-5, f"{name}: {label}")


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


# ---- padding and continuation (text models) -----------------------------------------------------------------------


@text_case
@pytest.mark.parametrize("path", ["fused", "explicit"])
def test_left_padding(zoo, name, path):
    """Each left-padded row equals its unpadded prompt at the real positions, on the fused attention path (nothing
    inside attention read) and on the explicit one (attention_probabilities read)."""
    _, _, model, ref, _ = zoo(name)
    rng = np.random.default_rng(5)
    lengths = [SEQ, 7, 4]
    rows = [rng.integers(0, model.config.vocab_size, n) for n in lengths]
    tokens = np.zeros((len(rows), SEQ), np.int64)
    mask = np.zeros((len(rows), SEQ), np.int64)
    for r, row in enumerate(rows):
        tokens[r, SEQ - len(row):] = row
        mask[r, SEQ - len(row):] = 1
    reads = ("layers.layer_output", "next_token_probs")
    if path == "explicit":
        reads += ("layers.self_attn.attention_probabilities",)
    out = jit_run(model, jstd.Inputs(tokens, mask), reads=reads)
    for r, row in enumerate(rows):
        n = len(row)
        want = ref.run(row[None], reads=reads + ("logits",))
        assert_close(out.logits[r, SEQ - n:], want["logits"][0], 1e-5, f"{name}: row {r} logits")
        assert_close(out["layers.layer_output"][:, r, SEQ - n:], want["layers.layer_output"][:, 0], 1e-5)
        assert_close(out["next_token_probs"][r], want["next_token_probs"][0], 1e-5)
        if path == "explicit":
            assert_close(out["layers.self_attn.attention_probabilities"][:, r, :, SEQ - n:, SEQ - n:],
                         want["layers.self_attn.attention_probabilities"][:, 0], 1e-5)


@text_case
def test_context_continues_the_run(zoo, name):
    """A suffix run continuing its prefix's cache (jstd.Context) gives the whole run's values at its positions."""
    _, _, model, _, spec = zoo(name)
    tokens, _ = spec.inputs(model, seed=4)
    whole = jit_run(model, tokens, reads=("layers.layer_output",))
    start = 6
    prefix = jit_run(model, tokens[:, :start], reads=jstd.Context.sites_for(model))
    positions = np.broadcast_to(np.arange(start, SEQ), (tokens.shape[0], SEQ - start))
    context = jstd.Context.continuing(model, prefix, positions)
    suffix = jax.jit(jstd.run, static_argnames="reads")(model, tokens[:, start:], reads=("layers.layer_output",),
                                                        context=context)
    assert_close(suffix.logits, whole.logits[:, start:], 1e-5, f"{name}: logits")
    assert_close(suffix["layers.layer_output"], whole["layers.layer_output"][:, :, start:], 1e-5, name)


# ---- bfloat16 -----------------------------------------------------------------------------------------------------

# (input site, output site): the output is a norm (and multiplier) of the input alone, so given torch's bf16 input
# jstd's bf16 output is torch's bit for bit (RMSNorm), or but for a rare last-bit tie in a LayerNorm (torch's CPU
# kernel sums the moments in another order: about one element in 6000): a rounding moved anywhere in the norm
# changes a quarter of the elements and fails
NEAR_TIES = 1e-3
NORMED = [("layer_input", "attention_norm_output"), ("layer_mid", "mlp_norm_output"),
          ("self_attn.attention_raw_output", "self_attn.attention_output"), ("mlp.mlp_raw_output", "mlp.mlp_output")]


def assert_bf16_exact(actual, expected, label: str) -> None:
    """Bit-equal bfloat16 values, but for at most a NEAR_TIES fraction of elements up to two units in the last place
    off (a near-tie rounded the other way before the norm's weight, which rounds again)."""
    a, b = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    differ = a != b
    ulp = np.abs(b) * 2.0 ** -7 + 1e-30  # bfloat16 keeps 8 significant bits: one unit is at most |b|·2⁻⁷
    assert differ.mean() <= NEAR_TIES, f"{label}: {differ.mean():.2%} of the elements differ from torch's"
    assert (np.abs(a - b)[differ] <= 2 * ulp[differ]).all(), f"{label}: an element differs by more than two units"


def _normed_pairs(model):
    """(input site, output site) for every norm the model has (on every block of the output's)."""
    pairs = []
    for stack in model.stacks:
        for src, dst in NORMED:
            src, dst = f"{stack}.{src}", f"{stack}.{dst}"
            if src in model.sites and dst in model.sites and set(model.blocks_for(dst)) <= set(model.blocks_for(src)):
                pairs.append((src, dst))
    return pairs


@main_case
def test_bfloat16(zoo, name):
    """bf16: every value near torch's bf16 value, and every norm bit-exact when it reads torch's bf16 input (so
    applying a norm's weight before or after the cast, or rounding a multiplier early, fails)."""
    _, _, model, ref, spec = zoo(name, "bfloat16")
    inputs, ref_inputs = spec.inputs(model)
    want = ref.run(ref_inputs)
    reads = tuple(sorted(model.sites))
    out = jit_run(model, inputs, reads=reads)
    for site in reads + (("logits",) if out.logits is not None else ()):
        a, b = np.asarray(out[site], np.float32), want[site]
        assert ((a < -1e30) == (b < -1e30)).all(), f"{name}:{site} masks other entries than torch"
        a, b = np.where(b < -1e30, 0, a), np.where(b < -1e30, 0, b)
        rel = relative_rms(a, b) if b.any() else float(np.abs(a).max())  # zeros (a state_input) stay zeros
        assert rel < 5e-2, f"{name}:{site} bf16 relative RMS error {rel:.3g}"
    assert final(model, out).dtype == jnp.bfloat16
    exact = []
    for src, dst in _normed_pairs(model):
        torch_src = jnp.asarray(want[src], jnp.bfloat16)
        forced = jit_run(model, inputs, [jstd.Set(src, torch_src)], reads=(dst,))[dst]
        assert_bf16_exact(forced, want[dst], f"{name}: {dst} from torch's {src}")
        exact.append(dst)
    last = {"layers": "final_norm_output", "vision.layers": "vision.tower_output"}
    for stack, dst in last.items():
        if stack in model.stacks and dst in model.sites:
            L = model.depth(stack) - 1
            torch_src = jnp.asarray(want[f"{stack}.layer_output"][L], jnp.bfloat16)
            forced = jit_run(model, inputs, [jstd.Set(f"{stack}.layer_output", torch_src, layer=L)], reads=(dst,))[dst]
            assert_bf16_exact(forced, want[dst], f"{name}: {dst}")
            exact.append(dst)
    assert exact, f"{name}: no norm checked"
