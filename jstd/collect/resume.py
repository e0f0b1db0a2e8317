"""What lets ``jstd.collect`` resume a collection, or refuse one: the settings' fingerprints written to the index,
the folder's index to continue (``prepare``), and the check that a resumed corpus's first rows are the ones on disk
(``ResumeCheck``).

A collection resumes only with the same settings (sites, positions, sizes, dtype, edits, model, corpus kind) and
the same tokens in its complete shards; each shard records the sha256 of every row's token up to its end.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.collect.batches import PositionFn
from jstd.collect.fingerprint import function_key
from jstd.collect.dataset import FORMAT, INDEX, ROW_MAP, VERSION, read_index, write_json
from jstd.core.checks import host_value, spans_processes
from jstd.core.edits import as_edits
from jstd.core.memo import per_model


def prepare(out: Path, settings: dict, model, path: str | None, layouts: dict[str, dict]) -> dict:
    """The index to continue: a fresh one for an empty or missing folder, the folder's own when its settings
    match (stray temporary and unlisted shard files removed). Raises ValueError otherwise."""
    index = read_index(out) if out.exists() else None
    if index is None:
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"jstd.collect: {out} is not empty and holds no {INDEX}; collect into a new or empty "
                             "folder")
        out.mkdir(parents=True, exist_ok=True)
        index = dict(format=FORMAT, version=VERSION, complete=False, rows=0, shards=[],
                     sites={s: dict(layout=l["layout"], blocks=l["blocks"], shape=None, dtype=None,
                                    **({"sparse": l["sparse"]} if "sparse" in l else {}))
                            for s, l in layouts.items()},
                     row_map={name: dict(dtype=str(np.dtype(dt))) for name, dt in ROW_MAP.items()},
                     model=dict(family=model.family, model_type=model.config.model_type, path=path,
                                config=repr(model.config)),
                     settings=settings)
        write_json(out / INDEX, index)
        return index
    old = index["settings"]
    differ = [k for k in settings if old.get(k) != settings[k]]
    if differ:
        what = "; ".join(f"{k}: {old.get(k)!r} there, {settings[k]!r} now" for k in differ)
        raise ValueError(f"jstd.collect: {out} holds a collection made with other settings ({what}); collect into "
                         "another folder, or delete this one to collect anew")
    listed = {s["file"] for s in index["shards"]} | {INDEX}
    for f in out.iterdir():
        if f.name.endswith(".tmp") or (f.name.startswith("shard-") and f.name not in listed):
            f.unlink()  # a shard cut short, or written but not yet listed when the run stopped
    return index


class ResumeCheck:
    """The corpus's first rows checked against the ``index["rows"]`` rows of the complete shards in ``out``, as
    the batches are replayed in order.

    ``hasher`` is the sha256 of the tokens of the rows so far: the check feeds it the rows on disk until it has
    verified them, then leaves it alone, for the writer to continue with the rows it writes (the writer gets
    this same object). A check of a resumed collection marks ``index`` incomplete until the writer finishes."""

    def __init__(self, out: Path, index: dict):
        self.out, self.index, self.done = out, index, index["rows"]
        self.hasher = hashlib.sha256()
        self.seen = 0
        self.verified = self.done == 0
        if not self.verified:
            index["complete"] = False

    def written(self, tokens: Int[np.ndarray, "rows"]) -> int | None:
        """How many of a batch's leading rows (whose tokens are ``tokens``) are on disk already: None when all of
        them are (the batch is not run: only its tokens are checked), else the count to drop, 0 once checked.
        The first batch that reaches past the rows on disk has them all checked: ValueError when they differ."""
        n = len(tokens)
        if self.verified:
            return 0
        if self.seen + n <= self.done:  # rows of complete shards: only their tokens are checked
            self.hasher.update(tokens.tobytes())
            self.seen += n
            return None
        drop = self.done - self.seen
        self.hasher.update(tokens[:drop].tobytes())
        self._verify(self.seen + drop)
        self.verified = True
        self.seen += n
        return drop

    def finish(self) -> None:
        """After the last batch: a corpus that never reached past the rows on disk (a finished collection, or a
        shorter corpus) has them checked here. ValueError when they differ or the corpus has fewer rows."""
        if not self.verified:
            self._verify(self.seen)

    def _verify(self, seen: int) -> None:
        index = self.index
        want = index["shards"][-1]["tokens_sha256"] if index["shards"] else hashlib.sha256().hexdigest()
        if seen < self.done or self.hasher.hexdigest() != want:
            raise ValueError(f"jstd.collect: {self.out} holds a collection of other texts (its first {self.done} "
                             "rows' tokens differ from this corpus's); collect into another folder, or delete this "
                             "one")


def positions_key(positions: str | PositionFn) -> str:
    """``positions`` as the settings record it: ``"all"``, ``"last"``, or a function's module, name and a digest
    of what it computes (``fingerprint.function_key``: its code, constants, defaults, closure values and the
    globals it reads). ValueError for anything else, and for a function capturing a value without a
    fingerprint."""
    if isinstance(positions, str) and positions in ("all", "last"):
        return positions
    if callable(positions):
        digest = function_key(positions, "positions")
        return f"function {getattr(positions, '__module__', '')}.{getattr(positions, '__qualname__', '?')} {digest}"
    raise ValueError(f"positions must be 'all', 'last' or a function (tokens, attention_mask) -> bool mask; "
                     f"got {positions!r}")


def edits_key(edits) -> str:
    """A fingerprint of ``edits`` (as ``jstd.run`` takes them): their structure, every leaf's value, and what each
    ``Apply``'s function computes (``fingerprint.function_key``: a closure over another factor is another key).
    ValueError for a function capturing a value without a fingerprint."""
    edits = as_edits(edits)
    leaves, treedef = jax.tree.flatten(edits)
    h = hashlib.sha256(re.sub(r" at 0x[0-9a-f]+", "", str(treedef)).encode())
    for leaf in leaves:
        h.update(np.asarray(leaf).tobytes() if hasattr(leaf, "shape") or isinstance(leaf, (int, float))
                 else repr(leaf).encode())
    for e in edits:
        fn = getattr(e, "fn", None)
        if fn is not None:
            h.update(function_key(fn, f"the {type(e).__name__} edit at {e.site}").encode())
    return h.hexdigest()[:32]


@per_model
def model_key(model) -> str:
    """A fingerprint of the model: family, config, and every weight's shape, dtype, sum and sum of squares
    (computed once per model object)."""
    leaves = [x for x in jax.tree.leaves(model) if hasattr(x, "shape")]
    if all(d.platform == "cpu" for x in leaves for d in getattr(x, "devices", lambda: ())()) and not any(
            map(spans_processes, leaves)):
        sums = np.asarray([[np.sum(a, dtype=np.float64), np.sum(np.square(a, dtype=np.float64))]
                           for a in map(np.asarray, leaves)])  # on the host's own memory: no copy, no compile
    else:
        sums = host_value(_sums(leaves))  # (across processes: the same sums on every process)
    h = hashlib.sha256(f"{model.family} {model.config!r}".encode())
    for x in leaves:
        h.update(f"{x.shape}{x.dtype}".encode())
    h.update(np.round(sums.astype(np.float64), 4).tobytes())
    return h.hexdigest()[:32]


@jax.jit
def _sums(leaves: Sequence[Array]) -> Float[Array, "leaves 2"]:
    """Each leaf's sum and sum of squares in float32, on its device."""
    return jnp.stack([jnp.stack([jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.square(x.astype(jnp.float32)))])
                      for x in leaves])
