"""Bad indices are refused, never skipped or clamped: before anything runs with a SiteError / ValueError /
TypeError where the index is known then, otherwise (positions and heads inside jstd.run, any index under jit or
vmap) with an equinox runtime error when the call runs.

Each table row is one refusal and the start of its message (the entries of docs/errors.md).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from jstd.core.edits import check_left_padded
from jstd.core.sites import SiteError

ASSET = Path(jstd.__file__).parent / "assets" / "tiny-llama"  # 4 blocks, 4 heads, 2 kv heads, vocab 768
SEQ = 7
HEADS = "layers.self_attn.attention_head_outputs"  # [batch, seq, heads, head_dim]
KEYS = "layers.self_attn.attention_keys"  # [batch, kv_heads, seq, head_dim]
STREAM = "layers.layer_output"
RUNTIME = Exception  # jax's runtime error carrying equinox's message (its type differs under jax.jit and filter_jit)


@pytest.fixture(scope="module")
def model():
    return jstd.load(ASSET)


@pytest.fixture(scope="module")
def tokens(model):
    return np.random.default_rng(0).integers(3, model.config.vocab_size, (2, SEQ))


@pytest.fixture(scope="module")
def corrupt(tokens):
    c = tokens.copy()
    c[:, 2] = 5
    return c


RIGHT = np.ones((2, SEQ), np.int32)
RIGHT[0, -2:] = 0  # row 0 padded on the right
LEFT = RIGHT[:, ::-1].copy()  # the same row padded on the left


# ---- edits: a bad layer, kind, mask shape or Apply refuses before anything runs ----------------------------------

EDIT_CASES = [
    ("layer past the depth", lambda: jstd.Zero(HEADS, layer=4),
     r"Zero at layers\.self_attn\.attention_head_outputs: layer=4: block 4 does not exist \(layers has 4 "
     r"blocks\); pass a block index in -4\.\.3 \(negatives count from the end\)"),
    ("layer before the start", lambda: jstd.Zero(HEADS, layer=-5), r"layer=-5: block -5 does not exist"),
    ("float layer", lambda: jstd.Zero(HEADS, layer=2.0), r"Zero at .*: layer must be an integer, got 2\.0"),
    ("layer array", lambda: jstd.Zero(HEADS, layer=jnp.arange(2)),
     r"layer must be one block index \(a scalar\), got shape \(2,\); vmap over"),
    ("mask of the wrong length", lambda: jstd.Zero(HEADS, heads=[True, False]),
     r"Zero at .*: heads: a boolean mask must have the axis' shape \(4,\), got shape \(2,\)"),
    ("float positions", lambda: jstd.Zero(HEADS, positions=1.5),
     r"positions must be integer indices or a boolean mask, got 1\.5 of dtype float"),
    ("Apply of the wrong shape", lambda: jstd.Apply(HEADS, lambda v: v.sum(-1), layer=2),
     r"Apply at layers\.self_attn\.attention_head_outputs: fn <lambda> returned shape \(2, 7, 4\); it must return "
     r"the site's value, shape \(2, 7, 4, 16\) \[batch, seq, heads, head_dim\] of dtype float32"),
    ("Apply of the wrong kind", lambda: jstd.Apply(STREAM, jnp.signbit),
     r"Apply at layers\.layer_output: fn signbit returned dtype bool \(bool\); it must return the site's value"),
]


@pytest.mark.parametrize("make, message", [c[1:] for c in EDIT_CASES], ids=[c[0] for c in EDIT_CASES])
def test_bad_edits_refuse_before_running(model, tokens, make, message):
    with pytest.raises(SiteError, match=message):
        jstd.run(model, tokens, [make()])


# ---- edits: indices that are values (positions, heads; layers under jit) raise when the call runs -------------

def test_indices_are_checked_under_jit_and_vmap(model, tokens):
    """Under jax.jit(jstd.run) an edit's ints are traced, and positions and heads are dynamic in every run (jstd.run
    compiles once per structure): a bad one raises when the call runs, naming the edit, the site, the axis and its
    size. One compile serves every case."""
    jit_run = jax.jit(jstd.run)
    f = lambda l, p, h: jit_run(model, tokens, [jstd.Zero(HEADS, layer=l, positions=p, heads=h)]).logits
    good = f(1, 2, 3)
    # negatives count from the end, like "layers.-1.X"; the bounds -L and L-1 are in range
    np.testing.assert_array_equal(f(-3, -5, -1), good)
    np.testing.assert_array_equal(f(-4, -7, -4), f(0, 0, 0))
    assert not np.array_equal(good, f(1, 2, 2))
    for args, message in [
        ((4, 0, 0), r"Zero at layers\.self_attn\.attention_head_outputs: layer is out of range \(layers has 4 "
                    r"blocks\); pass a block index in -4\.\.3 \(negatives count from the end\)"),
        ((-5, 0, 0), r"layer is out of range"),
        ((0, SEQ, 0), r"Zero at layers\.self_attn\.attention_head_outputs: positions is out of range for the seq "
                      r"axis of size 7; pass indices in -7\.\.6 \(negatives count from the end\)"),
        ((0, -8, 0), r"positions is out of range for the seq axis"),
        ((0, 0, 4), r"heads is out of range for the heads axis of size 4; pass indices in -4\.\.3"),
    ]:
        with pytest.raises(RUNTIME, match=message):
            jax.block_until_ready(f(*args))

    # an eager run (compiled and cached inside): the check's own message is the error, first line and all
    for edit, axis in [(jstd.Zero(HEADS, layer=0, positions=SEQ), "positions is out of range for the seq axis of "
                        "size 7; pass indices in -7..6"),
                       (jstd.Zero(HEADS, layer=0, heads=-5), "heads is out of range for the heads axis of size 4")]:
        with pytest.raises(ValueError) as caught:
            jax.block_until_ready(jstd.run(model, tokens, [edit]).logits)
        assert str(caught.value).splitlines()[0].startswith(f"Zero at layers.self_attn.attention_head_outputs: {axis}")

    # a vmap over indices that go past an axis or the depth: one bad entry refuses the whole call
    g = jax.vmap(lambda l, p, h: jstd.run(model, tokens, [jstd.Scale(KEYS, 2.0, layer=l, positions=p, heads=h)]).logits)
    ok = jnp.arange(2)
    jax.block_until_ready(g(ok, ok, ok))
    for args, message in [((ok + 3, ok, ok), r"Scale at layers\.self_attn\.attention_keys: layer is out of range"),
                          ((ok - 5, ok, ok), "layer is out of range"),
                          ((ok, ok + 6, ok), "positions is out of range for the seq axis of size 7"),
                          ((ok, ok, ok + 1), "heads is out of range for the kv_heads axis of size 2")]:
        with pytest.raises(RUNTIME, match=message):
            jax.block_until_ready(g(*args))


def test_hybrid_layer_must_have_the_host(zoo):
    """On a hybrid (DeltaNet blocks 0 and 2, attention blocks 1 and 3) a layer without the site's host refuses."""
    hybrid = zoo("olmo_hybrid-rotary_grouped").model
    tokens = np.arange(3, 3 + SEQ)[None]
    site = "layers.self_attn.attention_output"
    assert hybrid.blocks_for(site) == (1, 3)
    with pytest.raises(SiteError, match=r"Zero at layers\.self_attn\.attention_output: layer=2 is block 2, which has "
                                        r"no self_attn; pass a block with self_attn: \[1, 3\] \(negatives count from "
                                        r"the end: -4\.\.-1\)"):
        jstd.run(hybrid, tokens, [jstd.Zero(site, layer=2)])
    f = jax.jit(lambda l: jstd.run(hybrid, tokens, [jstd.Zero(site, layer=l)]).logits)
    np.testing.assert_array_equal(f(-1), f(3))
    with pytest.raises(RUNTIME, match="layer is out of range or names a block without self_attn"):
        jax.block_until_ready(f(2))


