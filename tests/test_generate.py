"""jstd.generate: greedy tokens and each step's logits equal transformers' ``generate`` (tiny random models of each
family, left-padded batches); every step's logits and reads equal ``jstd.run`` on the generated sequence with the
same edits; steering equals the same steering through torch hooks; EOS, sampling, vmap over strengths.

One jstd run on the whole generated sequence checks every step at once: a causal model's logits at position
``prompt + i - 1`` are those of the sequence so far.
"""

import contextlib
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import families
import jstd
from jstd.nn.params import with_fields
from conftest import assert_close
from decoding_hlo import decoding_loop, step_buffers
from jstd.cli import main
from reference.harness import TorchEdit
from reference.cases import jit_run

NEW = 6
PROMPT = 7
ASSET = Path(jstd.__file__).parent / "assets" / "tiny-llama"


def left_padded(model, seed=0, batch=2, pad=2):
    """Random prompts ``[batch, PROMPT]``, the last row left-padded by ``pad`` (id 0): (tokens, mask)."""
    tokens = np.random.default_rng(seed).integers(1, model.config.vocab_size, (batch, PROMPT))
    mask = np.ones_like(tokens)
    tokens[-1, :pad], mask[-1, :pad] = 0, 0
    return tokens, mask


def torch_generate(ref, arrays: dict, new=NEW, edits=(), **kwargs):
    """transformers' greedy ``generate`` on the reference model (``edits``: TorchEdits through its hooks):
    (tokens, per-step logits)."""
    tap, _ = ref._tap((), list(edits))
    hooks = ref._hooks(tap) if edits else contextlib.nullcontext()
    tensors = (ref.inputs(arrays) if hasattr(ref, "inputs")  # the Qwen-VL line: token types for M-RoPE
               else {k: torch.as_tensor(np.asarray(v)) for k, v in arrays.items()})
    with torch.no_grad(), hooks:
        out = ref.model.generate(**tensors, max_new_tokens=new, min_new_tokens=new if "eos_token_id" not in kwargs
                                 else 0, do_sample=False, return_dict_in_generate=True, output_logits=True,
                                 pad_token_id=kwargs.pop("pad_token_id", 0), **kwargs)
    return out.sequences.numpy(), torch.stack(out.logits, 1).float().numpy()


def whole_run(model, gen, mask, edits=(), reads=()):
    """``jstd.run`` on the generated sequence (the prompt's mask then ones): its values at each step's position."""
    total = np.asarray(gen.tokens)
    full_mask = np.concatenate([mask, np.ones((mask.shape[0], total.shape[1] - mask.shape[1]), mask.dtype)], 1)
    out = jit_run(model, total[:, :-1], edits, reads=reads, attention_mask=full_mask[:, :-1])
    return out, slice(mask.shape[1] - 1, total.shape[1] - 1)


def steering(model, seed=3):
    v = np.random.default_rng(seed).normal(size=model.config.hidden_size).astype(np.float32)
    return v / np.linalg.norm(v) * 4.0


def steered(model, tokens, mask, strength, eos=(), pad=0):
    """``generate`` with ``strength`` times the steering vector added at block 1's output (0: no steering) and
    ``eos`` (an id; ``()``: no row stops; None: the model's), reading ``layers.layer_output``: one structure per
    kind of ``eos``, so one compile serves every call on a model with it."""
    edits = [jstd.Add("layers.layer_output", strength * steering(model), layer=1)]
    return jstd.generate(model, tokens, edits, attention_mask=mask, max_new_tokens=NEW, reads=("layers.layer_output",),
                         eos_token_id=eos if eos in (None, ()) else [eos], pad_token_id=pad)


