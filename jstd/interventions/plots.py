"""Figures: attention patterns, patching heatmaps, logit-lens tables, from the arrays the tools return.

The tools return arrays (``jstd.run(..., reads=("layers.self_attn.attention_probabilities",))``,
``jstd.patch_sweep``, ``jstd.logit_lens``); these functions only draw them, as
matplotlib ``Figure`` objects (no pyplot state, any backend), and write a PNG
when given ``path``. ``logit_lens_table`` is the one data step: the top token
and its probability per (block, position), as plain arrays.

    probs = jstd.run(model, tokens, reads=("layers.self_attn.attention_probabilities",))[...]
    jstd.plot_attention(probs[:, 0], labels=words, path="attention.png")      # [layers, heads, query, key]
    jstd.plot_patching(grid, labels=words, path="patching.png")               # [layers, positions]
    jstd.plot_logit_lens(jstd.logit_lens(model, tokens)[:, 0], tok, labels=words, path="lens.png")

Requires matplotlib (``pip install jstd[plots]``), imported only when a
function is called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from jaxtyping import Array, Float

INSTALL = "pip install jstd[plots]"


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"jstd's plots need matplotlib, which is not installed: {INSTALL} "
                          "(or pip install matplotlib)") from e
    return Figure


def _finish(fig, path):
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


def _ticks(ax, labels, n, axis: str, every: int | None = None):
    if labels is None:
        return
    labels = [str(x) if len(str(x)) <= 10 else str(x)[:9] + "…" for x in labels]
    if len(labels) != n:
        raise ValueError(f"{len(labels)} labels for an axis of {n} entries")
    step = every or max(1, n // 40)
    idx = list(range(0, n, step))
    if axis == "x":
        ax.set_xticks(idx, [labels[i] for i in idx], rotation=90, fontsize=7)
    else:
        ax.set_yticks(idx, [labels[i] for i in idx], fontsize=7)


def plot_attention(
    probs: Float[Array, "*layers heads query key"], *, labels: Sequence[str] | None = None,
    layers: Sequence[int] | None = None, heads: Sequence[int] | None = None, title: str | None = None,
    path: str | Path | None = None,
):
    """Attention patterns as a grid of heatmaps: one row per block, one column per head (query down, key across).

    ``probs``: ``[heads, query, key]`` (one block) or ``[layers, heads, query,
    key]`` (e.g. ``out["layers.self_attn.attention_probabilities"][:, row]``).
    ``layers`` / ``heads`` choose which to draw (and label them); ``labels``
    names the positions (tokens). Returns the Figure; writes a PNG to ``path``.
    """
    Figure = _matplotlib()
    p = np.asarray(probs, np.float32)
    if p.ndim == 3:
        p = p[None]
    if p.ndim != 4:
        raise ValueError(f"attention probabilities are [heads, query, key] or [layers, heads, query, key]; got {p.shape}")
    layer_ids = list(range(p.shape[0])) if layers is None else list(layers)
    head_ids = list(range(p.shape[1])) if heads is None else list(heads)
    if layers is not None and len(layer_ids) != p.shape[0]:
        p = p[layer_ids]
    if heads is not None and len(head_ids) != p.shape[1]:
        p = p[:, head_ids]
    rows, cols = p.shape[:2]
    fig = Figure(figsize=(2.6 * cols + 0.6, 2.6 * rows + 0.4), layout="constrained")
    axes = np.atleast_2d(fig.subplots(rows, cols, squeeze=False))
    for i in range(rows):
        for j in range(cols):
            ax = axes[i, j]
            im = ax.imshow(p[i, j], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(f"block {layer_ids[i]} head {head_ids[j]}", fontsize=9)
            ax.tick_params(labelsize=7)
            if labels is not None:
                every = max(1, p.shape[3] // 12)
                _ticks(ax, labels, p.shape[3], "x", every) if i == rows - 1 else ax.set_xticks([])
                _ticks(ax, labels, p.shape[2], "y", every) if j == 0 else ax.set_yticks([])
    fig.colorbar(im, ax=axes, shrink=0.6, label="attention probability")
    if title:
        fig.suptitle(title)
    return _finish(fig, path)


def plot_patching(
    grid: Float[Array, "layers positions"], *, labels: Sequence[str] | None = None,
    layers: Sequence[int] | None = None, title: str | None = None, value_label: str = "metric",
    center: float | None = None, path: str | Path | None = None,
):
    """A patching sweep (``jstd.patch_sweep`` of a per-block, per-position site) as a block × position heatmap.

    ``grid`` ``[layers, positions]`` (normalize it first, e.g. to the fraction
    of the clean-corrupt gap recovered); ``center`` makes the colour map
    diverge around that value (default: sequential from the grid's range).
    ``labels`` names the positions, ``layers`` the rows. Returns the Figure.
    """
    Figure = _matplotlib()
    g = np.asarray(grid, np.float32)
    if g.ndim != 2:
        raise ValueError(f"a patching heatmap takes [layers, positions]; got {g.shape} (select a head or metric entry)")
    fig = Figure(figsize=(max(4.0, 0.22 * g.shape[1] + 1.5), 0.45 * g.shape[0] + 1.6), layout="constrained")
    ax = fig.subplots()
    if center is None:
        im = ax.imshow(g, cmap="viridis", aspect="auto", interpolation="nearest")
    else:
        span = float(np.max(np.abs(g - center))) or 1.0
        im = ax.imshow(g, cmap="RdBu_r", aspect="auto", interpolation="nearest", vmin=center - span, vmax=center + span)
    rows = list(range(g.shape[0])) if layers is None else list(layers)
    ax.set_yticks(range(g.shape[0]), [f"block {r}" for r in rows], fontsize=8)
    if labels is not None:
        _ticks(ax, labels, g.shape[1], "x", every=1)
    ax.set_xlabel("position")
    fig.colorbar(im, ax=ax, label=value_label)
    if title:
        ax.set_title(title)
    return _finish(fig, path)


def logit_lens_table(lens: Float[Array, "layers positions vocab"], tokenizer=None):
    """The top token of each (block, position) of a logit lens and its probability.

    ``lens``: logits ``[layers, positions, vocab]`` (``jstd.logit_lens(...)[:, row]``).
    Returns ``(ids [layers, positions], probs [layers, positions], tokens)``;
    ``tokens`` is a nested list of decoded strings with a tokenizer, else None.
    """
    x = np.asarray(lens, np.float32)
    if x.ndim != 3:
        raise ValueError(f"logit_lens_table takes [layers, positions, vocab]; got {x.shape} (pick one batch row)")
    x = x - x.max(-1, keepdims=True)
    p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    ids = p.argmax(-1)
    top = np.take_along_axis(p, ids[..., None], -1)[..., 0]
    tokens = None if tokenizer is None else [[tokenizer.decode([int(i)]) for i in row] for row in ids]
    return ids, top, tokens


def plot_logit_lens(
    lens: Float[Array, "layers positions vocab"], tokenizer=None, *, labels: Sequence[str] | None = None,
    targets: Sequence[int] | None = None, layers: Sequence[int] | None = None, title: str | None = None,
    path: str | Path | None = None,
):
    """A logit-lens table: blocks down, positions across, each cell the top token, coloured by its probability.

    ``lens``: logits ``[layers, positions, vocab]`` (one batch row of
    ``jstd.logit_lens``). With ``targets`` (one token id per position, e.g. the
    true next tokens) the colour is the target's probability instead, and cells
    whose top token is the target are bold. Returns the Figure.
    """
    Figure = _matplotlib()
    ids, top, tokens = logit_lens_table(lens, tokenizer)
    colour, what = top, "top-token probability"
    if targets is not None:
        x = np.asarray(lens, np.float32)
        x = x - x.max(-1, keepdims=True)
        p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
        t = np.asarray(targets).reshape(1, -1, 1).repeat(p.shape[0], 0)
        colour, what = np.take_along_axis(p, t, -1)[..., 0], "target probability"
    L, P = ids.shape
    fig = Figure(figsize=(max(4.0, 0.75 * P + 1.5), 0.5 * L + 1.6), layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(colour, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    for i in range(L):
        for j in range(P):
            text = tokens[i][j] if tokens is not None else str(int(ids[i, j]))
            bold = targets is not None and int(ids[i, j]) == int(np.asarray(targets)[j])
            ax.text(j, i, text[:8], ha="center", va="center", fontsize=7, fontweight="bold" if bold else "normal",
                    color="white" if colour[i, j] > 0.6 else "black")
    rows = list(range(L)) if layers is None else list(layers)
    ax.set_yticks(range(L), [f"block {r}" for r in rows], fontsize=8)
    if labels is not None:
        _ticks(ax, labels, P, "x", every=1)
    ax.set_xlabel("position")
    fig.colorbar(im, ax=ax, label=what)
    if title:
        ax.set_title(title)
    return _finish(fig, path)
