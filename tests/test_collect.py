"""``jstd.collect`` and ``jstd.ActivationDataset``: every collected row equals ``jstd.run``'s value at that
document's position (the run is tested against torch elsewhere), padding never reaches the disk, shards are
atomic and resumable, other settings are refused, write errors surface."""

import errno
import gc
import importlib
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import jstd

import jstd.cli
from conftest import assert_close
from jstd.core.memo import per_model

collect_module = importlib.import_module("jstd.collect.driver")  # (jstd.collect is the function)
safetensors_module = importlib.import_module("jstd.io.safetensors")  # write_array: every tensor written

INDUCTION = Path(jstd.__file__).parent / "assets" / "induction-llama"
SITES = ("layers.layer_output", "layers.1.mlp.mlp_neurons", "layers.self_attn.attention_queries")
MAX = 24
# a collection's settings shared by the tests, so one compiled step per padded length serves them all
KW = dict(batch_size=4, max_length=MAX, lengths=(12, MAX), shard_bytes=12_000, progress=False)
# the tests that compile a step of their own run on one padded length
ONE = {**KW, "lengths": (MAX,)}
read = jax.jit(jstd.run, static_argnames="reads")


@pytest.fixture(scope="module")
def setup():
    model = jstd.load(INDUCTION)
    tok = jstd.load_processor(INDUCTION)
    rng = np.random.default_rng(0)
    words = [tok.decode([i]) for i in range(10, 200)]
    # 11 documents: an empty one, one cut to MAX tokens, short ones (a last batch of 3 + a filler row)
    lengths = [5, 0, 9, 30, 3, 11, 7, 2, 16, 6, 10]
    texts = [" ".join(rng.choice(words, n)) for n in lengths]
    return model, tok, texts


def reference(model, tok, texts, reads, edits=()):
    """Each document's values by ``jstd.run`` on the whole corpus in one left-padded batch: a function
    (document, position) rows -> site values, and the batch's token ids per (document, position)."""
    enc = tok(texts, return_tensors="np", padding=True, truncation=True, max_length=MAX)
    out = read(model, jstd.Inputs.of(enc), edits, reads=reads)
    pad = enc["attention_mask"].shape[1] - enc["attention_mask"].sum(1)

    def at(site, document, position):
        v = np.asarray(out[site])
        if site == "layers.self_attn.attention_queries":      # [layers, batch, heads, seq, dim]
            return v[:, document, :, pad[document] + position]  # (numpy puts the indexed axis first)
        if site.startswith("layers.1."):                      # one block: [batch, seq, ...]
            return v[document, pad[document] + position]
        return v[:, document, pad[document] + position].swapaxes(0, 1)

    return at, enc["input_ids"], enc["attention_mask"]


@pytest.fixture(scope="module")
def collected(setup, tmp_path_factory):
    model, tok, texts = setup
    out = tmp_path_factory.mktemp("collect") / "all"
    with pytest.warns(UserWarning, match="1 of 11 documents were longer than max_length=24"):
        ds = jstd.collect(model, texts, SITES, out, processor=tok, **KW)
    return ds


def test_rows_equal_run_padding_dropped(setup, collected):
    model, tok, texts = setup
    ds = collected
    at, ids, mask = reference(model, tok, texts, SITES)
    rows = ds.rows
    # every real token of every document, once, in document order; nothing else
    want = [(d, p) for d in range(len(texts)) for p in range(int(mask[d].sum()))]
    assert list(zip(rows.document.tolist(), rows.position.tolist())) == want
    pad = mask.shape[1] - mask.sum(1)
    np.testing.assert_array_equal(rows.token, ids[rows.document, pad[rows.document] + rows.position])
    for site in SITES:
        assert_close(ds.read(site), at(site, rows.document, rows.position), name=site)
    assert ds.layout("layers.layer_output") == ("tokens", "layers", "hidden")
    assert ds.layout("layers.self_attn.attention_queries") == ("tokens", "layers", "heads", "qk_head_dim")
    assert ds.layout("layers.1.mlp.mlp_neurons") == ("tokens", "mlp")
    # the format without jstd: safetensors shards and a JSON index
    index = json.loads((ds.folder / "index.json").read_text())
    assert index["complete"] and index["documents"] == len(texts) and index["truncated_documents"] == 1
    assert len(index["shards"]) > 2 and sum(s["rows"] for s in index["shards"]) == len(want)
    first = load_file(str(ds.folder / index["shards"][0]["file"]))
    n = index["shards"][0]["rows"]
    assert first["layers.layer_output"].shape == (n, 2, model.config.hidden_size)
    np.testing.assert_array_equal(first["layers.layer_output"], ds.read("layers.layer_output", slice(0, n)))
    np.testing.assert_array_equal(first["document"], rows.document[:n])
    assert index["sites"]["layers.layer_output"]["blocks"] == [0, 1]
    assert not list(ds.folder.glob("*.tmp"))


