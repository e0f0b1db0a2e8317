"""``jstd demo``: induction on the embedded trained model — copying, the heads found by score, a head ablation, a
patching sweep, steering, the logit lens, figures."""

from __future__ import annotations

from pathlib import Path

import jstd

ASSET = Path(__file__).parent.parent / "assets" / "tiny-llama"
INDUCTION = Path(__file__).parent.parent / "assets" / "induction-llama"
DEMO_PROMPT = "the baker sat near this old river with one green boat"


def repeated_tokens(rng, rows: int, period: int, words, bos: int | None = 0):
    """[rows, 1 + 2·period] int32: bos (when not None), ``period`` random ``words``, the same words again."""
    import numpy as np

    seg = np.asarray(words)[rng.integers(0, len(words), (rows, period))]
    parts = ([np.full((rows, 1), bos)] if bos is not None else []) + [seg, seg]
    return np.concatenate(parts, axis=1).astype(np.int32)


def second_copy(tokens_len: int, period: int):
    """The positions whose next token induction can predict: the second copy's words 1..n-1 (0-based index)."""
    import numpy as np

    start = tokens_len - period                     # first position of the second copy
    return np.arange(start, tokens_len - 1)


def copying_accuracy(logits, tokens, period: int) -> float:
    """Top-1 accuracy of the next-token prediction on the second copy's words 2..n."""
    import numpy as np

    pos = second_copy(np.shape(tokens)[1], period)
    return float(np.mean(np.argmax(np.asarray(logits)[:, pos], -1) == np.asarray(tokens)[:, pos + 1]))


def head_scores(probs, period: int):
    """Attention scores per head from probabilities [layers, batch, heads, q, k] on repeated rows (mean over the
    second copy's queries q): returns (lag, lag_scores, induction), each score [layers, heads].

    ``lag`` is the offset d the most focused fixed-offset head attends to (the mean attention to q - d, maximized
    over heads and d); a textbook previous-token head has lag 1. ``lag_scores`` is every head's attention to q - lag;
    ``induction`` its attention to q - period + lag: ``lag`` tokens after the current word's previous occurrence,
    the key whose lag-back word matches the current one (q - period + 1 for lag 1)."""
    import numpy as np

    p = np.asarray(probs, np.float32)
    q = np.arange(p.shape[-2] - period, p.shape[-2])
    lags = np.stack([p[..., q, q - d].mean((1, 3)) for d in range(1, period)], -1)     # [layers, heads, lag-1]
    lag = int(np.unravel_index(np.argmax(lags), lags.shape)[-1]) + 1
    return lag, lags[..., lag - 1], p[..., q, q - period + lag].mean((1, 3))


def word_ids(tok, vocab: int):
    """Token ids that are neither special nor past the model's vocabulary (the random words)."""
    special = set(getattr(tok, "all_special_ids", []) or [])
    return [i for i in range(min(len(tok), vocab)) if i not in special]


