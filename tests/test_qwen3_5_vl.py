"""Qwen3.5 image-text (``qwen3_5``): Qwen3-VL's tower without DeepStack, its merger, the hybrid Qwen3.5 text model.
The conformance case ``qwen3_5`` (``tests/families.py``) compares every value with torch in float32 on a left-padded
batch of three images of different grids, two in one row; here: the values the notes name read from that batch,
the hub's key layouts and config keys, and edits at the merge and in a DeltaNet block against torch hooks."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jstd
import qwen3_vl_cases
from conftest import assert_close
from reference.cases import jit_run
from reference.harness import TorchEdit

NAME = "qwen3_5"
LA = "layers.linear_attn."
# what the text model's DeltaNet blocks hold, as the Qwen3.5 text tests read them
DELTANET = tuple(LA + s for s in ("attention_queries", "attention_keys", "attention_values", "decays", "betas",
                                  "state_input", "states", "state_output", "attention_head_outputs",
                                  "attention_output"))
VISION = ("vision.patch_embeddings", "vision.layers.layer_input", "vision.layers.layer_output",
          "vision.layers.self_attn.attention_queries", "projector.input", "projector.output")


def test_values_equal_torch(zoo):
    """The wrapper's values on the conformance batch (wide, tall and one-token images; the short row left-padded)
    equal transformers': logits, M-RoPE positions from the grids, the tower, the image features, every block's
    output and the DeltaNet blocks' interior. No DeepStack: block 0 alone reads the image."""
    model = zoo(NAME).model
    out, want = zoo.every_value(NAME)
    assert model.family == NAME and model.vision.deepstack == () and "layers.deepstack_output" not in model.sites
    assert model.layers_with("linear_attn") == (0, 1, 2) and model.layers_with("self_attn") == (3,)
    for site in ("positions", *VISION, "vision.image_features", "layers.layer_output", *DELTANET, "logits"):
        assert_close(out[site], want[site], 1e-5, site)
    positions = np.asarray(out["positions"])
    assert not (positions[1] == positions[2]).all()  # the images' rows and columns differ
    np.testing.assert_array_equal(np.asarray(out["layers.layer_input"])[1:], np.asarray(out["layers.layer_output"])[:-1])


def test_hub_layout_and_config_keys(zoo, tmp_path):
    """The hub's key spellings (text under ``model.``, tower under ``visual.``) and its multi-token-prediction heads
    (``mtp.*``, ignored) load the same model without a warning; every key of transformers' Qwen3.5 configs is read
    or knowingly ignored, so no ConfigWarning is spurious; a DeepStack list in the tower's config is not read."""
    from transformers import PretrainedConfig, Qwen3_5Config

    from jstd.io.hf import GENERIC
    from jstd.families import FAMILIES

    case = zoo(NAME)
    tensors = load_file(case.folder / "model.safetensors")
    hub = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v
           for k, v in tensors.items()}
    hub["mtp.fc.weight"] = np.zeros((32, 64), np.float32)
    save_file(hub, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((case.folder / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error", jstd.ConfigWarning)
        loaded = jstd.load(tmp_path)
    assert eqx.tree_equal(loaded, case.model), "the hub layout loads another model"
    family, hf = FAMILIES[NAME], Qwen3_5Config()
    listed = Qwen3_5Config(vision_config=dict(qwen3_vl_cases.VISION, depth=3))  # transformers reads no DeepStack list
    assert family.skeleton(listed, jnp.float32).vision.deepstack == ()
    generic = GENERIC | set(PretrainedConfig().to_dict())
    for config, handled in ((hf, family.handled), (hf.text_config, family.text_family(hf).handled),
                            (hf.vision_config, family.tower_for(hf).handled)):
        assert {k for k in config.to_dict() if "dropout" not in k} - generic - handled == set(), config.model_type




def test_edits_match_torch_hooks(zoo):
    """Zeroing vision.image_features removes the image (no DeepStack taps carry it on: other pixels change
    nothing), and betas halved on DeltaNet block 1, each equal torch under the same edits through hooks; one
    compile serves every case."""
    case = zoo(NAME)
    model, ref = case.model, case.ref
    inputs, batch = case.spec.inputs(model, seed=7)
    other = jstd.Inputs.of(dict(batch, pixel_values=np.random.default_rng(1).standard_normal(
        batch["pixel_values"].shape).astype(np.float32)))
    reads = ("layers.layer_output", LA + "state_output")
    clean = ref.run(batch, reads=("logits",))["logits"]
    for label, features, betas in (("features zeroed", 0.0, 1.0), ("block 1's betas halved", 1.0, 0.5)):
        edits = [jstd.Scale("vision.image_features", jnp.float32(features)),
                 jstd.Scale(LA + "betas", jnp.float32(betas), layer=1)]
        torch_edits = [TorchEdit("vision.image_features", lambda t: t * features),
                       TorchEdit(LA + "betas", lambda t: t * betas, 1)]
        out = jit_run(model, inputs, edits, reads=reads)
        want = ref.run(batch, reads=reads + ("logits",), edits=torch_edits)
        assert np.abs(want["logits"] - clean).max() > 1e-3, f"{label}: the edit changes nothing"
        for site in reads + ("logits",):
            assert_close(out[site], want[site], 1e-5, f"{label}: {site}")
        if features == 0.0:
            np.testing.assert_array_equal(out.logits, jit_run(model, other, edits, reads=reads).logits)
