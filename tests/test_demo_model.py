"""The shipped induction model (jstd/assets/induction-llama): it loads, copies, its circuit is where the scores say;
the plots draw; `jstd demo` runs and writes its figures."""

import json
import re
import sys

import jax
import numpy as np
import pytest

import jstd
from jstd.cli import demo as cli
from jstd.cli import main

PATH = cli.INDUCTION
run = jax.jit(jstd.run, static_argnames="reads")
PERIOD = 24
MIN_ACCURACY = 0.85          # measured: ~0.95 (scripts/train_induction.py prints it)


@pytest.fixture(scope="module")
def model():
    return jstd.load(PATH)


@pytest.fixture(scope="module")
def tok():
    return jstd.load_processor(PATH)


@pytest.fixture(scope="module")
def rows(tok, model):
    return cli.repeated_tokens(np.random.default_rng(123), 32, PERIOD, cli.word_ids(tok, model.config.vocab_size),
                               tok.bos_token_id)


def test_checkpoint_is_small_and_loads(model, tok):
    size = sum(p.stat().st_size for p in PATH.iterdir())
    assert size < 2 << 20, size
    c = model.config
    assert (c.num_layers, c.num_heads, c.vocab_size) == (2, 4, len(tok))
    ids = tok("the king went to the castle")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "the king went to the castle"


def test_copies_repeated_sequences(model, rows):
    logits = jstd.run(model, rows).logits
    assert cli.copying_accuracy(logits, rows, PERIOD) > MIN_ACCURACY
    first = np.argmax(np.asarray(logits)[:, 1:PERIOD], -1) == rows[:, 2:PERIOD + 1]
    assert first.mean() < 0.1                           # the first copy is random: nothing to copy


def test_heads_found_by_score_are_the_ones_ablation_needs(model, rows):
    probs = run(model, rows, reads=("layers.self_attn.attention_probabilities",))
    lag, lag_scores, induction = cli.head_scores(probs["layers.self_attn.attention_probabilities"], PERIOD)
    pl, ph = np.unravel_index(np.argmax(lag_scores), lag_scores.shape)
    assert pl == 0 and lag_scores[pl, ph] > 0.8         # block 0 has a fixed-lag (previous-token-like) head
    heads = [(l, h) for l in range(2) for h in range(4) if induction[l, h] > 0.5]
    assert heads and all(l == 1 for l, _ in heads)     # block 1's induction heads read it
    clean = cli.copying_accuracy(run(model, rows).logits, rows, PERIOD)
    acc = np.zeros(lag_scores.shape)
    for l in range(2):
        for h in range(4):
            edit = jstd.zero_ablation("layers.self_attn.attention_head_outputs", layer=l, heads=h)
            acc[l, h] = cli.copying_accuracy(run(model, rows, [edit]).logits, rows, PERIOD)
    assert np.unravel_index(np.argmin(acc), acc.shape) == (pl, ph) and acc[pl, ph] < 0.2, acc
    zero = lambda chosen: [jstd.zero_ablation("layers.self_attn.attention_head_outputs", layer=l, heads=h)
                           for l, h in chosen]
    assert cli.copying_accuracy(run(model, rows, zero(heads)).logits, rows, PERIOD) < 0.2
    others = [(1, h) for h in range(4) if (1, h) not in heads]
    assert cli.copying_accuracy(run(model, rows, zero(others)).logits, rows, PERIOD) > clean - 0.1


def test_plots_write_pngs(tmp_path, model, tok, rows):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    out = jstd.run(model, rows[:1], reads=("layers.self_attn.attention_probabilities",))
    probs = out["layers.self_attn.attention_probabilities"][:, 0]
    fig = jstd.plot_attention(probs, labels=[str(t) for t in rows[0]], path=tmp_path / "a.png")
    assert isinstance(fig, Figure)
    jstd.plot_attention(probs[1], heads=[0, 1, 2, 3], path=tmp_path / "one_block.png")
    grid = np.random.default_rng(0).normal(size=(2, rows.shape[1]))
    jstd.plot_patching(grid, center=0.0, path=tmp_path / "p.png", title="t")
    lens = jstd.logit_lens(model, rows[:1])[:, 0]
    ids, top, tokens = jstd.logit_lens_table(lens, tok)
    assert ids.shape == top.shape == (2, rows.shape[1]) and len(tokens) == 2
    assert (ids[-1] == np.argmax(np.asarray(jstd.run(model, rows[:1]).logits[0]), -1)).all()
    jstd.plot_logit_lens(lens[:, -8:], tok, targets=rows[0, -7:].tolist() + [0], path=tmp_path / "l.png")
    for name in ("a", "one_block", "p", "l"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        jstd.plot_patching(np.zeros((2, 3, 4)))


def test_plots_name_the_extra_when_matplotlib_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"jstd\[plots\]"):
        jstd.plot_patching(np.zeros((2, 3)))


def test_demo_runs_and_writes_figures(tmp_path, capsys):
    main(["demo", "--figures", str(tmp_path / "figs"), "--html", str(tmp_path / "demo.html")])
    out = capsys.readouterr().out
    assert "top-1 accuracy on the second copy" in out and "<- induction head" in out and "(the same head)" in out
    assert "jstd.patch_sweep" in out and "steering" in out
    assert "top next tokens" in out and "max |diff| 0.00e+00" in out  # (the one run of `jstd demo` in the suite)
    if "figures: skipped" not in out:
        assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["attention.png", "logit_lens.png", "patching.png"]
    page = (tmp_path / "demo.html").read_text()           # the same figures as a page (tests/test_viewer.py opens one)
    data = json.loads(re.search(r'id="page-data">(.*?)</script>', page, re.S).group(1))
    assert [f["kind"] for f in data["figures"]] == ["attention", "grid", "grid"] and "interactive figures" in out
    assert np.shape(data["figures"][0]["probs"]) == (2, 4, 49, 49) and np.shape(data["figures"][1]["values"]) == (2, 49)
