"""Bad checkpoints and arguments are refused with what is wrong and what to do: dtypes, corrupted or misplaced
weight files, unknown model types, missing tokenizers, config keys a family does not read, ``jstd inspect``."""

import json
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jstd
from jstd.io.hf import ConfigWarning, unhandled

ASSET = __import__("pathlib").Path(jstd.__file__).parent / "assets" / "tiny-llama"
WEIGHTS = "model.safetensors"


@pytest.fixture
def ckpt(tmp_path):
    """A writable copy of the tiny Llama checkpoint (with its tokenizer)."""
    return shutil.copytree(ASSET, tmp_path / "ckpt")


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


# ---- dtype --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64, jnp.float8_e4m3fn, "float64", "nonsense"])
def test_non_floating_dtypes_are_refused(dtype):
    with pytest.raises(ValueError, match=r"dtype=.* is not a floating dtype jstd computes in on the cpu backend; "
                                         r"pass one of float32, bfloat16"):
        jstd.load(ASSET, dtype=dtype)


def test_float16_on_cpu_names_the_fix(ckpt):
    with pytest.raises(ValueError, match=r"dtype=float16 does not run on the CPU backend.*jnp.bfloat16.*jnp.float32"):
        jstd.load(ASSET, dtype=jnp.float16)
    edit_config(ckpt, dtype="float16")  # a checkpoint that states float16 loads, widened to float32 (exactly)
    model = jstd.load(ckpt)
    assert model.embed.dtype == jnp.float32
    assert np.array_equal(model.embed, load_file(ckpt / WEIGHTS)["model.embed_tokens.weight"])


def test_cast_on_load_is_the_stored_weights_rounded():
    f32, bf16 = jstd.load(ASSET), jstd.load(ASSET, dtype="bfloat16")
    assert bf16.layers.slots[0].mlp.down.dtype == jnp.bfloat16
    for a, b in [(f32.embed, bf16.embed), (f32.layers.slots[0].mlp.down, bf16.layers.slots[0].mlp.down)]:
        assert np.array_equal(np.asarray(a).astype(jnp.bfloat16), np.asarray(b))


# ---- weight files -------------------------------------------------------------------------------------------------

