"""jstd convert / jstd export: the stacked jstd checkpoint round trip, atomic writes, bad shards, and an edited
model exported back to transformers."""

import hashlib
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import families
import jstd
from conftest import assert_close
from jstd.io import export as export_module
from jstd.io import stacked
from jstd.io.safetensors import Writer
from jstd.io.source import with_source
from jstd.nn.namemap import leaf_paths


def bits(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def assert_same_model(a, b):
    """The same tree (static fields included) and every leaf equal bit for bit, in the same dtype."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert a.config == b.config
    for (path, x), (_, y) in zip(leaf_paths(a), leaf_paths(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.array_equal(bits(x), bits(y)), f"{path} differs"


def digest(folder):
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def stored_tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("case", families.MAIN)
def test_round_trip_is_bit_exact(zoo, case, tmp_path):
    """HF -> convert -> load equals HF -> load, leaf for leaf; the side files are copied, the source untouched;
    exporting the converted model gives back every tensor the family reads, bit for bit."""
    _, folder, model, _, _ = zoo(case)
    before = digest(folder)
    dst = stacked.convert(folder, tmp_path / "jstd", progress=False)
    assert digest(folder) == before
    assert stacked.is_converted(dst) and not stacked.is_converted(folder)
    side = {p.name for p in folder.iterdir() if not p.name.endswith(".safetensors")}
    assert side <= {p.name for p in dst.iterdir()}
    assert (dst / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    loaded = jstd.load(dst)
    assert_same_model(model, loaded)
    assert loaded.source.tensors == model.source.tensors

    out = jstd.export(loaded, tmp_path / "hf")
    src, back = stored_tensors(folder), stored_tensors(out)
    assert set(back) == set(src)  # the tensors the family does not read too (kept aside by convert)
    for key, value in back.items():
        assert value.dtype == src[key].dtype and np.array_equal(bits(value), bits(src[key])), key


def test_dtype_cast_and_sharded_layout(zoo, tmp_path):
    """convert(dtype=bfloat16) stores what jstd.load(dtype=bfloat16) gives; loading it as float32 widens exactly;
    small shards give an index and the same model."""
    _, folder, model, _, _ = zoo("llama-gqa")
    dst = stacked.convert(folder, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert json.loads((dst / stacked.MARKER).read_text())["dtype"] == "bfloat16"
    assert_same_model(jstd.load(folder, dtype="bfloat16"), jstd.load(dst))
    wide = jstd.load(dst, dtype="float32")
    for x, y in zip(jax.tree.leaves(wide), jax.tree.leaves(jstd.load(folder, dtype="bfloat16"))):
        assert x.dtype == np.float32 and np.array_equal(np.asarray(x), np.asarray(y, np.float32))

    sharded = stacked.convert(folder, tmp_path / "sharded", progress=False, shard_bytes=20_000)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").exists()
    loaded = jstd.load(sharded)
    assert_same_model(model, loaded)
    on_mesh = jstd.load(sharded, mesh=jstd.sharding.mesh(), rules=jstd.sharding.FSDP)
    assert_same_model(model, on_mesh)
    assert all(isinstance(x.sharding, jax.sharding.NamedSharding) for x in jax.tree.leaves(on_mesh))


def test_destination_rules_and_interruption(zoo, tmp_path, monkeypatch):
    """Never into the source; a non-empty destination only with force (replaced once complete); an interrupted
    run leaves neither the destination nor its temporary folder."""
    _, case_folder, model, _, _ = zoo("llama-gqa")
    src = tmp_path / "src"
    shutil.copytree(case_folder, src)
    before = digest(src)
    for bad in (src, src / "sub", tmp_path):
        with pytest.raises(ValueError, match="source"):
            stacked.convert(src, bad, progress=False)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty.*force"):
        stacked.convert(src, taken, progress=False)
    assert (taken / "keep.txt").exists()

    real = Writer.write
    calls = []

    def interrupted(self, name, array):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, name, array)

    monkeypatch.setattr(Writer, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stacked.convert(src, taken, progress=False, force=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "taken"]  # no partial folder left behind
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]  # the old destination is intact

    stacked.convert(src, taken, progress=False, force=True)
    assert not (taken / "keep.txt").exists()
    assert_same_model(model, jstd.load(taken))
    assert digest(src) == before


def test_bad_converted_checkpoints_name_the_file(zoo, tmp_path):
    """A truncated or corrupted shard, a newer format version and a marker describing another model raise
    CheckpointError naming the problem."""
    _, folder, _, _, _ = zoo("llama-gqa")
    good = stacked.convert(folder, tmp_path / "good", progress=False, shard_bytes=20_000)
    shard = sorted(good.glob("model-*.safetensors"))[1]

    def broken(name):
        dst = tmp_path / name
        shutil.copytree(good, dst)
        return dst

    cut = broken("truncated")
    data = (cut / shard.name).read_bytes()
    (cut / shard.name).write_bytes(data[:len(data) - 100])
    with pytest.raises(jstd.CheckpointError, match=f"{shard.name} is truncated"):
        jstd.load(cut)

    bad = broken("corrupted")
    (bad / shard.name).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + data[24:])
    with pytest.raises(jstd.CheckpointError, match=f"{shard.name}: its safetensors header is corrupted"):
        jstd.load(bad)

    newer = broken("newer")
    meta = json.loads((newer / stacked.MARKER).read_text())
    (newer / stacked.MARKER).write_text(json.dumps({**meta, "version": stacked.VERSION + 1}))
    with pytest.raises(jstd.CheckpointError, match="newer jstd"):
        jstd.load(newer)

    other = broken("other")
    def widen(node):  # the first matrix of the structure one column wider
        if isinstance(node, dict) and len(node.get("@leaf", ())) >= 2:
            node["@leaf"][-1] += 1
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        return any(widen(c) for c in children)

    assert widen(meta["structure"])
    (other / stacked.MARKER).write_text(json.dumps(meta))
    named = r"parameter '[\w.]+' in model-\d{5}-of-\d{5}\.safetensors is float32"
    with pytest.raises(jstd.CheckpointError, match=named):
        jstd.load(other)


def test_export_after_folding_an_ablated_head(zoo, tmp_path):
    """A head zeroed in jstd's o_proj, exported: transformers loads it with the logits of jstd.run on the edited
    model and of the original torch model with that head zeroed by a hook."""
    import torch
    from transformers import AutoModelForCausalLM

    _, folder, model, _, _ = zoo("llama-gqa")
    layer, head = 1, 2
    path = "layers.slots.0.attn.o"  # [blocks, heads, head_dim, embed]: a head's rows of o_proj's input
    from jstd.nn.namemap import at_path as _get

    o = _get(model, path)
    edited = eqx.tree_at(lambda m: _get(m, path), model, o.at[layer, head].set(0))
    out = jstd.export(edited, tmp_path / "ablated", files_from=folder)
    assert {p.name for p in folder.iterdir()} <= {p.name for p in out.iterdir()}

    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9))
    ours = np.asarray(jax.jit(jstd.run)(edited, tokens).logits)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    original = AutoModelForCausalLM.from_pretrained(folder).eval()
    dim = model.config.head_dim

    def zero_head(module, args):
        x = args[0].clone()
        x[..., head * dim:(head + 1) * dim] = 0
        return (x,)

    with torch.no_grad():
        theirs = exported(torch.as_tensor(tokens)).logits.numpy()
        original.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero_head)
        hooked = original(torch.as_tensor(tokens)).logits.numpy()
    assert_close(theirs, hooked, rtol=1e-6, name="exported vs hooked torch")
    assert_close(ours, theirs, rtol=1e-6, name="jstd edited vs exported")
    unedited = np.asarray(jax.jit(jstd.run)(model, tokens).logits)
    assert np.abs(unedited - ours).max() > 1e-3  # the ablation changes the logits


def test_cli_and_refusals(zoo, tmp_path, capsys):
    """jstd convert and jstd export through the command line; export refuses a model with no source and a
    transform that changes values."""
    from jstd import cli
    from jstd.nn.namemap import Entry

    _, folder, model, _, _ = zoo("llama-gqa")
    assert cli.main(["convert", str(folder), str(tmp_path / "c"), "--quiet"]) == 0
    assert cli.main(["convert", str(folder), str(tmp_path / "c"), "--quiet"]) == 1
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path / "c"), str(tmp_path / "d"), "--quiet"]) == 1
    assert "already a converted jstd checkpoint" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "c"), str(tmp_path / "e"), "--quiet"]) == 0
    src, back = stored_tensors(folder), stored_tensors(tmp_path / "e")
    assert set(back) == set(src) and all(np.array_equal(bits(back[k]), bits(src[k])) for k in src)
    assert "tokenizer.json" not in src and (tmp_path / "e" / "generation_config.json").exists()

    with pytest.raises(ValueError, match="model.source is None"):
        jstd.export(with_source(model, None), tmp_path / "x")
    for scaled in (lambda w: w.T * 2, lambda w: 1 + w, np.abs):  # np.abs: a value change no index check sees
        with pytest.raises(ValueError, match="not a pure re-layout"):
            export_module._inverse_index(Entry("w", "w", scaled), (3, 4), "w", "w")
    assert export_module._inverse_index(Entry("w", "w", lambda w: w.T), (3, 4), "w", "w").shape == (4, 3)
    assert not (tmp_path / "x").exists()

    # the tensors CLIP's family does not read come from the folder the model was loaded from; gone, export warns
    _, clip_folder, _, _, _ = zoo("clip")
    shutil.copytree(clip_folder, tmp_path / "clip")
    clip = jstd.load(tmp_path / "clip")
    assert clip.source.ignored
    shutil.rmtree(tmp_path / "clip")
    with pytest.warns(UserWarning, match="no longer in"):
        jstd.export(clip, tmp_path / "clip-hf")
    assert set(stored_tensors(tmp_path / "clip-hf")) == set(stored_tensors(clip_folder)) - set(clip.source.ignored)


DATA = Path(__file__).parent / "data"
OLD = DATA / "converted-v1"
# (layout, case): v1 written by the jstd of commit 578b417 (before core/, io/ and the layers' first split), v2 by
# that of a339e69 (layers in jstd/models/, before jstd/nn/); a v2 case without its own HF folder is v1's
LAYOUTS = [(v, p.name) for v in ("converted-v1", "converted-v2") for p in sorted((DATA / v).iterdir())]


@pytest.mark.parametrize("layout,case", LAYOUTS)
def test_checkpoints_converted_by_earlier_jstd_still_load(layout, case, monkeypatch):
    """A checkpoint converted by an earlier jstd, whose classes have moved since (tests/data/converted-v1 and -v2,
    each written from the tiny HF checkpoint beside it), loads from its recorded structure, never falling back to
    transformers, into the model ``jstd.load`` makes of the HF folder, bit for bit."""
    hf = DATA / layout / case / "hf"
    fresh = jstd.load(hf if hf.exists() else OLD / case / "hf")
    monkeypatch.setattr(stacked, "_rebuilt_skeleton", lambda *a: pytest.fail(f"{a[-1]!r}: the structure did not decode"))
    assert_same_model(fresh, jstd.load(DATA / layout / case / "jstd"))


def test_small_shards_each_holding_filler_tensors_load(tmp_path):
    """A conversion into small shards, several holding filler tensors (each shard numbers its own from
    ``__jstd_padding__.0``), loads into the model of its HF folder, bit for bit."""
    hf = OLD / "llava" / "hf"
    dst = stacked.convert(hf, tmp_path / "sharded", progress=False, shard_bytes=20_000)
    assert len([f for f in dst.glob("model-*.safetensors") if "__jstd_padding__.0" in load_file(f)]) > 1
    assert_same_model(jstd.load(hf), jstd.load(dst))
