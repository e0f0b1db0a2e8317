"""The Qwen ViT line (Qwen2-VL, Qwen2.5-VL, HyperCLOVA X Vision V2) beyond the conformance suite: the notes'
identities on jstd's values, edits against torch hooks on all three, PIL images through the processor, M-RoPE
positions and their continuation, text-only prompts, the tower alone, and bad inputs."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from PIL import Image

import jstd
from conftest import assert_close
from reference.cases import jit_run
from reference.harness import TorchEdit
from jstd.vision.qwen_vit import packing

QWEN = ("qwen2_vl", "qwen2_5_vl", "hyperclovax_vision_v2")


def layout(model, inputs):
    return packing(inputs.static("image_grid_thw"), model.vision.merge, model.vision.window)


@pytest.mark.parametrize("name", QWEN)
def test_identities(zoo, name):
    """The scatter, one image token per 2 × 2 block, window vs scatter order, and a softmax over each
    segment's slice of queries and keys reproducing the head outputs (full blocks: images; windowed: windows)."""
    case = zoo(name)
    model = case.model
    inputs, _ = case.spec.inputs(model)
    out, _ = zoo.every_value(name)
    mask = np.asarray(out["vision.image_token_mask"])
    features = np.asarray(out["vision.image_features"])
    first = np.asarray(out["layers.layer_input"][0])
    scale = model.text.embedding_multiplier
    np.testing.assert_array_equal(first[mask], np.asarray(jax.numpy.asarray(features) * scale) if scale != 1 else features)
    pack = layout(model, inputs)
    if name == "hyperclovax_vision_v2":
        merged = np.asarray(out["vision.merger.output"])
        assert merged.shape[0] == mask.sum()
        np.testing.assert_array_equal(np.asarray(out["projector.input"]), merged[pack.restore])
        np.testing.assert_array_equal(np.asarray(out["projector.output"]), features)
    else:
        fed, projected = np.asarray(out["projector.input"]), np.asarray(out["projector.output"])
        assert fed.shape[0] // 4 == mask.sum()
        np.testing.assert_array_equal(fed, np.asarray(out["vision.tower_output"])[0])
        restore = slice(None) if pack.restore is None else pack.restore
        np.testing.assert_array_equal(projected[restore], features)
        if pack.restore is not None:
            assert not np.array_equal(projected, features)  # window order differs from the images' order here
    heads = model.config.vision.head_dim
    for block, windowed in enumerate(kind == "window_attention" for kind in model.vision.layers.kinds):
        q, k, v = (np.asarray(out[f"vision.layers.self_attn.attention_{x}"][block][0], np.float64)
                   for x in ("queries", "keys", "values"))
        want = np.asarray(out["vision.layers.self_attn.attention_head_outputs"][block][0])
        segs = pack.window if windowed else pack.full
        lengths = [h * w for t, h, w in inputs.static("image_grid_thw")] if not windowed else None
        bounds = np.cumsum([0] + (lengths or list(_window_lengths(segs))))
        for a, b in zip(bounds[:-1], bounds[1:]):
            scores = q[:, a:b] @ k[:, a:b].transpose(0, 2, 1) * heads ** -0.5
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose((p @ v[:, a:b]).transpose(1, 0, 2), want[a:b], rtol=1e-5, atol=1e-5)


def _window_lengths(segs):
    if segs.valid is None:
        return [segs.longest] * segs.count
    return segs.valid.sum(-1).tolist()


