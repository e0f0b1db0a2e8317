"""The torch reference for the CLIP and SigLIP vision towers (``reference.vision``) against the models themselves."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModel, CLIPVisionConfig, SiglipVisionConfig

from reference.harness import TorchEdit
from reference.vision import TowerReference, make_tower_checkpoint

TINY = dict(hidden_size=64, num_attention_heads=4, intermediate_size=96, num_hidden_layers=3, image_size=32,
            patch_size=8, num_channels=3)
CONFIGS = {
    "clip": lambda: CLIPVisionConfig(hidden_act="quick_gelu", **TINY),
    "siglip": lambda: SiglipVisionConfig(**TINY),  # hidden_act "gelu_pytorch_tanh"
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tower(request, tmp_path_factory):
    folder = make_tower_checkpoint(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param))
    ref = TowerReference(folder)
    pixels = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    return request.param, folder, ref, pixels, ref.run(pixels)


def test_capture_matches_the_model(tower):
    family, folder, ref, pixels, out = tower
    assert set(out) == set(ref.sites())
    plain = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()  # a fresh load of the saved folder
    with torch.no_grad():
        got = plain(pixel_values=torch.as_tensor(pixels), output_hidden_states=True, output_attentions=True)
    np.testing.assert_array_equal(out["vision.tower_output"], got.last_hidden_state.numpy())
    hidden = np.stack([h.numpy() for h in got.hidden_states])
    np.testing.assert_array_equal(out["vision.layers.layer_input"], hidden[:-1])
    np.testing.assert_array_equal(out["vision.layers.layer_output"], hidden[1:])
    np.testing.assert_array_equal(out["vision.layers.self_attn.attention_probabilities"],
                                  np.stack([a.numpy() for a in got.attentions]))
    patches = 16 + (family == "clip")
    assert out["vision.patch_embeddings"].shape == (2, 16, 64)
    assert out["vision.layers.self_attn.attention_queries"].shape == (3, 2, 4, patches, 16)
    assert out["vision.layers.self_attn.attention_premix"].shape == (3, 2, patches, 4, 16)
    assert out["vision.layers.mlp.mlp_activation"].shape == (3, 2, patches, 96)


def test_patch_embeddings_are_the_conv_in_raster_order(tower):
    _, _, ref, pixels, out = tower
    conv = ref.model.embeddings.patch_embedding
    w = conv.weight.detach().numpy()
    b = 0 if conv.bias is None else conv.bias.detach().numpy()
    for r, c in [(0, 0), (0, 3), (2, 1), (3, 3)]:
        block = pixels[:, :, 8 * r:8 * r + 8, 8 * c:8 * c + 8]
        np.testing.assert_allclose(out["vision.patch_embeddings"][:, 4 * r + c],
                                   np.einsum("nchw,dchw->nd", block, w) + b, rtol=1e-5, atol=1e-5)


def test_block_identities_and_attention_interior(tower):
    family, _, ref, _, out = tower
    v = {k.removeprefix("vision.layers.").removeprefix("self_attn.").removeprefix("mlp."): x for k, x in out.items()}
    np.testing.assert_array_equal(v["layer_input"] + v["attention_output"], v["layer_mid"])
    np.testing.assert_array_equal(v["layer_input"] + v["attention_output"] + v["mlp_output"], v["layer_output"])
    np.testing.assert_array_equal(v["mlp_norm_output"], v["mlp_input"])
    np.testing.assert_array_equal(v["mlp_activation"], v["mlp_neurons"])
    np.testing.assert_array_equal(v["attention_head_outputs"], v["attention_premix"])
    scores = np.einsum("lnhqd,lnhkd->lnhqk", v["attention_queries"], v["attention_keys"]) / 4.0  # head_dim 16
    np.testing.assert_allclose(v["attention_scores"], scores, rtol=1e-5, atol=1e-5)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(v["attention_probabilities"], probs / probs.sum(-1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(v["attention_head_outputs"],
                               np.einsum("lnhqk,lnhkd->lnqhd", v["attention_probabilities"], v["attention_values"]),
                               rtol=1e-5, atol=1e-5)
    last = v["layer_output"][-1]
    if family == "clip":  # post_layernorm norms only the pooled class token
        np.testing.assert_array_equal(out["vision.tower_output"], last)
    else:
        ln = ref.model.post_layernorm
        with torch.no_grad():
            np.testing.assert_array_equal(out["vision.tower_output"], ln(torch.as_tensor(last)).numpy())


def test_edits(tower):
    _, _, ref, pixels, out = tower
    same = ref.run(pixels, edits=[TorchEdit(s, lambda x: x.clone()) for s in ref.sites()])
    for site in out:
        np.testing.assert_array_equal(same[site], out[site], err_msg=site)

    zeroed = ref.run(pixels, edits=[TorchEdit("vision.layers.self_attn.attention_head_outputs", torch.zeros_like, 1)])
    for site in ("vision.layers.layer_output", "vision.layers.self_attn.attention_scores"):
        np.testing.assert_array_equal(zeroed[site][:1], out[site][:1])
    assert not (zeroed["vision.layers.self_attn.attention_premix"][1]).any()
    bias = ref.model.encoder.layers[1].self_attn.out_proj.bias.detach().numpy()
    np.testing.assert_array_equal(zeroed["vision.layers.self_attn.attention_output"][1],
                                  np.broadcast_to(bias, out["vision.tower_output"].shape))
    assert np.abs(zeroed["vision.tower_output"] - out["vision.tower_output"]).max() > 1e-2

    # an input edited in place reaches the stream: with layer_mid zeroed, the block's output is the mlp's output
    mid = ref.run(pixels, edits=[TorchEdit("vision.layers.layer_mid", torch.zeros_like, 0)])
    np.testing.assert_array_equal(mid["vision.layers.layer_output"][0], mid["vision.layers.mlp.mlp_output"][0])

    # patch embeddings: the edit reaches the model in the conv's layout
    flat = ref.run(pixels, edits=[TorchEdit("vision.patch_embeddings", lambda x: x * 0 + torch.arange(16.0)[:, None])])
    assert (flat["vision.patch_embeddings"] == np.arange(16.0)[:, None]).all()
    assert not np.allclose(flat["vision.layers.layer_input"][0], out["vision.layers.layer_input"][0])

    final = ref.run(pixels, reads=["vision.tower_output"], edits=[TorchEdit("vision.tower_output", lambda x: -x)])
    np.testing.assert_array_equal(final["vision.tower_output"], -out["vision.tower_output"])
    assert set(final) == {"vision.tower_output"}


def test_processor(tower):
    _, folder, _, _, _ = tower
    processor = AutoImageProcessor.from_pretrained(folder)
    rng = np.random.default_rng(1)
    for mode, channels in (("RGB", 3), ("RGBA", 4)):
        image = Image.fromarray(rng.integers(0, 256, (37, 50, channels), dtype=np.uint8), mode)  # 50 wide, 37 high
        pixels = processor(images=image, return_tensors="np")["pixel_values"]
        assert pixels.shape == (1, 3, 32, 32) and pixels.dtype == np.float32 and np.isfinite(pixels).all()
    flat = Image.new("RGB", (50, 37), (255, 0, 51))  # constant: resizing keeps it, so only the normalization shows
    pixels = processor(images=flat, return_tensors="np")["pixel_values"][0]
    expected = (np.array([1.0, 0.0, 0.2]) - processor.image_mean) / processor.image_std
    np.testing.assert_allclose(pixels, np.broadcast_to(expected[:, None, None], pixels.shape), atol=1e-5)
