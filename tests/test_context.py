"""jstd.Context: runs that continue earlier positions (a cache) and start at a later block.

Every continued run is compared with the one full run it continues: the
values at the positions it computes are those of the full run.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from jstd.interventions.reading import read as jitted_run
from olmo_hybrid_cases import SHORT_TAIL, config as hybrid_config, make_checkpoint as make_hybrid_checkpoint

continuing, sites_for = jstd.Context.continuing, jstd.Context.sites_for
ASSET = Path(jstd.__file__).parent / "assets" / "tiny-llama"
SEQ = 11
SITES = ("layers.layer_output", "layers.self_attn.attention_keys", "layers.mlp.mlp_neurons")


def close(a, b, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


def read(model, tokens, reads=(), edits=(), context=None):
    if context is None:
        return jitted_run(model, tokens, reads, edits)
    return _run(model, tokens, edits, context, reads)


def _run(model, tokens, edits, context, reads):
    return jax.jit(jstd.run, static_argnames="reads")(model, jnp.asarray(tokens), edits, reads=reads, context=context)


@pytest.fixture(scope="module")
def llama():
    return jstd.load(ASSET)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The tail layout (whole periods scanned, then the tail blocks unrolled), at its smallest: the layouts of
    the released checkpoints continue in test_conformance (test_context_continues_the_run on the MAIN hybrids)."""
    return jstd.load(make_hybrid_checkpoint(hybrid_config("tail", **SHORT_TAIL), tmp_path_factory.mktemp("tail")))


@pytest.fixture(scope="module")
def tokens(llama):
    return np.random.default_rng(0).integers(0, 97, (2, SEQ))


def suffix_positions(start, batch=2):
    return jnp.broadcast_to(jnp.arange(start, SEQ), (batch, SEQ - start))


def test_a_prompt_continued_from_its_prefix_cache_equals_the_whole_run(llama, tokens):
    full = read(llama, tokens, SITES)
    for start in (1, 6, SEQ - 1):
        prefix = read(llama, tokens[:, :start], sites_for(llama))
        rest = read(llama, tokens[:, start:], SITES, context=continuing(llama, prefix, suffix_positions(start)))
        close(rest.logits, full.logits[:, start:])
        close(rest["layers.layer_output"], full["layers.layer_output"][:, :, start:])
        close(rest["layers.self_attn.attention_keys"], full["layers.self_attn.attention_keys"][:, :, :, start:])
        close(rest["layers.mlp.mlp_neurons"], full["layers.mlp.mlp_neurons"][:, :, start:])


def test_one_cache_serves_every_start_and_packed_segments(llama, tokens):
    full = read(llama, tokens, sites_for(llama))
    for start in (0, 4, SEQ - 1):  # the whole run's cache: entries at or after the start are ignored
        rest = read(llama, tokens[:, start:], context=continuing(llama, full, suffix_positions(start)))
        close(rest.logits, full.logits[:, start:])
    # two segments in one row: the suffix from 3 and the suffix from 8, each sees its own past only
    positions = np.concatenate([np.arange(3, SEQ), np.arange(8, SEQ)])
    row = np.broadcast_to(positions, (2, len(positions)))
    packed = read(llama, np.take_along_axis(tokens, row, 1), context=continuing(llama, full, row))
    close(packed.logits, full.logits[:, positions])


def test_a_run_resumed_at_any_block_equals_the_whole_run(llama, tokens):
    full = read(llama, tokens, sites_for(llama) + ("layers.layer_input", "layers.layer_output"))
    start, L = 4, llama.config.num_layers
    streams = list(full["layers.layer_input"]) + [full["layers.layer_output"][-1]]
    for block in range(L + 1):
        context = continuing(llama, full, suffix_positions(start), block=jnp.asarray(block),
                             stream=streams[block][:, start:])
        rest = read(llama, tokens[:, start:], ("layers.layer_output",), context=context)
        close(rest.logits, full.logits[:, start:])
        if block < L:
            close(rest["layers.layer_output"][block:], full["layers.layer_output"][block:, :, start:])
        assert not np.any(np.asarray(rest["layers.layer_output"][:block]))  # skipped blocks read as zeros