@pytest.mark.parametrize("name", QWEN)
def test_edits_match_torch_hooks(zoo, name):
    """Zeroing the image features, zeroing one image's patches in a tower block, and halving one tower block's MLP
    give torch's values under the same edits through hooks."""
    case = zoo(name)
    model, ref = case.model, case.ref
    inputs, batch = case.spec.inputs(model, seed=7)
    grids = inputs.static("image_grid_thw")
    pack = layout(model, inputs)
    start = grids[0][1] * grids[0][2]
    rows = np.arange(start, start + grids[1][1] * grids[1][2])  # image 1's patches in the images' order
    if pack.order is not None:  # the block values are in window order: image 1's rows there
        rows = np.flatnonzero(np.isin(pack.order, rows))

    def zero_rows(t, rows=rows):
        t = t.clone()
        t[:, rows] = 0
        return t

    cases = [
        ("zero image features", [jstd.Zero("vision.image_features")],
         [TorchEdit("vision.image_features", lambda t: torch.zeros_like(t))]),
        ("zero image 1's patches at block 1", [jstd.Zero("vision.layers.layer_output", layer=1, positions=rows)],
         [TorchEdit("vision.layers.layer_output", zero_rows, 1)]),
        ("halve block 2's MLP", [jstd.Scale("vision.layers.2.mlp.mlp_output", 0.5)],
         [TorchEdit("vision.layers.mlp.mlp_output", lambda t: t * 0.5, 2)]),
    ]
    reads = ("layers.layer_output", "vision.image_features")
    clean = ref.run(batch, reads=("logits",))["logits"]
    for label, edits, torch_edits in cases:
        out = jit_run(model, inputs, edits, reads=reads)
        want = ref.run(batch, reads=reads + ("logits",), edits=torch_edits)
        assert np.abs(want["logits"] - clean).max() > 1e-3, f"{label}: the edit changes nothing"
        for site in reads + ("logits",):
            assert_close(out[site] if site != "logits" else out.logits, want[site], 1e-5, f"{name}: {label}: {site}")


def test_mrope_positions_follow_the_grids(zoo):
    """positions: text counts up, an image's tokens take start + (t, row, column), text after it resumes at
    start + max(rows, columns); padding 0; a text-only prompt is three equal streams counting real tokens."""
    case = zoo("qwen2_vl")
    inputs, _ = case.spec.inputs(case.model, counts=(1, 1))
    out = jit_run(case.model, inputs, reads=("positions",))
    pos = np.asarray(out["positions"])
    tokens, mask = np.asarray(inputs.tokens), np.asarray(inputs.attention_mask).astype(bool)
    grids = inputs.static("image_grid_thw")
    for row, (t, h, w) in enumerate(grids):
        real = np.flatnonzero(mask[row])
        image = np.flatnonzero(tokens[row] == case.model.image_token_id)
        start = image[0] - real[0]
        rr, cc = np.divmod(np.arange(len(image)), w // 2)
        np.testing.assert_array_equal(pos[:, row, image], np.stack([np.full_like(rr, start), start + rr, start + cc]))
        after = real[real > image[-1]]
        np.testing.assert_array_equal(pos[:, row, after], np.broadcast_to(start + max(h, w) // 2 + np.arange(len(after)),
                                                                         (3, len(after))))
        np.testing.assert_array_equal(pos[:, row, real[real < image[0]]], np.broadcast_to(np.arange(start), (3, start)))
        assert (pos[:, row, ~mask[row]] == 0).all()
    text = jstd.Inputs(np.full((2, 5), 7), np.array([[1] * 5, [0, 0, 1, 1, 1]]))
    plain = np.asarray(jit_run(case.model, text, reads=("positions",))["positions"])
    np.testing.assert_array_equal(plain, np.broadcast_to(np.array([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]), (3, 2, 5)))


@pytest.mark.parametrize("name", ["qwen2_vl", "hyperclovax_vision_v2"])
def test_text_only_prompt_matches_torch(zoo, name):
    """A prompt without images (left-padded): the text model alone, ordinary rotary on three equal streams."""
    case = zoo(name)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 95, (2, 9))
    mask = np.ones_like(tokens)
    mask[1, :3] = 0
    out = jit_run(case.model, jstd.Inputs(tokens, mask), reads=("layers.layer_output",))
    want = case.ref.run({"input_ids": tokens, "attention_mask": mask}, reads=("logits",))
    real = mask.astype(bool)
    assert_close(np.asarray(out.logits)[real], want["logits"][real], 1e-5, f"{name} text logits")


