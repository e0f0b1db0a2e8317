"""The conformance suite: every family and tower (``families.CASES``) against its torch reference.

Each test runs on every case or on one case per family and tower (``families.MAIN``): every value in float32,
the fused attention path, each value's shape against its ``Site.layout``, the block identity, edits against the
same edits made through torch hooks, left padding on both attention paths, ``jstd.Context`` continuation,
bfloat16 (norms bit-exact given torch's inputs, so one rounding in a different place fails), and every editable
site changing what follows it. A new family gets all of it by adding its cases to ``tests/families.py``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jstd
from conftest import assert_close
from families import CASES, FAMILY_CASES, MAIN, SEQ, TEXT_MAIN
from reference.cases import assert_every_value, assert_sites_close, jit_run
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
    stack (each block's mixer, whichever host it has); on parallel residual blocks (no layer_mid: GPT-NeoX)
    layer_input + attention_output + mlp_output == layer_output."""
    model = zoo(name).model
    out, _ = zoo.every_value(name)
    for stack in model.stacks:
        x, y = (np.asarray(out[f"{stack}.{s}"], np.float64) for s in ("layer_input", "layer_output"))
        mixer = np.zeros_like(x)
        for host in ("self_attn", "linear_attn"):
            site = f"{stack}.{host}.attention_output"
            if site in model.sites:
                mixer[list(model.blocks_for(site))] = out[site]
        if f"{stack}.layer_mid" not in model.sites:  # parallel residual: both sublayers read layer_input
            mid = x + mixer
        else:
            mid = np.asarray(out[f"{stack}.layer_mid"], np.float64)
            np.testing.assert_allclose(x + mixer, mid, rtol=1e-6, atol=1e-6 * np.abs(mid).max())
        np.testing.assert_allclose(mid + np.asarray(out[f"{stack}.mlp.mlp_output"]), y, rtol=1e-6,
                                   atol=1e-6 * np.abs(y).max())


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
