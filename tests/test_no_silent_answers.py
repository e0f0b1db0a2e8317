"""No silent wrong answers and no lost data (issue 29): export never touches its source; a collection is exactly
what it says (resume keys that capture what functions compute, shards checked against the index, empty corpora
and partial reads, floating dtypes); generation parameters checked, static or traced, and padding as
transformers'; sharding rules that do nothing refused; a tied config with a stored head of its own loaded as
transformers loads it; each ready rule set's placement of every logical axis pinned by a table."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import shutil
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import jstd
import jstd.cli
from conftest import assert_close
from jstd.io.hf import ConfigWarning
from jstd.nn.params import LOGICAL_NAMES, with_fields

INDUCTION = Path(jstd.__file__).parent / "assets" / "induction-llama"
SITE = ("layers.1.mlp.mlp_neurons",)
# one padded length and batch shape for every collection here: one compiled step serves the tests without edits
KW = dict(batch_size=4, max_length=16, lengths=(16,), shard_bytes=4_000, progress=False)
TEXTS = ["the cat sat on the mat", "a b c a b c", "one two three four five six seven", "x y", "hello there"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative name -> sha256 of its bytes)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def induction():
    return jstd.load(INDUCTION), jstd.load_processor(INDUCTION)


# ---- 1. export never touches its source --------------------------------------------------------------------------

def test_export_refuses_its_own_source_with_or_without_force(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(INDUCTION, src)
    (src / "generation_config.json").write_text('{"eos_token_id": 2}')
    before = snapshot(src)
    model = jstd.load(src)
    for dst, force in ((src, True), (src, False), (src / "sub", False), (src / "sub", True), (tmp_path, True)):
        with pytest.raises(ValueError, match="jstd export: the destination .* (is the source folder|contains the "
                                             "source)"):
            jstd.export(model, dst, force=force)
        assert snapshot(src) == before, f"export to {dst} (force={force}) changed its source"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no staging folder left either
    # a converted checkpoint: its own folder (not only its hf-ignored subfolder) is the source
    converted = jstd.convert(src, tmp_path / "converted", progress=False)
    kept = snapshot(converted)
    with pytest.raises(ValueError, match="is the source folder"):
        jstd.export(jstd.load(converted), converted, force=True)
    assert snapshot(converted) == kept


# ---- 2. a collection is exactly what it says ---------------------------------------------------------------------

def scaled(factor):
    return lambda x: x * factor


def test_resume_key_captures_closures_and_constants(induction, tmp_path):
    model, tok = induction
    run = lambda out, **kw: jstd.collect(model, TEXTS, SITE, tmp_path / out, processor=tok, **{**KW, **kw})
    first = run("apply", edits=[jstd.Apply(SITE[0], scaled(0.5))])
    # the same code capturing another factor computes other values: another setting, named
    with pytest.raises(ValueError, match=r"other settings \(edits: "):
        run("apply", edits=[jstd.Apply(SITE[0], scaled(2.0))])
    assert len(run("apply", edits=[jstd.Apply(SITE[0], scaled(0.5))])) == len(first)  # the same closure resumes

    def keep_from(n):
        return lambda tokens, mask: np.cumsum(mask, 1) > n

    run("positions", positions=keep_from(1))
    with pytest.raises(ValueError, match=r"other settings \(positions: 'function .* there, 'function .* now"):
        run("positions", positions=keep_from(3))
    with pytest.raises(ValueError, match=r"other settings \(positions: "):  # a constant in the code, not a closure
        run("positions", positions=lambda tokens, mask: np.cumsum(mask, 1) > 2)
    with pytest.raises(ValueError, match="positions is a function whose value cannot be fingerprinted.*capture "
                                         "only numbers"):
        lock = __import__("threading").Lock()
        run("unhashable", positions=lambda tokens, mask, lock=lock: mask > 0)


def test_dataset_checks_every_shard_against_the_index(induction, tmp_path):
    model, tok = induction
    ds = jstd.collect(model, TEXTS, SITE, tmp_path / "c", processor=tok, **KW)
    shards = [s["file"] for s in ds.index["shards"]]
    assert len(shards) >= 2
    good = tmp_path / "c" / shards[0]
    saved = good.read_bytes()
    tensors = load_file(good)
    save_file({k: v[:-1] for k, v in tensors.items()}, str(good), metadata={"format": "jstd.activations"})
    with pytest.raises(ValueError, match=f"shard {shards[0]} .* holds {len(tensors['token']) - 1} rows of .* but "
                                         f"index.json lists {len(tensors['token'])}"):
        jstd.ActivationDataset(tmp_path / "c")
    good.write_bytes(saved[:8] + b"\xff\xfe" + saved[10:])  # the header's first bytes: not UTF-8 JSON
    with pytest.raises(ValueError, match=f"shard {shards[0]} of the collection .* cannot be read.*collect it again"):
        jstd.ActivationDataset(tmp_path / "c")
    good.write_bytes(saved)
    assert len(jstd.ActivationDataset(tmp_path / "c")) == len(ds)


def test_empty_corpora_bad_items_partial_reads_and_dtype(induction, tmp_path):
    model, tok = induction

    class Empty:  # an empty datasets.Dataset as collect sees it
        column_names = ["text"]

        def __iter__(self):
            return iter(())

        def __len__(self):
            return 0

    class Columns:  # one without __iter__: dataset[column]
        column_names = ["text"]

        def __getitem__(self, column):
            return []

    for i, data in enumerate((Empty(), Columns(), [], iter(()), jstd.Inputs(np.zeros((0, 4), np.int32)))):
        with pytest.raises(ValueError, match="collect got no documents"):
            jstd.collect(model, data, SITE, tmp_path / f"empty{i}", processor=tok, **KW)
        assert not (tmp_path / f"empty{i}").exists()
    with pytest.raises(TypeError, match="document 0 is a NoneType"):
        jstd.collect(model, [None, "a"], SITE, tmp_path / "none0", processor=tok, **KW)
    with pytest.raises(TypeError, match="document 2 is a int, not a string"):
        jstd.collect(model, ["a", "b", 7], SITE, tmp_path / "int2", processor=tok, **KW)
    for dtype in ("int8", np.int32, "bool"):
        with pytest.raises(ValueError, match="not a floating dtype: activations cast to it would be truncated"):
            jstd.collect(model, TEXTS, SITE, tmp_path / "int8", processor=tok, dtype=dtype, **KW)

    # a collection being written, before its first shard: an empty dataset with clear messages
    def texts():
        yield "a b c"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        jstd.collect(model, texts(), SITE, tmp_path / "partial", processor=tok, **{**KW, "shard_bytes": 10**9})
    ds = jstd.ActivationDataset(tmp_path / "partial", partial=True)
    assert len(ds) == 0 and "0 rows, no complete shard yet" in repr(ds)
    assert list(ds.batches(2)) == [] and ds.layout(SITE[0]) == ("tokens", "mlp")
    assert len(ds.rows.token) == 0
    with pytest.raises(ValueError, match="has no complete shard yet .* shape of .* is not known"):
        ds.shape(SITE[0])
    with pytest.raises(KeyError, match="was not collected here"):
        list(ds.batches(2, sites=["logits"]))


# ---- 3, 4. generation parameters and padding ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(zoo):
    return zoo("llama-gqa")


def test_sampling_numbers_checked_concrete_and_traced():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 11)), jnp.float32)
    for kw, what in ((dict(temperature=0.0), "temperature must be > 0"), (dict(temperature=-1.0), "temperature"),
                     (dict(top_p=0.0), r"top_p must be in \(0, 1\]"), (dict(top_p=1.5), "top_p"),
                     (dict(temperature=np.array([1.0, 0.0])), r"temperature must be > 0 .*got 0.0 \(of \[1.0, 0.0\]\)"),
                     (dict(top_k=0), "top_k must be a positive int"), (dict(temperature=float("nan")), "temperature")):
        with pytest.raises(ValueError, match=what):
            jstd.Sampling(**kw)
    vmapped = jax.jit(jax.vmap(lambda t, p: jstd.Sampling(temperature=t, top_p=p).filtered(logits)))
    fine = vmapped(jnp.asarray([1.0, 0.5]), jnp.asarray([1.0, 0.3]))  # valid traced values: as the concrete ones
    np.testing.assert_array_equal(fine[1], jstd.Sampling(temperature=0.5, top_p=0.3).filtered(logits))
    with pytest.raises(Exception, match="temperature must be > 0"):
        jax.block_until_ready(vmapped(jnp.asarray([1.0, 0.0]), jnp.asarray([1.0, 1.0])))
    with pytest.raises(Exception, match=r"top_p must be in \(0, 1\]"):
        jax.block_until_ready(vmapped(jnp.asarray([1.0, 1.0]), jnp.asarray([0.5, 0.0])))


def test_generate_checks_token_ids_and_the_cache_size(llama, monkeypatch):
    _, _, model, _, _ = llama
    vocab = model.config.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (2, 5))
    for kw, what in ((dict(eos_token_id=[vocab]), f"eos_token_id={vocab} is outside the vocabulary of {vocab}"),
                     (dict(eos_token_id=[-1]), "eos_token_id=-1 is outside"), (dict(eos_token_id=2**40), "2**40"),
                     (dict(pad_token_id=vocab + 3), f"pad_token_id={vocab + 3} is outside"),
                     (dict(eos_token_id=[1.5]), "not integer token ids")):
        with pytest.raises(ValueError, match=what.replace("2**40", str(2**40))):
            jstd.generate(model, tokens, max_new_tokens=2, **kw)

    loop = importlib.import_module("jstd.generate.loop")
    stream = importlib.import_module("jstd.generate.streaming").stream
    monkeypatch.setattr(loop, "_jit_generate", lambda *a: pytest.fail("compiled a generation that cannot fit"))
    with pytest.raises(ValueError, match=r"max_new_tokens=1000000000 preallocates .* GiB \(\d+ bytes\) .* free on"):
        jstd.generate(model, tokens, max_new_tokens=10**9)
    with pytest.raises(ValueError, match="preallocates"):
        next(stream(model, tokens, max_new_tokens=10**9))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        next(stream(model, tokens, max_new_tokens=0))
    monkeypatch.undo()

    # traced ids: the compiled call fails
    @jax.jit
    def traced(eos, pad):
        return jstd.generate(model, tokens, max_new_tokens=2, eos_token_id=eos, pad_token_id=pad).tokens

    assert traced(jnp.asarray([1]), jnp.asarray(0)).shape == (2, 7)
    with pytest.raises(Exception, match="eos_token_id=is outside the vocabulary"):
        jax.block_until_ready(traced(jnp.asarray([vocab]), jnp.asarray(0)))
    with pytest.raises(Exception, match="pad_token_id=is outside the vocabulary"):
        jax.block_until_ready(traced(jnp.asarray([1]), jnp.asarray(-1)))


def test_an_explicit_eos_pads_with_the_checkpoints_pad_id_as_transformers(llama):
    _, _, model, ref, _ = llama
    tokens = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 5))
    with torch.no_grad():  # transformers' greedy tokens, no row stopping: jstd's equal them (test_generate)
        free = ref.model.generate(torch.as_tensor(tokens), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                  pad_token_id=0).numpy()
    eos = int(free[0, 5 + 1])  # row 0's second new token: row 0 stops there
    pad = 5 if eos != 5 else 6
    own = with_fields(model, config=dataclasses.replace(model.config, pad_token_id=pad))
    got = np.asarray(jstd.generate(own, tokens, max_new_tokens=6, eos_token_id=[eos]).tokens)
    assert got[0, 5 + 1] == eos and (got[0, 5 + 2:] == pad).all()
    config = ref.model.generation_config
    old = config.pad_token_id
    config.pad_token_id = pad
    try:
        with torch.no_grad():
            want = ref.model.generate(torch.as_tensor(tokens), max_new_tokens=6, do_sample=False,
                                      eos_token_id=eos).numpy()
    finally:
        config.pad_token_id = old
    np.testing.assert_array_equal(got[:, :want.shape[1]], want)
    assert (got[:, want.shape[1]:] == pad).all()


def test_cli_temperature_0_is_greedy_and_bad_counts_get_the_api_message(monkeypatch, capsys):
    cli = importlib.import_module("jstd.cli.generate")
    seen = {}

    def stream(model, ids, *, max_new_tokens, sampling, key):
        seen["sampling"] = sampling
        return iter([[5]])

    monkeypatch.setattr(cli, "stream", stream)
    assert jstd.cli.main(["generate", str(INDUCTION), "a b", "--temperature", "0", "--max-new-tokens", "2"]) == 0
    assert seen["sampling"] is None
    assert jstd.cli.main(["generate", str(INDUCTION), "a b", "--temperature", "0.5"]) == 0
    assert float(seen["sampling"].temperature) == 0.5
    assert jstd.cli.main(["generate", str(INDUCTION), "a b", "--top-k", "3"]) == 0
    assert float(seen["sampling"].temperature) == 1.0 and seen["sampling"].top_k == 3
    capsys.readouterr()
    for args, what in ((["--max-new-tokens", "0"], "max_new_tokens must be a positive int"),
                       (["--max-new-tokens", "-3"], "got -3"), (["--top-p", "2"], r"top_p must be in \(0, 1\]"),
                       (["--temperature", "-1"], "temperature must be > 0")):
        assert jstd.cli.main(["generate", str(INDUCTION), "a b", *args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("jstd generate: ") and len(err.strip().splitlines()) == 1
        assert __import__("re").search(what, err), err


# ---- 5, 7. sharding rules ----------------------------------------------------------------------------------------

def test_rules_that_do_nothing_are_refused(llama):
    _, folder, model, _, _ = llama
    mesh = jstd.sharding.mesh()
    with pytest.raises(ValueError, match=r"none of the rules' mesh axes \(x, y\) is an axis of the mesh"):
        jstd.shard(model, mesh, [("batch", "x"), ("embed", "y")])
    with pytest.raises(ValueError, match="logical axes no parameter has: 'embedding'"):
        jstd.shard(model, mesh, [("batch", "data"), ("embedding", "data")])
    with pytest.raises(ValueError, match="logical axes no parameter has: 'kv_head'"):
        jstd.shard(model, mesh, [("embed", "data"), ("kv_head", "model")])
    with pytest.raises(ValueError, match="no rule matches a logical axis of this model's parameters"):
        jstd.shard(model, mesh, [("batch", "data"), ("linear_heads", "model")])
    with pytest.raises(ValueError, match="logical axes no parameter has: 'embedding'"):
        jstd.load(folder, mesh=mesh, rules=[("embedding", "data")])
    line = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    with pytest.warns(UserWarning, match=r"has no axis model: the rules for heads, kv_heads, .*place nothing"):
        jstd.shard(model, line, jstd.sharding.FSDP_TP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jstd.shard(model, line, jstd.sharding.FSDP)  # every axis there: silent
        jstd.shard(model, mesh, jstd.sharding.TP)  # linear_heads: Llama has none, another family does
        jstd.shard(model, mesh, jstd.sharding.DP)


D, M = "data", "model"
# where each ready rule set puts every logical axis (None: replicated); a new logical axis or rule set needs a row
PLACEMENT = {
    #                   DP    FSDP  TP    FSDP_TP EP
    "batch":           (D,    D,    D,    D,    D),
    "embed":           (None, D,    None, D,    D),
    "heads":           (None, None, M,    M,    M),
    "kv_heads":        (None, None, M,    M,    M),
    "linear_heads":    (None, None, M,    M,    M),
    "linear_qk_heads": (None, None, M,    M,    M),
    "mlp":             (None, None, M,    M,    M),
    "vocab":           (None, None, M,    M,    M),
    "experts":         (None, None, None, None, M),
    "layers":          (None, None, None, None, None),
    "head_dim":        (None, None, None, None, None),
    "qkv":             (None, None, None, None, None),
    "key_dim":         (None, None, None, None, None),
    "value_dim":       (None, None, None, None, None),
    "conv":            (None, None, None, None, None),
    "projector_in":    (None, D,    None, D,    D),
    "projector_hidden": (None, None, M,   M,    M),
    "patch_in":        (None, None, None, None, None),
    "positions":       (None, None, None, None, None),
    "expert_gate":     (None, None, None, None, None),
    "q_lora":          (None, None, None, None, None),  # a latent's rank: every head reads the whole latent
    "kv_lora":         (None, None, None, None, None),
    "embed_out":       (None, None, None, None, None),  # a transcoder skip's output width (an axis once per array)
}
SETS = ("DP", "FSDP", "TP", "FSDP_TP", "EP")


def test_every_ready_rule_set_places_every_logical_axis_as_the_table_says(llama):
    layouts = jstd.sharding.LAYOUTS
    assert set(layouts) == set(SETS), f"rule sets {sorted(set(layouts) - set(SETS))} need a column in PLACEMENT"
    names = set(LOGICAL_NAMES) | {n for rules in layouts.values() for n, _ in rules}
    assert names <= set(PLACEMENT), f"logical axes {sorted(names - set(PLACEMENT))} need a row in PLACEMENT"
    for k, layout in enumerate(SETS):
        rules = dict(layouts[layout])
        assert len(rules) == len(layouts[layout]), f"{layout} names a logical axis twice"
        for name, where in PLACEMENT.items():
            assert rules.get(name) == where[k], f"{layout} puts {name!r} on {rules.get(name)!r}, not {where[k]!r}"
    # and the shardings jstd builds follow the table, parameter by parameter
    _, _, model, _, _ = llama
    mesh = jstd.sharding.mesh()
    for k, layout in enumerate(SETS):
        placed = jax.tree.leaves(jstd.sharding.shardings(model, mesh, layouts[layout]))
        specs = jax.tree.leaves(jstd.logical_axes(model), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        assert len(specs) == len(placed)
        for axes, sharding in zip(specs, placed):
            want = [PLACEMENT[a][k] for a in axes]
            got = list(sharding.spec) + [None] * (len(axes) - len(sharding.spec))
            assert got == want, f"{layout}: a parameter of axes {tuple(axes)} placed {got}, the table says {want}"


# ---- 6. a tied config whose checkpoint stores its own head -------------------------------------------------------

def test_tied_config_with_a_stored_head_of_its_own_keeps_it_as_transformers(llama, tmp_path):
    from transformers import AutoModelForCausalLM

    _, folder, model, _, _ = llama
    tokens = np.random.default_rng(2).integers(0, model.config.vocab_size, (2, 7))
    apart, same = tmp_path / "apart", tmp_path / "same"
    for dst in (apart, same):
        shutil.copytree(folder, dst)
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tensors = load_file(same / "model.safetensors")
    assert not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, str(same / "model.safetensors"),
              metadata={"format": "pt"})

    with pytest.warns(ConfigWarning, match="stores 'lm_head.weight' with other values than "
                                           "'model.embed_tokens.weight'; jstd keeps the stored head"):
        kept = jstd.load(apart)
    assert kept.lm_head is not None
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(apart, dtype=torch.float32)(torch.as_tensor(tokens)).logits
    assert_close(jstd.run(kept, tokens).logits, want.numpy(), 1e-5, "logits of the kept head")
    assert_close(jstd.run(kept, tokens).logits, jstd.run(model, tokens).logits, 1e-6, "the untied model's")

    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        tied = jstd.load(same)  # a stored head equal to the embedding is the embedding: tied, silently
    assert tied.lm_head is None
