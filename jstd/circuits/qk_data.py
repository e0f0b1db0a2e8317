"""QK attributions and head loadings as data: one head's decomposed score (``QK``) and the set a graph carries
(``QKGraph``, ``Graph.qk``), with their files (safetensors + JSON, no pickle). Computed by ``jstd.circuits.qk``."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from jstd.io.safetensors import SafetensorsFiles, write_tensors
from jstd.io.staging import atomic

QK_FILE, QK_META_FILE = "qk.safetensors", "qk_meta.json"
QK_ARRAYS = ("terms", "query_vectors", "key_vectors")
QK_FIELDS = ("layer", "head", "query_pos", "key_pos", "score", "scale")


@dataclasses.dataclass
class QK:
    """The QK attribution of one head's score at (query, key) positions.

    terms: ``[S + 1, S + 1]`` float64 (so that their sum is the score to float32 precision), ``terms[s, t] = scale ·
    q_s · k_t``: rows the query-side sources, columns the key-side ones, both in the graph's source order
    (``graph.node(i)`` for ``i < graph.logit_start``: features, errors, tokens) then the bias (index ``S =
    graph.logit_start``). ``terms.sum() == score``.
    query_vectors, key_vectors: ``[S + 1, head_dim]`` (``q_s``, ``k_t``; the last row the bias).
    score: the model's score ``scale · q · k`` (before any soft-cap and the mask). scale: the head's scale.
    """

    layer: int
    head: int
    query_pos: int
    key_pos: int
    terms: np.ndarray
    query_vectors: np.ndarray
    key_vectors: np.ndarray
    score: float
    scale: float

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` largest terms by magnitude: ``(query source, key source, term)``."""
        flat = np.argsort(-np.abs(self.terms).ravel(), kind="stable")[:k]
        return [(int(i // self.terms.shape[1]), int(i % self.terms.shape[1]), float(self.terms.ravel()[i]))
                for i in flat]

    @property
    def query_totals(self) -> np.ndarray:
        """``[S + 1]``: each source's part of the score through the query side (``terms.sum(1)``)."""
        return self.terms.sum(1)

    @property
    def key_totals(self) -> np.ndarray:
        """``[S + 1]``: each source's part of the score through the key side (``terms.sum(0)``)."""
        return self.terms.sum(0)


@dataclasses.dataclass
class QKGraph:
    """What ``jstd.circuits.qk_graph`` attaches to a graph (``Graph.qk``): ``attributions`` (one ``QK`` per head
    and positions asked for) and ``loadings`` (``(target, source)`` graph node indices -> ``[L, heads]`` float32, each
    head's part of the edge ``adjacency[target, source]``)."""

    attributions: list[QK] = dataclasses.field(default_factory=list)
    loadings: dict[tuple[int, int], np.ndarray] = dataclasses.field(default_factory=dict)

    def save(self, folder: str | os.PathLike) -> None:
        """``folder/qk.safetensors`` (the arrays) and ``folder/qk_meta.json`` (the rest), atomically."""
        folder = Path(folder)
        arrays = {f"qk.{i}.{k}": np.ascontiguousarray(getattr(a, k)) for i, a in enumerate(self.attributions)
                  for k in QK_ARRAYS}
        pairs = sorted(self.loadings)
        arrays.update({f"loadings.{t}.{s}": np.ascontiguousarray(self.loadings[t, s], np.float32) for t, s in pairs})
        with atomic(folder / QK_FILE, "wb") as fh:
            write_tensors(fh, arrays)
        meta = {"attributions": [{k: getattr(a, k) for k in QK_FIELDS} for a in self.attributions],
                "loadings": [[int(t), int(s)] for t, s in pairs]}
        with atomic(folder / QK_META_FILE, "w") as fh:
            json.dump(meta, fh, indent=1)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "QKGraph | None":
        """What ``save`` wrote in ``folder``; None where it wrote nothing. FileNotFoundError where one of the two
        files is missing."""
        folder = Path(folder)
        present = [(folder / f).exists() for f in (QK_FILE, QK_META_FILE)]
        if not any(present):
            return None
        if not all(present):
            raise FileNotFoundError(f"{folder} has one of {QK_FILE} and {QK_META_FILE} without the other: QKGraph.save "
                                    "writes both")
        files = SafetensorsFiles(folder / QK_FILE)
        meta = json.loads((folder / QK_META_FILE).read_text())
        attributions = [QK(**m, **{k: np.array(files.mapped(f"qk.{i}.{k}", lazy=True)) for k in QK_ARRAYS})
                        for i, m in enumerate(meta["attributions"])]
        loadings = {(t, s): np.array(files.mapped(f"loadings.{t}.{s}", lazy=True)) for t, s in meta["loadings"]}
        return cls(attributions, loadings)

    @staticmethod
    def remove(folder: str | os.PathLike) -> None:
        """Delete a saved ``QKGraph`` from ``folder`` (a graph saved without one over a folder that had one)."""
        for name in (QK_FILE, QK_META_FILE):
            (Path(folder) / name).unlink(missing_ok=True)
