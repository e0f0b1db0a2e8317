"""Attribution graphs of prompts with images (``jstd.circuits.inputs``): an image-text wrapper's image tokens are
input nodes, one per image token, in their positions' token slots, labelled by image and patch.

On tiny wrappers of three merges (Llava: a CLIP tower's patches; Gemma 3: SigLIP pooled, image tokens attending
bidirectionally, a scaled embedding; Qwen2-VL: a packed tower and the multimodal rotary):

* the brute-force identity of ``tests/test_circuits_families.py``: an edge from an image node (and from text
  tokens, features, errors) equals the float64 finite difference of its target's input in the frozen model under a
  perturbation of the image token's merged embedding. The test perturbs ``vision.image_features`` itself (the
  ``k``-th row for the ``k``-th image token, counted here), not through the library's own edit;
* completeness: each row sums to its target's input less the constants (``b_dec`` and position 0);
* images that do not match the image tokens, images for a text model, several rows: a clear error;
* the frontend JSON's labels (``img{i} patch{j}``) and ``Graph.save``/``load``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from jstd.circuits import Graph, frontend_json
from jstd.circuits.display import labelled
from jstd.circuits.inputs import image_prompt, with_features
from jstd.circuits.replacement import SkipOnly, prompt_values
from jstd.core.edits import Add
from jstd.core.inputs import with_layout
from jstd.nn.frozen import frozen
from jstd.sae.splice import Source
from test_circuits import completeness
from test_circuits_families import FAR, H, builder, held_forward, to64, transcoders

WRAPPERS = ("llava", "gemma3", "qwen2_vl")
IMAGE_TOKEN = 96  # tests/families.py's


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import families

    model_of = builder(tmp_path_factory, lambda config: config)  # (2 text blocks already)
    cache = {}

    def build(name):
        if name not in cache:
            model = model_of(name)
            rng = np.random.default_rng(0)
            batch = families.CASES[name].images(model, rng, [1])  # one row, one image (left-padded by two: dropped)
            batch["input_ids"][0, 2] = 1  # a BOS-like first real token
            tc = transcoders(model, rng)
            cache[name] = model, batch, tc, jstd.attribute(model, batch, tc, max_n_logits=2, desired_logit_prob=0.99)
        return cache[name]

    return build


def rows_of(batch, B):
    """``batch``'s one prompt (padding dropped) repeated on ``B`` rows, its images with it (every image array's
    first axis is the images', or for Idefics 3 the rows')."""
    real = batch["attention_mask"][0].astype(bool)
    ids = batch["input_ids"][0][real]
    images = {k: np.concatenate([v] * B) for k, v in batch.items() if k not in ("input_ids", "attention_mask",
                                                                                  "token_type_ids")}
    return ids, with_layout(jstd.Inputs(jnp.asarray(np.repeat(ids[None], B, 0), jnp.int32), None, images))


def frozen_effects(model, tc, inputs, sources, targets, monkeypatch):
    """``(derivative, difference)`` ``[targets, sources]`` in the frozen text model (the tower runs as it is, not
    differentiated): sources ``(kind, block, position or image-feature row, vector)`` with kind ``"y"`` (a block's
    MLP output), ``"e"`` (a text token's embedding) or ``"image"`` (row ``k`` of ``vision.image_features``, the
    ``k``-th image token's merged embedding); targets ``(block or L, position, vector)``."""
    L, d = tc.num_layers, tc.d_out
    B, n = inputs.tokens.shape
    F = int((np.asarray(inputs.tokens[0]) == IMAGE_TOKEN).sum())
    d_y, d_e, d_img = np.zeros((L, B, n, d)), np.zeros((B, n, d)), np.zeros((B * F, d))
    for i, (kind, layer, at, u) in enumerate(sources):
        for j, scale in enumerate((FAR, H, -H)):
            row = 1 + 3 * i + j
            if kind == "y":
                d_y[layer, row, at] = scale * u
            elif kind == "e":
                d_e[row, at] = scale * u
            else:
                d_img[row * F + at] = scale * u
    text = frozen(model.text.unstacked(lambda a, j: a[j]))
    model = eqx.tree_at(lambda m: m.text, model, text)
    W_skip = tc.W_skip

    def f(deltas):
        d_y, d_e, d_img = deltas
        edits = [Source(tc.input_site, tc.output_site), SkipOnly(tc.output_site, W_skip, d_y),
                 Add("token_embeddings", d_e), Add("vision.image_features", d_img)]
        out = jstd.run(model, inputs, edits, reads=(tc.input_site, "final_norm_output"))
        return out[tc.input_site], out["final_norm_output"]

    zeros = tuple(jnp.zeros(a.shape, jnp.float64) for a in (d_y, d_e, d_img))
    x, final = held_forward(f, zeros, tuple(map(jnp.asarray, (d_y, d_e, d_img))), monkeypatch)
    x, final = np.asarray(x, np.float64), np.asarray(final, np.float64)
    read = np.stack([np.einsum("bd,d->b", x[l, :, p] if l < L else final[:, p], v) for l, p, v in targets])
    base, plus, small, minus = read[:, :1], read[:, 1::3], read[:, 2::3], read[:, 3::3]
    return (small - minus) / (2 * H), (plus - base) / FAR


@pytest.mark.parametrize("name", WRAPPERS)
def test_image_edges_are_the_frozen_models_finite_differences(name, built, monkeypatch):
    model, batch, tc, graph = built(name)
    L, n = graph.num_layers, graph.n_pos
    ids = np.asarray(graph.input_tokens)
    image_positions = np.flatnonzero(ids == IMAGE_TOKEN)
    assert len(image_positions) >= 4 and (graph.image_patches[image_positions, 0] == 0).all()
    A = graph.adjacency.astype(np.float64)
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        model64, tc64 = to64(model), to64(tc)
        ids_b, inputs = rows_of(batch, 1)
        inputs = to64(inputs)
        out = jstd.run(model64, inputs, reads=(tc.input_site, tc.output_site, "token_embeddings",
                                                "vision.image_features"))
        x = np.asarray(out[tc.input_site][:, 0], np.float64)
        acts = np.array(tc64.encode(jnp.asarray(x)))
        acts[:, 0] = 0
        errors = np.asarray(out[tc.output_site][:, 0]) - np.asarray(tc64.decode(jnp.asarray(acts)) + tc64.skip(
            jnp.asarray(x)))
        features = np.asarray(out["vision.image_features"], np.float64)
        embeddings = np.asarray(out["token_embeddings"][0], np.float64)
        rank = np.cumsum(ids == IMAGE_TOKEN) - 1  # the k-th image token takes row k
        sources, picks = [], []
        for p in (image_positions[0], image_positions[len(image_positions) // 2], image_positions[-1]):
            picks.append(graph.token_start + p)
            sources.append(("image", None, rank[p], features[rank[p]]))
        text = [p for p in range(1, n) if ids[p] != IMAGE_TOKEN]
        picks.append(graph.token_start + text[0])
        sources.append(("e", None, text[0], embeddings[text[0]]))
        feats = [i for i in range(graph.n_features) if graph.node(i)[1] < L - 1]
        for i in rng.choice(feats, min(2, len(feats)), replace=False):
            _, l, p, f = graph.node(i)
            picks.append(i)
            sources.append(("y", l, p, acts[l, p, f] * np.asarray(tc.W_dec[l, f], np.float64)))
        picks.append(graph.error_start + 0 * n + image_positions[1])
        sources.append(("y", 0, image_positions[1], errors[0, image_positions[1]]))
        later = [i for i in range(graph.n_features) if graph.node(i)[1] >= 1]
        rows = list(rng.choice(later, min(6, len(later)), replace=False))
        targets = [(graph.node(t)[1], graph.node(t)[2], np.asarray(tc.W_enc[graph.node(t)[1], graph.node(t)[3]],
                                                                    np.float64)) for t in rows]
        rows += list(range(graph.logit_start, graph.n_nodes))
        targets += [(L, n - 1, np.asarray(v, np.float64)) for v in graph.logit_vectors]
        _, inputs_b = rows_of(batch, 1 + 3 * len(sources))
        derivative, difference = frozen_effects(model64, tc64, to64(inputs_b), sources, targets, monkeypatch)
    want = A[np.ix_(rows, picks)]
    scale = np.abs(A[rows]).max(1, keepdims=True)
    assert np.abs(want[:, :3]).max() > 1e-3 * scale.max()  # image edges that are there
    err_l = np.abs(difference - want) / scale
    err_d = np.abs(derivative - want) / scale
    assert err_l.max() <= 2e-5, (name, "the frozen model is not linear in its sources", err_l.max())
    assert err_d.max() <= 2e-5, (name, "edges differ from the frozen model's finite differences", err_d.max())


@pytest.mark.parametrize("name", WRAPPERS[:1])
def test_image_rows_sum_to_the_target_minus_the_constants(name, built):
    """Completeness with image nodes: ⟨v, x⟩ = Σ_s A[t, s] + ⟨g, b_dec⟩ at positions >= 1 + ⟨g, y - skip(x)⟩ at
    position 0, for feature and logit rows (as tests/test_circuits.py, the text case)."""
    model, batch, tc, g = built(name)
    ids, prompt, _ = image_prompt(model, batch, lambda i: i)
    embeddings = prompt_values(model, prompt, tc.input_site, tc.output_site)["embeddings"]
    prompt, _ = with_features(model, prompt, embeddings)
    rows, total, target = completeness(model, prompt, tc, g)
    np.testing.assert_allclose(total, target, rtol=1e-4, atol=1e-4 * np.abs(target).max())
    image = g.token_start + np.flatnonzero(ids == IMAGE_TOKEN)
    assert np.abs(g.adjacency[np.ix_(rows, image)]).sum() > 1e-3 * np.abs(g.adjacency[rows]).sum()


def test_images_that_do_not_fit_are_refused(built):
    model, batch, tc, _ = built("llava")
    fewer = {**batch, "input_ids": batch["input_ids"].copy()}
    fewer["input_ids"][0, np.flatnonzero(fewer["input_ids"][0] == IMAGE_TOKEN)[0]] = 5
    with pytest.raises(ValueError, match=r"hold 15 image tokens \(id 96\) but the images give 16"):
        jstd.attribute(model, fewer, tc)
    with pytest.raises(ValueError, match="text model and takes no images"):
        jstd.attribute(model.text, batch, tc)
    two = {k: np.concatenate([v, v]) for k, v in batch.items()}
    with pytest.raises(ValueError, match="hold 2 rows of tokens; with images, pass one prompt per jstd.Inputs"):
        jstd.attribute(model, two, tc)


def test_image_nodes_are_labelled_in_the_graph_and_the_json(built, tmp_path):
    model, batch, tc, g = built("llava")
    ids = np.asarray(g.input_tokens)
    image = np.flatnonzero(ids == IMAGE_TOKEN)
    assert g.image_patch(g.token_start + image[3]) == (0, 3) and g.image_patch(g.token_start + 1) is None
    assert g.image_patch(0) is None and g.node(g.token_start + image[3]) == ("token", int(image[3]), IMAGE_TOKEN)
    data = frontend_json(labelled(g), "img", node_threshold=1.0, edge_threshold=1.0, scan="s")
    tokens = data["metadata"]["prompt_tokens"]
    assert [tokens[p] for p in image] == [f"img0 patch{j}" for j in range(len(image))]
    assert tokens[0] == str(ids[0]) and tokens[-1] == str(ids[-1])
    nodes = {nd["node_id"]: nd for nd in data["nodes"]}
    third = nodes[f"E_{IMAGE_TOKEN}_{image[2]}"]
    assert (third["clerp"], third["image"], third["patch"], third["feature_type"]) == ("img0 patch2", 0, 2, "embedding")
    assert "image" not in nodes[f"E_{ids[1]}_1"]
    ticks = [t.get_text() for t in jstd.circuits.plot_graph(g).axes[0].get_xticklabels()]
    assert ticks[image[5]] == "img0 patch5" and ticks[1] == str(ids[1])
    back = Graph.load(g.save(tmp_path / "g"))
    np.testing.assert_array_equal(back.image_patches, g.image_patches)
    # programs that skip blocks (batches of features of one block run the first blocks alone): the same graph
    deep = jstd.attribute(model, batch, tc, max_n_logits=2, desired_logit_prob=0.99, batch_size=4)
    assert g.n_features > 4 * 4
    np.testing.assert_allclose(deep.adjacency, g.adjacency, rtol=1e-5, atol=1e-6 * np.abs(g.adjacency).max())
    # several prompts with images: each its own graph, the same as alone
    again = jstd.attribute(model, [batch, batch], tc, max_n_logits=2, desired_logit_prob=0.99)
    assert len(again) == 2
    for h in again:
        np.testing.assert_array_equal(h.adjacency, g.adjacency)
        np.testing.assert_array_equal(h.image_patches, g.image_patches)


@pytest.mark.parametrize("name", ["llava_next", "idefics3"])
def test_image_tokens_are_labelled_by_image_and_patch(name, tmp_path):
    """Two images of different token counts (LLaVA-NeXT: sizes cut into different crop grids, counted by
    transformers' own functions; Idefics 3: each tile a tower image of 4 tokens): each image token is labelled by its
    image and its rank within it (no forward runs)."""
    import families

    spec = families.CASES[name]
    model = jstd.load(spec.make(spec.config(), tmp_path, seed=spec.seed))
    batch = spec.images(model, np.random.default_rng(0), [2])
    if name == "llava_next":
        counts = [families.llava_next_tokens(spec.config(), families.LLAVA_NEXT_SIZES[k]) for k in range(2)]
        assert counts[0] != counts[1]
    else:
        counts = [(model.config.vision.image_size // model.config.vision.patch_size) ** 2 // model.scale ** 2] * sum(
            families.IDEFICS3_TILES[:2])
    ids, _, patches = image_prompt(model, batch, lambda i: i)
    image = np.flatnonzero(ids == IMAGE_TOKEN)
    np.testing.assert_array_equal(patches[image, 0], np.repeat(np.arange(len(counts)), counts))
    np.testing.assert_array_equal(patches[image, 1], np.concatenate([np.arange(c) for c in counts]))
    assert (patches[ids != IMAGE_TOKEN] == -1).all()


def test_image_tokens_have_a_key_each_in_aggregated_edges(built):
    """``node_keys``: an image token's key is its image and patch (as ``Graph.input_label`` labels it), not the one
    image token id, so edges from two patches of an image stay two rows of ``aggregate_edges``."""
    from jstd.circuits.sweep import aggregate_edges, node_keys

    _, _, _, g = built("llava")
    ids = np.asarray(g.input_tokens)
    image = np.flatnonzero(ids == IMAGE_TOKEN)
    keys = node_keys(g)
    assert [keys[g.token_start + p] for p in image] == [("image", 0, j) for j in range(len(image))]
    assert keys[g.token_start + 1] == ("token", int(ids[1]))
    table = aggregate_edges([g])
    sources = {table.keys[s] for s in table.sources}
    patches = [k for k in sources if k[0] == "image"]
    assert len(patches) > 1 and len(set(patches)) == len(patches)
    # each patch's edges summed under its own pair (a loop over the graph's entries; no two patches summed)
    want: dict = {}
    for row, col in zip(*np.nonzero(g.adjacency[:, g.token_start + image])):
        pair = (keys[row], ("image", 0, int(col)))
        want[pair] = want.get(pair, 0.0) + float(g.adjacency[row, g.token_start + image[col]])
    assert len(want) > len(image)
    for (target, source), v in list(want.items())[::max(1, len(want) // 40)]:
        assert table.weight(target, source) == pytest.approx(v, rel=1e-6, abs=1e-9)
