"""``Source``: the HuggingFace layout a model was loaded from, kept on the model (``model.source``) so that
``jstd.export`` can write it back."""

from __future__ import annotations

import json
from pathlib import Path

from jstd.io.safetensors import SafetensorsFiles
from jstd.nn.params import with_fields


class Source:
    """The HuggingFace layout a model was loaded from: ``config`` (the text of its config.json), ``tensors``
    (stored name -> (shape, dtype name) of every tensor the family's name map reads), ``ignored`` (the same for
    the checkpoint's tensors the family knowingly does not read: a tower's pooling head, multi-token-prediction
    layers) and ``folder`` (where those are stored). Kept on a loaded model as ``model.source`` for ``export``. It
    is metadata: it compares equal to any other ``Source`` and to None and hashes alike, so two models' tree
    structures match whatever checkpoint they came from."""

    __slots__ = ("config", "tensors", "ignored", "folder")

    def __init__(self, config: str, tensors: dict[str, tuple[tuple[int, ...], str]], ignored=None, folder=None):
        shapes = lambda d: {k: (tuple(int(n) for n in shape), str(dtype)) for k, (shape, dtype) in (d or {}).items()}
        self.config, self.tensors, self.ignored = config, shapes(tensors), shapes(ignored)
        self.folder = None if folder is None else str(folder)

    def __eq__(self, other):
        return other is None or isinstance(other, Source)

    def __hash__(self):
        return 0

    def __repr__(self):
        return f"Source(model_type={json.loads(self.config).get('model_type')!r}, {len(self.tensors)} tensors)"


def with_source(model, source: Source | None):
    """``model`` with ``model.source`` set to ``source`` (a shallow copy; the parameters are shared)."""
    return with_fields(model, source=source)


def hf_source(folder: Path, files: SafetensorsFiles, entries) -> Source:
    """The ``Source`` of a HuggingFace folder: its config.json and the stored tensors ``entries`` (the family's
    name map, keys already spelled as stored) read."""
    keys = {k.format(i=i) for e in entries for k in e.keys for i in (e.blocks if e.stacked else [0])}
    layout = lambda names: {k: (files.shape(k), files.dtype(k).name) for k in sorted(names)}
    return Source((Path(folder) / "config.json").read_text(), layout(keys), layout(files.keys() - keys), folder)
