"""``jstd demo``: induction on the embedded trained model — copying, the heads found by score, a head ablation, a
patching sweep, steering, the logit lens, figures (PNG; with ``--html``, an interactive page)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jstd
from jstd import viewer

ASSET = Path(__file__).parent.parent / "assets" / "tiny-llama"
INDUCTION = Path(__file__).parent.parent / "assets" / "induction-llama"
DEMO_PROMPT = "the baker sat near this old river with one green boat"
RESIDUAL = ("layers.layer_input", "layers.self_attn.attention_output", "layers.mlp.mlp_output", "layers.layer_output")
PROBS = "layers.self_attn.attention_probabilities"
HEAD_OUTPUTS = "layers.self_attn.attention_head_outputs"


def repeated_tokens(rng, rows: int, period: int, words, bos: int | None = 0):
    """[rows, 1 + 2·period] int32: bos (when not None), ``period`` random ``words``, the same words again."""
    seg = np.asarray(words)[rng.integers(0, len(words), (rows, period))]
    parts = ([np.full((rows, 1), bos)] if bos is not None else []) + [seg, seg]
    return np.concatenate(parts, axis=1).astype(np.int32)


def second_copy(tokens_len: int, period: int):
    """The positions whose next token induction can predict: the second copy's words 1..n-1 (0-based index)."""
    start = tokens_len - period                     # first position of the second copy
    return np.arange(start, tokens_len - 1)


def copying_accuracy(logits, tokens, period: int) -> float:
    """Top-1 accuracy of the next-token prediction on the second copy's words 2..n."""
    pos = second_copy(np.shape(tokens)[1], period)
    return float(np.mean(np.argmax(np.asarray(logits)[:, pos], -1) == np.asarray(tokens)[:, pos + 1]))


def head_scores(probs, period: int):
    """Attention scores per head from probabilities [layers, batch, heads, q, k] on repeated rows (mean over the
    second copy's queries q): returns (lag, lag_scores, induction), each score [layers, heads].

    ``lag`` is the offset d the most focused fixed-offset head attends to (the mean attention to q - d, maximized
    over heads and d); a textbook previous-token head has lag 1. ``lag_scores`` is every head's attention to q - lag;
    ``induction`` its attention to q - period + lag: ``lag`` tokens after the current word's previous occurrence,
    the key whose lag-back word matches the current one (q - period + 1 for lag 1)."""
    p = np.asarray(probs, np.float32)
    q = np.arange(p.shape[-2] - period, p.shape[-2])
    lags = np.stack([p[..., q, q - d].mean((1, 3)) for d in range(1, period)], -1)     # [layers, heads, lag-1]
    lag = int(np.unravel_index(np.argmax(lags), lags.shape)[-1]) + 1
    return lag, lags[..., lag - 1], p[..., q, q - period + lag].mean((1, 3))


def word_ids(tok, vocab: int):
    """Token ids that are neither special nor past the model's vocabulary (the random words)."""
    special = set(getattr(tok, "all_special_ids", []) or [])
    return [i for i in range(min(len(tok), vocab)) if i not in special]


@dataclass(frozen=True)
class Session:
    """What every section of the demo reads: the model and its tokenizer, ``run`` (``jax.jit(jstd.run)``, reads
    static), the vocabulary's random ``words``, and ``clean``: rows of bos (where the tokenizer has one), ``period``
    random words, the same words again."""

    model: Any
    tok: Any
    run: Any
    words: list
    period: int
    clean: np.ndarray

    @property
    def layers(self) -> int:
        return self.model.config.num_layers

    @property
    def heads(self) -> int:
        return self.model.config.num_heads

    @property
    def offset(self) -> int:
        """The first copy's first position: 1 after a bos token, else 0."""
        return 0 if self.tok.bos_token_id is None else 1

    def fmt(self, ids) -> str:
        """``ids`` decoded one token at a time (a blank one as its repr), space-separated."""
        return " ".join(self.tok.decode([int(i)]).strip() or repr(self.tok.decode([int(i)])) for i in ids)


