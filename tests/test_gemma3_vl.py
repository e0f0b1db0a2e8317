"""Gemma 3's image-text model (``gemma3``) beyond its conformance case (``families.CASES["gemma3"]``: every value at
float32, the fused path, the scatter identity and greedy generation after an image against transformers): bfloat16,
edits against torch hooks, the image block mask (each image's tokens attend to each other, never to a later image),
left padding, ``jstd.Context`` across an image, the processor's real output with pan-and-scan crops, the toolkit,
and the published Gemma 3 4B config."""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gemma3_cases
import jstd
import test_conformance
import test_conformance_bfloat16
from conftest import assert_close, relative_rms
from families import IMAGE_TOKEN
from reference.cases import jit_run
from reference.gemma3 import Gemma3Reference
from reference.harness import TorchEdit
from reference.wrapper import make_wrapper_checkpoint

NAME = "gemma3"
PROBS = "layers.self_attn.attention_probabilities"


def image_runs(tokens) -> list[list[np.ndarray]]:
    """Each row's images as arrays of their token positions (runs of consecutive image tokens)."""
    out = []
    for row in np.asarray(tokens):
        at = np.flatnonzero(row == IMAGE_TOKEN)
        out.append(np.split(at, np.flatnonzero(np.diff(at) > 1) + 1) if len(at) else [])
    return out


def test_layouts_and_block_identity(zoo):
    test_conformance.test_layouts(zoo, NAME)
    test_conformance.test_block_identity(zoo, NAME)


def test_bfloat16(zoo):
    """bf16: every value near torch's bf16 one; every norm of both stacks (and the final ones) bit-exact from torch's
    bf16 input, all set in one run (each norm reads only a set value)."""
    _, _, model, ref, spec = zoo(NAME, "bfloat16")
    inputs, arrays = spec.inputs(model)
    want = ref.run(arrays)
    reads = tuple(sorted(model.sites))
    out = jit_run(model, inputs, reads=reads)
    assert out.logits.dtype == jnp.bfloat16
    for site in reads + ("logits",):
        a, b = np.asarray(out[site], np.float32), want[site]
        assert ((a < -1e30) == (b < -1e30)).all(), f"{site} masks other entries than torch"
        a, b = np.where(b < -1e30, 0, a), np.where(b < -1e30, 0, b)
        assert relative_rms(a, b) < 5e-2, f"{site} bf16 relative RMS error {relative_rms(a, b):.3g}"
    pairs = test_conformance_bfloat16._normed_pairs(model)
    pairs += [("layers.layer_output", "final_norm_output"), ("vision.layers.layer_output", "vision.tower_output")]
    assert len(pairs) == 6  # both stacks: the attention and MLP pre-norms; the final norm, SigLIP's post_layernorm
    last = {"final_norm_output": model.depth("layers") - 1, "vision.tower_output": model.depth("vision.layers") - 1}
    sets = []
    for src, dst in pairs:
        layer = last.get(dst)
        value = want[src] if layer is None else want[src][layer]
        sets.append(jstd.Set(src, jnp.asarray(value, jnp.bfloat16), layer=layer))
    forced = jit_run(model, inputs, sets, reads=tuple(dst for _, dst in pairs))
    for _, dst in pairs:
        test_conformance_bfloat16.assert_bf16_exact(forced[dst], want[dst], f"{dst} from torch's input")


def test_edits_match_torch_hooks(zoo):
    """An edit of the image features (what the text model receives) and one inside the text model's attention, each
    against the same edit made through torch hooks."""
    _, _, model, ref, spec = zoo(NAME)
    inputs, arrays = spec.inputs(model, seed=2)
    v = np.random.default_rng(4).normal(size=model.config.hidden_size).astype(np.float32) * 3

    def zero_head(t):
        t = t.clone()
        t[:, 1] = 0
        return t

    cases = [
        ([jstd.Add("vision.image_features", v)], [TorchEdit("vision.image_features", lambda t: t + torch.from_numpy(v))]),
        ([jstd.Zero("layers.self_attn.attention_values", layer=0, heads=1)],
         [TorchEdit("layers.self_attn.attention_values", zero_head, 0)]),
    ]
    clean = ref.run(arrays, reads=("logits",))["logits"]
    for edits, torch_edits in cases:
        out = jit_run(model, inputs, edits, reads=("layers.layer_output",))
        want = ref.run(arrays, reads=("layers.layer_output", "logits"), edits=torch_edits)
        assert np.abs(want["logits"] - clean).max() > 1e-3, f"{edits[0].site}: the edit changes nothing"
        assert_close(out["layers.layer_output"], want["layers.layer_output"], 1e-5, edits[0].site)
        assert_close(out.logits, want["logits"], 1e-5, f"{edits[0].site}: logits")


