"""Qwen3-VL beyond the conformance suite (whose ``qwen3_vl`` case compares every value — text, tower, DeepStack
taps, positions, logits — with torch in float32 on a left-padded batch of three images: wide, tall and square, two
in one row): the DeepStack identity, the learned positions' resampling, removing the image (features *and* taps)
against torch hooks, Qwen3.5's tower (no DeepStack) alone (the MoE line: tests/test_moe.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
from conftest import assert_close
from reference.cases import jit_run
from reference.harness import TorchEdit
from jstd.vision.qwen_vit import position_taps

NAME = "qwen3_vl"


def test_deepstack_identity(zoo):
    """Block k + 1 reads block k's output plus tap k at the image tokens and block k's output elsewhere, exactly
    (taps on blocks 0 … K - 1 only); block 0 reads the image features; the tower's block 0 reads the patch
    embeddings plus the resampled position table."""
    model = zoo(NAME).model
    inputs, _ = zoo(NAME).spec.inputs(model)
    out, _ = zoo.every_value(NAME)
    mask = np.asarray(out["vision.image_token_mask"])
    x, y = np.asarray(out["layers.layer_input"]), np.asarray(out["layers.layer_output"])
    taps = np.asarray(out["layers.deepstack_output"])
    assert model.blocks_for("layers.deepstack_output") == (0, 1) and taps.shape == (2, mask.sum(), 64)
    for k in range(model.depth() - 1):
        want = y[k].copy()
        if k < len(taps):
            want[mask] = (jnp.asarray(y[k][mask]) + jnp.asarray(taps[k])).__array__()
        np.testing.assert_array_equal(x[k + 1], want, err_msg=f"block {k + 1}'s input")
    np.testing.assert_array_equal(x[0][mask], np.asarray(out["vision.image_features"]))
    grids = inputs.static("image_grid_thw")
    positions = model.vision.positions(grids, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out["vision.layers.layer_input"])[0],
                                  np.asarray(out["vision.patch_embeddings"] + positions))


def test_position_taps_are_transformers():
    """The resampling's table rows and float32 weights equal transformers' bilinear, corner-aligned ones in
    merge-block order, for grids larger, smaller and other than the table, over several frames."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    grids = ((1, 4, 6), (2, 6, 4), (1, 2, 2), (1, 8, 12), (1, 48, 2))
    for side in (4, 7, 48):
        want_i, want_w = get_vision_interpolation_indices_and_weights(
            torch.tensor(grids), side, mode="bilinear", align_corners=True, spatial_merge_size=2)
        indices, weights = position_taps(grids, 2, side)
        np.testing.assert_array_equal(indices, want_i.numpy())
        np.testing.assert_array_equal(weights, want_w.numpy())


def _scaled(features, taps) -> tuple[list, list]:
    """(jstd edits, torch edits): the image features times ``features``, DeepStack tap k times ``taps[k]``."""
    edits = [jstd.Scale("vision.image_features", jnp.float32(features)),
             jstd.Scale("layers.deepstack_output", jnp.asarray(taps, jnp.float32)[:, None, None])]
    torch_edits = [TorchEdit("vision.image_features", lambda t: t * features)]
    torch_edits += [TorchEdit("layers.deepstack_output", lambda t, f=f: t * f, k) for k, f in enumerate(taps)]
    return edits, torch_edits


