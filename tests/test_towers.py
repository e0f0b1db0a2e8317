"""Vision towers loaded alone (CLIP, SigLIP), ``jstd.Inputs``, and several stacks: what the conformance suite does not
cover — images through the PIL processors, the hub's key layout, the tower's stack addressed like ``layers``,
bad inputs, and tools taking ``Inputs``."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file, save_file

import families
import jstd
from conftest import assert_close
from reference.cases import jit_run

ASSET = Path(jstd.__file__).parent / "assets" / "tiny-llama"


@pytest.fixture(params=["clip", "siglip"])
def tower(request, zoo):
    return zoo(request.param)


def pixels(model):
    """The conformance cases' random images for this tower: [2, channels, size, size]."""
    return families.CASES["clip"].inputs(model)[1]


def test_a_tower_alone_serves_vision_values_and_no_logits(tower):
    model = tower.model
    v = model.config.vision
    assert model.config.num_layers is None and v.num_layers == 3 and model.depth("vision.layers") == 3
    assert v.positions == v.num_patches + (tower.name == "clip")
    out = jit_run(model, jstd.Inputs(images={"pixel_values": pixels(model)}), reads=("vision.tower_output",))
    assert out.logits is None and "logits" not in out
    for site, why in (("logits", "vision tower alone"), ("layers.layer_output", "no text model"),
                      ("token_embeddings", "vision tower alone")):
        with pytest.raises(jstd.SiteError, match=why):
            jstd.run(model, jstd.Inputs(images={"pixel_values": pixels(model)}), reads=(site,))


def test_images_through_the_processor(tower):
    """PIL images of any size and mode -> the saved image processor -> Inputs.of -> the tower, as torch on the same
    pixels; a processor output is taken directly too (outside jit)."""
    processor = jstd.load_processor(tower.folder)
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (37, 50, 3), np.uint8)),
              Image.fromarray(rng.integers(0, 256, (40, 40, 4), np.uint8), "RGBA"),
              Image.fromarray(rng.integers(0, 256, (30, 20), np.uint8), "L").convert("RGB")]
    batch = processor(images=images, return_tensors="np")
    inputs = jstd.Inputs.of(batch)
    assert inputs.tokens is None and inputs.images["pixel_values"].shape == (3, 3, 32, 32)
    out = jit_run(tower.model, inputs, reads=("vision.tower_output",))
    want = tower.ref.run(batch["pixel_values"], reads=("vision.tower_output",))
    assert_close(out["vision.tower_output"], want["vision.tower_output"], 1e-5, tower.name)
    direct = jstd.run(tower.model, batch, reads=("vision.tower_output",))
    assert_close(direct["vision.tower_output"], out["vision.tower_output"], 1e-5, "eager")


