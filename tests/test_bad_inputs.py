"""Inputs refused clearly (before anything compiles), processor outputs accepted, eager ``jstd.run`` compiled and
cached, and the first steps with a tokenizer: token strings and the leading-space form of a word.

Each row of ``REFUSED`` is one refusal and the start of its message (the entries of docs/errors.md).
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from conftest import assert_close
from jstd.interventions.lens import get_first_tokens
from jstd.interventions.reading import token_strings
from jstd.run import _jit_forward

ASSET = Path(jstd.__file__).parent / "assets" / "tiny-llama"  # vocab 768
ROOT = Path(__file__).parents[1]
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def model():
    return jstd.load(ASSET)


@pytest.fixture(scope="module")
def tok():
    return jstd.load_processor(ASSET)


@pytest.fixture(scope="module")
def tokens(tok):
    return tok([TEXT], return_tensors="np")["input_ids"]  # int64 [1, 6]


def compiles():
    return _jit_forward._cache_size()


REFUSED = [  # (name, call(model, tok), error, first words of the message)
    ("int64 id past 2**31 (would wrap to 5)", lambda m, t: jstd.run(m, np.array([[1, 2**32 + 5]], np.int64)),
     ValueError, r"token id 4294967301 is out of range: token ids must lie in \[0, 768\)"),
    ("int64 id just past int32", lambda m, t: jstd.run(m, np.array([[2**31 + 5]], np.int64)),
     ValueError, r"token id 2147483653 is out of range"),
    ("negative id", lambda m, t: jstd.run(m, np.array([[3, -1]])), ValueError, r"token id -1 is out of range"),
    ("empty sequence", lambda m, t: jstd.run(m, np.zeros((1, 0), np.int32)),
     ValueError, r"tokens have shape \(1, 0\): a run needs at least one row and one token per row"),
    ("batch of none", lambda m, t: jstd.run(m, np.zeros((0, 4), np.int32)),
     ValueError, r"tokens have shape \(0, 4\): a run needs at least one row"),
    ("empty sequence under jit", lambda m, t: jax.jit(jstd.run)(m, jnp.zeros((1, 0), jnp.int32)),
     ValueError, r"tokens have shape \(1, 0\)"),
    ("empty prompt from the tokenizer", lambda m, t: jstd.run(m, t([""], add_special_tokens=False, return_tensors="np")),
     ValueError, r"tokens have shape \(1, 0\)"),
    ("text", lambda m, t: jstd.run(m, TEXT), TypeError, r"run takes token ids, not text: tokenize first, e\.g\. "
     r"jstd\.Inputs\.of\(jstd\.load_processor\(path\)\(texts"),
    ("texts", lambda m, t: jstd.run(m, [TEXT, TEXT]), TypeError, r"run takes token ids, not text"),
    ("an array of text", lambda m, t: jstd.run(m, np.array([[TEXT]])), TypeError,
     r"tokens must be token ids, got an array of <U\d+ \(text\?\); tokenize first"),
    ("float ids", lambda m, t: jstd.run(m, np.ones((1, 3), np.float32)), ValueError,
     r"tokens must be integer token ids, got dtype float32"),
    ("one row without a batch axis", lambda m, t: jstd.run(m, np.arange(3)), ValueError,
     r"tokens must be \[batch, seq\] token ids, got shape \(3,\); add a batch axis"),
    ("ragged rows", lambda m, t: jstd.run(m, [[1, 2, 3], [4]]), ValueError,
     r"tokens are ragged \(rows of different lengths\): pad them"),
    ("ragged tokenizer output", lambda m, t: jstd.run(m, t([TEXT, "is"])), ValueError,
     r"Inputs\.of: input_ids is ragged \(rows of different lengths\); call the tokenizer with padding=True"),
    ("a dict traced by jit", lambda m, t: jax.jit(jstd.run)(m, dict(t([TEXT], return_tensors="np"))), TypeError,
     r"a processor output \(a dict of arrays\) cannot be traced: convert it outside jit with jstd\.Inputs\.of"),
    ("a read that is not a name", lambda m, t: jstd.run(m, np.ones((1, 3), np.int32), reads=(3,)), TypeError,
     r"reads are site names \(strings\)"),
]


@pytest.mark.parametrize("name, call, error, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_before_compiling(model, tok, name, call, error, message):
    before = compiles()
    with pytest.raises(error, match="^" + message):
        call(model, tok)
    assert compiles() == before  # checked eagerly: nothing was compiled for a refused call


def test_processor_outputs_and_reads_none(model, tok, tokens):
    want = jstd.run(model, tokens).logits
    for given in (tok([TEXT], return_tensors="np"),  # BatchEncoding, numpy
                  tok(TEXT),  # one text, unbatched lists: one row
                  dict(tok([TEXT], return_tensors="np")),
                  jstd.Inputs.of(tok([TEXT])),
                  tokens.tolist()):
        np.testing.assert_array_equal(jstd.run(model, given).logits, want)
    out = jstd.run(model, tokens, reads=None)  # None reads nothing, as reads=()
    assert dict(out.values) == {}
    np.testing.assert_array_equal(out.logits, want)


def test_eager_run_is_the_jitted_run_compiled_once(model, tokens):
    site = "layers.mlp.mlp_output"
    reads = ("layers.layer_output", "layers.2.self_attn.attention_probabilities")
    jitted = jax.jit(jstd.run, static_argnames="reads")
    first = jstd.run(model, tokens, [jstd.Scale(site, 0.5, layer=1)], reads=reads)
    n = compiles()
    for factor, layer in ((0.25, 2), (2.0, -1), (0.0, 0)):  # new edit values and layers: no new compile
        out = jstd.run(model, tokens, [jstd.Scale(site, factor, layer=layer)], reads=reads)
        want = jitted(model, tokens, [jstd.Scale(site, factor, layer=layer)], reads=reads)
        np.testing.assert_array_equal(out.logits, want.logits)
        for r in reads:
            np.testing.assert_array_equal(out[r], want[r])
    assert compiles() == n
    assert not np.array_equal(out.logits, first.logits)
    np.testing.assert_array_equal(jstd.run(model, jnp.asarray(tokens), [jstd.Scale(site, 0.5, layer=1)],
                                           reads=reads).logits, first.logits)  # jax or numpy ids alike
    n = compiles()  # (a jax array is its own entry of jit's dispatch cache)
    double = lambda v: 2 * v  # an Apply's plain function is static: the same object compiles once
    a = jstd.run(model, tokens, jstd.Apply(site, double, layer=1)).logits
    b = jstd.run(model, tokens, jstd.Apply(site, double, layer=3)).logits
    assert compiles() == n + 1 and not np.array_equal(a, b)
    np.testing.assert_array_equal(a, jstd.run(model, tokens, jstd.Scale(site, 2.0, layer=1)).logits)


def test_eager_run_under_transformations(model, tokens):
    site = "layers.mlp.mlp_output"
    factors = jnp.asarray([0.0, 0.5, 1.0])
    swept = jax.vmap(lambda f: jstd.run(model, tokens, jstd.Scale(site, f, layer=2)).logits)(factors)
    for f, logits in zip(factors, swept):
        # one program batched, one not: equal to float32 rounding at the logits' scale
        assert_close(logits, jstd.run(model, tokens, jstd.Scale(site, f, layer=2)).logits, 1e-5, f"factor {f}")
    grad = jax.grad(lambda f: jstd.run(model, tokens, jstd.Scale(site, f, layer=2)).logits[0, -1, 5])(1.0)
    assert np.isfinite(grad) and grad != 0


def test_token_strings_and_the_leading_space_form(tok, tokens):
    strings = token_strings(tok, TEXT)
    assert strings == [tok.decode([int(i)]) for i in tokens[0]]
    assert "".join(strings[1:]) == TEXT and strings[-1] == " is"
    assert token_strings(tok, tokens[0]) == strings
    assert token_strings(tok, TEXT, add_special_tokens=False) == strings[1:]
    with pytest.raises(ValueError, match="one text or one row of token ids"):
        token_strings(tok, tokens)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    spaced, plain = enc(" Paris")[0], enc("Paris")[0]
    assert spaced != plain and tok.decode([spaced]).startswith(" ")
    assert get_first_tokens("Paris", tok, space=True) == [spaced]  # what follows "The capital of France is"
    assert get_first_tokens("Paris", tok, space=False) == [plain]
    assert get_first_tokens(["Paris", "Rome"], tok) == [plain, spaced, enc("Rome")[0], enc(" Rome")[0]]


def test_make_demo_installs_the_plots_extra():
    make = (ROOT / "Makefile").read_text()
    demo = next(line for line in make.splitlines() if line.startswith("demo:"))
    stamp = demo.split(":", 1)[1].split()[0]
    recipe = make.split(f"{stamp}:", 1)[1].split("\n\n", 1)[0]
    assert "'.[plots]'" in recipe or "'.[plots," in recipe
    assert '"matplotlib' in (ROOT / "pyproject.toml").read_text().split("plots = [", 1)[1].split("]", 1)[0]
