"""An attribution graph: nodes, the direct-effect adjacency, and how it is saved (safetensors + JSON, no pickle).

Node order (circuit-tracer's, ``Graph`` of circuit-tracer 0.5.0): ``[selected features (in active order) | errors
layer-major (block 0: positions 0..n-1, block 1: …) | tokens 0..n-1 | logit targets (in target order)]``, so
``N = n_selected + L·n + n + k``. ``adjacency[target, source]`` is the direct effect of ``source`` on ``target``:
on a feature, its pre-activation minus ``b_enc``; on a logit target, the demeaned logit (or the custom
direction's value) at the final norm's output. Rows of errors and tokens and columns of logits are zero.

A prompt with images (an image-text wrapper's, ``jstd.circuits.inputs``) keeps this order: the token slot of an
image token's position is its *image node* (its input vector is the merged embedding, the projector's feature
row, where a text token's is its embedding); ``image_patches`` labels it by image and patch, and ``node`` still
calls it ``("token", pos, image_token_id)`` (``image_patch`` tells which).

``adjacency`` is a dense ``float32 [N, N]`` array, or with ``jstd.attribute(..., edges_per_row=k)`` a
``SparseAdjacency``: each row's ``k`` largest edges by magnitude (CSR), with each row's full ``Σ |A[t, :]|`` kept
beside them so that pruning's row-normalised weights of the kept edges are the dense graph's. At 10⁵ features the
dense matrix is 40 GB; ``N · k`` entries are not. Large prompts may also bound the feature nodes
(``max_feature_nodes``, circuit-tracer's own answer: the features most influential on the logits, visited in
influence order); the skipped features' effects are left out, not moved to errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from jstd.circuits.qk_data import QKGraph
from jstd.io.safetensors import SafetensorsFiles, write_tensors
from jstd.io.staging import atomic

ARRAYS = ("adjacency", "active_features", "activation_values", "selected_features", "input_tokens",
          "logit_token_ids", "logit_probabilities", "logit_vectors")
META = ("num_layers", "vocab_size", "logit_strings", "scan", "input_string", "prompt_tokens")
SPARSE = ("indptr", "indices", "data", "row_abs_sums")
GRAPH_FILE, META_FILE = "graph.safetensors", "graph_meta.json"


@dataclasses.dataclass
class SparseAdjacency:
    """An ``[N, N]`` adjacency as the top edges of each row (CSR: row ``t``'s entries are ``data[indptr[t]:
    indptr[t + 1]]`` at columns ``indices[…]``, largest magnitude first), and ``row_abs_sums [N]``: each row's
    ``Σ |A[t, s]|`` over every source, the dropped edges included. Entries not kept read as 0 (``toarray``,
    indexing). ``row_abs_sums`` equals ``toarray()``'s row sums when nothing was dropped."""

    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    row_abs_sums: np.ndarray
    shape: tuple[int, int]

    @property
    def nnz(self) -> int:
        return len(self.data)

    @property
    def dtype(self):
        return self.data.dtype

    def matrix(self):
        """The kept entries as a ``scipy.sparse.csr_array``."""
        from scipy.sparse import csr_array

        return csr_array((self.data, self.indices, self.indptr), shape=self.shape)

    def toarray(self) -> np.ndarray:
        """The dense ``[N, N]`` matrix of the kept entries (zeros elsewhere)."""
        return self.matrix().toarray()

    def nonzero(self) -> tuple[np.ndarray, np.ndarray]:
        """``(targets, sources)`` of the nonzero kept entries (``np.nonzero(adjacency)`` works too)."""
        rows = np.repeat(np.arange(self.shape[0]), np.diff(self.indptr))
        hit = self.data != 0
        return rows[hit], self.indices[hit]

    def __getitem__(self, key):
        """``A[t, s]`` for ints or index arrays (broadcast), 0 where the edge was not kept; ``A[t]``: a dense row."""
        if not isinstance(key, tuple):
            return self.matrix()[[int(key)], :].toarray()[0]
        t, s = np.broadcast_arrays(*(np.asarray(k) for k in key))
        out = np.asarray(self.matrix()[t.reshape(-1), s.reshape(-1)], self.data.dtype)
        return out.reshape(t.shape) if t.ndim else out.reshape(()).item()


