"""The interpretability toolkit on a vision-language wrapper (the tiny Llava case), each tool checked against a
direct computation: patching sweeps over image tokens and tower blocks x patches between a clean and a corrupted
image (same prompt), the logit lens, and ablating tower heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jstd
from conftest import assert_close
from families import IMAGE_TOKEN
from jstd.interventions.reading import read
from reference.harness import TorchEdit

TARGET, OTHER = 5, 7
metric = jstd.logit_difference(TARGET, OTHER)  # at each row's last position, mean over rows
HEADS = "vision.layers.self_attn.attention_head_outputs"


@pytest.fixture(scope="module")
def llava(zoo):
    """(case, clean Inputs, corrupted Inputs, clean arrays, corrupted arrays): two rows holding 2 and 1 images;
    the corrupted batch has the same prompt and other pixel values."""
    case = zoo("llava")
    clean, arrays = case.spec.inputs(case.model, seed=0)
    pixels = np.random.default_rng(1).normal(size=arrays["pixel_values"].shape).astype(np.float32)
    bad_arrays = {**arrays, "pixel_values": pixels}
    return case, clean, jstd.Inputs.of(bad_arrays), arrays, bad_arrays


# the tools' own cached jitted run: the direct runs below reuse the programs the tools compiled
def metric_of(model, inputs, edits=()):
    return np.asarray(metric(read(model, inputs, (), edits).logits))


def image_tokens(arrays):
    """(rows, columns) of the image tokens, row-major: feature k of vision.image_features sits at (rows[k], cols[k])."""
    return np.nonzero(arrays["input_ids"] == IMAGE_TOKEN)


def test_sweep_over_image_tokens(llava):
    """A sweep's entries are single patched runs; patching feature row k is patching block 0's input at the k-th
    image token; the features sweep changes the metric (the images matter)."""
    case, clean, corrupt, arrays, _ = llava
    model = case.model
    rows, cols = image_tokens(arrays)
    picked = [0, 5, 17, 40]                              # features of images 0 and 1 (row 0) and image 2 (row 1)
    features = jstd.patch_sweep(model, clean, corrupt, "vision.image_features", metric, positions=picked,
                                progress=False)
    assert features.shape == (4,)
    value = read(model, clean, ("vision.image_features",))["vision.image_features"]
    for j, k in enumerate(picked):
        direct = metric_of(model, corrupt, [jstd.Set("vision.image_features", value, positions=k)])
        assert_close(features[j], direct, 1e-5, f"features[{k}]")
    # the text model's positions address columns of the prompt, in every row: image 0's columns are padding in
    # row 1, so patching them at block 0 is patching image 0's features
    assert (rows[:16] == 0).all() and not (arrays["input_ids"][1, cols[:16]] == IMAGE_TOKEN).any()
    stream = jstd.patch_sweep(model, clean, corrupt, "layers.layer_input", metric, positions=cols[picked[:2]],
                              progress=False)
    assert stream.shape == (2, 2)
    assert_close(stream[0], features[:2], 1e-5, "layer_input sweep at image 0")
    assert np.abs(np.asarray(features) - metric_of(model, corrupt)).max() > 1e-3


def test_sweep_over_tower_blocks_and_patches(llava):
    """Tower sites are addressed by block and patch (``patches``: position 0 is the class token); an entry equals a
    run with the Set edit and the torch wrapper with the same patch; patching the last block changes nothing
    (Llava's projector reads block -2)."""
    case, clean, corrupt, _, bad_arrays = llava
    model = case.model
    site = "vision.layers.layer_output"
    patches = [0, 1, 9, 16]
    grid = jstd.patch_sweep(model, clean, corrupt, site, metric, positions=patches, progress=False)
    assert grid.shape == (3, len(patches))
    value = np.asarray(read(model, clean, (site,))[site])
    direct = metric_of(model, corrupt, [jstd.Set(site, value[1], layer=1, positions=9)])
    assert_close(grid[1, 2], direct, 1e-5, "grid[1, 9]")

    def patch_nine(t):                                   # [images, patches, hidden] in jstd's layout
        t = t.clone()
        t[:, 9] = torch.from_numpy(value[1][:, 9].copy())
        return t

    logits = case.ref.run(bad_arrays, reads=("logits",), edits=[TorchEdit(site, patch_nine, 1)])["logits"]
    assert_close(grid[1, 2], np.asarray(metric(jnp.asarray(logits))), 1e-4, "grid[1, 9] vs torch")
    assert_close(grid[2], np.full(len(patches), metric_of(model, corrupt)), 1e-6, "last block")
    assert np.abs(np.asarray(grid[:2]) - metric_of(model, corrupt)).max() > 1e-4


def test_logit_lens_on_a_wrapper(llava):
    """The lens projects every text block's stream through the text model's head; the last block is the logits;
    block 0's lens equals torch's final norm and head on block 0's output (images in)."""
    case, clean, _, arrays, _ = llava
    model = case.model
    rows, cols = image_tokens(arrays)
    image_pos = int(cols[rows == 1][3])                  # an image token of row 1, a real token in row 0 too
    lens = jstd.logit_lens(model, clean, positions=[image_pos, -1])
    assert lens.shape == (2, 2, 2, model.config.vocab_size)
    logits = read(model, clean, ()).logits
    assert_close(lens[-1], logits[:, [image_pos, -1]], 1e-5, "last block")
    stream = case.ref.run(arrays, reads=("layers.layer_output",))["layers.layer_output"][0]
    lm = case.ref.model
    with torch.no_grad():
        want = lm.lm_head(lm.model.language_model.norm(torch.from_numpy(stream[:, [image_pos, -1]]))).numpy()
    assert_close(lens[0], want, 1e-4, "block 0 vs torch")


def test_ablating_tower_heads(llava):
    """Zeroing a tower head equals torch with that head zeroed; a vmapped sweep of single-head ablations over
    blocks x heads matches its entries; a mean ablation averages over every image and patch."""
    case, clean, _, arrays, _ = llava
    model = case.model
    got = read(model, clean, (), [jstd.zero_ablation(HEADS, layer=0, heads=[3])]).logits

    def zero_head(t):                                    # [images, patches, heads, head_dim]
        t = t.clone()
        t[:, :, 3] = 0
        return t

    want = case.ref.run(arrays, reads=("logits",), edits=[TorchEdit(HEADS, zero_head, 0)])["logits"]
    assert_close(got, want, 1e-4, "zeroed head vs torch")
    assert np.abs(np.asarray(got - read(model, clean, ()).logits)).max() > 1e-4

    def one(layer, head):
        return metric(jstd.run(model, clean, [jstd.zero_ablation(HEADS, layer=layer, heads=head)]).logits)

    layers, heads = np.meshgrid(np.arange(3), np.arange(4), indexing="ij")
    grid = jax.jit(jax.vmap(one))(layers.ravel(), heads.ravel()).reshape(3, 4)
    assert_close(grid[1, 2], metric_of(model, clean, [jstd.zero_ablation(HEADS, layer=1, heads=[2])]), 1e-5, "[1, 2]")

    mean = jstd.mean_ablation(model, HEADS, clean, layer=1, heads=0)
    value = np.asarray(read(model, clean, (HEADS,))[HEADS][1])  # [images, patches, heads, head_dim]
    assert_close(np.asarray(mean.value)[0, 0], value.mean(axis=(0, 1)), 1e-5, "mean over images and patches")
