"""Figures as a page in the viewer's style: attention patterns (every block and head, one enlarged, hover for a
probability) and heatmaps (a patching sweep, a logit lens; hover for a value), so the demo's figures have an
interactive form. Build figure dicts with ``attention_figure`` and ``grid_figure``; ``view_figures`` writes them as
one self-contained HTML page (``static/figures.*``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from jstd.viewer.page import page, write


def attention_figure(probs, labels: Sequence[str] | None = None, layers: Sequence[int] | None = None,
                     title: str = "attention patterns") -> dict:
    """A figure of attention probabilities of one prompt: ``probs`` ``[layers, heads, query, key]`` (e.g.
    ``out["layers.self_attn.attention_probabilities"][:, row]``) or ``[heads, query, key]``; ``labels`` the
    positions' tokens; ``layers`` the block numbers to show for the first axis (default 0, 1, ...). Values kept
    to 5 decimals. Raises ValueError on other shapes or labels of the wrong length."""
    p = np.asarray(probs, np.float64)
    if p.ndim == 3:
        p = p[None]
    if p.ndim != 4 or p.shape[-1] != p.shape[-2]:
        raise ValueError(f"attention probabilities are [layers, heads, query, key] or [heads, query, key] with "
                         f"query == key (one prompt); got {p.shape}")
    labels = [str(t) for t in (labels if labels is not None else range(p.shape[-1]))]
    layers = list(range(p.shape[0])) if layers is None else [int(l) for l in layers]
    if len(labels) != p.shape[-1] or len(layers) != p.shape[0]:
        raise ValueError(f"{len(labels)} labels and {len(layers)} layer numbers for probabilities of shape "
                         f"{p.shape}: one label per position, one number per block")
    return {"kind": "attention", "title": title, "labels": labels, "layers": layers,
            "probs": finite_lists(np.round(p, 5))}


def grid_figure(values, rows: Sequence[str] | None = None, columns: Sequence[str] | None = None,
                title: str = "", value_label: str = "value", center: float | None = None, text=None) -> dict:
    """A heatmap figure of ``values`` ``[rows, columns]`` (NaN: no value, drawn grey); ``center``: a diverging
    blue-white-red scale around it (None: sequential); ``text``: a string per cell, shown on hover. Raises
    ValueError where the labels or text do not match the shape."""
    v = np.asarray(values, np.float64)
    if v.ndim != 2:
        raise ValueError(f"a heatmap's values are [rows, columns]; got shape {v.shape}")
    for name, got, want in (("rows", rows, v.shape[0]), ("columns", columns, v.shape[1])):
        if got is not None and len(got) != want:
            raise ValueError(f"{len(got)} {name} labels for values of shape {v.shape}")
    if text is not None and np.shape(text) != v.shape:
        raise ValueError(f"text of shape {np.shape(text)} for values of shape {v.shape}: one string per cell")
    return {"kind": "grid", "title": title, "values": finite_lists(v),
            "rows": None if rows is None else [str(r) for r in rows],
            "columns": None if columns is None else [str(c) for c in columns], "value_label": value_label,
            "center": None if center is None else float(center),
            "text": None if text is None else [[str(t) for t in row] for row in text]}


def finite_lists(a: np.ndarray):
    """``a`` as nested lists of floats, NaN and infinities as None (JSON has no such numbers)."""
    if a.ndim > 1:
        return [finite_lists(x) for x in a]
    return [float(x) if np.isfinite(x) else None for x in a]


def figures_page(figures: Sequence[dict], title: str = "jstd figures") -> str:
    """One self-contained HTML page of ``figures`` (from ``attention_figure`` and ``grid_figure``)."""
    return page("figures", {"title": title, "figures": list(figures)}, title)


def view_figures(figures: Sequence[dict], out=None, title: str = "jstd figures", open_browser: bool = False) -> Path:
    """Writes the page of ``figures`` to ``out`` (None: ``jstd-figures.html`` in the temporary folder) and returns
    its path; ``open_browser``: also open it."""
    out = Path(tempfile.gettempdir()) / "jstd-figures.html" if out is None else out
    return write(figures_page(figures, title), out, open_browser)