class Heads(NamedTuple):
    """The heads found by score: the fixed offset ``lag``, the most focused ``lag_head`` (block, head), and the
    ``induction`` heads (block, head) of later blocks that attend ``lag`` after the previous occurrence."""

    lag: int
    lag_head: tuple
    induction: list


def open_session(path, period: int, rows: int, seed: int) -> Session:
    """Loads the model at ``path`` and its tokenizer, prints the model's shape, and draws ``rows`` clean rows from
    ``seed``."""
    model = jstd.load(path)
    tok = jstd.load_processor(path)
    c = model.config
    print(f"model: {path}\n  {type(model).__name__}: {c.num_layers} blocks, {c.num_heads} heads, hidden "
          f"{c.hidden_size}, vocab {c.vocab_size}")
    words = word_ids(tok, c.vocab_size)
    clean = repeated_tokens(np.random.default_rng(seed), rows, period, words, tok.bos_token_id)
    return Session(model, tok, jax.jit(jstd.run, static_argnames="reads"), words, period, clean)


def show_prompt(s: Session, prompt: str) -> None:
    """Prints what the model predicts on ``prompt`` given twice, the block identity on its residual sites, and its
    top next tokens."""
    bos = s.tok.bos_token_id
    ids = list(s.tok(prompt, add_special_tokens=False)["input_ids"])
    tokens = np.asarray([([bos] if bos is not None else []) + ids + ids], np.int32)
    out = s.run(s.model, tokens, reads=RESIDUAL)
    n = len(ids)
    pred = np.argmax(np.asarray(out.logits[0]), -1)
    pos = second_copy(tokens.shape[1], n)
    hits = int((pred[pos] == tokens[0, pos + 1]).sum())
    print(f"\nprompt, twice: {prompt!r} ({n} tokens) + the same again")
    print(f"  predicted second copy: {s.fmt(pred[pos])}")
    print(f"  copied {hits}/{len(pos)} of the words induction can predict")
    x, a, m, y = (out[site] for site in RESIDUAL)
    print(f"  block identity layer_input + attention_output + mlp_output == layer_output: "
          f"max |diff| {float(jnp.abs(x + a + m - y).max()):.2e}")
    top = jstd.top_k(jax.nn.softmax(out.logits[:, -1]), 3, s.tok)
    print("  top next tokens after it: "
          + ", ".join(f"{t!r} {float(v):.2f}" for t, v in zip(top.tokens[0], top.values[0])))


def show_copying(s: Session) -> tuple[float, Any]:
    """Prints the copying accuracy on the clean rows (and on their unpredictable first copy); returns it and the
    attention probabilities [layers, rows, heads, q, k]."""
    out = s.run(s.model, s.clean, reads=(PROBS,))
    acc = copying_accuracy(out.logits, s.clean, s.period)
    first = np.arange(s.offset, s.offset + s.period - 1)
    acc_first = float(np.mean(np.argmax(np.asarray(out.logits)[:, first], -1) == s.clean[:, first + 1]))
    print(f"\ncopying: {len(s.clean)} rows of {s.period} random words, then the same words again")
    print(f"  top-1 accuracy on the second copy: {acc:.3f}   (first copy, unpredictable: {acc_first:.3f}; "
          f"chance {1 / len(s.words):.3f})")
    return acc, out[PROBS]


def show_heads(s: Session, probs) -> Heads:
    """Prints every head's lag and induction scores on ``probs``, marking the lag head and the induction heads."""
    lag, prev, ind = head_scores(probs, s.period)
    pl, ph = np.unravel_index(np.argmax(prev), prev.shape)
    heads = [(l, h) for l in range(s.layers) for h in range(s.heads) if ind[l, h] > 0.5 and l > pl]
    print(f"\nattention scores per head (mean over the second copy's queries q); the most focused fixed-offset head "
          f"attends {lag} token{'s' if lag > 1 else ''} back:")
    print(f"  block.head  to q-{lag} (lag)  to q-{s.period}+{lag} (induction: {lag} after the previous occurrence)")
    for l in range(s.layers):
        for h in range(s.heads):
            mark = " <- lag head" if (l, h) == (pl, ph) else " <- induction head" if (l, h) in heads else ""
            print(f"  {l}.{h:<9} {prev[l, h]:>12.2f}  {ind[l, h]:>9.2f}{mark}")
    if lag != 1:
        print(f"  (a textbook previous-token head has lag 1; this model learned lag {lag}: block 0 writes the word "
              f"{lag} back into each position, and block 1 attends to the position whose word {lag} back is the "
              "current word, then copies what follows)")
    return Heads(lag, (pl, ph), heads)