def test_image_tokens_attend_within_their_image(zoo):
    """In both blocks an image token weighs a later token of its own image (nonzero) and no later token outside it
    (exactly zero: a later image, later text); text attends causally. The sliding block's window (4, shorter than an
    image) still bounds the earlier keys: an image's last token does not see its first, which sees it."""
    model = zoo(NAME).model
    out, want = zoo.every_value(NAME)
    inputs, _ = zoo(NAME).spec.inputs(model)
    probs = np.asarray(out[PROBS])  # [blocks, batch, heads, q, k]
    np.testing.assert_allclose(probs, want[PROBS], atol=1e-5)
    seq = probs.shape[-1]
    kinds = model.config.layer_types
    assert set(kinds) == {"sliding_attention", "full_attention"}
    later = np.triu(np.ones((seq, seq), bool), 1)
    checked = 0
    for r, images in enumerate(image_runs(inputs.tokens)):
        assert images, "every row holds an image"
        own = np.zeros((seq, seq), bool)
        for at in images:
            own[np.ix_(at, at)] = True
            first, last = at[0], at[-1]
            for b, kind in enumerate(kinds):
                p = probs[b, r]
                assert (p[:, first, last] > 0).all(), f"block {b}: an image's first token sees its last"
                if kind == "sliding_attention":
                    assert (p[:, last, first] == 0).all(), "the window hides an image's first token from its last"
                else:
                    assert (p[:, last, first] > 0).all()
        real = np.asarray(inputs.attention_mask[r], bool)[:, None]  # a padding query sees nothing: uniform
        for b in range(len(kinds)):
            p = probs[b, r]
            assert (p[:, later & ~own & real] == 0).all(), f"block {b} row {r}: a token sees a later token outside its image"
            assert (p[:, later & own] > 0).all()
            checked += 1
    assert checked == 2 * len(kinds)


def test_left_padded_row_equals_its_unpadded_run(zoo):
    """The padded batch's row 1 (one image, left padding) equals the run of its prompt alone (the explicit attention
    path; the conformance case's fused-path test runs the padded batch against torch)."""
    _, _, model, _, spec = zoo(NAME)
    inputs, arrays = spec.inputs(model, seed=5)
    mask = np.asarray(inputs.attention_mask)
    r = 1
    pad = int((mask[r] == 0).sum())
    assert pad > 0
    first = sum(len(runs) for runs in image_runs(inputs.tokens)[:r])
    mine = len(image_runs(inputs.tokens)[r])
    reads = ("layers.layer_output", PROBS)
    batch = jit_run(model, inputs, reads=reads)
    alone = jit_run(model, jstd.Inputs(np.asarray(inputs.tokens)[r:r + 1, pad:], None,
                                       {"pixel_values": arrays["pixel_values"][first:first + mine]}), reads=reads)
    assert_close(batch.logits[r, pad:], alone.logits[0], 1e-5, "logits")
    assert_close(batch["layers.layer_output"][:, r, pad:], alone["layers.layer_output"][:, 0], 1e-5, "layer_output")
    assert_close(batch[PROBS][:, r, :, pad:, pad:], alone[PROBS][:, 0], 1e-5, "probabilities")