def test_batches_in_order_and_shuffled(collected):
    ds = collected
    every = ds.read("layers.layer_output")
    ordered = list(ds.batches(8, sites=["layers.layer_output"], row_map=True))
    np.testing.assert_array_equal(np.concatenate([b["layers.layer_output"] for b in ordered]), every)
    shuffled = list(ds.batches(8, key=jax.random.key(1), row_map=True, drop_last=True))
    assert all(len(b["token"]) == 8 for b in shuffled) and len(shuffled) == len(ds) // 8
    order = np.asarray(jax.random.permutation(jax.random.key(1), len(ds)))[:len(shuffled) * 8]
    got = np.concatenate([b["layers.1.mlp.mlp_neurons"] for b in shuffled])
    np.testing.assert_array_equal(got, ds.read("layers.1.mlp.mlp_neurons")[order])
    np.testing.assert_array_equal(np.concatenate([b["position"] for b in shuffled]), ds.rows.position[order])


def test_last_position_and_position_function(setup, tmp_path):
    model, tok, texts = setup
    at, ids, mask = reference(model, tok, texts, SITES)
    last = jstd.collect(model, texts, SITES, tmp_path / "last", processor=tok, positions="last", **ONE)
    lengths = mask.sum(1)
    real = [d for d in range(len(texts)) if lengths[d] > 0]
    np.testing.assert_array_equal(last.rows.document, real)
    np.testing.assert_array_equal(last.rows.position, lengths[real] - 1)
    for site in SITES:
        assert_close(last.read(site), at(site, last.rows.document, last.rows.position), name=f"last {site}")

    odd = lambda tokens, attention_mask: np.broadcast_to(np.arange(tokens.shape[1]) % 2 == 1, tokens.shape)
    ds = jstd.collect(model, texts, SITES, tmp_path / "odd", processor=tok, positions=odd, **ONE)
    # the function sees the padded batch: it keeps about half of each document's tokens, never padding
    assert 0.3 * sum(lengths) < len(ds) < 0.7 * sum(lengths)
    assert (ds.rows.position < lengths[ds.rows.document]).all()
    assert_close(ds.read("layers.layer_output"), at("layers.layer_output", ds.rows.document, ds.rows.position))


def test_edits_and_dtype(setup, tmp_path):
    model, tok, texts = setup
    edits = [jstd.Scale("layers.mlp.mlp_output", 0.25, layer=0)]
    ds = jstd.collect(model, texts, SITES, tmp_path / "edited", processor=tok, edits=edits, dtype="bfloat16", **ONE)
    at, _, _ = reference(model, tok, texts, SITES, edits)
    plain, _, _ = reference(model, tok, texts, SITES)
    r = ds.rows
    assert ds.index["sites"]["layers.layer_output"]["dtype"] == "BF16"
    got = ds.read("layers.layer_output")
    assert str(got.dtype) == "bfloat16"
    want = at("layers.layer_output", r.document, r.position)
    assert_close(got.astype(np.float32), want, rtol=8e-3)  # bfloat16's rounding of the float32 values
    assert np.abs(plain("layers.layer_output", r.document, r.position) - want).max() > 1e-2


