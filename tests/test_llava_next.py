"""LLaVA-NeXT: the unpadded features and their newlines, real images through the processor, the count checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlavaNextConfig
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

import jstd
from conftest import assert_close
from families import IMAGE_TOKEN, LLAVA_NEXT_PINPOINTS, LLAVA_PATHS, TOWER, WRAPPER_TEXT
from reference.cases import jit_run
from reference.wrapper import WrapperReference, make_wrapper_checkpoint
from jstd.vision.llava_next import LlavaNext

TOKENIZER = __import__("pathlib").Path(__file__).parents[1] / "jstd" / "assets" / "tiny-llama"


def config(**kw) -> LlavaNextConfig:
    return LlavaNextConfig(vision_config=dict(model_type="clip_vision_model", **TOWER, hidden_act="quick_gelu"),
                           text_config={**WRAPPER_TEXT, **kw.pop("text", {})}, image_token_index=IMAGE_TOKEN,
                           image_grid_pinpoints=LLAVA_NEXT_PINPOINTS, **kw)


def layout(size, side: int, pinpoints, image_size: int):
    """transformers' plan for one image: (crops, grid (rows, cols) in patches, kept grid (rows, cols))."""
    rows, cols = get_anyres_image_grid_shape(list(size), pinpoints, image_size)
    _, kept_rows, kept_cols = unpad_image(torch.zeros(1, rows * side, cols * side), list(size)).shape
    return 1 + rows * cols, (rows * side, cols * side), (kept_rows, kept_cols)


def test_rows_are_the_projectors_unpadded_with_a_newline_per_row(zoo):
    """image_features = projector.output's rows - the cut rows and columns + one newline per kept grid row, laid out
    as base crop, then the kept grid row by row, each row closed by image_newline."""
    _, _, model, _, spec = zoo("llava_next")
    inputs, arrays = spec.inputs(model)
    out = jit_run(model, inputs, reads=("projector.output", "vision.image_features"))
    projected, features = np.asarray(out["projector.output"]), np.asarray(out["vision.image_features"])
    side, hidden = model.config.vision.image_size // model.config.vision.patch_size, projected.shape[-1]
    newline = np.asarray(model.image_newline)
    crop, row, newlines, cut = 0, 0, 0, 0
    for size in arrays["image_sizes"].tolist():
        crops, (h, w), (kh, kw) = layout(size, side, LLAVA_NEXT_PINPOINTS, model.config.vision.image_size)
        mine = projected[crop:crop + crops]
        grid = mine[1:].reshape(h // side, w // side, side, side, hidden).transpose(0, 2, 1, 3, 4).reshape(h, w, hidden)
        top, left = (h - kh) // 2, (w - kw) // 2
        np.testing.assert_array_equal(features[row:row + side * side], mine[0])
        image = features[row + side * side:row + side * side + kh * (kw + 1)].reshape(kh, kw + 1, hidden)
        np.testing.assert_array_equal(image[:, :kw], grid[top:top + kh, left:left + kw])
        np.testing.assert_array_equal(image[:, kw], np.broadcast_to(newline, (kh, hidden)))
        crop, row, newlines, cut = crop + crops, row + side * side + kh * (kw + 1), newlines + kh, cut + h * w - kh * kw
    assert crop == projected.shape[0] and row == features.shape[0]
    assert features.shape[0] == projected.shape[0] * projected.shape[1] - cut + newlines
    assert cut > 0 and newlines > 0


def test_notes_tiny_counts():
    """The notes' pinned tiny shape: a base image and one crop of 4 patches each (8 projector rows) give 10
    features, 2 of them newlines; without a cut, image_features has more rows than projector.output."""
    hf = LlavaNextConfig(vision_config=dict(model_type="clip_vision_model", **{**TOWER, "image_size": 16}),
                         text_config=WRAPPER_TEXT, image_token_index=IMAGE_TOKEN, image_grid_pinpoints=[[16, 16]])
    model = LlavaNext.skeleton(hf, jnp.float32)
    inputs = jstd.Inputs(np.zeros((1, 10), np.int64), images={"pixel_values": np.zeros((1, 2, 3, 16, 16), np.float32)},
                         layout=(("image_sizes", ((16, 16),)),))
    assert model.num_features(inputs) == 10
    assert model.tokens_per_image * 2 == 8


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    """A checkpoint whose vocabulary holds the tiny-llama tokenizer's added <image> token, its LlavaNextProcessor
    (PIL image processor) and a batch of two PIL images of different sizes and modes."""
    from PIL import Image
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.padding_side = "left"
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    hf = LlavaNextConfig(vision_config=dict(model_type="clip_vision_model", **TOWER, hidden_act="quick_gelu"),
                         text_config={**WRAPPER_TEXT, "vocab_size": image_token + 1}, image_token_index=image_token,
                         image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    folder = make_wrapper_checkpoint(hf, tmp_path_factory.mktemp("llava_next_processor"), seed=5)
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1)
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 256, (20, 45, 3), dtype=np.uint8), "RGB")
    tall = Image.fromarray(rng.integers(0, 256, (70, 30, 4), dtype=np.uint8), "RGBA")
    batch = processor(text=["a photo <image> of", "<image> and more words here"], images=[wide, tall],
                      return_tensors="np", padding=True)
    return jstd.load(folder), WrapperReference(folder, torch.float32, LLAVA_PATHS), dict(batch), image_token


def test_processor_images_match_torch(processed):
    model, ref, batch, image_token = processed
    assert batch["pixel_values"].ndim == 5 and batch["image_sizes"].tolist() == [[20, 45], [70, 30]]
    inputs = jstd.Inputs.of(batch)
    reads = ("vision.image_features",)
    out = jit_run(model, inputs, reads=reads)
    want = ref.run(batch, reads=reads + ("logits",))
    assert out["vision.image_features"].shape[0] == (batch["input_ids"] == image_token).sum()
    assert_close(out["vision.image_features"], want["vision.image_features"], 1e-5, "image_features")
    assert_close(out.logits, want["logits"], 1e-5, "logits")


def test_image_token_count_mismatch_names_both(zoo):
    _, _, model, _, spec = zoo("llava_next")
    _, arrays = spec.inputs(model)
    ids = arrays["input_ids"].copy()
    n = int((ids == IMAGE_TOKEN).sum())
    ids[0, np.argmax(ids[0] == IMAGE_TOKEN)] = 1
    with pytest.raises(ValueError, match=rf"hold {n - 1} image tokens.* give {n} image features"):
        jstd.run(model, jstd.Inputs.of({**arrays, "input_ids": ids}))


def test_missing_image_sizes_says_how(zoo):
    _, _, model, _, spec = zoo("llava_next")
    inputs, _ = spec.inputs(model)
    bare = jstd.Inputs(inputs.tokens, inputs.attention_mask, inputs.images)  # no static layout, traced under jit
    with pytest.raises(ValueError, match="original sizes.*jstd.Inputs.of"):
        jax.jit(jstd.run)(model, bare)