def test_context_continues_across_images(zoo):
    """A prompt of two images cut between them: the first image in the prefix, the second in the continued run
    (whose image tokens must attend within their image there too); the suffix gives the whole run's values."""
    _, _, model, _, spec = zoo(NAME)
    _, arrays = spec.inputs(model, seed=6, counts=(2,))
    real = arrays["attention_mask"][0].astype(bool)
    tokens = arrays["input_ids"][:, real]
    images = image_runs(tokens)[0]
    pixels = arrays["pixel_values"]
    start = images[0][-1] + 2  # the text between the images
    assert images[1][0] > start
    reads = ("layers.layer_output",)
    whole = jit_run(model, jstd.Inputs(tokens, None, {"pixel_values": pixels}), reads=reads)
    prefix = jit_run(model, jstd.Inputs(tokens[:, :start], None, {"pixel_values": pixels[:1]}),
                     reads=jstd.Context.sites_for(model))
    seq = tokens.shape[1]
    context = jstd.Context.continuing(model, prefix, np.arange(start, seq)[None])
    suffix = jstd.run(model, jstd.Inputs(tokens[:, start:], None, {"pixel_values": pixels[1:]}), reads=reads,
                      context=context)
    assert_close(suffix.logits, whole.logits[:, start:], 1e-5, "logits")
    assert_close(suffix["layers.layer_output"], whole["layers.layer_output"][:, :, start:], 1e-5, "layer_output")


def test_tools_run_on_it(zoo, tmp_path):
    """A patching sweep (the property tests/test_tools_every_family.py checks on the main cases), collect (its rows
    are the run's values at the real positions) and the converted checkpoint's bit-exact round trip."""
    import test_convert
    import test_tools_every_family as tools

    tools.test_patching(tools.pair(zoo, NAME))
    test_convert.test_round_trip_is_bit_exact(zoo, NAME, tmp_path / "convert")
    model = zoo(NAME).model
    inputs, _ = zoo(NAME).spec.inputs(model)
    ds = jstd.collect(model, [inputs], ("layers.layer_output",), tmp_path / "collect", progress=False)
    out, _ = zoo.every_value(NAME)
    r, p = np.nonzero(np.asarray(inputs.attention_mask))
    assert len(ds) == len(r)
    assert_close(ds.read("layers.layer_output", slice(0, len(r))),
                 np.asarray(out["layers.layer_output"])[:, r, p].swapaxes(0, 1))


# ---- the processor ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    """(jstd model, torch reference, processor loaded by jstd.load_processor) of a tiny Gemma 3 whose vocabulary is
    the tiny tokenizer's with Gemma 3's image tokens, the processor saved beside the checkpoint."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    from families import ASSET_TOKENIZER

    tokenizer = AutoTokenizer.from_pretrained(ASSET_TOKENIZER, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    size = gemma3_cases.VISION["image_size"]
    processor = Gemma3Processor(Gemma3ImageProcessorPil(size={"height": size, "width": size}), tokenizer,
                                image_seq_length=gemma3_cases.TOKENS)
    config = gemma3_cases.config()
    config.text_config.vocab_size = len(tokenizer)
    config.image_token_id = tokenizer.image_token_id
    config.boi_token_id, config.eoi_token_id = tokenizer.boi_token_id, tokenizer.eoi_token_id
    folder = make_wrapper_checkpoint(config, tmp_path_factory.mktemp("gemma3-processor"), seed=3)
    processor.save_pretrained(folder)
    return jstd.load(folder), Gemma3Reference(folder), jstd.load_processor(folder)


def test_processor_with_pan_and_scan_matches_torch(processed):
    """The PIL processor's output: a wide image cut into 2 crops (extra images, each its own run of image tokens),
    a square one, batched with left padding; token_type_ids are the image tokens; every row matches torch."""
    from PIL import Image

    model, ref, processor = processed
    assert type(processor).__name__ == "Gemma3Processor" and processor.tokenizer.padding_side == "left"
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessorPil"
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 256, (20, 60, 3), np.uint8))
    square = Image.fromarray(rng.integers(0, 256, (30, 30, 3), np.uint8))
    boi = processor.boi_token
    batch = processor(text=[f"a {boi} b {boi} c", f"d {boi}"], images=[[wide, square], [square]], padding=True,
                      return_tensors="np", do_pan_and_scan=True, pan_and_scan_min_crop_size=8,
                      pan_and_scan_max_num_crops=2, pan_and_scan_min_ratio_to_activate=1.2)
    tokens = batch["input_ids"]
    assert batch["pixel_values"].shape[0] == 5  # the wide image, its 2 crops, the square one twice
    assert [len(runs) for runs in image_runs(np.where(tokens == model.image_token_id, IMAGE_TOKEN, -1))] == [4, 1]
    np.testing.assert_array_equal(batch["token_type_ids"], tokens == model.image_token_id)
    inputs = jstd.Inputs.of(batch)
    out = jit_run(model, inputs, reads=("vision.image_features",))
    want = ref.run(dict(batch), reads=("vision.image_features", "logits"))
    assert_close(out["vision.image_features"], want["vision.image_features"], 1e-5, "vision.image_features")
    real = batch["attention_mask"].astype(bool)
    assert_close(np.asarray(out.logits)[real], want["logits"][real], 1e-5, "logits")


