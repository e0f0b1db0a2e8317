"""The model with parts of its computation held at their values for gradients: ``frozen``.

Freezing changes no forward value. It changes derivatives: a frozen norm is a fixed diagonal (its ``1 / rms``, a
LayerNorm's ``1 / std``, held), a frozen mixer a fixed linear map of its values (softmax attention, multi-head
latent attention included: its probabilities held, after any edit, and a gated attention's output gate; a gated
DeltaNet: its queries, keys, decays, betas, output gate and the value activation's gain held — ``GatedDeltaNet``), a
frozen mixture of experts a fixed weighted sum of the prompt's experts (its routing weights and shared-expert gate
held). With these, every path through a model whose MLPs are held too (an edit at their outputs; what
``jstd.circuits`` does) is linear in the residual stream: the *local replacement model* of attribution graphs
(``docs/circuits.md``). Works on every family built from ``jstd.nn``'s layers (every ``RMSNorm`` / ``LayerNorm`` /
``L2Norm``, q/k norms, post-norms and DeltaNet's output norm included, every softmax ``Attention`` /
``LatentAttention``, ``GatedDeltaNet`` and ``MoEMLP``), in any stack.
"""

from __future__ import annotations

import dataclasses

import jax

from jstd.nn.attention import Attention
from jstd.nn.deltanet import GatedDeltaNet
from jstd.nn.latent_attention import LatentAttention
from jstd.nn.moe import MoEMLP
from jstd.nn.norms import L2Norm, LayerNorm, RMSNorm

NORMS = (RMSNorm, LayerNorm, L2Norm)
MIXERS = (Attention, LatentAttention, GatedDeltaNet)
HELD = NORMS + MIXERS + (MoEMLP,)


def frozen(model, *, norms: bool = True, attention: bool = True, routing: bool = True):
    """``model`` (any pytree of jstd layers) with every norm's scale (``norms``), every mixer's pattern
    (``attention``: softmax attention's probabilities and output gate, a DeltaNet's everything-but-the-values) and
    every mixture of experts' routing (``routing``) held constant for gradients; the same arrays, forward values
    unchanged. A frozen attention always takes the explicit path (the fused kernel has no probabilities to hold)."""

    def freeze(m):
        if isinstance(m, NORMS):
            return dataclasses.replace(m, frozen_scale=True) if norms else m
        if isinstance(m, MIXERS):
            m = dataclasses.replace(m, frozen_pattern=attention or m.frozen_pattern)
        elif isinstance(m, MoEMLP):
            m = dataclasses.replace(m, frozen_routing=routing or m.frozen_routing)
        else:
            return m
        return jax.tree.map(freeze, m, is_leaf=lambda x: x is not m and isinstance(x, HELD))

    return jax.tree.map(freeze, model, is_leaf=lambda x: isinstance(x, HELD))
