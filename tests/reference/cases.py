"""The families' tiny checkpoints as test cases, and every value of a case on one batch.

The session-scoped ``zoo`` fixture (conftest) is a ``Zoo`` of ``families.CASES``; each case is built, loaded
by jstd and by transformers once, on first use, and its every-value comparison batch is run once, however many
tests read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import torch

import jstd
from conftest import assert_close

jit_run = jax.jit(jstd.run, static_argnames="reads")


def random_tokens(model, seq: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    """A (batch, seq) int64 array of token ids drawn uniformly from ``model``'s vocabulary with ``seed``
    (a test module binds its length: ``tokens_for = functools.partial(random_tokens, seq=SEQ)``)."""
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, (batch, seq))


class Case(NamedTuple):
    """A built checkpoint: its case name, its folder, the jstd model, the torch reference loaded from it, and the
    case's spec (``families.Spec``)."""

    name: str
    folder: Path
    model: object
    ref: object
    spec: object


class Zoo:
    """Every family's tiny random checkpoints (``families.CASES``), each built once, on first use, under pytest's
    ``tmp_path_factory``; one session-wide instance serves every test module (the ``zoo`` fixture)."""

    def __init__(self, tmp_path_factory, specs: dict):
        self._tmp, self._specs = tmp_path_factory, specs
        self._cases: dict[tuple[str, str], Case] = {}
        self._values: dict[str, tuple] = {}

    def __call__(self, name: str, dtype: str = "float32") -> Case:
        """The ``Case`` for ``name`` with the model and reference in ``dtype`` (another dtype loads the float32
        case's folder)."""
        key = (name, dtype)
        if key not in self._cases:
            spec = self._specs[name]
            if dtype == "float32":
                folder = spec.make(spec.config(), self._tmp.mktemp(name), seed=spec.seed)
                model = jstd.load(folder)
            else:
                folder = self(name).folder
                model = jstd.load(folder, dtype=dtype)
            self._cases[key] = Case(name, folder, model, spec.reference(folder, getattr(torch, dtype)), spec)
        return self._cases[key]

    def every_value(self, name: str) -> tuple:
        """(jstd's output reading every site the model serves, the torch reference's dict of every value it
        captures) for the float32 case ``name`` on the spec's first batch, computed once per case."""
        if name not in self._values:
            _, _, model, ref, spec = self(name)
            inputs, ref_inputs = spec.inputs(model)
            self._values[name] = jit_run(model, inputs, reads=tuple(sorted(model.sites))), ref.run(ref_inputs)
        return self._values[name]


class FamilyCases:
    """One family's cases of a ``Zoo`` by their short names (``olmo_hybrid-tail`` as ``tail``):
    ``cases(name, dtype="float32") -> (name, folder, jstd model, torch reference)``;
    ``cases.every_value(name) -> (inputs, every value jstd serves, every value torch captures)`` on one batch."""

    def __init__(self, zoo: Zoo, family: str):
        self.zoo, self.family = zoo, family

    def __call__(self, name: str, dtype: str = "float32") -> tuple:
        return (name,) + tuple(self.zoo(f"{self.family}-{name}", dtype))[1:4]

    def every_value(self, name: str) -> tuple:
        case = self.zoo(f"{self.family}-{name}")
        return (case.spec.inputs(case.model)[0],) + self.zoo.every_value(case.name)


def assert_sites_close(out, want, sites, rtol: float = 1e-5, label: str = "") -> None:
    """Assert that jstd's ``out[site]`` is within ``rtol`` of the reference's ``want[site]`` (``assert_close``)
    for each of ``sites`` and the logits; a failure names ``label:site``. Returns None."""
    for site in tuple(sites) + (("logits",) if out.logits is not None else ()):
        assert_close(out[site], want[site], rtol, f"{label}:{site}")


def assert_every_value(name: str, model, out, want, rtol: float = 1e-5) -> None:
    """Assert that the reference captured exactly the sites ``model`` serves (and the logits), and that each of
    jstd's values is within ``rtol`` of the reference's (``assert_sites_close``). Returns None."""
    reads = tuple(sorted(model.sites))
    assert set(want) - {"logits"} == set(reads) - {"logits"}, set(want) ^ set(reads)
    assert_sites_close(out, want, reads, rtol, name)