@pytest.mark.parametrize("name", families.TEXT_MAIN)
def test_plain_and_steered_generation_equal_transformers_and_the_whole_run(zoo, name):
    """Greedy tokens and each step's logits equal transformers' generate, plain and steered through its hooks; the
    steered steps' logits and reads equal jstd.run on the generated sequence with the same edit."""
    _, _, model, ref, _ = zoo(name)
    tokens, mask = left_padded(model)
    arrays = dict(input_ids=tokens, attention_mask=mask)
    plain, gen = steered(model, tokens, mask, 0.0), steered(model, tokens, mask, 1.0)
    want_tokens, want_logits = torch_generate(ref, arrays)
    np.testing.assert_array_equal(np.asarray(plain.tokens), want_tokens)
    assert_close(plain.logits, want_logits, 1e-5, f"{name}: step logits")
    assert np.abs(np.asarray(gen.logits) - np.asarray(plain.logits)).max() > 1e-2, "the steering changes nothing"
    v = torch.from_numpy(steering(model))
    want_tokens, want_logits = torch_generate(ref, arrays, edits=[TorchEdit("layers.layer_output", lambda t: t + v, 1)])
    np.testing.assert_array_equal(np.asarray(gen.tokens), want_tokens)
    assert_close(gen.logits, want_logits, 1e-5, f"{name}: steered step logits")
    if model.layers_with("linear_attn"):  # the hybrids' steps are checked against transformers' alone: their whole
        return                             # run would add a 15 s compile each to the suite
    edits = [jstd.Add("layers.layer_output", steering(model), layer=1)]
    out, steps = whole_run(model, gen, mask, edits, reads=("layers.layer_output",))
    assert_close(gen.logits, out.logits[:, steps], 1e-5, f"{name}: steered logits vs the whole run")
    assert_close(gen["layers.layer_output"], out["layers.layer_output"][:, :, steps], 1e-5, f"{name}: reads")


@pytest.fixture(scope="module")
def llama(zoo):
    return zoo("llama-gqa")


def test_rows_stop_at_eos_and_pad_after_it_as_transformers(llama):
    _, _, model, ref, _ = llama
    tokens, mask = left_padded(model, seed=1)
    free = np.asarray(steered(model, tokens, mask, 0.0).tokens)
    eos = int(free[0, PROMPT + 2])  # row 0's third new token: row 0 stops there
    pad = 5
    got = np.asarray(steered(model, tokens, mask, 0.0, eos=eos, pad=pad).tokens)
    want, _ = torch_generate(ref, dict(input_ids=tokens, attention_mask=mask), eos_token_id=eos, pad_token_id=pad)
    np.testing.assert_array_equal(got[:, :want.shape[1]], want)  # transformers stops when every row has
    assert (got[:, want.shape[1]:] == pad).all()
    assert (got[0, PROMPT + 3:] == pad).all() and got[0, PROMPT + 2] == eos
    assert (got[:, :PROMPT + 2] == free[:, :PROMPT + 2]).all()
    # by default a generation stops at the checkpoint's EOS ids and pads with its pad id (generation_config.json)
    folder = llama.folder
    assert model.config.eos_token_ids == jstd.generation_config(folder)["eos_token_id"] != ()
    own = with_fields(model, config=dataclasses.replace(model.config, eos_token_ids=(eos,), pad_token_id=pad))
    np.testing.assert_array_equal(np.asarray(steered(own, tokens, mask, 0.0, eos=None, pad=None).tokens), got)


def test_edit_positions_are_absolute_in_the_growing_sequence(llama):
    """An edit at one generated position (and one prompt position) changes the steps from there on exactly as the
    same edit does on the whole sequence."""
    _, _, model, _, _ = llama
    tokens, mask = left_padded(model, seed=4)
    v = steering(model, 5)
    at = [PROMPT - 3, PROMPT + 2]
    edits = [jstd.Add("layers.layer_mid", v, layer=2, positions=np.asarray(at))]
    gen = jstd.generate(model, tokens, edits, attention_mask=mask, max_new_tokens=NEW)
    out, steps = whole_run(model, gen, mask, edits)
    assert_close(gen.logits, out.logits[:, steps], 1e-5, "positioned edit")
    with pytest.raises(jstd.SiteError, match="no negatives"):
        jstd.generate(model, tokens, [jstd.Add("layers.layer_mid", v, layer=2, positions=-1)], max_new_tokens=NEW)


