"""Interventions on a graph's feature nodes: set (clamp, ablate with 0) or add to feature activations, with
attention and norms frozen (the setting in which the graph's edges are exact) or free (everything recomputed).

An intervention is ``(layer, pos, feature, value)`` — set the activation of feature ``feature`` of block ``layer``
at position ``pos`` to ``value`` — or ``(layer, pos, feature, value, "add")``.

- ``frozen=True``: the change ``Δ`` of each feature's activation enters the local replacement model
  (``jstd.circuits.replacement``: attention patterns, norm scales and every MLP output but the skip held at the
  prompt's values, so no other feature responds) as ``Δ · decoder`` at the blocks the feature writes, and every
  target moves by exactly ``Σ_s Δ_s / a_s · A[t, s]`` (the graph's edges; a forward-mode derivative of the same
  model, so it is exact for any size of ``Δ``: the frozen model is linear in it).
- ``frozen=False``: the model runs with the transcoders spliced at their sites (``jstd.sae.splice``) and the
  features edited there (``jstd.sae.FeatureEdit``); attention, norms, other features and the MLPs' errors are
  recomputed. Per-layer sets only (a cross-layer decoder writes to later blocks, which a splice at one block
  cannot express): ValueError for a cross-layer transcoder.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jstd.circuits.replacement import linearised, prompt_values
from jstd.circuits.transcoders import Transcoders
from jstd.run import run
from jstd.sae.module import SAE
from jstd.sae.splice import FeatureEdit, splice


def _parsed(interventions, tc: Transcoders, n: int):
    out = []
    for item in interventions:
        if len(item) not in (4, 5):
            raise ValueError(f"an intervention is (layer, pos, feature, value[, 'set' | 'add']), got {item!r}")
        l, p, f, v = (int(item[0]), int(item[1]), int(item[2]), float(item[3]))
        how = item[4] if len(item) == 5 else "set"
        if how not in ("set", "add"):
            raise ValueError(f"intervention {item!r}: how must be 'set' or 'add'")
        for what, i, size in (("layer", l, tc.num_layers), ("pos", p, n), ("feature", f, tc.d_features)):
            if not 0 <= i < size:
                raise ValueError(f"intervention {item!r}: {what} {i} is outside 0..{size - 1}")
        if p == 0:
            raise ValueError(f"intervention {item!r}: position 0 (the BOS) has no features")
        out.append((l, p, f, v, how))
    return out


def frozen_effect(model, tokens, tc: Transcoders, interventions: Sequence) -> dict:
    """The change the interventions make in the frozen model: ``{"inputs": [L, n, d]`` (every block's transcoder
    input), ``"final": [n, d]`` (the final norm's output), ``"logits": [n, V]`` (before any final soft-cap)``}``
    — linear in the interventions' Δs."""
    tokens = jnp.asarray(tokens).reshape(1, -1)
    n = tokens.shape[1]
    items = _parsed(interventions, tc, n)
    v = prompt_values(model, tokens, tc.input_site, tc.output_site)
    acts = np.asarray(tc.encode(v["x"][:, 0].astype(jnp.float32)))
    L, d = tc.num_layers, tc.d_out
    delta = np.zeros((L, 1, n, d), np.float32)
    for l, p, f, value, how in items:
        change = value - acts[l, p, f] if how == "set" else value
        delta[:, 0, p] += change * tc.decoder_vectors(np.array([l]), np.array([f]))[0]
    f_lin = linearised(model, tokens, tc)
    zeros = (jnp.zeros((L, 1, n, d), jnp.float32), jnp.zeros((1, n, d), jnp.float32))
    _, (dx, dfinal) = jax.jvp(f_lin, (zeros,), ((jnp.asarray(delta), zeros[1]),))
    _, linear = model.readout()
    return {"inputs": dx[:, 0], "final": dfinal[0], "logits": linear(dfinal[0])}


def intervene(model, tokens, tc: Transcoders, interventions: Sequence, *, frozen: bool = False):
    """The logits ``[n, V]`` of ``tokens`` (one prompt, BOS included) with the interventions made (module
    docstring). ``frozen=True``: the prompt's logits plus the frozen model's change (the change before any final
    soft-cap, the soft-cap then applied)."""
    tokens = jnp.asarray(tokens).reshape(1, -1)
    if frozen:
        effect = frozen_effect(model, tokens, tc, interventions)
        normed = prompt_values(model, tokens, tc.input_site, tc.output_site)["final"][0] + effect["final"]
        return model.logits_from_norm(normed)
    if tc.cross_layer:
        raise ValueError("intervene(frozen=False) splices one transcoder per block; a cross-layer transcoder writes "
                         "to later blocks too: use frozen=True (the graph's setting)")
    items = _parsed(interventions, tc, tokens.shape[1])
    arch = "transcoder" if tc.threshold is None else "jumprelu_transcoder"
    sae = SAE(jnp.swapaxes(tc.W_enc, 1, 2), tc.b_enc, tc.W_dec, tc.b_dec, tc.threshold, architecture=arch,
              apply_b_dec_to_input=False)
    edits = list(splice(model, sae, tc.output_site, source=tc.input_site))
    latents = f"{tc.output_site}.sae.latents"
    for l, p, f, value, how in items:
        edits.append(FeatureEdit(latents, "add" if how == "add" else "set", [f], [value], layer=l, positions=[p]))
    return run(model, tokens, edits).logits[0]