def test_the_hub_key_layout_loads(tower, tmp_path):
    """Hub checkpoints keep the tower under vision_model.; transformers 5 saves it at the top level. Both load."""
    tensors = load_file(tower.folder / "model.safetensors")
    save_file({"vision_model." + k: v for k, v in tensors.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((tower.folder / "config.json").read_text())
    again = jstd.load(tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(tower.model)):
        np.testing.assert_array_equal(a, b)
    del tensors["encoder.layers.2.mlp.fc2.bias"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(jstd.CheckpointError, match="fc2.bias"):
        jstd.load(tmp_path)


def test_the_tower_stack_reads_and_edits_like_layers(tower):
    """vision.layers.X stacked, vision.layers.1.X alone, an edit with an int, negative or traced layer (a vmap
    over blocks is one compiled sweep), a stacked edit value."""
    model = tower.model
    inputs = jstd.Inputs(images={"pixel_values": pixels(model)})
    site = "vision.layers.layer_output"
    out = jit_run(model, inputs, reads=(site, "vision.layers.1.layer_output", "vision.layers.-1.mlp.mlp_output"))
    np.testing.assert_array_equal(out["vision.layers.1.layer_output"], out[site][1])
    assert out["vision.layers.-1.mlp.mlp_output"].shape == out[site][2].shape
    scale = "vision.layers.mlp.mlp_output"
    outputs = [jit_run(model, inputs, [jstd.Scale(scale, 0.5, layer=b)], reads=("vision.tower_output",))
               for b in range(3)]
    swept = jax.jit(jax.vmap(lambda b: jstd.run(model, inputs, [jstd.Scale(scale, 0.5, layer=b)],
                                                reads=("vision.tower_output",))["vision.tower_output"]))(jnp.arange(3))
    for b in range(3):
        assert_close(swept[b], outputs[b]["vision.tower_output"], 1e-6, f"vmapped block {b}")
    negative = jit_run(model, inputs, [jstd.Scale(scale, 0.5, layer=-2)], reads=("vision.tower_output",))
    np.testing.assert_array_equal(negative["vision.tower_output"], outputs[1]["vision.tower_output"])
    stacked = jit_run(model, inputs, [jstd.Scale(scale, np.array([1.0, 0.5, 1.0], np.float32)[:, None, None, None])],
                      reads=("vision.tower_output",))
    assert_close(stacked["vision.tower_output"], outputs[1]["vision.tower_output"], 1e-6, "stacked edit")
    patch = jit_run(model, inputs, [jstd.Zero("vision.patch_embeddings", positions=0)], reads=("vision.patch_embeddings",))
    np.testing.assert_array_equal(patch["vision.patch_embeddings"][:, 0], 0)


def test_bad_inputs_name_the_problem(tower):
    model = tower.model
    good = pixels(model)
    cases = [
        (jstd.Inputs(images={"pixel_values": good[:, :, :16]}), ValueError, "takes \\[images, 3, 32, 32\\]"),
        (jstd.Inputs(images={"other": good}), ValueError, "runs on images"),
        (np.zeros((1, 4), np.int64), ValueError, "takes images, not tokens"),
        (jstd.Inputs(images={"pixel_values": good.astype(np.int32)}), ValueError, "floating point"),
    ]
    for inputs, error, match in cases:
        with pytest.raises(error, match=match):
            jstd.run(model, inputs)
    with pytest.raises(jstd.SiteError, match="block 3 does not exist"):
        jstd.run(model, jstd.Inputs(images={"pixel_values": good}), reads=("vision.layers.3.layer_output",))
    with pytest.raises(jstd.SiteError, match="block 5 does not exist"):
        jstd.run(model, jstd.Inputs(images={"pixel_values": good}), [jstd.Zero("vision.layers.mlp.mlp_output", layer=5)])
    with pytest.raises(ValueError, match="no cache to continue"):
        jstd.run(model, jstd.Inputs(images={"pixel_values": good}), context=jstd.Context(np.zeros((2, 1), np.int32)))
    with pytest.raises(jstd.SiteError, match="does not broadcast"):
        jstd.run(model, jstd.Inputs(images={"pixel_values": good}), [jstd.Set("vision.tower_output", np.ones(7))])


def test_inspect_shows_the_tower_stack(tower, capsys):
    from jstd import cli

    cli.main(["inspect", str(tower.folder)])
    out = capsys.readouterr().out
    assert "vision tower: num_layers=3" in out and "vision.layers  × 3 blocks" in out
    assert "vision.layers.slots[0].attn.q" in out
    positions = tower.model.config.vision.positions
    assert f"[images, heads=4, patches={positions}, qk_head_dim=16]" in out


# ---- Inputs on text models ----------------------------------------------------------------------------------------


def test_inputs_of_a_tokenizer_output():
    """A tokenizer's output runs as Inputs, or directly (outside jit); strings are refused with the fix."""
    model, tok = jstd.load(ASSET), jstd.load_processor(ASSET)
    batch = tok(["the cat sat", "a dog"], return_tensors="np", padding=True)
    inputs = jstd.Inputs.of(batch)
    np.testing.assert_array_equal(inputs.tokens, batch["input_ids"])
    np.testing.assert_array_equal(inputs.attention_mask, batch["attention_mask"])
    assert inputs.images is None
    want = jit_run(model, batch["input_ids"], attention_mask=batch["attention_mask"])
    np.testing.assert_array_equal(jit_run(model, inputs).logits, want.logits)
    assert_close(jstd.run(model, batch).logits, want.logits, 1e-5, "eager")
    with pytest.raises(TypeError, match="tokenize first"):
        jstd.run(model, "the cat sat")
    with pytest.raises(TypeError, match="neither input_ids nor images"):
        jstd.Inputs.of({"labels": [1, 2]})
    with pytest.raises(ValueError, match="takes no images"):
        jstd.run(model, jstd.Inputs(batch["input_ids"], images={"pixel_values": np.zeros((1, 3, 4, 4))}))
    with pytest.raises(ValueError, match="inside the jstd.Inputs"):
        jstd.run(model, inputs, attention_mask=batch["attention_mask"])
    with pytest.raises(jstd.SiteError, match="has no vision tower"):
        jstd.run(model, inputs, reads=("vision.layers.layer_output",))


def test_tools_take_inputs():
    """patch, patch_sweep, logit_lens and site_mean give the same numbers for Inputs as for token arrays."""
    model = jstd.load(ASSET)
    rng = np.random.default_rng(0)
    clean = rng.integers(0, model.config.vocab_size, (2, 6))
    corrupt = clean.copy()
    corrupt[:, 2] = (clean[:, 2] + 1) % model.config.vocab_size
    mask = np.ones_like(clean)
    mask[1, 0] = 0
    metric = jstd.logit_difference(3, 4)
    as_inputs = lambda t: jstd.Inputs(t, mask)
    site = "layers.layer_output"
    np.testing.assert_array_equal(
        jstd.patch(model, as_inputs(clean), as_inputs(corrupt), site, layer=1, positions=2, metric=metric),
        jstd.patch(model, clean, corrupt, site, layer=1, positions=2, metric=metric, attention_mask=mask))
    np.testing.assert_allclose(
        jstd.patch_sweep(model, as_inputs(clean), as_inputs(corrupt), site, metric, progress=False),
        jstd.patch_sweep(model, clean, corrupt, site, metric, attention_mask=mask, progress=False), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(jstd.logit_lens(model, as_inputs(clean), positions=-1),
                                  jstd.logit_lens(model, clean, positions=-1, attention_mask=mask))
    np.testing.assert_array_equal(jstd.site_mean(model, site, as_inputs(clean)),
                                  jstd.site_mean(model, site, clean, attention_mask=mask))