# ---- tools and metrics ---------------------------------------------------------------------------------------

METRIC = jstd.logit_difference(4, 5)
LOGITS = np.zeros((2, SEQ, 768), np.float32)

TOOL_CASES = [
    ("patch layer", lambda m, t, c: jstd.patch(m, t, c, STREAM, layer=4, positions=2, metric=METRIC),
     SiteError, r"patch at layers\.layer_output: layer=4: block 4 does not exist \(layers has 4 blocks\)"),
    ("patch position", lambda m, t, c: jstd.patch(m, t, c, STREAM, layer=1, positions=99, metric=METRIC),
     SiteError, r"patch at layers\.layer_output: positions=99 is out of range for the seq axis of size 7"),
    ("patch_sweep positions", lambda m, t, c: jstd.patch_sweep(m, t, c, STREAM, METRIC, positions=[1, 99]),
     SiteError, r"patch_sweep at layers\.layer_output: positions=99 is out of range for the seq axis of size 7"),
    ("patch_sweep layers", lambda m, t, c: jstd.patch_sweep(m, t, c, STREAM, METRIC, layers=[0, -5]),
     SiteError, r"patch_sweep at layers\.layer_output: layer=-5: block -5 does not exist"),
    ("logit_lens position", lambda m, t, c: jstd.logit_lens(m, t, positions=99),
     SiteError, r"logit_lens at layers\.layer_output: positions=99 is out of range for the seq axis of size 7"),
    ("logit_difference id", lambda m, t, c: jstd.logit_difference(5000, 3)(LOGITS), ValueError,
     r"LogitDifference: target=5000 is out of range: token ids must lie in 0\.\.767 \(the logits' vocabulary"),
    ("target_probability id", lambda m, t, c: jstd.target_probability(-1)(LOGITS), ValueError,
     r"TargetProbability: target=-1 is out of range: token ids must lie in 0\.\.767"),
    ("ids per row", lambda m, t, c: jstd.target_probability([1, 2, 3])(LOGITS), ValueError,
     r"TargetProbability: target must be an int or one id per row \(2 rows\), got shape \(3,\)"),
    ("float ids", lambda m, t, c: jstd.logit_difference(1.5, 3), TypeError,
     r"logit_difference: target must be integer token ids"),
    ("metric position", lambda m, t, c: jstd.target_probability(1, position=SEQ)(LOGITS), SiteError,
     r"TargetProbability: position=7 is out of range for the seq axis of size 7"),
    ("KL reference", lambda m, t, c: jstd.kl_divergence(jnp.zeros((2, SEQ, 97)))(LOGITS), ValueError,
     r"KLDivergence: the reference logits at the position have shape \(2, 97\), the run's \(2, 768\)"),
    ("metric id in a sweep", lambda m, t, c: jstd.patch_sweep(m, t, c, STREAM, jstd.logit_difference(4, 768)),
     ValueError, r"LogitDifference: other=768 is out of range"),
    ("attribution id", lambda m, t, c: jstd.direct_logit_attribution(m, t, 5000, 3), ValueError,
     r"direct_logit_attribution: target=5000 is out of range"),
    ("attribution position", lambda m, t, c: jstd.direct_logit_attribution(m, t, 4, position=SEQ), SiteError,
     r"direct_logit_attribution: position=7 is out of range"),
    ("site_mean layer", lambda m, t, c: jstd.mean_ablation(m, STREAM, t, layer=4), SiteError,
     r"site_mean at layers\.layer_output: layer=4: block 4 does not exist"),
    ("resample layer", lambda m, t, c: jstd.resample_ablation(m, STREAM, t, layer=-5), SiteError,
     r"resample_ablation at layers\.layer_output: layer=-5: block -5 does not exist"),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in TOOL_CASES], ids=[c[0] for c in TOOL_CASES])