def test_a_strength_sweep_is_one_vmap_over_generate(llama):
    _, _, model, _, _ = llama
    tokens, mask = left_padded(model, seed=6)
    v = jnp.asarray(steering(model))
    strengths = jnp.asarray([0.0, 1.0, 3.0])

    @jax.jit
    def sweep(strengths, layer):
        one = lambda s: jstd.generate(model, tokens, [jstd.Add("layers.layer_output", s * v, layer=layer)],
                                      attention_mask=mask, max_new_tokens=NEW, reads=("layers.layer_output",),
                                      eos_token_id=())
        return jax.vmap(one)(strengths)

    swept = sweep(strengths, jnp.asarray(1))
    for k, s in enumerate(np.asarray(strengths)):
        single = steered(model, tokens, mask, s)
        np.testing.assert_array_equal(np.asarray(swept.tokens[k]), np.asarray(single.tokens))
        assert_close(swept.logits[k], single.logits, 1e-5, f"strength {s}")
        assert_close(swept["layers.layer_output"][k], single["layers.layer_output"], 1e-5, f"strength {s} reads")
    assert not np.array_equal(np.asarray(swept.tokens[0]), np.asarray(swept.tokens[2])), "the sweep changes nothing"


def test_sampling_filters_as_transformers_and_is_reproducible(llama):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = np.random.default_rng(8).normal(size=(4, 50)).astype(np.float32) * 3
    sampling = jstd.Sampling(temperature=0.7, top_k=20, top_p=0.8)
    t = torch.from_numpy(logits)
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        t = warper(None, t)
    got = np.asarray(sampling.filtered(jnp.asarray(logits)))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(t.numpy()))
    assert_close(np.where(np.isinf(got), 0, got), np.where(np.isinf(got), 0, t.numpy()), 1e-6, "filtered logits")

    _, _, model, _, _ = llama
    tokens, mask = left_padded(model, seed=9)
    hot = jstd.Sampling(temperature=2.0, top_k=8)
    a = jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=NEW, eos_token_id=(), sampling=hot, key=jax.random.key(1))
    b = jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=NEW, eos_token_id=(), sampling=hot, key=jax.random.key(1))
    c = jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=NEW, eos_token_id=(), sampling=hot, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    new = np.asarray(a.tokens)[:, PROMPT:]
    rank = (np.asarray(a.logits) > np.take_along_axis(np.asarray(a.logits), new[..., None], -1)).sum(-1)
    assert (rank < 8).all(), "a sampled token outside the top k"
    cold = jstd.Sampling(temperature=1e-4, top_k=8)  # the same compile: temperature is a value
    greedy = steered(model, tokens, mask, 0.0)
    one = jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=NEW, eos_token_id=(), sampling=cold, key=jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(greedy.tokens))


@pytest.mark.parametrize("name", families.WRAPPERS)
def test_wrappers_generate_after_the_image_as_transformers(zoo, name):
    """Every wrapper: image features in the prefill only; M-RoPE positions keep counting past the image; rows stop
    at the checkpoint's EOS ids (jstd's default), as transformers' do with the same ids."""
    _, _, model, ref, spec = zoo(name)
    inputs, arrays = spec.inputs(model, seed=1, counts=(1, 1))
    gen = jstd.generate(model, inputs, max_new_tokens=NEW, pad_token_id=0)
    eos = list(model.config.eos_token_ids)
    want_tokens, want_logits = torch_generate(ref, arrays, **({"eos_token_id": eos} if eos else {}))
    done = want_tokens.shape[1]  # transformers stops when every row has
    np.testing.assert_array_equal(np.asarray(gen.tokens)[:, :done], want_tokens)
    assert (np.asarray(gen.tokens)[:, done:] == 0).all(), f"{name}: tokens after every row stopped"
    assert_close(gen.logits[:, :want_logits.shape[1]], want_logits, 1e-5, f"{name}: step logits")