def show_ablation(s: Session, acc: float, heads: Heads) -> None:
    """Prints the copying accuracy (``acc`` unablated) with each head's output zeroed in turn, then with the
    induction heads zeroed together and with the other heads of their blocks."""
    model, clean, period = s.model, s.clean, s.period

    @jax.jit
    def ablated(layer, head):
        edit = jstd.zero_ablation(HEAD_OUTPUTS, layer=layer, heads=head)
        return jstd.run(model, clean, [edit]).logits

    pos = second_copy(clean.shape[1], period)
    target = clean[:, pos + 1]
    grid_l, grid_h = np.meshgrid(np.arange(s.layers), np.arange(s.heads), indexing="ij")
    logits_all = jax.jit(jax.vmap(ablated))(jnp.asarray(grid_l.ravel()), jnp.asarray(grid_h.ravel()))
    abl = (np.argmax(np.asarray(logits_all)[:, :, pos], -1) == target[None]).mean((1, 2)).reshape(s.layers, s.heads)
    al, ah = np.unravel_index(np.argmin(abl), abl.shape)
    pl, ph = heads.lag_head
    print("\nablation: copying accuracy with one head's output zeroed (jstd.zero_ablation, heads=...)")
    for l in range(s.layers):
        print(f"  block {l}: " + "  ".join(f"head {h} {abl[l, h]:.3f}" for h in range(s.heads)))
    print(f"  the single ablation that hurts most: block {al} head {ah} ({acc:.3f} -> {abl[al, ah]:.3f}); "
          f"lag head by score: block {pl} head {ph}" + (" (the same head)" if (al, ah) == (pl, ph) else ""))
    chosen = heads.induction
    if chosen:
        zeroed = lambda which: copying_accuracy(s.run(model, clean, [
            jstd.zero_ablation(HEAD_OUTPUTS, layer=int(l), heads=int(h)) for l, h in which]).logits, clean, period)
        others = [(l, h) for l in sorted({l for l, _ in chosen}) for h in range(s.heads) if (l, h) not in chosen]
        print(f"  zeroing the induction heads together ({', '.join(f'{l}.{h}' for l, h in chosen)}): {acc:.3f} -> "
              f"{zeroed(chosen):.3f}"
              + (f"; the other heads of their block ({', '.join(f'{l}.{h}' for l, h in others)}): {acc:.3f} -> "
                 f"{zeroed(others):.3f}" if others else ""))


def show_patching(s: Session, lag: int, seed: int) -> tuple[np.ndarray, int]:
    """Prints a patching sweep of every block's layer_output from 8 clean rows into the same rows with the first
    copy corrupted (other random words, from ``seed + 1``), the metric p(correct word) at a query ``q`` in the
    middle of the second copy; returns the fraction recovered [blocks, positions] and ``q``."""
    period, off = s.period, s.offset
    few = s.clean[:8]
    corrupt = few.copy()
    other = repeated_tokens(np.random.default_rng(seed + 1), 8, period, s.words, None)
    corrupt[:, off:off + period] = other[:, :period]
    q = s.clean.shape[1] - period + period // 2         # a query in the middle of the second copy
    metric = jstd.target_probability(jnp.asarray(few[:, q + 1]), position=q)
    clean_m = float(metric(s.run(s.model, few).logits))
    corrupt_m = float(metric(s.run(s.model, corrupt).logits))
    grid = np.asarray(jstd.patch_sweep(s.model, few, corrupt, "layers.layer_output", metric, progress=False))
    recovered = (grid - corrupt_m) / (clean_m - corrupt_m)
    key = q - period + lag
    print(f"\npatching: the first copy corrupted (other random words); metric p(correct word) at position {q}: "
          f"clean {clean_m:.3f}, corrupted {corrupt_m:.3f}")
    print(f"  jstd.patch_sweep of layers.layer_output over {grid.shape[0]} blocks x {grid.shape[1]} positions; "
          "fraction recovered, largest entries:")
    notes = {q: "the query", key: f"{lag} after its word's first occurrence", key - lag: "its word's first occurrence"}
    for l in range(s.layers):
        top = np.argsort(-recovered[l])[:3]
        print(f"  block {l}: " + ", ".join(f"position {p} {recovered[l, p]:.2f}"
                                           + (f" ({notes[p]})" if p in notes else "") for p in top))
    return recovered, q


