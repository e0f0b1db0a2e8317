"""The torch reference for the Qwen-ViT wrappers (``reference.qwen_vl``) checked against the models themselves and the
family notes' identities: torch only, one tiny checkpoint per family."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText
from transformers.vision_utils import get_vision_window_index

import qwen_vl_cases as cases
from reference.harness import TorchEdit
from reference.qwen_vl import QwenVLReference

COUNTS = (2, 1)  # row 0: grids (1, 4, 6) and (1, 6, 4); row 1: (1, 2, 2); 52 patches, 13 image tokens
WINDOWED = ("qwen2_5_vl", "hyperclovax_vision_v2")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: torch's thread pool only costs here, and under a loaded machine its spinning threads make a run
    tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(cases.CONFIGS))
def family(request, tmp_path_factory):
    name = request.param
    folder = cases.make_qwen_checkpoint(cases.CONFIGS[name](), tmp_path_factory.mktemp(name))
    ref = QwenVLReference(folder)
    batch = cases.qwen_images(None, np.random.default_rng(0), COUNTS)
    return name, folder, ref, batch, ref.run(batch)


def _grids(batch):
    return [tuple(g) for g in batch["image_grid_thw"].tolist()]


def _window_order(batch):
    """The patch permutation Qwen2.5-VL's encoder applies at entry (merge blocks, 4 patches each, into windows)."""
    index, cu = get_vision_window_index(torch.as_tensor(batch["image_grid_thw"]), spatial_merge_size=2,
                                        window_size=16, patch_size=4)
    index = index.numpy()
    return (index[:, None] * 4 + np.arange(4)).reshape(-1), index, cu.numpy()


def _v(out):
    return {k.removeprefix("vision.layers.").removeprefix("self_attn.").removeprefix("mlp."): x
            for k, x in out.items() if k.startswith("vision.layers.")}


def _t(out):
    return {k.removeprefix("layers.").removeprefix("self_attn.").removeprefix("mlp."): x
            for k, x in out.items() if k.startswith("layers.")}


def test_sites_shapes_and_logits_match_the_plain_model(family):
    name, folder, ref, batch, out = family
    assert set(out) == set(ref.sites())
    assert ("positions" in out) == (name != "hyperclovax_vision_v2")
    assert not any(s.endswith(("attention_scores", "attention_probabilities")) for s in out if s.startswith("vision."))
    plain = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = plain(**ref.inputs(batch)).logits.numpy()
    np.testing.assert_array_equal(out["logits"], logits)
    P, tokens, b, s = 52, 13, 2, out["logits"].shape[1]
    assert out["vision.patch_embeddings"].shape == (1, P, 32)
    assert out["vision.layers.layer_input"].shape == (3, 1, P, 32)
    assert out["vision.layers.self_attn.attention_queries"].shape == (3, 1, 4, P, 8)
    assert out["vision.layers.self_attn.attention_values"].shape == (3, 1, 4, P, 8)
    assert out["vision.layers.self_attn.attention_head_outputs"].shape == (3, 1, P, 4, 8)
    assert out["vision.layers.mlp.mlp_neurons"].shape == (3, 1, P, 96 if name == "qwen2_vl" else 48)
    assert out["vision.tower_output"].shape == (1, P, 32)
    assert out["vision.image_features"].shape == (tokens, 64)
    assert out["vision.image_token_mask"].sum() == tokens
    assert out["layers.self_attn.attention_keys"].shape == (2, b, 2, s, 16)
    if name == "hyperclovax_vision_v2":
        assert out["vision.merger.output"].shape == (tokens, 48)
        assert out["projector.input"].shape == (tokens, 48)
        np.testing.assert_allclose(out["logits"], 0.5 * out["lm_head_output"], rtol=1e-6)  # logits_scaling
    else:
        assert out["projector.input"].shape == (P, 32)
        assert out["positions"].shape == (3, b, s) and out["positions"].dtype == np.int64
    assert out["projector.output"].shape == (tokens, 64)