def test_tools_refuse_bad_indices_and_ids(model, tokens, corrupt, call, error, message):
    with pytest.raises(error, match=message):
        call(model, tokens, corrupt)


def test_traced_metric_ids_raise_when_run():
    f = jax.jit(lambda ids, logits: jstd.target_probability(ids)(logits))
    np.testing.assert_allclose(f(3, LOGITS), 1 / 768, rtol=1e-6)
    with pytest.raises(RUNTIME, match=r"TargetProbability: target is out of range: token ids must lie in 0\.\.767"):
        jax.block_until_ready(f(5000, LOGITS))


# ---- right padding: nothing reads a row's last position when it is padding ------------------------------------

PAD_MESSAGE = (r"attention_mask row 0 ends in padding: {} reads each row's last position, which is padding on a row "
               r"padded on the right; pad on the left \(tokenizer\.padding_side = 'left'")
PADDING_CASES = [
    ("next_token_probs", lambda m, t, c, mask: jstd.next_token_probs(m, t, attention_mask=mask), "next_token_probs"),
    ("logit_lens", lambda m, t, c, mask: jstd.logit_lens(m, t, positions=-1, attention_mask=mask),
     r"logit_lens \(positions=-1\)"),
    ("patch", lambda m, t, c, mask: jstd.patch(m, t, c, STREAM, layer=1, metric=METRIC, attention_mask=mask),
     r"the metric LogitDifference \(position=-1\) of patch at layers\.layer_output"),
    ("patch_sweep", lambda m, t, c, mask: jstd.patch_sweep(m, t, c, STREAM, METRIC, attention_mask=mask),
     r"the metric LogitDifference \(position=-1\) of patch_sweep at layers\.layer_output"),
    ("attribution_patching", lambda m, t, c, mask: jstd.attribution_patching(m, t, c, STREAM, METRIC,
                                                                             attention_mask=mask),
     r"the metric LogitDifference \(position=-1\) of attribution_patching"),
    ("direct_logit_attribution", lambda m, t, c, mask: jstd.direct_logit_attribution(m, t, 4, attention_mask=mask),
     r"direct_logit_attribution \(position=-1\)"),
    ("Inputs", lambda m, t, c, mask: jstd.next_token_probs(m, jstd.Inputs(t, mask)), "next_token_probs"),
]


@pytest.mark.parametrize("call, reader", [c[1:] for c in PADDING_CASES], ids=[c[0] for c in PADDING_CASES])
def test_right_padding_refused_where_the_last_position_is_read(model, tokens, corrupt, call, reader):
    with pytest.raises(ValueError, match=PAD_MESSAGE.format(reader)):
        call(model, tokens, corrupt, RIGHT)


def test_left_padding_and_positions_from_the_start_are_read(model, tokens):
    # positions from the start read real tokens on a right-padded row: accepted, and equal to the same row padded
    # on the left, read at the same tokens (where -1 is accepted: the row ends with a real token)
    left_tokens = tokens.copy()
    left_tokens[0] = np.roll(tokens[0], 2)  # row 0's five real tokens after two pads
    right = jstd.logit_lens(model, tokens, positions=[0, 3], attention_mask=RIGHT)
    left = jstd.logit_lens(model, left_tokens, positions=[2, 5, -1], attention_mask=LEFT)
    np.testing.assert_allclose(right[:, 0], left[:, 0, :2], rtol=1e-5, atol=1e-5)
    with pytest.raises(RUNTIME, match=r"a row of attention_mask ends in padding: next_token_probs reads"):
        jax.block_until_ready(jax.jit(lambda m: check_left_padded(m, "next_token_probs"))(RIGHT))