def show_steering(s: Session) -> None:
    """Prints p(word) and the copying accuracy with the last block's output steered along one word's unembedding
    direction (at the residual norm) over the second copy, at a few factors."""
    model, clean, period, last = s.model, s.clean, s.period, s.layers - 1
    word = int(s.words[len(s.words) // 2])
    head = np.asarray(model.embed if model.lm_head is None else model.lm_head.T)[word]
    stream = np.asarray(s.run(model, clean, reads=("layers.layer_output",))["layers.layer_output"][last])
    vector = head / np.linalg.norm(head) * float(np.linalg.norm(stream[:, 1:], axis=-1).mean())
    name = s.tok.decode([word]).strip()
    print(f"\nsteering: jstd.steer({last}, v, factor=f, positions=second copy), v = the unembedding direction of "
          f"{name!r} at the residual norm")
    second = np.arange(clean.shape[1] - period, clean.shape[1])
    pos = second_copy(clean.shape[1], period)
    for factor in (0.0, 0.1, 0.2, 0.5):
        logits = s.run(model, clean, jstd.steer(last, vector, factor=factor, positions=second)).logits
        p_word = float(jax.nn.softmax(logits[:, pos], -1)[..., word].mean())
        print(f"  factor {factor:<4}: p({name!r}) {p_word:.3f}, "
              f"copying accuracy {copying_accuracy(logits, clean, period):.3f}")


def show_logit_lens(s: Session):
    """Prints the logit lens's top token per block at the start of the second copy of clean row 0; returns the lens
    [blocks, positions, vocab] of that row."""
    lens = jstd.logit_lens(s.model, s.clean[:1])[:, 0]
    show = np.arange(s.clean.shape[1] - s.period, s.clean.shape[1] - s.period + 6)
    _, _, toks = jstd.logit_lens_table(lens[:, show], s.tok)
    print("\nlogit lens (top token per block) at the start of the second copy, row 0:")
    print("  next word:  " + " ".join(f"{s.fmt([t]):>8}" for t in s.clean[0, show + 1]))
    for l in range(s.layers):
        print(f"  block {l}:    " + " ".join(f"{t.strip():>8}" for t in toks[l]))
    return lens


def draw_figures(s: Session, folder: Path, probs, heads: Heads, recovered, q: int, lens) -> None:
    """Writes attention.png, patching.png and logit_lens.png of clean row 0 into ``folder`` (or says why not:
    matplotlib missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("\nfigures: skipped (matplotlib is not installed: pip install 'jstd[plots]'; make demo installs it)")
        return
    labels = [s.fmt([t]) for t in s.clean[0]]
    (pl, ph), second = heads.lag_head, np.arange(s.clean.shape[1] - s.period, s.clean.shape[1] - 1)
    jstd.plot_attention(probs[:, 0], labels=labels, path=folder / "attention.png",
                        title=f"attention on repeated words (lag-{heads.lag} head {pl}.{ph}, induction heads "
                              + ", ".join(f"{l}.{h}" for l, h in heads.induction) + ")")
    jstd.plot_patching(recovered, labels=labels, path=folder / "patching.png", center=0.0,
                       value_label="fraction recovered",
                       title=f"patching layer_output: p(correct word) at position {q}")
    jstd.plot_logit_lens(lens[:, second], s.tok, labels=[labels[p] for p in second], targets=s.clean[0, second + 1],
                         path=folder / "logit_lens.png", title="logit lens on the second copy")
    print(f"\nfigures in {folder.resolve()}: attention.png, patching.png, logit_lens.png")


def write_html(s: Session, page, probs, heads: Heads, recovered, q: int, lens) -> None:
    """Writes the demo's figures of clean row 0 as one interactive page (``jstd.viewer``: hover for values): the
    attention patterns of every block and head, the patching sweep, the logit lens's top token on the second
    copy."""
    labels = [s.fmt([t]) for t in s.clean[0]]
    second = np.arange(s.clean.shape[1] - s.period, s.clean.shape[1] - 1)
    top = np.asarray(jax.nn.softmax(jnp.asarray(lens[:, second], jnp.float32), -1))
    best = top.argmax(-1)
    (pl, ph) = heads.lag_head
    figures = [
        viewer.attention_figure(np.asarray(probs[:, 0]), labels, title=f"attention on repeated words (lag-{heads.lag} "
                                f"head {pl}.{ph}, induction heads " + ", ".join(f"{l}.{h}" for l, h in heads.induction)
                                + ")"),
        viewer.grid_figure(recovered, [f"block {l}" for l in range(s.layers)], labels, center=0.0,
                           title=f"patching layer_output: p(correct word) at position {q}",
                           value_label="fraction recovered"),
        viewer.grid_figure(top.max(-1), [f"block {l}" for l in range(s.layers)], [labels[p] for p in second],
                           title="logit lens on the second copy: the top token's probability",
                           value_label="p(top token)", text=[[s.fmt([t]) for t in row] for row in best]),
    ]
    out = viewer.view_figures(figures, page, title="jstd demo: induction on the embedded model")
    print(f"\ninteractive figures: {out.resolve()} (one HTML file; hover for values)")


def demo(path=INDUCTION, prompt=None, figures="jstd-demo-figures", period: int = 24, rows: int = 32, seed: int = 0,
         html=None):
    """Induction on the embedded trained model: copying, the heads found by score, ablation, patching, steering, the
    logit lens, and (``figures``: a folder, or falsy for none) figures, and (``html``: a path, or None) the same
    figures as an interactive page; prints each section in that order."""
    t0 = time.time()
    s = open_session(path, period, rows, seed)
    show_prompt(s, prompt or (DEMO_PROMPT if Path(str(path)) == INDUCTION else "The capital of France is"))
    acc, probs = show_copying(s)
    heads = show_heads(s, probs)
    show_ablation(s, acc, heads)
    recovered, q = show_patching(s, heads.lag, seed)
    show_steering(s)
    lens = show_logit_lens(s)
    if figures:
        draw_figures(s, Path(figures), probs, heads, recovered, q, lens)
    if html:
        write_html(s, html, probs, heads, recovered, q, lens)
    print(f"\ndone in {time.time() - t0:.1f} s")


def add_arguments(subparsers) -> None:
    d = subparsers.add_parser("demo", help="induction on the embedded trained model: copying, heads, patching, "
                                           "ablation, steering, figures")
    d.add_argument("--model", default=str(INDUCTION),
                   help="a checkpoint folder or repo id (default: the embedded induction model)")
    d.add_argument("--prompt", default=None, help="text the model sees twice (default: a sentence of its words)")
    d.add_argument("--figures", default="jstd-demo-figures", metavar="DIR",
                   help="folder for the PNG figures (default: ./jstd-demo-figures; '' for none)")
    d.add_argument("--html", nargs="?", const="jstd-demo.html", default=None, metavar="PAGE",
                   help="also write the figures as one interactive HTML page (default PAGE: ./jstd-demo.html)")


def command(args) -> int:
    demo(args.model, args.prompt, args.figures, html=args.html)
    return 0