def test_a_context_continues_past_an_image_prompt(zoo):
    """Tokens after an image prompt, continuing its cache: the M-RoPE delta carries on, so they get the whole run's
    values; tokens inside the prompt take its stored positions."""
    case = zoo("qwen2_5_vl")
    model = case.model
    inputs, _ = case.spec.inputs(model, counts=(1, 1))
    tokens, mask = np.asarray(inputs.tokens), np.asarray(inputs.attention_mask)
    whole = jit_run(model, inputs, reads=("layers.layer_output",))
    cut = tokens.shape[1] - 2
    prefix = jstd.Inputs(tokens[:, :cut], mask[:, :cut], inputs.images, inputs.layout)
    first = jit_run(model, prefix, reads=jstd.Context.sites_for(model))
    assert "positions" in jstd.Context.sites_for(model)
    every = jit_run(model, inputs, reads=jstd.Context.sites_for(model))
    positions = np.broadcast_to(np.arange(cut, tokens.shape[1]), (2, 2))
    for label, source in (("past the prefix", first), ("inside the whole run", every)):
        context = jstd.Context.continuing(model, source, positions, mask=mask[:, :source["positions"].shape[2]])
        suffix = jstd.run(model, tokens[:, cut:], reads=("layers.layer_output",), context=context)
        assert_close(suffix.logits, np.asarray(whole.logits)[:, cut:], 1e-5, label)
        assert_close(suffix["layers.layer_output"], np.asarray(whole["layers.layer_output"])[:, :, cut:], 1e-5, label)


@pytest.fixture(scope="module")
def qwen_with_processor(tmp_path_factory):
    """A tiny Qwen2-VL whose vocabulary is the tiny-llama tokenizer's plus the vision tokens, saved with its
    Qwen2VLProcessor (PIL image processor, 4-pixel patches)."""
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    import families
    import qwen_vl_cases
    from reference.qwen_vl import QwenVLReference

    tokenizer = AutoTokenizer.from_pretrained(families.ASSET_TOKENIZER, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                                "<|video_pad|>"]})
    tokenizer.padding_side = "left"
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                      size={"shortest_edge": 8 * 8, "longest_edge": 24 * 24})
    config = qwen_vl_cases.qwen2_vl_config()
    config.text_config.vocab_size = len(tokenizer)
    config.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    config.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    folder = qwen_vl_cases.make_qwen_checkpoint(config, tmp_path_factory.mktemp("qwen-processor"))
    tokenizer.save_pretrained(folder)  # the processor's parts: Qwen2VLProcessor itself wants a video processor
    images.save_pretrained(folder)
    (folder / "processor_config.json").write_text('{"processor_class": "Qwen2VLProcessor"}')
    assert isinstance(jstd.load_processor(folder), Qwen2VLProcessor)  # built without the video processor
    return folder, jstd.load(folder), QwenVLReference(folder)


def test_pil_images_through_the_processor(qwen_with_processor):
    """A square and a wide image, two in one prompt, a left-padded batch: the processor's arrays through
    jstd.Inputs.of give torch's logits; one image token too few is refused with both counts."""
    folder, model, ref = qwen_with_processor
    processor = jstd.load_processor(folder)
    rng = np.random.default_rng(3)
    square = Image.fromarray(rng.integers(0, 256, (20, 20, 3), np.uint8))
    wide = Image.fromarray(rng.integers(0, 256, (14, 41, 3), np.uint8))
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    texts = [f"a {pad} and {pad} here", f"then {pad}"]
    batch = processor(text=texts, images=[square, wide, wide], return_tensors="np", padding=True)
    inputs = jstd.Inputs.of(batch)
    grids = inputs.static("image_grid_thw")
    assert len(set(grids)) == 2 and np.asarray(batch["attention_mask"])[1, 0] == 0
    out = jit_run(model, inputs)
    real = np.asarray(batch["attention_mask"]).astype(bool)
    want = ref.run(dict(batch), reads=("logits",))["logits"]
    assert_close(np.asarray(out.logits)[real], want[real], 1e-5, "processor batch")
    fewer = dict(batch)
    ids = np.asarray(batch["input_ids"]).copy()
    ids[0, np.flatnonzero(ids[0] == model.image_token_id)[0]] = 5
    fewer["input_ids"] = ids
    n = int((np.asarray(batch["input_ids"]) == model.image_token_id).sum())
    with pytest.raises(ValueError, match=f"{n - 1} image tokens .* give {n}"):
        jstd.run(model, jstd.Inputs.of(fewer))