def test_block_identities(family):
    name, _, ref, batch, out = family
    for v in (_v(out), _t(out)):
        np.testing.assert_allclose(v["layer_input"] + v["attention_output"], v["layer_mid"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(v["layer_input"] + v["attention_output"] + v["mlp_output"], v["layer_output"],
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(v["layer_input"][1:], v["layer_output"][:-1])
        np.testing.assert_array_equal(v["mlp_norm_output"], v["mlp_input"])
        np.testing.assert_array_equal(v["attention_head_outputs"], v["attention_premix"])
    v = _v(out)
    if name == "qwen2_vl":
        np.testing.assert_array_equal(v["mlp_activation"], v["mlp_neurons"])
        np.testing.assert_array_equal(v["layer_input"][0], out["vision.patch_embeddings"])
    else:  # entry into window order; the SwiGLU's neurons are act(gate) * up, not act(gate)
        assert not np.allclose(v["mlp_activation"], v["mlp_neurons"])
        order, _, _ = _window_order(batch)
        assert not np.array_equal(order, np.arange(len(order)))
        np.testing.assert_array_equal(v["layer_input"][0], out["vision.patch_embeddings"][:, order])
    np.testing.assert_array_equal(out["vision.tower_output"], v["layer_output"][-1])
    t = _t(out)
    if name == "hyperclovax_vision_v2":  # contributions: post-norm outputs times the text residual_multiplier 0.5
        assert not np.allclose(t["attention_output"], t["attention_raw_output"])
        assert not np.allclose(t["mlp_output"], t["mlp_raw_output"])
    else:
        np.testing.assert_array_equal(out["projector.input"], out["vision.tower_output"][0])


def test_image_features_at_the_scatter(family):
    name, _, ref, batch, out = family
    mask = out["vision.image_token_mask"]
    np.testing.assert_array_equal(mask, batch["input_ids"] == cases.IMAGE_TOKEN)
    features = out["vision.image_features"]
    entry = out["layers.layer_input"][0]
    multiplier = 2.0 if name == "hyperclovax_vision_v2" else 1.0  # HCX's text model multiplies inputs_embeds
    np.testing.assert_array_equal(entry[mask], multiplier * features)
    np.testing.assert_array_equal(entry[~mask], multiplier * out["token_embeddings"][~mask])
    _, windows, _ = _window_order(batch)
    restore = np.argsort(windows)
    if name == "qwen2_vl":
        np.testing.assert_array_equal(features, out["projector.output"])
    elif name == "qwen2_5_vl":  # the merger runs in window order; the encoder restores token order after it
        np.testing.assert_array_equal(features, out["projector.output"][restore])
        assert not np.allclose(features, out["projector.output"])
    else:
        np.testing.assert_array_equal(features, out["projector.output"])
        np.testing.assert_array_equal(out["projector.input"], out["vision.merger.output"][restore])
        assert not np.allclose(out["projector.input"], out["vision.merger.output"])
    if name == "hyperclovax_vision_v2":
        assert out["projector.input"].shape[0] == mask.sum()
    else:
        assert out["projector.input"].shape[0] // 4 == mask.sum()


def _chunked_attention(q, k, v, bounds):
    """Softmax attention of [heads, P, d] queries/keys/values within each [a, b) of ``bounds``: [P, heads, d]."""
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        scores = q[:, a:b] @ k[:, a:b].transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        p = np.exp(scores - scores.max(-1, keepdims=True))
        parts.append((p / p.sum(-1, keepdims=True)) @ v[:, a:b])
    return np.concatenate(parts, axis=1).transpose(1, 0, 2)


def test_vision_attention_runs_per_image_and_per_window(family):
    name, _, ref, batch, out = family
    v = _v(out)
    q, k, vals, heads = (v[s][:, 0] for s in ("attention_queries", "attention_keys", "attention_values",
                                               "attention_head_outputs"))
    images = np.concatenate([[0], np.cumsum([t * h * w for t, h, w in _grids(batch)])])
    full = 0 if name == "qwen2_vl" else 1
    np.testing.assert_allclose(_chunked_attention(q[full], k[full], vals[full], images), heads[full],
                               rtol=1e-4, atol=1e-5)
    if name != "qwen2_vl":  # block 0 attends within windows of 16 patches, not whole images
        _, _, windows = _window_order(batch)
        assert len(windows) > len(images)
        np.testing.assert_allclose(_chunked_attention(q[0], k[0], vals[0], windows), heads[0], rtol=1e-4, atol=1e-5)
        assert not np.allclose(_chunked_attention(q[0], k[0], vals[0], images), heads[0], rtol=1e-4, atol=1e-5)
    # queries and keys are after the rotary: each (i, i + d/2) pair is a rotation of the projection's
    block = ref._module(ref.paths["tower"]).blocks[full].attn.qkv
    with torch.no_grad():
        raw = block(torch.as_tensor(v["attention_norm_output"][full, 0])).numpy().reshape(-1, 3, 4, 8)
    np.testing.assert_allclose(raw[:, 2].transpose(1, 0, 2), vals[full], rtol=1e-5, atol=1e-5)
    for got, proj in ((q[full], raw[:, 0]), (k[full], raw[:, 1])):
        proj = proj.transpose(1, 0, 2)
        pair = lambda x: x[..., :4] ** 2 + x[..., 4:] ** 2
        np.testing.assert_allclose(pair(got), pair(proj), rtol=1e-4, atol=1e-5)
        assert not np.allclose(got, proj, atol=1e-3)


def _expected_positions(batch):
    """The notes' M-RoPE positions: text counts up over real tokens; an image's tokens take (start, start + row,
    start + column) over its grid of merged tokens; the text after it resumes at start + max(rows, columns)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    grids = iter(_grids(batch))
    want = np.zeros((3,) + ids.shape, np.int64)
    for r in range(ids.shape[0]):
        pos, j, real = 0, 0, np.flatnonzero(mask[r])
        while j < len(real):
            if ids[r, real[j]] != cases.IMAGE_TOKEN:
                want[:, r, real[j]] = pos
                pos, j = pos + 1, j + 1
                continue
            _, h, w = next(grids)
            h, w = h // 2, w // 2
            rows, cols = np.divmod(np.arange(h * w), w)
            at = real[j:j + h * w]
            want[0, r, at], want[1, r, at], want[2, r, at] = pos, pos + rows, pos + cols
            pos, j = pos + max(h, w), j + h * w
    return want


def test_positions(family):
    name, _, ref, batch, out = family
    if name == "hyperclovax_vision_v2":
        assert "positions" not in ref.sites()
        return
    np.testing.assert_array_equal(out["positions"], _expected_positions(batch))
    # the first image (grid 1 x 4 x 6: 2 x 3 tokens) after two text tokens: rows 2, 2, 2, 3, 3, 3; text resumes at 5
    first = np.flatnonzero(batch["input_ids"][0] == cases.IMAGE_TOKEN)[:6]
    np.testing.assert_array_equal(out["positions"][:, 0, first], [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]])
    assert out["positions"][0, 0, first[-1] + 1] == 5
    # text alone: the three streams equal, counting each row's real tokens (0 at padding)
    ids = np.where(batch["input_ids"] == cases.IMAGE_TOKEN, 7, batch["input_ids"])
    text = {"input_ids": ids, "attention_mask": batch["attention_mask"]}
    got = ref.run(text, reads=("positions", "logits"))
    real = batch["attention_mask"].astype(bool)
    count = np.where(real, np.cumsum(real, -1) - 1, 0)
    np.testing.assert_array_equal(got["positions"], np.broadcast_to(count, (3,) + count.shape))
    # a left-padded row gives its unpadded prompt's logits
    r = len(COUNTS) - 1
    alone = ref.run({"input_ids": ids[r:, real[r]], "attention_mask": np.ones((1, real[r].sum()), np.int64)},
                    reads=("logits",))
    np.testing.assert_allclose(got["logits"][r, real[r]], alone["logits"][0], rtol=1e-4, atol=1e-5)


def test_edits_reach_the_model(family):
    name, _, ref, batch, out = family
    reads = ("logits", "vision.layers.layer_output", "vision.layers.layer_mid", "vision.layers.mlp.mlp_output",
             "vision.layers.layer_input")
    half = ref.run(batch, reads, [TorchEdit("vision.layers.mlp.mlp_output", lambda x: 0.5 * x, layer=1)])
    assert not np.allclose(half["logits"], out["logits"], atol=1e-4)
    np.testing.assert_array_equal(half["vision.layers.layer_output"][0], out["vision.layers.layer_output"][0])
    np.testing.assert_array_equal(half["vision.layers.mlp.mlp_output"][0], out["vision.layers.mlp.mlp_output"][0])
    np.testing.assert_allclose(half["vision.layers.mlp.mlp_output"][1], 0.5 * out["vision.layers.mlp.mlp_output"][1],
                               rtol=1e-6)
    np.testing.assert_allclose(half["vision.layers.layer_output"][1],
                               out["vision.layers.layer_mid"][1] + 0.5 * out["vision.layers.mlp.mlp_output"][1],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(half["vision.layers.layer_input"][2], half["vision.layers.layer_output"][1])

    # zero values at block 0: each head output is 0, so the attention's output is the projection's bias
    zero = ref.run(batch, ("vision.layers.self_attn.attention_head_outputs", "vision.layers.self_attn.attention_output",
                           "logits"),
                   [TorchEdit("vision.layers.self_attn.attention_values", torch.zeros_like, layer=0)])
    assert not (zero["vision.layers.self_attn.attention_head_outputs"][0] != 0).any()
    bias = ref._module(ref.paths["tower"]).blocks[0].attn.proj.bias.detach().numpy()
    np.testing.assert_allclose(zero["vision.layers.self_attn.attention_output"][0, 0],
                               np.broadcast_to(bias, (52, 32)), rtol=1e-6, atol=1e-6)
    assert not np.allclose(zero["logits"], out["logits"], atol=1e-4)
    # zero queries at block 0: uniform attention within each chunk (image or window)
    flat = ref.run(batch, ("vision.layers.self_attn.attention_head_outputs",),
                   [TorchEdit("vision.layers.self_attn.attention_queries", torch.zeros_like, layer=0)])
    vals = out["vision.layers.self_attn.attention_values"][0, 0]
    first = 24 if name == "qwen2_vl" else 16  # the first chunk: image 0 (24 patches), or its first window
    np.testing.assert_allclose(flat["vision.layers.self_attn.attention_head_outputs"][0, 0, :first],
                               np.broadcast_to(vals[:, :first].mean(1), (first, 4, 8)), rtol=1e-5, atol=1e-6)

    # zeroing the image as the text model receives it
    gone = ref.run(batch, ("logits", "layers.layer_input", "vision.image_features"),
                   [TorchEdit("vision.image_features", torch.zeros_like)])
    mask = out["vision.image_token_mask"]
    assert not gone["layers.layer_input"][0][mask].any()
    np.testing.assert_array_equal(gone["layers.layer_input"][0][~mask], out["layers.layer_input"][0][~mask])
    assert not np.allclose(gone["logits"], out["logits"], atol=1e-4)