def demo(path=INDUCTION, prompt=None, figures="jstd-demo-figures", period: int = 24, rows: int = 32, seed: int = 0):
    """Induction on the embedded trained model: copying, the heads found by score, patching, ablation, steering."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    t0 = time.time()
    model = jstd.load(path)
    tok = jstd.load_processor(path)
    c = model.config
    L, H = c.num_layers, c.num_heads
    bos = tok.bos_token_id
    print(f"model: {path}\n  {type(model).__name__}: {L} blocks, {H} heads, hidden {c.hidden_size}, vocab {c.vocab_size}")
    run = jax.jit(jstd.run, static_argnames="reads")
    words = word_ids(tok, c.vocab_size)
    fmt = lambda ids: " ".join(tok.decode([int(i)]).strip() or repr(tok.decode([int(i)])) for i in ids)

    # ---- the prompt, twice ------------------------------------------------------------------------------------------
    prompt = prompt or (DEMO_PROMPT if Path(str(path)) == INDUCTION else "The capital of France is")
    ids = list(tok(prompt, add_special_tokens=False)["input_ids"])
    tokens = np.asarray([([bos] if bos is not None else []) + ids + ids], np.int32)
    out = run(model, tokens, reads=("layers.layer_input", "layers.self_attn.attention_output",
                                    "layers.mlp.mlp_output", "layers.layer_output"))
    n = len(ids)
    pred = np.argmax(np.asarray(out.logits[0]), -1)
    pos = second_copy(tokens.shape[1], n)
    hits = int((pred[pos] == tokens[0, pos + 1]).sum())
    print(f"\nprompt, twice: {prompt!r} ({n} tokens) + the same again")
    print(f"  predicted second copy: {fmt(pred[pos])}")
    print(f"  copied {hits}/{len(pos)} of the words induction can predict")
    x, a, m, y = (out[s] for s in ("layers.layer_input", "layers.self_attn.attention_output",
                                    "layers.mlp.mlp_output", "layers.layer_output"))
    print(f"  block identity layer_input + attention_output + mlp_output == layer_output: "
          f"max |diff| {float(jnp.abs(x + a + m - y).max()):.2e}")
    print("  top next tokens after it: "
          + ", ".join(f"{t!r} {float(v):.2f}" for t, v in zip(*(lambda k: (k.tokens[0], k.values[0]))(
              jstd.top_k(jax.nn.softmax(out.logits[:, -1]), 3, tok)))))

    # ---- copying accuracy on random repeated words ------------------------------------------------------------------
    rng = np.random.default_rng(seed)
    clean = repeated_tokens(rng, rows, period, words, bos)
    out = run(model, clean, reads=("layers.self_attn.attention_probabilities",))
    acc = copying_accuracy(out.logits, clean, period)
    off = 0 if bos is None else 1
    first = np.arange(off, off + period - 1)
    acc_first = float(np.mean(np.argmax(np.asarray(out.logits)[:, first], -1) == clean[:, first + 1]))
    print(f"\ncopying: {rows} rows of {period} random words, then the same words again")
    print(f"  top-1 accuracy on the second copy: {acc:.3f}   (first copy, unpredictable: {acc_first:.3f}; "
          f"chance {1 / len(words):.3f})")

    # ---- heads by score -------------------------------------------------------------------------------------------
    probs = out["layers.self_attn.attention_probabilities"]
    lag, prev, ind = head_scores(probs, period)
    pl, ph = np.unravel_index(np.argmax(prev), prev.shape)
    heads = [(l, h) for l in range(L) for h in range(H) if ind[l, h] > 0.5 and l > pl]
    print(f"\nattention scores per head (mean over the second copy's queries q); the most focused fixed-offset head "
          f"attends {lag} token{'s' if lag > 1 else ''} back:")
    print(f"  block.head  to q-{lag} (lag)  to q-{period}+{lag} (induction: {lag} after the previous occurrence)")
    for l in range(L):
        for h in range(H):
            mark = " <- lag head" if (l, h) == (pl, ph) else " <- induction head" if (l, h) in heads else ""
            print(f"  {l}.{h:<9} {prev[l, h]:>12.2f}  {ind[l, h]:>9.2f}{mark}")
    if lag != 1:
        print(f"  (a textbook previous-token head has lag 1; this model learned lag {lag}: block 0 writes the word "
              f"{lag} back into each position, and block 1 attends to the position whose word {lag} back is the "
              "current word, then copies what follows)")

    # ---- ablation: each head zeroed in turn --------------------------------------------------------------------------
    @jax.jit
    def ablated(layer, head):
        edit = jstd.zero_ablation("layers.self_attn.attention_head_outputs", layer=layer, heads=head)
        return jstd.run(model, clean, [edit]).logits

    pos = second_copy(clean.shape[1], period)
    target = clean[:, pos + 1]
    grid_l, grid_h = np.meshgrid(np.arange(L), np.arange(H), indexing="ij")
    logits_all = jax.jit(jax.vmap(ablated))(jnp.asarray(grid_l.ravel()), jnp.asarray(grid_h.ravel()))
    abl = (np.argmax(np.asarray(logits_all)[:, :, pos], -1) == target[None]).mean((1, 2)).reshape(L, H)
    al, ah = np.unravel_index(np.argmin(abl), abl.shape)
    print("\nablation: copying accuracy with one head's output zeroed (jstd.zero_ablation, heads=...)")
    for l in range(L):
        print(f"  block {l}: " + "  ".join(f"head {h} {abl[l, h]:.3f}" for h in range(H)))
    print(f"  the single ablation that hurts most: block {al} head {ah} ({acc:.3f} -> {abl[al, ah]:.3f}); "
          f"lag head by score: block {pl} head {ph}" + (" (the same head)" if (al, ah) == (pl, ph) else ""))
    if heads:
        zero = lambda chosen: [jstd.zero_ablation("layers.self_attn.attention_head_outputs", layer=int(l), heads=int(h))
                               for l, h in chosen]
        others = [(l, h) for l in sorted({l for l, _ in heads}) for h in range(H) if (l, h) not in heads]
        print(f"  zeroing the induction heads together ({', '.join(f'{l}.{h}' for l, h in heads)}): {acc:.3f} -> "
              f"{copying_accuracy(run(model, clean, zero(heads)).logits, clean, period):.3f}"
              + (f"; the other heads of their block ({', '.join(f'{l}.{h}' for l, h in others)}): {acc:.3f} -> "
                 f"{copying_accuracy(run(model, clean, zero(others)).logits, clean, period):.3f}" if others else ""))

    # ---- patching sweep -------------------------------------------------------------------------------------------
    few = clean[:8]
    corrupt = few.copy()
    corrupt[:, off:off + period] = repeated_tokens(np.random.default_rng(seed + 1), 8, period, words, None)[:, :period]
    q = clean.shape[1] - period + period // 2         # a query in the middle of the second copy
    metric = jstd.target_probability(jnp.asarray(few[:, q + 1]), position=q)
    clean_m = float(metric(run(model, few).logits))
    corrupt_m = float(metric(run(model, corrupt).logits))
    grid = np.asarray(jstd.patch_sweep(model, few, corrupt, "layers.layer_output", metric, progress=False))
    recovered = (grid - corrupt_m) / (clean_m - corrupt_m)
    key = q - period + lag
    print(f"\npatching: the first copy corrupted (other random words); metric p(correct word) at position {q}: "
          f"clean {clean_m:.3f}, corrupted {corrupt_m:.3f}")
    print(f"  jstd.patch_sweep of layers.layer_output over {grid.shape[0]} blocks x {grid.shape[1]} positions; "
          "fraction recovered, largest entries:")
    for l in range(L):
        top = np.argsort(-recovered[l])[:3]
        notes = {q: "the query", key: f"{lag} after its word's first occurrence", key - lag: "its word's first occurrence"}
        print(f"  block {l}: " + ", ".join(f"position {p} {recovered[l, p]:.2f}"
                                           + (f" ({notes[p]})" if p in notes else "") for p in top))

    # ---- steering ---------------------------------------------------------------------------------------------------
    word = int(words[len(words) // 2])
    head = np.asarray(model.embed if model.lm_head is None else model.lm_head.T)[word]
    stream = np.asarray(run(model, clean, reads=("layers.layer_output",))["layers.layer_output"][L - 1])
    vector = head / np.linalg.norm(head) * float(np.linalg.norm(stream[:, 1:], axis=-1).mean())
    print(f"\nsteering: jstd.steer({L - 1}, v, factor=f, positions=second copy), v = the unembedding direction of "
          f"{tok.decode([word]).strip()!r} at the residual norm")
    second = np.arange(clean.shape[1] - period, clean.shape[1])
    for factor in (0.0, 0.1, 0.2, 0.5):
        logits = run(model, clean, jstd.steer(L - 1, vector, factor=factor, positions=second)).logits
        p_word = float(jax.nn.softmax(logits[:, pos], -1)[..., word].mean())
        print(f"  factor {factor:<4}: p({tok.decode([word]).strip()!r}) {p_word:.3f}, "
              f"copying accuracy {copying_accuracy(logits, clean, period):.3f}")

    # ---- logit lens, figures -----------------------------------------------------------------------------------------
    lens = jstd.logit_lens(model, clean[:1])[:, 0]
    show = np.arange(clean.shape[1] - period, clean.shape[1] - period + 6)
    ids_, top_p, toks = jstd.logit_lens_table(lens[:, show], tok)
    print("\nlogit lens (top token per block) at the start of the second copy, row 0:")
    print("  next word:  " + " ".join(f"{fmt([t]):>8}" for t in clean[0, show + 1]))
    for l in range(L):
        print(f"  block {l}:    " + " ".join(f"{t.strip():>8}" for t in toks[l]))

    if figures:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("\nfigures: skipped (matplotlib is not installed: pip install 'jstd[plots]'; make demo installs it)")
        else:
            folder = Path(figures)
            labels = [fmt([t]) for t in clean[0]]
            jstd.plot_attention(probs[:, 0], labels=labels, path=folder / "attention.png",
                                title=f"attention on repeated words (lag-{lag} head {pl}.{ph}, induction heads "
                                      + ", ".join(f"{l}.{h}" for l, h in heads) + ")")
            jstd.plot_patching(recovered, labels=labels, path=folder / "patching.png", center=0.0,
                               value_label="fraction recovered",
                               title=f"patching layer_output: p(correct word) at position {q}")
            jstd.plot_logit_lens(lens[:, second[:-1]], tok, labels=[labels[p] for p in second[:-1]], targets=clean[0, second[:-1] + 1],
                                 path=folder / "logit_lens.png", title="logit lens on the second copy")
            print(f"\nfigures in {folder.resolve()}: attention.png, patching.png, logit_lens.png")
    print(f"\ndone in {time.time() - t0:.1f} s")


def add_arguments(subparsers) -> None:
    d = subparsers.add_parser("demo", help="induction on the embedded trained model: copying, heads, patching, "
                                           "ablation, steering, figures")
    d.add_argument("--model", default=str(INDUCTION),
                   help="a checkpoint folder or repo id (default: the embedded induction model)")
    d.add_argument("--prompt", default=None, help="text the model sees twice (default: a sentence of its words)")
    d.add_argument("--figures", default="jstd-demo-figures", metavar="DIR",
                   help="folder for the PNG figures (default: ./jstd-demo-figures; '' for none)")


def command(args) -> int:
    demo(args.model, args.prompt, args.figures)
    return 0
