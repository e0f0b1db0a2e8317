"""The MLPs shared by every family and tower: the gated ``GatedMLP`` (Llama's) and the plain ``MLP`` (the ViT's).

Weights are stored input-major (``x @ w``). Every value an MLP computes passes
a tap (``s(site, value)``) under its name relative to its block
(``mlp.mlp_neurons``); ``entries(names)`` lists its checkpoint tensors relative
to the module (``gate_proj.weight`` -> ``gate``).
"""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
from jaxtyping import Array, Float

from jstd.core.tap import Taps
from jstd.kernels.activations import activation
from jstd.kernels.projection import add_bias
from jstd.nn.params import param, shape
from jstd.nn.namemap import Entry, linear, present


class GatedMLP(eqx.Module):
    """down(act(gate(x)) · up(x)); taps ``mlp.mlp_activation`` and ``mlp.mlp_neurons``; returns down's output."""

    gate: Float[Array, "embed mlp"] = param("embed", "mlp")
    up: Float[Array, "embed mlp"] = param("embed", "mlp")
    down: Float[Array, "mlp embed"] = param("mlp", "embed")
    gate_bias: Float[Array, "mlp"] | None = param("mlp")
    up_bias: Float[Array, "mlp"] | None = param("mlp")
    down_bias: Float[Array, "embed"] | None = param("embed")
    act: str = eqx.field(static=True)

    sites: ClassVar[tuple[str, ...]] = ("mlp_activation", "mlp_neurons")

    def __call__(self, x: Float[Array, "batch seq embed"], s: Taps) -> Float[Array, "batch seq embed"]:
        act = s("mlp.mlp_activation", activation(self.act)(add_bias(x @ self.gate, self.gate_bias)))
        neurons = s("mlp.mlp_neurons", act * add_bias(x @ self.up, self.up_bias))
        return add_bias(neurons @ self.down, self.down_bias)

    def entries(self, names=None) -> list[Entry]:
        """Its checkpoint tensors relative to it: ``{gate,up,down}_proj.weight`` and the biases it has."""
        return present(self, [
            Entry("gate_proj.weight", "gate", linear), Entry("up_proj.weight", "up", linear),
            Entry("down_proj.weight", "down", linear), Entry("gate_proj.bias", "gate_bias"),
            Entry("up_proj.bias", "up_bias"), Entry("down_proj.bias", "down_bias"),
        ])

    @classmethod
    def skeleton(cls, embed: int, mlp: int, act: str, bias: bool, dtype) -> "GatedMLP":
        """``embed`` -> ``mlp`` -> ``embed`` with activation ``act``, biases on all three projections or none."""
        b = lambda n: shape(n, dtype=dtype) if bias else None
        return cls(shape(embed, mlp, dtype=dtype), shape(embed, mlp, dtype=dtype), shape(mlp, embed, dtype=dtype),
                   b(mlp), b(mlp), b(embed), act)


class MLP(eqx.Module):
    """fc2(act(fc1(x))) with biases (the ViT MLP): ``mlp.mlp_activation`` is act's output and, with no gate,
    ``mlp.mlp_neurons`` the same value as fc2 receives it."""

    fc1: Float[Array, "embed mlp"] = param("embed", "mlp")
    fc1_bias: Float[Array, "mlp"] = param("mlp")
    fc2: Float[Array, "mlp embed"] = param("mlp", "embed")
    fc2_bias: Float[Array, "embed"] = param("embed")
    act: str = eqx.field(static=True)

    sites: ClassVar[tuple[str, ...]] = ("mlp_activation", "mlp_neurons")

    def __call__(self, x: Float[Array, "batch seq embed"], s: Taps) -> Float[Array, "batch seq embed"]:
        neurons = s("mlp.mlp_neurons", s("mlp.mlp_activation", activation(self.act)(x @ self.fc1 + self.fc1_bias)))
        return neurons @ self.fc2 + self.fc2_bias

    def entries(self, names=None) -> list[Entry]:
        """``names["fc1"]`` / ``names["fc2"]``: the linears' module names where not ``fc1`` / ``fc2`` (Qwen3-VL's
        ``linear_fc1`` / ``linear_fc2``)."""
        fc1, fc2 = ((names or {}).get(k, k) for k in ("fc1", "fc2"))
        return [Entry(f"{fc1}.weight", "fc1", linear), Entry(f"{fc1}.bias", "fc1_bias"),
                Entry(f"{fc2}.weight", "fc2", linear), Entry(f"{fc2}.bias", "fc2_bias")]

    @classmethod
    def skeleton(cls, embed: int, mlp: int, act: str, dtype) -> "MLP":
        """``embed`` -> ``mlp`` -> ``embed`` with activation ``act`` and both biases."""
        return cls(shape(embed, mlp, dtype=dtype), shape(mlp, dtype=dtype), shape(mlp, embed, dtype=dtype),
                   shape(embed, dtype=dtype), act)