def test_bad_image_inputs_are_refused(zoo):
    """Pixels that do not fit the grids, a grid that is not what the layout recorded, and videos name the fix."""
    case = zoo("qwen2_vl")
    inputs, batch = case.spec.inputs(case.model)
    short = dict(batch, pixel_values=batch["pixel_values"][:-4])
    with pytest.raises(ValueError, match="pixel_values has shape"):
        jstd.run(case.model, jstd.Inputs.of(short))
    stale = jstd.Inputs(inputs.tokens, inputs.attention_mask, dict(inputs.images, image_grid_thw=np.array(
        [[1, 2, 2]] * len(inputs.static("image_grid_thw")))), inputs.layout)
    with pytest.raises(ValueError, match="differs from the inputs' recorded layout"):
        jstd.run(case.model, stale)
    with pytest.raises(ValueError, match="videos are not supported"):
        jstd.run(case.model, jstd.Inputs.of(dict(batch, pixel_values_videos=batch["pixel_values"])))
    unrecorded = jstd.Inputs(inputs.tokens, inputs.attention_mask, inputs.images)
    with pytest.raises(ValueError, match="statically"):
        jax.jit(jstd.run)(case.model, unrecorded)
    with pytest.raises(jstd.SiteError, match="no one tensor is the block's pattern"):
        jstd.run(case.model, inputs, reads=("vision.layers.1.self_attn.attention_probabilities",))


def test_the_tower_alone(tmp_path):
    """A Qwen2.5-VL vision model saved alone loads as the tower with its merger: its values equal transformers'."""
    from transformers import AutoModel
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    import qwen_vl_cases

    config = Qwen2_5_VLVisionConfig(**qwen_vl_cases.QWEN2_5_VISION, out_hidden_size=24)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(tmp_path)
    ref = AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    grids = np.array([(1, 4, 6), (1, 8, 8)])
    pixels = np.random.default_rng(0).normal(size=(int(grids.prod(-1).sum()), 96)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids))
    tower = jstd.load(tmp_path)
    inputs = jstd.Inputs.of({"pixel_values": pixels, "image_grid_thw": grids})
    out = jit_run(tower, inputs, reads=("vision.tower_output", "vision.merger.output"))
    assert out.logits is None
    assert_close(out["vision.tower_output"][0], want.last_hidden_state.numpy(), 1e-5, "tower output")
    restore = layout(tower, inputs).restore
    assert_close(np.asarray(out["vision.merger.output"])[restore], want.pooler_output.numpy(), 1e-5, "merger")


def test_checkpoint_layouts_load(zoo, tmp_path):
    """transformers' in-memory names (model.visual., model.language_model.) and the hub's (visual., model.) load the
    same Qwen2-VL."""
    from safetensors.numpy import load_file, save_file

    case = zoo("qwen2_vl")
    tensors = load_file(case.folder / "model.safetensors")
    hub = any(k.startswith("visual.") for k in tensors)
    rename = (lambda k: "model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
              if k.startswith("model.") else k) if hub else (
        lambda k: k.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1))
    other = {rename(k): v for k, v in tensors.items()}
    assert set(other) != set(tensors)
    save_file(other, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((case.folder / "config.json").read_text())
    inputs, _ = case.spec.inputs(case.model)
    assert_close(jit_run(jstd.load(tmp_path), inputs).logits, jit_run(case.model, inputs).logits, 0, "other layout")