def test_corrupted_header_names_the_file(ckpt):
    data = bytearray((ckpt / WEIGHTS).read_bytes())
    data[8:12] = b"\xff\x00[{"  # garbage inside the JSON header
    (ckpt / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(jstd.CheckpointError, match=rf"{WEIGHTS}: its safetensors header is corrupted \(not valid "
                                                   r"JSON.*download the file again"):
        jstd.load(ckpt)
    data[:8] = (1 << 40).to_bytes(8, "little")  # an absurd header length
    (ckpt / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(jstd.CheckpointError, match=rf"{WEIGHTS} is not a safetensors file or its header is corrupted"):
        jstd.load(ckpt)


def test_header_entry_that_does_not_fit_its_shape(ckpt):
    data = (ckpt / WEIGHTS).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"]["shape"] = [65]  # 64 floats stored
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    (ckpt / WEIGHTS).write_bytes(data[:8] + raw + data[8 + n:])
    with pytest.raises(jstd.CheckpointError, match=r"header is corrupted \(tensor 'model.norm.weight' spans 256 bytes, "
                                                   r"but F32 \[65\] needs 260\)"):
        jstd.load(ckpt)


def test_git_lfs_pointer_says_git_lfs_pull(ckpt):
    (ckpt / WEIGHTS).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64
                                + "\nsize 940120\n")
    with pytest.raises(jstd.CheckpointError, match=rf"{WEIGHTS} is a git-lfs pointer file .*run `git lfs pull`"):
        jstd.load(ckpt)


def test_gguf_says_what_jstd_reads_and_how_to_convert(tmp_path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    for path in (tmp_path, gguf):  # a GGUF repo's folder (no config.json) and the file itself
        with pytest.raises(jstd.CheckpointError, match=r"model-Q4_K_M.gguf is a GGUF file; jstd reads safetensors.*"
                                                       r"gguf_file='model-Q4_K_M.gguf'\).save_pretrained"):
            jstd.load(path)


def test_pytorch_bin_only_says_how_to_convert(ckpt):
    (ckpt / WEIGHTS).rename(ckpt / "pytorch_model.bin")
    with pytest.raises(jstd.CheckpointError, match=r"holds pytorch_model.bin \(PyTorch pickles\) and no \*.safetensors "
                                                   r"file; jstd reads safetensors only: convert .*save_pretrained"):
        jstd.load(ckpt)


def test_integer_weights_are_refused(ckpt):
    tensors = load_file(ckpt / WEIGHTS)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
    save_file(tensors, ckpt / WEIGHTS)
    with pytest.raises(jstd.CheckpointError, match=r"'model.norm.weight' in model.safetensors is stored as int8 "
                                                   r"\(a quantized checkpoint\?\)"):
        jstd.load(ckpt)


# ---- config.json --------------------------------------------------------------------------------------------------

def test_model_type_jstd_has_no_family_for(ckpt):
    edit_config(ckpt, model_type="frobnicator")  # unknown to transformers too: jstd answers first
    with pytest.raises(ValueError, match=r"unsupported model_type 'frobnicator'; jstd supports: .*llama.*config.json"):
        jstd.load(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["model_type"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"no model_type; jstd supports: "):
        jstd.load(ckpt)
    (ckpt / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(jstd.CheckpointError, match=r"config.json is not valid JSON"):
        jstd.load(ckpt)


def test_config_keys_a_family_does_not_read_are_reported(ckpt, monkeypatch):
    from jstd.models.llama import Llama

    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        edit_config(ckpt, rope_interleaved=False, attention_dropout=0.1, use_cache=False)  # undeclared, training-only
        jstd.load(ckpt)
        monkeypatch.setattr(Llama, "handled", Llama.handled - {"mlp_bias", "attention_bias"})
        jstd.load(ckpt)  # at transformers' defaults: nothing to report
    edit_config(ckpt, mlp_bias=True, attention_bias=True)
    with pytest.warns(ConfigWarning, match=r"config.json: the llama family does not read attention_bias=True, "
                                           r"mlp_bias=True \(not transformers' defaults\); jstd ignores them"):
        with pytest.raises(jstd.CheckpointError):  # the biases are not in the checkpoint
            jstd.load(ckpt)


def test_the_conformance_zoo_has_no_unread_config_keys(tmp_path):
    """Every case of tests/families.py, through config.json as jstd reads it, sets only keys its family reads or
    knowingly ignores (the wrappers' text and vision configs against their own families)."""
    import families
    from transformers import AutoConfig

    from jstd.families import family_for

    for name, spec in families.CASES.items():
        spec.config().save_pretrained(tmp_path / name)
        hf = AutoConfig.from_pretrained(tmp_path / name)
        assert unhandled(hf, family_for(hf.model_type)) == {}, name


# ---- processor, command line ---------------------------------------------------------------------------------------

def test_processor_pads_causal_lms_on_the_left():
    tok = jstd.load_processor(ASSET)
    batch = tok(["one two three", "one"], padding=True, return_tensors="np")
    assert tok.padding_side == "left"
    assert batch["attention_mask"][1, 0] == 0 and batch["attention_mask"][1, -1] == 1


def test_missing_tokenizer_names_the_files(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer vocabulary \(tokenizer.json, tokenizer.model.*"
                                                r"AutoTokenizer: .*Copy the tokenizer"):
        jstd.load_processor(ckpt)
    (ckpt / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no tokenizer vocabulary .*; no tokenizer_config.json; no "
                                                r"preprocessor_config.json"):
        jstd.load_processor(ckpt)


def test_inspect_a_missing_path_prints_one_line(tmp_path, capsys):
    from jstd import cli

    assert cli.main(["inspect", str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"jstd inspect: no such folder: {tmp_path / 'absent'}")
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    assert cli.main(["inspect", str(tmp_path)]) == 1
    assert "unsupported model_type 't5'" in capsys.readouterr().err