def test_a_run_resumed_at_a_block_traces_each_block_once(llama, tokens, monkeypatch):
    """Resuming at a traced block (``Stack(first=)``: a ``lax.cond`` a block) traces each block's Python as often as
    a plain run does (once, the skipping branch's zeros shaped from that one trace)."""
    full = read(llama, tokens, sites_for(llama) + ("layers.layer_input",))
    block_type = type(llama.stacks["layers"].slots[0])
    calls = []
    original = block_type.__call__
    monkeypatch.setattr(block_type, "__call__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))

    def traces(context):
        calls.clear()  # a fresh function each time: no trace cache
        jax.eval_shape(lambda t: jstd.run(llama, t, reads=("layers.layer_output",), context=context), tokens[:, 4:])
        return len(calls)

    plain = traces(continuing(llama, full, suffix_positions(4)))
    resumed = traces(continuing(llama, full, suffix_positions(4), block=jnp.asarray(2),
                                stream=full["layers.layer_input"][2][:, 4:]))
    assert plain > 0 and resumed == plain


def test_edits_on_a_continued_run_equal_the_same_edits_on_the_whole_run(llama, tokens):
    start, layer = 5, 2
    full = read(llama, tokens, sites_for(llama))
    value = jnp.full((2, 64), 0.25)
    whole = jstd.Add("layers.layer_mid", value[:, None], layer=layer, positions=7)
    part = jstd.Add("layers.layer_mid", value[:, None], layer=layer, positions=7 - start)  # the run's own seq axis
    edited = read(llama, tokens, edits=(whole,))
    rest = read(llama, tokens[:, start:], edits=(part,), context=continuing(llama, full, suffix_positions(start)))
    close(rest.logits, edited.logits[:, start:])
    assert not np.allclose(edited.logits[:, 7:], full.logits[:, 7:], atol=1e-3)  # the edit did something


def test_hybrid_continues_states_and_convolutions(hybrid):
    tokens = np.random.default_rng(1).integers(0, hybrid.config.vocab_size, (2, SEQ))
    reads = sites_for(hybrid) + ("layers.layer_input", "layers.linear_attn.state_input", "layers.linear_attn.attention_queries")
    full = read(hybrid, tokens, reads)
    for start in (0, 1, 2, 7):  # before, at and after the convolutions' width
        rest = read(hybrid, tokens[:, start:], reads[-2:], context=continuing(hybrid, full, suffix_positions(start)))
        close(rest.logits, full.logits[:, start:])
        close(rest["layers.linear_attn.attention_queries"], full["layers.linear_attn.attention_queries"][:, :, start:])
        expected = full["layers.linear_attn.states"][:, :, start - 1] if start else 0 * rest["layers.linear_attn.state_input"]
        close(rest["layers.linear_attn.state_input"], expected)
        for block in (1, hybrid.config.num_layers - 1):
            context = continuing(hybrid, full, suffix_positions(start), block=block,
                                 stream=full["layers.layer_input"][block][:, start:])
            close(read(hybrid, tokens[:, start:], context=context).logits, full.logits[:, start:])


def padded(tokens, pad):
    """Row 1 left-padded by ``pad`` tokens (id 0): (tokens, attention_mask)."""
    out, mask = tokens.copy(), np.ones_like(tokens)
    out[1, :pad], mask[1, :pad] = 0, 0
    out[1, pad:] = tokens[1, :SEQ - pad]
    return out, mask


def test_a_padded_run_continues_with_its_mask(llama, tokens, hybrid):
    for model in (llama, hybrid):
        toks, mask = padded(tokens % model.config.vocab_size, 3)
        full = jstd.run(model, toks, attention_mask=mask,
                        reads=sites_for(model) + ("layers.layer_input", "layers.layer_output"))
        for start in (2, 3, 6):  # inside the padding, at the first real token, after it
            positions = suffix_positions(start)
            rest = jstd.run(model, toks[:, start:], reads=("layers.layer_output",),
                            context=continuing(model, full, positions, mask=mask))
            real = mask[:, start:].astype(bool)
            close(np.asarray(rest.logits)[real], np.asarray(full.logits[:, start:])[real])
            close(np.asarray(rest["layers.layer_output"])[:, real], np.asarray(full["layers.layer_output"][:, :, start:])[:, real])
            context = continuing(model, full, positions, block=1, stream=full["layers.layer_input"][1][:, start:], mask=mask)
            resumed = jstd.run(model, toks[:, start:], context=context)
            close(np.asarray(resumed.logits)[real], np.asarray(full.logits[:, start:])[real])
    with pytest.raises(ValueError, match="context.mask has shape"):
        jstd.run(llama, tokens[:, 4:], context=continuing(llama, jstd.run(llama, tokens, reads=sites_for(llama)),
                                                          suffix_positions(4), mask=np.ones((2, 3), bool)))


def test_contexts_vmap_over_starts_and_block(llama, tokens):
    full = read(llama, tokens, sites_for(llama) + ("layers.layer_input",))
    start = 3

    def resumed(block):
        stream = full["layers.layer_input"][block][:, start:]
        context = continuing(llama, full, suffix_positions(start), block=block, stream=stream)
        return jstd.run(llama, tokens[:, start:], context=context).logits

    every = jax.jit(jax.vmap(resumed))(jnp.arange(llama.config.num_layers))
    close(every, np.broadcast_to(full.logits[:, start:], every.shape))


def test_context_errors_name_the_problem(llama, tokens, hybrid):
    full = read(llama, tokens, sites_for(llama) + ("layers.layer_input",))
    good = continuing(llama, full, suffix_positions(4))
    rest = tokens[:, 4:]
    with pytest.raises(ValueError, match="takes no attention_mask"):
        jstd.run(llama, rest, context=good, attention_mask=np.ones_like(rest))
    with pytest.raises(ValueError, match="positions has shape"):
        jstd.run(llama, rest[:, 1:], context=good)
    with pytest.raises(ValueError, match="context.keys has shape"):
        jstd.run(llama, rest, context=jstd.Context(good.positions, good.keys[:2], good.values[:2]))
    with pytest.raises(ValueError, match="needs context.block"):
        jstd.run(llama, rest, context=jstd.Context(good.positions, good.keys, good.values, stream=jnp.zeros((2, 7, 64))))
    with pytest.raises(ValueError, match="context.stream has shape"):
        jstd.run(llama, rest, context=jstd.Context(good.positions, block=1, stream=jnp.zeros((2, 7, 3))))
    with pytest.raises(ValueError, match=r"block must be one block index in \[0, 4\]"):
        jstd.run(llama, rest, context=jstd.Context(good.positions, block=9, stream=jnp.zeros((2, 7, 64))))
    with pytest.raises(jstd.SiteError, match="token_embeddings is not computed"):
        jstd.run(llama, rest, reads=("token_embeddings",),
                 context=jstd.Context(good.positions, block=1, stream=jnp.zeros((2, 7, 64))))
    hfull = read(hybrid, tokens % hybrid.config.vocab_size, sites_for(hybrid))
    hgood = continuing(hybrid, hfull, suffix_positions(4))
    with pytest.raises(ValueError, match="needs both the attention cache"):
        jstd.run(hybrid, rest % hybrid.config.vocab_size, context=jstd.Context(hgood.positions, hgood.keys, hgood.values))
