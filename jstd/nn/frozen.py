"""The model with parts of its computation held at their values for gradients: ``frozen``.

Freezing changes no forward value. It changes derivatives: a frozen norm is a fixed diagonal (its ``1 / rms``, a
LayerNorm's ``1 / std``, held), a frozen attention a fixed mixing of its values (its probabilities held, after any
edit). With both, every path through a model whose MLPs are held too (an edit at their outputs; what
``jstd.circuits`` does) is linear in the residual stream: the *local replacement model* of attribution graphs.
Works on every family built from ``jstd.nn``'s layers (every ``RMSNorm`` / ``LayerNorm``, q/k norms and post-norms
included, and every softmax ``Attention`` / ``LatentAttention``), in any stack.
"""

from __future__ import annotations

import dataclasses

import jax

from jstd.nn.attention import Attention
from jstd.nn.latent_attention import LatentAttention
from jstd.nn.norms import LayerNorm, RMSNorm

NORMS = (RMSNorm, LayerNorm)
ATTENTIONS = (Attention, LatentAttention)


def frozen(model, *, norms: bool = True, attention: bool = True):
    """``model`` (any pytree of jstd layers) with every norm's scale (``norms``) and every softmax attention's
    probabilities (``attention``) held constant for gradients; the same arrays, forward values unchanged.
    A frozen attention always takes the explicit path (the fused kernel has no probabilities to hold)."""

    def freeze(m):
        if norms and isinstance(m, NORMS):
            return dataclasses.replace(m, frozen_scale=True)
        if isinstance(m, ATTENTIONS):
            inner = jax.tree.map(freeze, dataclasses.replace(m, frozen_pattern=attention or m.frozen_pattern),
                                 is_leaf=lambda x: x is not m and isinstance(x, NORMS))
            return inner
        return m

    return jax.tree.map(freeze, model, is_leaf=lambda x: isinstance(x, NORMS + ATTENTIONS))
