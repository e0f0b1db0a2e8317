"""One family's tiny checkpoints as test cases, and every value of a case on one batch.

A family's test module makes a module-scoped fixture of ``Checkpoints`` from its configurations; each case
is built, loaded by jstd and by transformers once, on first use, and its every-value comparison batch is
run once, however many tests read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import jax
import numpy as np
import torch

import jstd
from conftest import assert_close
from reference.checkpoints import make_checkpoint
from reference.harness import LLAMA_PLAN, TorchReference

jit_run = jax.jit(jstd.run, static_argnames="reads")


def random_tokens(model, seq: int, batch: int = 2, seed: int = 0) -> np.ndarray:
    """A (batch, seq) int64 array of token ids drawn uniformly from ``model``'s vocabulary with ``seed``
    (a test module binds its length: ``tokens_for = functools.partial(random_tokens, seq=SEQ)``)."""
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, (batch, seq))


class Case(NamedTuple):
    """A built checkpoint: its case name, its folder, the jstd model and the torch reference loaded from it."""

    name: str
    folder: Path
    model: object
    ref: TorchReference


class Checkpoints:
    """One family's tiny random checkpoints, each built once, on first use, under pytest's ``tmp_path_factory``.

    ``config(name)`` gives a case's transformers config; ``make(config, folder, seed=...)`` writes its checkpoint
    (``reference.checkpoints.make_checkpoint`` by default); ``plan`` is the torch reference's capture plan;
    ``tokens(model)`` is the batch ``every_value`` runs.
    """

    def __init__(self, tmp_path_factory, config: Callable[[str], object], *, seed: int,
                 tokens: Callable[[object], np.ndarray], plan=LLAMA_PLAN, make=make_checkpoint):
        self._tmp, self._config, self._seed, self._plan, self._make, self._tokens = (
            tmp_path_factory, config, seed, plan, make, tokens)
        self._cases: dict[tuple[str, str], Case] = {}
        self._values: dict[str, tuple] = {}

    def __call__(self, name: str, dtype: str = "float32") -> Case:
        """The ``Case`` for ``name`` with the model and reference in ``dtype`` (another dtype loads the float32
        case's folder)."""
        key = (name, dtype)
        if key not in self._cases:
            if dtype == "float32":
                folder = self._make(self._config(name), self._tmp.mktemp(name), seed=self._seed)
                model = jstd.load(folder)
            else:
                folder = self(name).folder
                model = jstd.load(folder, dtype=dtype)
            self._cases[key] = Case(name, folder, model, TorchReference(folder, dtype=getattr(torch, dtype),
                                                                       plan=self._plan))
        return self._cases[key]

    def every_value(self, name: str) -> tuple:
        """(tokens, jstd's output reading every site the model serves, the torch reference's dict of every value
        it captures) for the float32 case ``name`` on the batch ``tokens(model)``, computed once per case."""
        if name not in self._values:
            _, _, model, ref = self(name)
            tokens = self._tokens(model)
            self._values[name] = tokens, jit_run(model, tokens, reads=tuple(sorted(model.sites))), ref.run(tokens)
        return self._values[name]


def assert_sites_close(out, want, sites, rtol: float = 1e-5, label: str = "") -> None:
    """Assert that jstd's ``out[site]`` is within ``rtol`` of the reference's ``want[site]`` (``assert_close``)
    for each of ``sites`` and the logits; a failure names ``label:site``. Returns None."""
    for site in tuple(sites) + ("logits",):
        assert_close(out[site], want[site], rtol, f"{label}:{site}")


def assert_every_value(name: str, model, out, want, rtol: float = 1e-5) -> None:
    """Assert that the reference captured exactly the sites ``model`` serves (and the logits), and that each of
    jstd's values is within ``rtol`` of the reference's (``assert_sites_close``). Returns None."""
    reads = tuple(sorted(model.sites))
    assert set(want) == set(reads) | {"logits"}, set(want) ^ set(reads)
    assert_sites_close(out, want, reads, rtol, name)
