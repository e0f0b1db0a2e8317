"""Idefics 3 / SmolVLM beyond the conformance cases: the projector reads the tower's output, the scatter identity,
the PIL processor's real output (tiles, padding images, a partial pixel mask) against torch, and a token-count
mismatch."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer, Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

import jstd
from conftest import assert_close
from families import IDEFICS3_PATHS, TOWER, WRAPPER_TEXT, idefics3_images
from reference.cases import jit_run
from reference.wrapper import WrapperReference, make_wrapper_checkpoint

ASSETS = __import__("pathlib").Path(__file__).parents[1] / "jstd" / "assets" / "tiny-llama"
TILE = 32  # the tower's image_size: 4 × 4 patches of 8, 2 × 2 shuffled into 4 tokens a tile


@pytest.fixture(scope="module")
def processor():
    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>", "<global-img>"]})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE})
    return Idefics3Processor(images, tokenizer, image_seq_len=(TILE // 8) ** 2 // 4)


@pytest.fixture(scope="module")
def idefics3(processor, tmp_path_factory):
    """(jstd model, torch reference) of a tiny Idefics 3 whose vocabulary covers the processor's tokens."""
    tokenizer = processor.tokenizer
    config = Idefics3Config(vision_config=dict(model_type="idefics3_vision", **TOWER),
                            text_config={**WRAPPER_TEXT, "vocab_size": len(tokenizer)},
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2)
    folder = make_wrapper_checkpoint(config, tmp_path_factory.mktemp("idefics3"), seed=5)
    return jstd.load(folder), WrapperReference(folder, paths=IDEFICS3_PATHS)


def test_projector_reads_tower_output_and_scatter_identity(idefics3):
    model, _ = idefics3
    arrays = idefics3_images(model, np.random.default_rng(1), (2, 1))
    arrays["input_ids"] = np.where(arrays["input_ids"] == 96, model.image_token_id, arrays["input_ids"])
    inputs = jstd.Inputs.of(arrays)
    out = jit_run(model, inputs, reads=("vision.tower_output", "projector.input", "projector.output",
                                         "vision.image_features", "vision.image_token_mask", "layers.layer_input"))
    real = np.asarray(inputs.static("real_images")).sum()
    assert real < arrays["pixel_values"].shape[0] * arrays["pixel_values"].shape[1]  # padding images dropped
    assert out["vision.tower_output"].shape[0] == real
    np.testing.assert_array_equal(out["projector.input"], out["vision.tower_output"])
    features = np.asarray(out["vision.image_features"])
    assert features.shape[0] == real * 4
    np.testing.assert_array_equal(features, np.asarray(out["projector.output"]).reshape(features.shape))
    mask = np.asarray(out["vision.image_token_mask"])
    np.testing.assert_array_equal(np.asarray(out["layers.layer_input"])[0][mask], features)


def pictures():
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 256, (40, 70, 3), np.uint8))                 # RGB, 2 × 3 tiles + global
    rgba = Image.fromarray(rng.integers(0, 256, (23, 17, 4), np.uint8), mode="RGBA")    # smaller than a tile
    gray = Image.fromarray(rng.integers(0, 256, (50, 30), np.uint8), mode="L")          # grayscale, 2 × 1 + global
    return wide, rgba, gray


def test_processor_output_matches_torch(idefics3, processor):
    model, ref = idefics3
    wide, rgba, gray = pictures()
    text = ["A <image> and <image> here.", "Only <image>."]
    batch = processor(text=text, images=[[wide, rgba], [gray]], return_tensors="np", padding=True)
    inputs = jstd.Inputs.of(batch)
    pixels = batch["pixel_values"]
    assert pixels.ndim == 5 and not all(all(row) for row in inputs.static("real_images"))  # padding images
    tokens = batch["input_ids"]
    for t in ("<fake_token_around_image>", "<global-img>"):  # ordinary text tokens around the image tokens
        assert (tokens == processor.tokenizer.convert_tokens_to_ids(t)).any()
    assert model.image_token_id != model.config.vocab_size - 1
    out = jit_run(model, inputs, reads=("vision.image_features",))
    want = ref.run({k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")},
                   reads=("vision.image_features", "logits"))
    assert_close(out["vision.image_features"], want["vision.image_features"], 1e-5, "vision.image_features")
    real = batch["attention_mask"].astype(bool)
    assert_close(np.asarray(out.logits)[real], want["logits"][real], 1e-5, "logits")


def test_image_token_count_mismatch_names_both(idefics3):
    model, _ = idefics3
    arrays = idefics3_images(model, np.random.default_rng(2), (2, 1))
    ids = np.where(arrays["input_ids"] == 96, model.image_token_id, arrays["input_ids"])
    count = int((ids == model.image_token_id).sum())
    ids[0, np.flatnonzero(ids[0] == model.image_token_id)[0]] = 5
    inputs = jstd.Inputs.of({**arrays, "input_ids": ids})
    with pytest.raises(ValueError, match=f"hold {count - 1} image tokens.*give {count} image features"):
        jstd.run(model, inputs)


def test_missing_layout_is_refused(idefics3):
    model, _ = idefics3
    arrays = idefics3_images(model, np.random.default_rng(3), (1, 1))
    arrays["input_ids"] = np.where(arrays["input_ids"] == 96, model.image_token_id, arrays["input_ids"])
    inputs = jstd.Inputs.of(arrays)
    bare = jstd.Inputs(inputs.tokens, inputs.attention_mask, inputs.images)
    import jax

    with pytest.raises(ValueError, match="real_images"):
        jax.jit(jstd.run)(model, bare)