def test_generate_errors_name_the_problem(llama):
    _, _, model, _, _ = llama
    tokens, mask = left_padded(model)
    with pytest.raises(ValueError, match="pass key="):
        jstd.generate(model, tokens, max_new_tokens=2, sampling=jstd.Sampling(temperature=0.5))
    with pytest.raises(ValueError, match="ends in padding"):
        jstd.generate(model, tokens, attention_mask=mask[:, ::-1], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        jstd.generate(model, tokens, max_new_tokens=0)
    with pytest.raises(jstd.SiteError, match="span the cache"):
        jstd.generate(model, tokens, max_new_tokens=2, reads=("layers.self_attn.attention_probabilities",))
    with pytest.raises(jstd.SiteError, match="covers the whole sequence"):
        jstd.generate(model, tokens, [jstd.Zero("layers.layer_output", positions=np.ones(PROMPT, bool))],
                      max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p must be in"):
        jstd.Sampling(top_p=1.5)


def test_generate_command_streams_the_greedy_tokens_of_transformers(capsys):
    from transformers import AutoModelForCausalLM

    induction = ASSET.parent / "induction-llama"  # trained to copy: its tokens show a wrong step
    proc = jstd.load_processor(induction)
    prompt = "the baker sat near this old river with one green boat the baker sat"
    ids = torch.as_tensor(proc(prompt, return_tensors="np")["input_ids"])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(induction).eval().generate(ids, max_new_tokens=6, do_sample=False)
    assert main(["generate", str(induction), prompt, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == proc.decode(want[0], skip_special_tokens=True) + "\n"


def compiled_generate(model, tokens, mask, new=NEW):
    """The compiled program of ``jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=new,
    eos_token_id=())``, which this runs once."""
    import importlib

    loop = importlib.import_module("jstd.generate.loop")  # the module whose _jit_generate generate calls
    real, compiled = loop._jit_generate, []

    def spy(dynamic, structure, static):
        compiled.append(real.lower(dynamic, structure, static).compile())
        return real(dynamic, structure, static)

    loop._jit_generate = spy
    try:
        jstd.generate(model, tokens, attention_mask=mask, max_new_tokens=new, eos_token_id=())
    finally:
        loop._jit_generate = real
    return compiled[-1]


@pytest.mark.parametrize("name", families.TEXT_MAIN)
def test_the_decoding_loop_reads_every_weight_where_it_lies(zoo, name):
    """No instruction of the compiled decoding loop but a product makes a block weight's worth of data out of a
    weight: each step reads the weights as stored (no copy out of the stacked arrays, no transposed copy for a
    product)."""
    import re

    _, _, model, _, _ = zoo(name)
    tokens, mask = left_padded(model, seed=6)
    vocab = model.config.vocab_size
    loop = decoding_loop(compiled_generate(model, tokens, mask).as_text(), f"f32[{NEW},{tokens.shape[0]},{vocab}]")
    # the weights in the loop: its state's entries of a product weight's shape, per block or stacked (and bitcasts
    # of them; the DeltaNet convolutions' are read elementwise, in place, and per-head biases [heads, head_dim] are
    # added to a product's output, which is no copy of them)
    products = [a for path, a in jax.tree_util.tree_leaves_with_path(model.layers)
                if a.ndim >= 3 and not any(w in jax.tree_util.keystr(path) for w in ("conv", "bias"))]
    weights = {",".join(map(str, shape)): int(np.prod(a.shape[1:])) for a in products for shape in (a.shape, a.shape[1:])}
    held, made = {}, []  # the weights' names (and their bitcasts') -> one block's size; the instructions copying one
    for line in loop:
        m = re.match(r"\s+%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\((.*)", line)
        if not m:
            continue
        name, dims, op, rest = m.groups()
        size = int(np.prod([int(d) for d in dims.split(",") if d]))
        read = [held[o] for o in re.findall(r"%([\w.-]+)", rest.split("), ")[0]) if o in held]
        if op == "get-tuple-element" and dims in weights or op == "bitcast" and read:
            held[name] = weights[dims] if op == "get-tuple-element" else min(read)
        elif op not in ("dot", "tuple") and "kind=kCustom" not in rest and read and size >= min(read):
            made.append(line.strip()[:160])  # a whole weight's worth made from a weight (kCustom: a library dot)
    assert held, "no weight found in the decoding loop"
    assert not made, "the decoding loop copies weights:\n" + "\n".join(made)


def test_a_decoding_step_copies_no_cache():
    """Each decoding step attends every block's cache where it lies and writes its keys and values into it in
    place: in the compiled loop, nothing but an in-place write (and a product) makes a buffer as large as one
    block's cache — no copy of the cache carried from step to step, no concatenation of a block's cache with the
    step's own keys, no block's slice out of a stacked cache. Batch 1, and under ``jax.vmap`` over steering
    strengths (a cache per strength)."""
    model = jstd.load(ASSET)
    c, prompt, new = model.config, 56, 4  # a long prompt: one block's cache outsizes a row's logits
    tokens = np.random.default_rng(10).integers(1, c.vocab_size, (1, prompt))
    steer = lambda s: jstd.generate(model, tokens, [jstd.Add("layers.layer_output", s * jnp.ones(c.hidden_size),
                                                                layer=1)], max_new_tokens=new, eos_token_id=())
    programs = {  # rows of cache -> (the compiled program, the loop's logits buffer)
        1: (compiled_generate(model, tokens, None, new).as_text(), f"f32[{new},1,{c.vocab_size}]"),
        3: (jax.jit(jax.vmap(steer)).lower(jnp.linspace(0.0, 1.0, 3)).compile().as_text(),
            f"f32[3,{new},1,{c.vocab_size}]"),
    }
    for rows, (hlo, logits) in programs.items():
        block_cache = rows * c.num_kv_heads * (prompt + new) * c.head_dim * 4  # float32 keys of one block
        made = step_buffers(hlo, logits)
        big = [line for size, kind, line in made if kind in ("made", "copy") and size >= block_cache]
        assert not big, f"{rows} row(s): a decoding step makes a cache-sized buffer:\n" + "\n".join(big)
        writes = sum(kind == "in place" for _, kind, _ in made)
        assert writes >= 2 * c.num_layers, f"{writes} in-place writes: not one a block's keys and values"


def test_the_budget_counts_the_float32_copies_of_bfloat16_weights():
    """XLA:CPU has no bfloat16 one-row product: it converts each weight to float32 and multiplies that, the
    conversion hoisted out of the decoding loop, so a bfloat16 model's generate holds float32 copies of its weights
    for the call, beside the prefill's own. The budget (``preallocated_bytes``, checked before compiling) counts
    two copies of every such weight: the compiled program's temporary memory really holds at least that much
    more than the float32 model's program (which holds none), and not twice more."""
    from jstd.generate.budget import float32_copies, preallocated_bytes

    models = {dtype: jstd.load(ASSET, dtype=getattr(jnp, dtype)) for dtype in ("float32", "bfloat16")}
    tokens, mask = left_padded(models["float32"], seed=8)
    temp = {dtype: compiled_generate(model, tokens, mask).memory_analysis().temp_size_in_bytes
            for dtype, model in models.items()}
    weights = sum(x.size for x in jax.tree.leaves(models["bfloat16"].decoder) if getattr(x, "ndim", 0) >= 2)
    copies = float32_copies(models["bfloat16"])
    assert float32_copies(models["float32"]) == 0 and copies == 2 * 4 * weights
    held = temp["bfloat16"] - temp["float32"]
    assert copies <= held < 2 * copies, (copies, held)
    cache_and_logits = preallocated_bytes(models["float32"], *tokens.shape, NEW) - float32_copies(models["float32"])
    assert preallocated_bytes(models["bfloat16"], *tokens.shape, NEW) >= copies + cache_and_logits // 2


def test_a_sweep_without_eos_runs_one_unbatched_loop():
    """Under ``jax.vmap`` (a sweep of strengths) with ``eos_token_id=()`` no row can stop, and the decoding loop's
    predicate is the step count alone, not batched: a batched predicate makes every step select each row's whole
    carry (the logits buffer, the cache). With EOS ids the rows may stop apart, and the predicate is batched."""
    model = jstd.load(ASSET)
    tokens = np.random.default_rng(9).integers(1, model.config.vocab_size, (1, PROMPT))
    v = jnp.ones(model.config.hidden_size)

    def predicates(eos):
        steer = lambda s: jstd.generate(model, tokens, [jstd.Add("layers.layer_output", s * v, layer=1)],
                                        max_new_tokens=NEW, eos_token_id=eos)
        jaxpr = jax.make_jaxpr(jax.vmap(steer))(jnp.linspace(0.0, 1.0, 3)).jaxpr
        found = []

        def walk(j):
            for e in j.eqns:
                if e.primitive.name == "while":
                    found.append(e.params["cond_jaxpr"].jaxpr.outvars[0].aval.shape)
                for sub in e.params.values():
                    inner = getattr(sub, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))
        walk(jaxpr)
        return found

    assert predicates(()) == [()]
    assert predicates(None) == [(3,)]