@dataclasses.dataclass
class Graph:
    """One prompt's attribution graph (see the module docstring for the node order).

    adjacency: ``[N, N] float32``, ``[target, source]``; or a ``SparseAdjacency`` (``edges_per_row``).
    active_features: ``[n_active, 3] int64`` (block, position, feature) of every active feature, lexicographic.
    activation_values: ``[n_active] float32``. selected_features: ``[n_selected] int64``, indices into
    ``active_features`` of the feature nodes (all unless ``max_feature_nodes``).
    input_tokens: ``[n] int64`` (the BOS included). logit_token_ids: ``[k]`` (vocab ids; ``vocab_size + i`` for
    a custom direction ``i``); logit_probabilities ``[k]`` (or the custom weights); logit_vectors ``[k, d]``
    (what each logit target reads at the final norm's output); logit_strings: their labels.
    image_patches: ``[n, 2] int64`` or None (a prompt without images): ``(image, patch)`` of the image token at
    each position — image ``i`` of the prompt in the tower's order (an Idefics 3 tile), its ``j``-th image token —
    and ``(-1, -1)`` at text positions.
    """

    adjacency: np.ndarray | SparseAdjacency
    active_features: np.ndarray
    activation_values: np.ndarray
    selected_features: np.ndarray
    input_tokens: np.ndarray
    logit_token_ids: np.ndarray
    logit_probabilities: np.ndarray
    logit_vectors: np.ndarray
    num_layers: int
    vocab_size: int
    logit_strings: list[str]
    scan: str | None = None
    input_string: str | None = None
    prompt_tokens: list[str] | None = None
    qk: QKGraph | None = None  # QK attributions and head loadings (jstd.circuits.qk_graph), saved beside the graph
    image_patches: np.ndarray | None = None

    # ---- node bookkeeping --------------------------------------------------------------------------------------
    @property
    def n_pos(self) -> int:
        return len(self.input_tokens)

    @property
    def n_features(self) -> int:
        return len(self.selected_features)

    @property
    def n_logits(self) -> int:
        return len(self.logit_token_ids)

    @property
    def error_start(self) -> int:
        return self.n_features

    @property
    def token_start(self) -> int:
        return self.n_features + self.num_layers * self.n_pos

    @property
    def logit_start(self) -> int:
        return self.token_start + self.n_pos

    @property
    def n_nodes(self) -> int:
        return self.logit_start + self.n_logits

    def node(self, i: int) -> tuple:
        """``("feature", layer, pos, feature)``, ``("error", layer, pos)``, ``("token", pos, id)`` or ``("logit",
        k, id)`` for node ``i``."""
        i = int(i)
        if not 0 <= i < self.n_nodes:
            raise IndexError(f"node {i} is outside 0..{self.n_nodes - 1}")
        if i < self.n_features:
            return ("feature", *map(int, self.active_features[self.selected_features[i]]))
        if i < self.token_start:
            return ("error", *divmod(i - self.error_start, self.n_pos))
        if i < self.logit_start:
            p = i - self.token_start
            return ("token", p, int(self.input_tokens[p]))
        k = i - self.logit_start
        return ("logit", k, int(self.logit_token_ids[k]))

    def image_patch(self, i: int) -> tuple[int, int] | None:
        """``(image, patch)`` of node ``i`` where it is an image node (the token slot of an image token), else
        None."""
        kind, *rest = self.node(i)
        if kind != "token" or self.image_patches is None or self.image_patches[rest[0], 0] < 0:
            return None
        return tuple(int(v) for v in self.image_patches[rest[0]])

    def input_label(self, pos: int) -> str:
        """The label of position ``pos``'s input: ``"img{i} patch{j}"`` at an image token, else its token string
        (``prompt_tokens``; the id without them)."""
        if self.image_patches is not None and self.image_patches[pos, 0] >= 0:
            return "img{} patch{}".format(*map(int, self.image_patches[pos]))
        return self.prompt_tokens[pos] if self.prompt_tokens is not None else str(int(self.input_tokens[pos]))

    def feature_node(self, layer: int, pos: int, feature: int) -> int:
        """The node index of feature ``(layer, pos, feature)``; KeyError if it is not a node of the graph."""
        chosen = self.active_features[self.selected_features]
        hit = np.nonzero((chosen == np.array([layer, pos, feature])).all(1))[0]
        if not len(hit):
            raise KeyError(f"feature (layer {layer}, pos {pos}, feature {feature}) is not a node of this graph")
        return int(hit[0])

    # ---- files -------------------------------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike) -> Path:
        """``folder/graph.safetensors`` (the arrays) and ``folder/graph_meta.json`` (the rest), atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {k: getattr(self, k) for k in ARRAYS}
        if self.image_patches is not None:
            arrays["image_patches"] = np.asarray(self.image_patches, np.int64)
        if isinstance(self.adjacency, SparseAdjacency):
            a = arrays.pop("adjacency")
            arrays.update({f"adjacency.{k}": getattr(a, k) for k in SPARSE})
            arrays["adjacency.shape"] = np.asarray(a.shape, np.int64)
        with atomic(folder / GRAPH_FILE, "wb") as fh:
            write_tensors(fh, {k: np.ascontiguousarray(v) for k, v in arrays.items()})
        with atomic(folder / META_FILE, "w") as fh:
            json.dump({k: getattr(self, k) for k in META}, fh, indent=1)
        if self.qk is not None:
            self.qk.save(folder)
        else:
            QKGraph.remove(folder)
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "Graph":
        """The graph ``save`` wrote in ``folder``. FileNotFoundError naming the missing file."""
        folder = Path(folder)
        for name in (GRAPH_FILE, META_FILE):
            if not (folder / name).exists():
                raise FileNotFoundError(f"{folder} has no {name}: Graph.save writes {GRAPH_FILE} and {META_FILE}")
        files = SafetensorsFiles(folder / GRAPH_FILE)
        names = set(files.keys())
        arrays = {k: np.array(files.mapped(k, lazy=True)) for k in ARRAYS + ("image_patches",) if k in names}
        if "adjacency" not in names:  # a SparseAdjacency
            parts = {k: np.array(files.mapped(f"adjacency.{k}", lazy=True)) for k in SPARSE}
            shape = tuple(int(i) for i in np.array(files.mapped("adjacency.shape", lazy=True)))
            arrays["adjacency"] = SparseAdjacency(**parts, shape=shape)
        meta = json.loads((folder / META_FILE).read_text())
        return cls(**arrays, **{k: meta.get(k) for k in META}, qk=QKGraph.load(folder))