def test_removing_the_image_takes_the_taps_too(zoo):
    """Zeroing vision.image_features leaves the image in the logits (other pixels change them: the DeepStack taps
    carry it into blocks 1 and 2); zeroing the taps as well removes it (other pixels change nothing). Both, and one
    tap doubled, equal torch under the same edits through hooks; one compile serves every case."""
    case = zoo(NAME)
    model, ref = case.model, case.ref
    inputs, batch = case.spec.inputs(model, seed=7)
    other = dict(batch, pixel_values=np.random.default_rng(1).standard_normal(batch["pixel_values"].shape)
                 .astype(np.float32))
    mask = np.asarray(inputs.tokens) == model.image_token_id
    after = np.asarray(inputs.attention_mask).astype(bool) & (np.cumsum(mask, 1) == mask.sum(1, keepdims=True)) & ~mask
    reads = ("layers.layer_input",)
    clean = ref.run(batch, reads=("logits",))["logits"]
    logits = {}
    for label, scales in (("features", (0.0, (1.0, 1.0))), ("features and taps", (0.0, (0.0, 0.0))),
                          ("tap 1 doubled", (1.0, (1.0, 2.0)))):
        edits, torch_edits = _scaled(*scales)
        out = jit_run(model, inputs, edits, reads=reads)
        want = ref.run(batch, reads=reads + ("logits",), edits=torch_edits)
        assert np.abs(want["logits"] - clean).max() > 1e-3, f"{label}: the edit changes nothing"
        assert_close(out.logits, want["logits"], 1e-5, f"{label}: logits")
        assert_close(out["layers.layer_input"], want["layers.layer_input"], 1e-5, f"{label}: layer_input")
        logits[label] = (np.asarray(out.logits),
                         np.asarray(jit_run(model, jstd.Inputs.of(other), edits, reads=reads).logits))
    kept, removed = logits["features"], logits["features and taps"]
    assert np.abs(kept[0] - kept[1])[after].max() > 1e-3, "zeroed features alone: the pixels no longer matter"
    np.testing.assert_array_equal(removed[0], removed[1])  # the image is gone: its pixels change nothing


def test_qwen3_5_tower_alone(tmp_path):
    """Qwen3.5's vision model (the Qwen3-VL tower without DeepStack) saved alone loads as the tower with its merger;
    its values equal transformers'."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    import qwen3_vl_cases
    from reference.checkpoints import randomize

    config = Qwen3_5VisionConfig(**qwen3_vl_cases.QWEN3_5_VISION)
    torch.manual_seed(0)
    ref = Qwen3_5VisionModel(config)
    randomize(ref, 0)
    ref.save_pretrained(tmp_path)
    ref.eval()
    grids = np.array([(1, 4, 6), (1, 8, 8)])
    pixels = np.random.default_rng(0).normal(size=(int(grids.prod(-1).sum()), 96)).astype(np.float32)
    captured = {}
    hook = ref.blocks[0].register_forward_pre_hook(lambda m, args: captured.update(x=args[0].clone()))
    with torch.no_grad():
        want = ref(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids))
    hook.remove()
    tower = jstd.load(tmp_path)
    assert tower.vision.deepstack == () and "layers.deepstack_output" not in tower.sites
    out = jit_run(tower, jstd.Inputs.of({"pixel_values": pixels, "image_grid_thw": grids}),
                  reads=("vision.layers.0.layer_input", "vision.tower_output", "vision.merger.output"))
    assert_close(out["vision.layers.0.layer_input"][0], captured["x"].numpy(), 1e-5, "block 0's input")
    assert_close(out["vision.tower_output"][0], want.last_hidden_state.numpy(), 1e-5, "tower output")
    assert_close(out["vision.merger.output"], want.pooler_output.numpy(), 1e-5, "merger")


def test_deepstack_needs_images(zoo):
    """Without images there are no taps: reading or editing them says so; a block past the taps has none."""
    model = zoo(NAME).model
    text = jstd.Inputs(np.full((1, 5), 7), np.ones((1, 5), np.int64))
    for kw in (dict(reads=("layers.deepstack_output",)), dict(edits=[jstd.Zero("layers.deepstack_output", layer=1)])):
        with pytest.raises(ValueError, match="layers.deepstack_output needs images"):
            jstd.run(model, text, **kw)
    inputs, _ = zoo(NAME).spec.inputs(model)
    with pytest.raises(jstd.SiteError, match="blocks with it: 0..1"):
        jstd.run(model, inputs, reads=("layers.2.deepstack_output",))


