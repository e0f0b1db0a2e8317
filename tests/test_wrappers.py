"""Vision-language wrappers beyond the conformance suite: the notes' identities, the scatter, edits at the merge and
in the tower against torch hooks, prompts without images, image-token counts that do not match, PIL images through
the processor, and the hub's key layout."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import load_file, save_file

import families
import jstd
from conftest import assert_close
from reference.cases import jit_run
from reference.harness import TorchEdit

IDENTITY_CASES = ("llava", "llava-full", "vipllava", "deepseek_vl")


def image_mask(model, inputs) -> np.ndarray:
    return np.asarray(inputs.tokens) == model.image_token_id


@pytest.mark.parametrize("name", families.WRAPPERS)
def test_scatter_identity(zoo, name):
    """What block 0 reads at the image tokens is vision.image_features, exactly; elsewhere, the token embeddings (both
    times the text model's embedding multiplier, which HyperCLOVA X applies after the scatter)."""
    model = zoo(name).model
    out, _ = zoo.every_value(name)
    inputs, _ = zoo(name).spec.inputs(model)
    mask = image_mask(model, inputs)
    assert (np.asarray(out["vision.image_token_mask"]) == mask).all()
    first = np.asarray(out["layers.layer_input"][0])
    entering = lambda x: np.asarray(model.text.enter_blocks(jnp.asarray(x)))
    assert np.array_equal(first[mask], entering(out["vision.image_features"]))
    assert np.array_equal(first[~mask], entering(out["token_embeddings"])[~mask])


@pytest.mark.parametrize("name", IDENTITY_CASES)
def test_what_the_projector_reads(zoo, name):
    """Llava: the hidden states vision_feature_layer names (block -2's output without the class token by default,
    whole under "full"); VipLlava: its blocks in the config's order, concatenated; DeepSeek-VL: the normed
    tower_output, which is SigLIP's post-norm of the last block's output."""
    case = zoo(name)
    model, hf = case.model, jstd.io.hf.hf_config(case.folder)
    out, _ = zoo.every_value(name)
    fed = np.asarray(out["projector.input"])
    blocks = np.asarray(out["vision.layers.layer_output"])
    if name == "deepseek_vl":
        assert np.array_equal(fed, np.asarray(out["vision.tower_output"]))
        normed = model.vision.post_norm(out["vision.layers.layer_output"][-1])
        assert_close(out["vision.tower_output"], normed, 1e-6, "tower_output == norm(last layer_output)")
        return
    states = np.concatenate([np.asarray(out["vision.layers.layer_input"])[:1], blocks])  # transformers' hidden states
    layers = hf.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    drop = getattr(hf, "vision_feature_select_strategy", "default") == "default"
    want = np.concatenate([states[i][:, 1:] if drop else states[i] for i in layers], axis=-1)
    assert np.array_equal(fed, want)
    if name == "llava":
        assert np.array_equal(fed, blocks[-2][:, 1:])  # the notes: block -2 without the class token


def _torch_edits_agree(case, edits, torch_edits, reads=("logits",), seed=7):
    inputs, batch = case.spec.inputs(case.model, seed=seed)
    clean = case.ref.run(batch, reads=("logits",))["logits"]
    out = jit_run(case.model, inputs, edits, reads=tuple(r for r in reads if r != "logits"))
    want = case.ref.run(batch, reads=reads, edits=torch_edits)
    assert np.abs(want["logits"] - clean).max() > 1e-3, "the edit changes nothing"
    for site in reads:
        assert_close(out[site], want[site], 1e-5, site)
    return out


def test_edits_at_the_merge_and_in_the_tower_match_torch(zoo):
    """Zero the image features, patch one image token from another image, edit a tower block: as torch hooks do
    (Idefics 3's edits run in the conformance suite)."""
    case = zoo("llava")
    model = case.model
    inputs, _ = case.spec.inputs(model, seed=7)
    n = int(image_mask(model, inputs).sum())
    # zero every image feature: the text model receives zeros at the image tokens
    out = _torch_edits_agree(case, [jstd.Zero("vision.image_features")],
                             [TorchEdit("vision.image_features", torch.zeros_like)], ("logits", "layers.layer_input"))
    assert not np.asarray(out["layers.layer_input"][0])[image_mask(model, inputs)].any()
    # patch one image token: feature 3 takes feature n - 1's value (another image's)
    def patch(t):
        t = t.clone()
        t[3] = t[n - 1]
        return t
    where = np.zeros((n, 1), bool)
    where[3] = True
    values = jit_run(model, inputs, reads=("vision.image_features",))["vision.image_features"]
    _torch_edits_agree(case, [jstd.Set("vision.image_features", np.asarray(values)[n - 1], where=where)],
                       [TorchEdit("vision.image_features", patch)])
    # edit a tower block: halve block 0's MLP output on every patch
    _torch_edits_agree(case, [jstd.Scale("vision.layers.mlp.mlp_output", 0.5, layer=0)],
                       [TorchEdit("vision.layers.mlp.mlp_output", lambda t: t * 0.5, 0)],
                       ("logits", "projector.input"))


def test_prompts_without_images(zoo):
    """A row without images among rows with images; inputs without any image run the text model alone (and the
    vision values say they need images)."""
    case = zoo("llava")
    inputs, batch = case.spec.inputs(case.model, seed=2, counts=(0, 2))
    out = jit_run(case.model, inputs, reads=("vision.image_features",))
    want = case.ref.run(batch, reads=("logits", "vision.image_features"))
    assert_close(out.logits, want["logits"], 1e-5, "a row without images")
    text = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    text["input_ids"] = np.where(text["input_ids"] == families.IMAGE_TOKEN, 5, text["input_ids"])
    out = jit_run(case.model, jstd.Inputs.of(text))
    assert_close(out.logits, case.ref.run(text, reads=("logits",))["logits"], 1e-5, "no images at all")
    with pytest.raises(ValueError, match="needs images"):
        jstd.run(case.model, jstd.Inputs.of(text), reads=("vision.image_features",))


def test_image_token_counts_that_do_not_match(zoo):
    case = zoo("llava")
    model = case.model
    inputs, batch = case.spec.inputs(model, counts=(1, 1))
    per = model.tokens_per_image
    fewer = dict(batch, pixel_values=batch["pixel_values"][:1])  # two images' tokens, one image
    with pytest.raises(ValueError, match=f"{2 * per} image tokens .* give {per} image features"):
        jstd.run(model, jstd.Inputs.of(fewer))
    text = dict(batch)
    text.pop("pixel_values")
    with pytest.raises(ValueError, match=f"{2 * per} image tokens .* no images give 0"):
        jstd.run(model, jstd.Inputs.of(text))
    with pytest.raises(Exception, match="image tokens"):  # under jit: a runtime error, not a silent scatter
        jit_run(model, jstd.Inputs.of(fewer)).logits.block_until_ready()


@pytest.fixture(scope="module")
def llava_with_processor(tmp_path_factory):
    """A tiny Llava whose vocabulary is the tiny-llama tokenizer's plus <image>, saved with its LlavaProcessor."""
    from transformers import AutoTokenizer, LlavaConfig, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from reference.wrapper import WrapperReference, make_wrapper_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(families.ASSET_TOKENIZER, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    size = families.TOWER["image_size"]
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(images, tokenizer, patch_size=families.TOWER["patch_size"],
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    config = LlavaConfig(vision_config=dict(model_type="clip_vision_model", **families.TOWER, hidden_act="quick_gelu"),
                         text_config={**families.WRAPPER_TEXT, "vocab_size": len(tokenizer)},
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    folder = make_wrapper_checkpoint(config, tmp_path_factory.mktemp("llava-processor"))
    processor.save_pretrained(folder)
    return folder, jstd.load(folder), WrapperReference(folder, paths=families.LLAVA_PATHS)


def test_pil_images_through_the_processor(llava_with_processor):
    """Text and PIL images of any size and mode -> the saved processor -> jstd.Inputs.of -> logits equal torch's on
    the same arrays; the processor's output runs directly too (outside jit)."""
    folder, model, ref = llava_with_processor
    processor = jstd.load_processor(folder)
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (37, 50, 3), np.uint8)),
              Image.fromarray(rng.integers(0, 256, (40, 40, 4), np.uint8), "RGBA"),
              Image.fromarray(rng.integers(0, 256, (30, 20), np.uint8), "L")]
    texts = ["a <image> and <image> here", "and <image> there"]
    batch = processor(text=texts, images=images, return_tensors="np", padding=True)
    inputs = jstd.Inputs.of(batch)
    assert inputs.images["pixel_values"].shape[0] == 3
    out = jit_run(model, inputs)
    assert_close(out.logits, ref.run(dict(batch), reads=("logits",))["logits"], 1e-5, "processor batch")
    assert_close(jstd.run(model, batch).logits, out.logits, 1e-5, "eager, processor output")


def test_hub_key_layout_loads(zoo, tmp_path):
    """Hub Llava checkpoints keep the CLIP tower under vision_tower.vision_model.: the same model loads."""
    case = zoo("llava")
    tensors = load_file(case.folder / "model.safetensors")
    hub = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
           for k, v in tensors.items()}
    assert hub != tensors
    save_file(hub, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((case.folder / "config.json").read_text())
    inputs, _ = case.spec.inputs(case.model)
    assert_close(jit_run(jstd.load(tmp_path), inputs).logits, jit_run(case.model, inputs).logits, 0, "hub layout")


def test_a_context_continues_an_image_prompt(zoo):
    """Text after an image prompt, continuing its cache (jstd.Context), gives the whole run's values there."""
    case = zoo("llava")
    inputs, _ = case.spec.inputs(case.model, counts=(1, 1))
    tokens, mask = np.asarray(inputs.tokens), np.asarray(inputs.attention_mask)
    start = tokens.shape[1] - 2  # the prompts end with two text tokens
    whole = jit_run(case.model, inputs, reads=("layers.layer_output",) + jstd.Context.sites_for(case.model))
    positions = np.broadcast_to(np.arange(start, tokens.shape[1]), (tokens.shape[0], tokens.shape[1] - start))
    context = jstd.Context.continuing(case.model, whole, positions, mask=mask)
    suffix = jstd.run(case.model, tokens[:, start:], reads=("layers.layer_output",), context=context)
    assert_close(suffix.logits, whole.logits[:, start:], 1e-5, "logits after the image prompt")
    assert_close(suffix["layers.layer_output"], whole["layers.layer_output"][:, :, start:], 1e-5, "stream")


def test_unsupported_parts_are_named():
    """A wrapper whose text model or tower jstd does not have says which, and what it has."""
    from transformers import LlavaConfig

    from jstd.families import FAMILIES

    unknown = LlavaConfig(text_config=dict(model_type="t5"))
    with pytest.raises(ValueError, match="'t5' is not supported; jstd's text families: .*llama"):
        FAMILIES["llava"].skeleton(unknown, np.float32)
    pixtral = LlavaConfig(vision_config=dict(model_type="pixtral"))
    with pytest.raises(ValueError, match="'pixtral' is not supported; jstd's towers: clip_vision_model"):
        FAMILIES["llava"].skeleton(pixtral, np.float32)
