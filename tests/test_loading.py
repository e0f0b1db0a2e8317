"""jstd.load: sharded checkpoints, dtype, repo ids from the cache, and every error a checkpoint can cause."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jstd
from llama_cases import config
from reference.checkpoints import make_checkpoint
from reference.harness import TorchReference
from conftest import assert_close


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint(config("gqa"), tmp_path_factory.mktemp("gqa"), seed=2)


def copy(folder, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_sharded_checkpoint_with_index(tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_checkpoint(config("bias"), tmp_path / "one", seed=4)
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    tokens = np.arange(12)[None] % 90
    a = jstd.run(jstd.load(tmp_path / "sharded"), tokens).logits
    assert_close(a, TorchReference(src).run(tokens, reads=("logits",))["logits"], 1e-5)


def test_dtype_and_source_untouched(folder):
    before = snapshot(folder)
    m = jstd.load(folder, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in [m.embed, m.layers.slots[0].attn.q, m.final_norm.weight])
    assert jstd.load(folder).embed.dtype == jnp.float32
    assert snapshot(folder) == before


def test_repo_id_from_the_cache(folder, tmp_path, monkeypatch):
    """A repo id resolves through huggingface_hub's cache, offline."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny--llama"
    commit = "0" * 40
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    m = jstd.load("tiny/llama")
    assert m.config.num_layers == 3
    with pytest.raises(FileNotFoundError, match="not in the huggingface_hub cache"):
        jstd.load("tiny/absent")


def test_missing_tensor(folder, tmp_path):
    dst = copy(folder, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(jstd.CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'.*model.safetensors"):
        jstd.load(dst)


def test_extra_tensor(folder, tmp_path):
    dst = copy(folder, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.mlp.surprise.weight"] = np.zeros(3, np.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(jstd.CheckpointError, match=r"unexpected tensor 'model.layers.0.mlp.surprise.weight' in model.safetensors"):
        jstd.load(dst)


def test_wrong_shape(folder, tmp_path):
    dst = copy(folder, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.2.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(jstd.CheckpointError, match=r"'model.layers.2.self_attn.k_proj.weight' in model.safetensors has shape \(48, 64\)"):
        jstd.load(dst)


def test_truncated_file(folder, tmp_path):
    dst = copy(folder, tmp_path)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(jstd.CheckpointError, match=r"model.safetensors is truncated: tensor '.*' ends at byte"):
        jstd.load(dst)
    (dst / "model.safetensors").write_bytes(data[:4])
    with pytest.raises(jstd.CheckpointError, match="truncated"):
        jstd.load(dst)


def test_index_naming_a_missing_shard(folder, tmp_path):
    dst = copy(folder, tmp_path)
    keys = load_file(dst / "model.safetensors").keys()
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors" for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(jstd.CheckpointError, match="model-00001-of-00002.safetensors, which is not in"):
        jstd.load(dst)


def test_unsupported_model_type(folder, tmp_path):
    dst = copy(folder, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = "t5"  # an encoder-decoder, which jstd does not serve
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model_type 't5'; jstd supports: .*llama"):
        jstd.load(dst)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        jstd.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a hub repo id"):
        jstd.load(tmp_path / "nope" / "deeper")
