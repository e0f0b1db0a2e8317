"""jstd.load: sharded checkpoints, dtype, repo ids from the cache, and every error a checkpoint can cause."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jstd
from llama_cases import config
from reference.checkpoints import make_checkpoint
from reference.harness import TorchReference
from conftest import assert_close

ROOT = str(Path(__file__).resolve().parents[1])


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


def test_transformed_tensors_read_in_parts_equal_whole(folder, monkeypatch):
    """Tensors that need a transpose, a split into heads or a cast are read a part at a time (``CHUNK_BYTES``):
    with parts of 64 bytes the loaded parameters equal, bit for bit, those read whole."""
    from jstd.io import buffers

    whole = {dt: jax.tree.leaves(jstd.load(folder, dtype=dt)) for dt in (jnp.float32, jnp.bfloat16)}
    calls = []
    monkeypatch.setattr(buffers, "CHUNK_BYTES", 64)
    monkeypatch.setattr(buffers, "_fill_in_parts", lambda *a, _f=buffers._fill_in_parts: calls.append(1) or _f(*a))
    for dt, leaves in whole.items():
        parts = jax.tree.leaves(jstd.load(folder, dtype=dt))
        assert all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                   for a, b in zip(leaves, parts))
    assert calls  # the parts path ran


# a fresh process that imports only jax and jstd: loads a checkpoint (torch is never imported), then measures the
# peak resident memory each larger load adds, then checks that the user's own transformers still has torch
NO_TORCH_LOAD = """
import gc, json, sys
import jax, jax.numpy as jnp, jstd
def status(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) * 1024
jnp.ones(3).block_until_ready()
small, big = sys.argv[1], sys.argv[2:]
jstd.load(small)
out = {"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules, "added": []}
for folder in big:
    open("/proc/self/clear_refs", "w").write("5")  # the peak from now on
    base = status("VmRSS")
    model = jstd.load(folder)
    jax.block_until_ready(model)
    out["added"].append(status("VmHWM") - base)
    del model
    gc.collect()  # the model's buffers unmapped before the next baseline
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1))
out["torch_after"] = transformers.utils.is_torch_available() and "torch" in sys.modules
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures memory through Linux's /proc")
def test_load_imports_no_torch_and_holds_the_weights_once(folder, tmp_path):
    """In a process that imported only jax and jstd, ``jstd.load`` imports neither torch nor (outside its own
    calls) transformers, and the peak memory a load adds is at most 1.2x the weights, one safetensors file or
    shards alike (an untied head of 16 MiB: read transposed a part at a time); afterwards the user's
    ``import transformers`` has torch as usual."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{**config("gqa").to_dict(), "vocab_size": 32768, "hidden_size": 256,
                         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "head_dim": 64})
    one = make_checkpoint(cfg, tmp_path / "one", seed=3)
    AutoModelForCausalLM.from_pretrained(one).save_pretrained(tmp_path / "sharded", max_shard_size="24MB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    weights = sum(p.stat().st_size for p in one.glob("*.safetensors"))
    done = subprocess.run([sys.executable, "-c", NO_TORCH_LOAD, str(folder), str(one), str(tmp_path / "sharded")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["torch"] and not out["transformers"] and out["torch_after"]
    assert all(added <= 1.2 * weights for added in out["added"]), (out["added"], weights)


CONFIGS_WITHOUT_TORCH = """
import json, sys
from jstd.families import FAMILIES
from jstd.io.torchless import transformers
out = {}
with transformers() as library:
    for name in sorted(FAMILIES):
        try:
            out[name] = library.AutoConfig.for_model(name).to_dict()
        except Exception as e:
            out[name] = repr(e)
print(json.dumps({"torch": "torch" in sys.modules, "configs": out}, default=str))
"""


def test_configs_without_torch_equal_transformers():
    """Every family's default config built by the torch-free copy of transformers (``jstd.io.torchless``) in a
    process without torch equals the installed transformers' (with torch), key by key."""
    from transformers import AutoConfig

    from jstd.families import FAMILIES

    done = subprocess.run([sys.executable, "-c", CONFIGS_WITHOUT_TORCH], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["torch"]
    for name in sorted(FAMILIES):
        try:
            expected = AutoConfig.for_model(name).to_dict()
        except Exception as e:
            expected = repr(e)
        assert out["configs"][name] == json.loads(json.dumps(expected, default=str)), name