# ---- the published config -----------------------------------------------------------------------------------------


def test_published_config_is_read_whole(tmp_path):
    """Gemma 3 4B's config.json (2 text blocks) names no key the family leaves unread, and the model is the
    published one's shape: 256 image tokens pooled 4 × 4 from SigLIP's 64 × 64 patches, 27 tower blocks, the text
    model's windows and rotaries (shapes only)."""
    from transformers import AutoConfig

    from jstd.families import family_for
    from jstd.io.hf import unhandled
    from published_configs import two_blocks

    config = two_blocks("gemma-3-4b-it")
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    family = family_for(hf.model_type)
    assert unhandled(hf, family) == {}
    model = family.skeleton(hf, jnp.float32)
    assert model.tokens_per_image == 256 and model.projector.kernel == 4
    assert model.projector.weight.shape == (1152, 2560) and model.depth("vision.layers") == 27
    assert model.config.vision.num_patches == 64 * 64 and model.image_token_id == 262144
    assert model.text.config.layer_types == ("sliding_attention", "sliding_attention")
    assert model.text.layers.slots[0].attn.sliding_window == 1024
    assert dict(model.text.kind_rotary)["sliding_attention"].inv_freq[1] == pytest.approx(10000 ** (-2 / 256), 1e-6)
    assert model.text.lm_head is None  # tied


def test_published_config_loads_without_warning_and_matches(tmp_path):
    """The published config's every key, its sizes cut to a tiny model: jstd.load with every warning an error, the
    logits equal transformers'."""
    from transformers import AutoConfig

    from published_configs import tiny

    (tmp_path / "config.json").write_text(json.dumps(tiny("gemma-3-4b-it")))
    hf = AutoConfig.from_pretrained(tmp_path)
    folder = make_wrapper_checkpoint(hf, tmp_path / "model", seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = jstd.load(folder)
    arrays = gemma3_cases.images(model, np.random.default_rng(1), (1, 1))
    arrays["input_ids"] = np.where(arrays["input_ids"] == IMAGE_TOKEN, model.image_token_id, arrays["input_ids"])
    arrays["token_type_ids"] = (arrays["input_ids"] == model.image_token_id).astype(np.int64)
    out = jit_run(model, jstd.Inputs.of(arrays), reads=())
    want = Gemma3Reference(folder).run(arrays, reads=("logits",))["logits"]
    real = arrays["attention_mask"].astype(bool)
    assert_close(np.asarray(out.logits)[real], want[real], 1e-5, "logits")


def test_a_projector_that_cannot_pool_is_refused():
    """transformers' own default config (SigLIP's 14 × 14 patches, 256 image tokens) cannot pool: refused, named."""
    from transformers import Gemma3Config

    from jstd.families import family_for

    with pytest.raises(ValueError, match=r"mm_tokens_per_image=256 must be a square whose side divides the tower's "
                                         r"14 × 14 patch grid"):
        family_for("gemma3").skeleton(Gemma3Config(), jnp.float32)
