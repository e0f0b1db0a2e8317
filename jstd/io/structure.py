"""A model's structure as plain JSON, and back: how the converted layout records the skeleton of the model it
holds (its static fields and each parameter's shape and dtype) with no code ever loaded from the checkpoint.

A structure names jstd's dataclasses by ``module:qualname``; ``MOVED`` maps the names a checkpoint written by an
earlier jstd uses to where those classes live now, so such checkpoints keep loading.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import jax
import numpy as np

# classes the structure of a checkpoint written by an earlier jstd names where they no longer live:
# "module:qualname" as written -> where the class is now (the fields are the same); a module that moved since
# (``jstd.models.MOVED_MODULES``: the layers' move to ``jstd.nn``) still imports under its old name
MOVED = {
    "jstd.config:ModelConfig": "jstd.core.config:ModelConfig",
    "jstd.config:VisionConfig": "jstd.core.config:VisionConfig",
    "jstd.models.layers:RMSNorm": "jstd.nn.norms:RMSNorm",
    "jstd.models.layers:HeadNorm": "jstd.nn.norms:HeadNorm",
    "jstd.models.layers:LayerNorm": "jstd.nn.norms:LayerNorm",
    "jstd.models.layers:GatedMLP": "jstd.nn.mlp:GatedMLP",
    "jstd.models.layers:MLP": "jstd.nn.mlp:MLP",
    "jstd.models.layers:Attention": "jstd.nn.attention:Attention",
    "jstd.models.layers:Block": "jstd.nn.block:Block",
}


def encode_structure(tree) -> object:
    """The static structure of a skeleton (``jax.ShapeDtypeStruct`` leaves) as JSON: jstd dataclasses by class
    name and fields, tuples, dicts, scalars and strings; each parameter as its shape and dtype. TypeError for
    anything else (the converted layout cannot hold it)."""
    if isinstance(tree, jax.ShapeDtypeStruct):
        return {"@leaf": list(tree.shape), "dtype": np.dtype(tree.dtype).name}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, tuple):
        return {"@tuple": [encode_structure(x) for x in tree]}
    if isinstance(tree, list):
        return [encode_structure(x) for x in tree]
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        return {"@dict": {k: encode_structure(v) for k, v in tree.items()}}
    cls = type(tree)
    if dataclasses.is_dataclass(tree) and cls.__module__.split(".")[0] == "jstd" and "<" not in cls.__qualname__:
        return {"@class": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: encode_structure(getattr(tree, f.name)) for f in dataclasses.fields(tree)
                           if f.name != "source"}}
    raise TypeError(f"the converted layout cannot hold a {cls.__module__}.{cls.__qualname__} ({tree!r:.60})")


def decode_structure(data, dtype: Callable[[str], np.dtype] = np.dtype):
    """The skeleton ``encode_structure`` wrote. Only jstd's own dataclasses are built (without running any of
    their code: fields are set one by one); ``dtype(stored name)`` gives each parameter's dtype. ValueError for
    anything this jstd does not know (a class renamed, a field removed, or a field added since the checkpoint was
    written without a default; an added field with a default takes it)."""
    if isinstance(data, list):
        return [decode_structure(x, dtype) for x in data]
    if not isinstance(data, dict):
        return data
    if "@leaf" in data:
        return jax.ShapeDtypeStruct(tuple(data["@leaf"]), dtype(data["dtype"]))
    if "@tuple" in data:
        return tuple(decode_structure(x, dtype) for x in data["@tuple"])
    if "@dict" in data:
        return {k: decode_structure(v, dtype) for k, v in data["@dict"].items()}
    module, _, qualname = MOVED.get(str(data.get("@class", "")), str(data.get("@class", ""))).partition(":")
    if module.split(".")[0] != "jstd" or not qualname:
        raise ValueError(f"not a jstd class: {data.get('@class')!r}")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{module}:{qualname} is not a jstd dataclass")
    known = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    stored = set(data["fields"])
    # a field added since the checkpoint was written takes its default (what every model of that time had)
    added = {n: f for n, f in known.items() if n not in stored and f.default is not dataclasses.MISSING}
    if stored != set(known) - set(added):
        raise ValueError(f"{qualname} has fields {sorted(known)}, the checkpoint {sorted(stored)}")
    obj = cls.__new__(cls)
    for name, value in data["fields"].items():
        object.__setattr__(obj, name, decode_structure(value, dtype))
    for name, f in added.items():
        object.__setattr__(obj, name, f.default)
    if "source" in {f.name for f in dataclasses.fields(cls)}:
        object.__setattr__(obj, "source", None)
    return obj
