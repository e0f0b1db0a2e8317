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


def left_padded(rows, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, attention_mask), both int64 [len(rows), seq]: each row of token ids right-aligned, the positions
    before it padding (token 0, mask 0)."""
    tokens = np.zeros((len(rows), seq), np.int64)
    mask = np.zeros((len(rows), seq), np.int64)
    for r, row in enumerate(rows):
        tokens[r, seq - len(row):] = row
        mask[r, seq - len(row):] = 1
    return tokens, mask


# where a value's seq axis is (after the block axis), for comparing a padded row's real positions
PADDED_SLICES = {
    "layers.layer_output": lambda v, r, pad: v[:, r, pad:],
    "layers.linear_attn.attention_queries": lambda v, r, pad: v[:, r, pad:],
    "layers.linear_attn.states": lambda v, r, pad: v[:, r, pad:],
    "layers.linear_attn.state_output": lambda v, r, pad: v[:, r],
    "layers.self_attn.attention_probabilities": lambda v, r, pad: v[:, r, :, pad:, pad:],
    "next_token_probs": lambda v, r, pad: v[r],
}


def assert_padded_rows_match(model, ref, rows, reads, seq: int, rtol: float = 1e-5, label: str = "") -> None:
    """Run ``rows`` (token id arrays) left-padded to ``seq`` in one batch and assert that each row equals the
    reference run on that row alone: the logits and each of ``reads`` (keys of ``PADDED_SLICES``) at the row's real
    positions; DeltaNet ``states`` read are exactly zero through the padding. Returns None."""
    tokens, mask = left_padded(rows, seq)
    out = jit_run(model, jstd.Inputs(tokens, mask), reads=tuple(reads))
    for r, row in enumerate(rows):
        pad = seq - len(row)
        want = ref.run(row[None], reads=tuple(reads) + ("logits",))
        assert_close(out.logits[r, pad:], want["logits"][0], rtol, f"{label}: row {r} logits")
        for site in reads:
            assert_close(PADDED_SLICES[site](out[site], r, pad), PADDED_SLICES[site](want[site], 0, 0), rtol,
                         f"{label}: row {r} {site}")
        if "layers.linear_attn.states" in reads:
            np.testing.assert_array_equal(out["layers.linear_attn.states"][:, r, :pad], 0)


def assert_hybrid_identities(model, out) -> None:
    """The identities of a hybrid of DeltaNet and attention blocks on ``out`` (every value read), exact: each
    block's ``layer_input + attention_output + mlp_output == layer_output`` (from the block's own host), block
    ``i + 1`` reads block ``i``'s output, block 0 the token embeddings, the last ``states`` entry is
    ``state_output``, ``state_input`` is zero, the logit lens at the last block is the logits, and decays are
    negative. Returns None."""
    la = "layers.linear_attn."
    x, y, mlp = out["layers.layer_input"], out["layers.layer_output"], out["layers.mlp.mlp_output"]
    for host in ("linear_attn", "self_attn"):
        for rank, i in enumerate(model.layers_with(host)):
            np.testing.assert_array_equal((x[i] + out[f"layers.{host}.attention_output"][rank]) + mlp[i], y[i])
    np.testing.assert_array_equal(x[1:], y[:-1])
    np.testing.assert_array_equal(out["token_embeddings"], x[0])
    np.testing.assert_array_equal(out[la + "states"][:, :, -1], out[la + "state_output"])
    np.testing.assert_array_equal(out[la + "state_input"], 0)
    np.testing.assert_array_equal(jax.jit(jstd.project_on_vocab)(model, y[-1]), out.logits)
    assert np.asarray(out[la + "decays"]).max() < 0


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


def final_site(model) -> str:
    """What a run returns: the logits, or a tower's output."""
    return "logits" if "layers" in model.stacks else "vision.tower_output"


def final(model, out):
    return out.logits if out.logits is not None else out["vision.tower_output"]
