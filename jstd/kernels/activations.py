"""The activation functions HuggingFace configs name (``hidden_act``), computed as torch computes them."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(jnp.asarray(1.702, x.dtype) * x),
    "relu": jax.nn.relu,
    # BLOOM's BloomGelu: the tanh approximation with its own rounded constants, in torch's order of operations
    "bloom_gelu": lambda x: x * 0.5 * (1.0 + jnp.tanh(0.79788456 * x * (1 + 0.044715 * x * x))),
}


def activation(name: str) -> Callable[[Float[Array, "..."]], Float[Array, "..."]]:
    """The elementwise function ``name`` names (a key of ``ACTIVATIONS``); the result keeps the input's dtype.

    Raises ValueError naming ``name`` and listing the supported ones for any other name.
    """
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]