def test_sources_dataset_inputs_and_cli(setup, collected, tmp_path, monkeypatch):
    model, tok, texts = setup

    class Columns:  # datasets.Dataset's interface as collect uses it: column_names and dataset[column]
        column_names = ["id", "text"]

        def __getitem__(self, column):
            return {"id": list(range(len(texts))), "text": texts}[column]

    ds = jstd.collect(model, Columns(), SITES, tmp_path / "dataset", processor=tok, **KW)
    for site in SITES:
        np.testing.assert_array_equal(ds.read(site), collected.read(site))

    file = tmp_path / "texts.txt"
    file.write_text("\n".join(texts) + "\n")
    status = jstd.cli.main(["collect", str(INDUCTION), "--sites", *SITES, "--texts", str(file), "--out",
                            str(tmp_path / "cli"), "--batch-size", "4", "--max-length", str(MAX),
                            "--shard-mb", "0.01"])
    assert status == 0
    cli = jstd.ActivationDataset(tmp_path / "cli")
    np.testing.assert_array_equal(cli.rows.document, collected.rows.document)
    assert_close(cli.read("layers.layer_output"), collected.read("layers.layer_output"))

    # --dataset DIR --split: a DatasetDict saved with save_to_disk, read through datasets.load_from_disk (stood in
    # for here: the package is not a test dependency)
    saved = tmp_path / "saved"
    fake = type(sys)("datasets")
    opened = []
    fake.load_from_disk = lambda path: opened.append(Path(path)) or {"train": Columns()}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    args = ["collect", str(INDUCTION), "--sites", *SITES, "--out", str(tmp_path / "cli-dataset"), "--batch-size", "4",
            "--max-length", str(MAX), "--shard-mb", "0.01"]
    assert jstd.cli.main(args + ["--dataset", str(saved), "--split", "train"]) == 0 and opened == [saved]
    from_dataset = jstd.ActivationDataset(tmp_path / "cli-dataset")
    np.testing.assert_array_equal(from_dataset.rows.document, collected.rows.document)
    np.testing.assert_array_equal(from_dataset.read("layers.layer_output"), cli.read("layers.layer_output"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    assert jstd.cli.main(args + ["--dataset", str(saved)]) == 1

    # pre-tokenized rows, right-padded: each row a document, its mask says where it ends
    ids = [tok(t)["input_ids"][:MAX] for t in texts[:5]]
    tokens = np.zeros((5, MAX), np.int64)
    mask = np.zeros((5, MAX), np.int64)
    for r, row in enumerate(ids):
        tokens[r, :len(row)], mask[r, :len(row)] = row, 1
    at, _, _ = reference(model, tok, texts, SITES)  # documents 0-4 of the corpus
    pre = jstd.collect(model, jstd.Inputs(tokens, mask), SITES, tmp_path / "inputs", positions="last", **ONE)
    np.testing.assert_array_equal(pre.rows.position, [len(i) - 1 for i in ids if i][:len(pre)])
    assert_close(pre.read("layers.layer_output"), at("layers.layer_output", pre.rows.document, pre.rows.position))


def test_write_error_surfaces_and_resumes(setup, collected, tmp_path, monkeypatch):
    model, tok, texts = setup
    out = tmp_path / "full"
    writes = []
    real_write = safetensors_module.write_array

    def disk_full(f, a):
        writes.append(f.name)
        if len(writes) == 9 * 6 + 2:  # the tenth shard's second tensor (3 sites and the row map's 3 a shard)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(f, a)

    monkeypatch.setattr(safetensors_module, "write_array", disk_full)
    with pytest.raises(OSError, match="No space left on device.*complete shards are kept.*rerun") as e:
        jstd.collect(model, texts, SITES, out, processor=tok, **KW)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.setattr(safetensors_module, "write_array", real_write)
    assert all(name.endswith(".safetensors.tmp") for name in writes)  # a shard is written under a temporary name
    index = json.loads((out / "index.json").read_text())
    assert not index["complete"] and len(index["shards"]) == 9
    # nothing cut short on disk: the index and the complete shards alone
    assert sorted(p.name for p in out.iterdir()) == ["index.json"] + [f"shard-{i:05d}.safetensors" for i in range(9)]
    with pytest.raises(ValueError, match="unfinished.*resume"):
        jstd.ActivationDataset(out)

    # what a run killed while writing leaves: a shard cut short, a whole shard written but not yet listed
    (out / "shard-00009.safetensors.tmp").write_bytes(b"cut short")
    (out / "shard-00009.safetensors").write_bytes(b"not listed")
    steps = []
    real_step = collect_module._step
    monkeypatch.setattr(collect_module, "_step", lambda *a, **k: steps.append(1) or real_step(*a, **k))
    before = (out / "shard-00000.safetensors").stat().st_mtime_ns
    ds = jstd.collect(model, texts, SITES, out, processor=tok, **KW)
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == before
    batches = -(-len(texts) // KW["batch_size"])
    assert 0 < len(steps) < batches  # the batches inside the complete shards were not run again
    for name in ("document", "position", "token"):
        np.testing.assert_array_equal(ds.read(name), collected.read(name))
    for site in SITES:
        np.testing.assert_array_equal(ds.read(site), collected.read(site))
    # a finished collection with the same settings and texts: checked, returned, nothing run
    steps.clear()
    again = jstd.collect(model, texts, SITES, out, processor=tok, **KW)
    assert steps == [] and len(again) == len(collected)


def test_refuses_other_settings_texts_and_folders(setup, collected, tmp_path):
    model, tok, texts = setup
    with pytest.raises(ValueError, match=r"other settings \(sites: .*delete this one"):
        jstd.collect(model, texts, SITES[:1], collected.folder, processor=tok, **KW)
    with pytest.raises(ValueError, match=r"other settings \(positions: 'all' there, 'last' now"):
        jstd.collect(model, texts, SITES, collected.folder, processor=tok, **{**KW, "progress": False},
                     positions="last")
    with pytest.raises(ValueError, match="collection of other texts"):
        jstd.collect(model, texts[::-1], SITES, collected.folder, processor=tok, **KW)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no index.json"):
        jstd.collect(model, texts, SITES, tmp_path, processor=tok, **KW)
    with pytest.raises(jstd.SiteError, match="one row per token position.*attention_probabilities"):
        jstd.collect(model, texts, ("layers.self_attn.attention_probabilities",), tmp_path / "p", processor=tok, **KW)
    splits = type("DatasetDict", (), {"column_names": {"train": ["text"], "test": ["text"]}})()
    with pytest.raises(ValueError, match="one split of a DatasetDict: pass dataset\\[split\\], one of train, test"):
        jstd.collect(model, splits, SITES, tmp_path / "splits", processor=tok, **KW)
    assert collected.index == json.loads((collected.folder / "index.json").read_text())


def test_image_prompts_on_a_wrapper(zoo, tmp_path):
    case = zoo("llava")
    inputs, _ = case.spec.inputs(case.model)
    sites = ("layers.layer_output", "token_embeddings")
    ds = jstd.collect(case.model, [inputs, inputs], sites, tmp_path / "vlm", progress=False)
    out, _ = zoo.every_value("llava")  # jstd.run reading every site on the same inputs (shared with conformance)
    mask = np.asarray(inputs.attention_mask)
    r, p = np.nonzero(mask)
    n = len(r)
    assert len(ds) == 2 * n
    np.testing.assert_array_equal(ds.rows.document, np.concatenate([r, r + len(mask)]))
    for half in (slice(0, n), slice(n, 2 * n)):
        assert_close(ds.read("layers.layer_output", half), np.asarray(out["layers.layer_output"])[:, r, p].swapaxes(0, 1))
        assert_close(ds.read("token_embeddings", half), np.asarray(out["token_embeddings"])[r, p])


def test_per_model_memo_follows_the_model_object():
    """The resume key's memo (``jstd.core.memo.per_model``): computed once per live object, by identity, and
    dropped with it."""
    calls = []
    get = per_model(lambda m: calls.append(m) or len(calls))

    class Model:
        pass

    a, b = Model(), Model()
    assert (get(a), get(a), get(b), get(a)) == (1, 1, 2, 1) and len(calls) == 2
    del a, calls[:]
    gc.collect()
    assert list(get.entries) == [id(b)] and get(b) == 2
