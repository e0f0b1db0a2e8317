"""The mixture-of-experts MLP (``MoEMLP``): a router, ``experts`` gated MLPs of which each token takes ``top_k``,
and optionally a shared expert behind a sigmoid gate (Qwen3.5-MoE). It is a ``Block``'s ``mlp``.

    router_logits   = x @ router                                   # [batch, seq, experts], editable: re-routes
    router_weights, expert_indices = route(router_logits)          # softmax (float32), top-k, renormalised
    expert_outputs  = expert_e(x) for each chosen e                # [batch, seq, top_k, hidden], before weighting
    mlp_output      = Σ_k router_weights[k] · expert_outputs[k]  (+ sigmoid(x @ shared_gate) · shared(x))

The families differ only in numbers: ``normalize`` (renormalise the top-k weights: Mixtral, Qwen3-VL-MoE,
Qwen3.5-MoE always; Qwen3-MoE and OLMoE by ``norm_topk_prob``) and ``weights_in_float32`` (Mixtral keeps the
weights in float32 and weights each expert's output in float32 before the cast; the others cast the weights to
the logits' dtype first). gpt-oss adds a bias to the router (``router_logits`` include it) and to each expert's
products, routes ``top_k_softmax`` (the softmax of the top-k logits alone) and gates its experts with a clamped
SwiGLU (``swiglu``: ``(limit, alpha)``, ``kernels.moe.clamped``); its checkpoints interleave each expert's gate and
up columns (``names["experts"] = "interleaved"``), split into gate then up at load. Phi-3.5-MoE routes by
``sparsemixer`` (``kernels.moe.sparsemixer``: transformers' inference path, two experts a token) and names its
router ``router`` (``names["router"]``). DeepSeek routes ``group_limited_softmax`` (V2) or ``group_limited_sigmoid``
(V3, with ``score_correction_bias``: the checkpoint's ``e_score_correction_bias``, which moves the choice and not
the weights) over ``groups`` (``(n_group, topk_group)``: only the best groups' experts may be chosen), scales the
weights by ``routed_scaling_factor`` and keeps its router in float32 (``router_logits`` are float32 in a bfloat16
model, as transformers keeps ``gate.weight``); its chosen experts come in ascending expert order
(``kernels.moe.group_limited``), and its shared experts have no gate (``shared_gate`` None;
``names["shared"] = "shared_experts"``). Llama 4 routes ``top_k_sigmoid`` (``kernels.moe.top_k_sigmoid``: the top-k
logits' sigmoids) and weights its experts' *inputs* (``weights_on_input``): ``expert_outputs`` are then
``expert_e(router_weights[k] · x)`` and ``mlp_output`` their plain sum plus an ungated shared expert
(``shared_gate`` False); its checkpoints store the experts fused and input-major (``names["experts"] =
"input_major"``, taken as stored whatever the shapes). The grouped product is ``kernels.moe.expert_outputs``: O(tokens · top_k) memory.

``frozen_routing`` (static; ``jstd.nn.frozen``): the routing is held for gradients — the chosen experts (discrete
anyway), their weights ``router_weights`` (as edited) and the shared expert's sigmoid gate — so a derivative sees
each token's MLP as the fixed weighted sum ``Σ_k w_k · expert_k(x)`` of the prompt's experts (the forward is
unchanged). This is the MoE's part of the local replacement model of attribution graphs (``docs/circuits.md``).

Weights are stored input-major: ``router`` ``[embed, experts]``, ``gate_up`` ``[experts, embed, 2 · mlp]`` (each
expert's gate columns, then its up columns: transformers 5's fused ``experts.gate_up_proj`` transposed), ``down``
``[experts, mlp, embed]``. Checkpoints spell the experts fused (transformers 5; Qwen3-VL-MoE's hub files store
them transposed, taken as stored) or one tensor per expert (``experts.{e}.gate_proj.weight`` … or Mixtral's
``w1`` / ``w3`` / ``w2``), gathered into the stacked leaf at load (``Entry.alternatives``).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jstd.core.config import ModelConfig
from jstd.core.tap import Taps
from jstd.kernels.moe import clamped, combine, expert_outputs, group_limited, route, sparsemixer, top_k_sigmoid
from jstd.nn.params import param, shape
from jstd.nn.mlp import GatedMLP
from jstd.nn.namemap import Entry, linear, present

# how a router turns its logits into weights and experts: softmax, top-k, renormalised by ``normalize`` (most);
# the top-k logits' softmax (gpt-oss); Phi-3.5-MoE's sparsemixer
ROUTINGS = ("softmax", "top_k_softmax", "sparsemixer", "top_k_sigmoid", "group_limited_softmax", "group_limited_sigmoid")
# the per-expert spellings of (gate, up, down): transformers' module names, and Mixtral's hub files'
PER_EXPERT = {"proj": ("gate_proj", "up_proj", "down_proj"), "w": ("w1", "w3", "w2")}


class MoEMLP(eqx.Module):
    """A mixture-of-experts MLP; taps ``mlp.router_logits``, ``mlp.router_weights``, ``mlp.expert_indices``,
    ``mlp.expert_outputs`` and (with a shared expert) ``mlp.shared_expert_output``; returns what the block adds."""

    router: Float[Array, "embed experts"] = param("embed", "experts")
    gate_up: Float[Array, "experts embed two_mlp"] = param("experts", "embed", "mlp")
    down: Float[Array, "experts mlp embed"] = param("experts", "mlp", "embed")
    shared: GatedMLP | None
    shared_gate: Float[Array, "embed 1"] | None = param("embed", "expert_gate")
    top_k: int = eqx.field(static=True)
    normalize: bool = eqx.field(static=True)
    weights_in_float32: bool = eqx.field(static=True)
    act: str = eqx.field(static=True)
    router_bias: Float[Array, "experts"] | None = param("experts", default=None)
    gate_up_bias: Float[Array, "experts two_mlp"] | None = param("experts", "mlp", default=None)
    down_bias: Float[Array, "experts embed"] | None = param("experts", "embed", default=None)
    routing: str = eqx.field(static=True, default="softmax")
    jitter_eps: float = eqx.field(static=True, default=0.0)
    swiglu: tuple[float, float] | None = eqx.field(static=True, default=None)
    weights_on_input: bool = eqx.field(static=True, default=False)
    groups: tuple[int, int] | None = eqx.field(static=True, default=None)
    routed_scaling_factor: float = eqx.field(static=True, default=1.0)
    score_correction_bias: Float[Array, "experts"] | None = param("experts", default=None)
    frozen_routing: bool = eqx.field(static=True, default=False)

    @property
    def sites(self) -> tuple[str, ...]:
        routed = ("router_logits", "router_weights", "expert_indices", "expert_outputs")
        return routed + (("shared_expert_output",) if self.shared is not None else ())

    @property
    def num_experts(self) -> int:
        return self.router.shape[-1]

    def __call__(self, x: Float[Array, "batch seq embed"], s: Taps) -> Float[Array, "batch seq embed"]:
        batch, seq, embed = x.shape
        logits = x @ self.router
        logits = s("mlp.router_logits", logits if self.router_bias is None else logits + self.router_bias)
        if self.routing == "sparsemixer":
            weights, indices = sparsemixer(logits, self.jitter_eps)
        elif self.routing == "top_k_sigmoid":
            weights, indices = top_k_sigmoid(logits, self.top_k)
        elif self.routing.startswith("group_limited_"):
            weights, indices = group_limited(logits, self.top_k, self.routing.removeprefix("group_limited_"),
                                             self.groups, self.normalize, self.routed_scaling_factor,
                                             self.score_correction_bias)
        else:
            weights, indices = route(logits, self.top_k, self.normalize,
                                     np.float32 if self.weights_in_float32 else logits.dtype,
                                     self.routing == "top_k_softmax")
        weights = s("mlp.router_weights", weights)
        if self.frozen_routing:
            weights = jax.lax.stop_gradient(weights)
        indices = s("mlp.expert_indices", indices)
        if self.weights_on_input:  # each (token, choice) is its own row: the expert reads the weighted input
            rows, chosen = (x[..., None, :] * weights[..., None]).astype(x.dtype).reshape(-1, embed), indices.reshape(-1, 1)
        else:
            rows, chosen = x.reshape(-1, embed), indices.reshape(-1, self.top_k)
        outputs = expert_outputs(rows, chosen, self.gate_up, self.down,
                                 self.act, gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                                 product=None if self.swiglu is None else clamped(*self.swiglu))
        outputs = s("mlp.expert_outputs", outputs.reshape(batch, seq, self.top_k, embed))
        y = combine(outputs, jnp.ones_like(weights) if self.weights_on_input else weights, indices)
        if self.shared is not None:
            shared = self.shared(x, _Quiet())
            if self.shared_gate is not None:
                gate = jax.nn.sigmoid(x @ self.shared_gate)
                shared = (jax.lax.stop_gradient(gate) if self.frozen_routing else gate) * shared
            shared = s("mlp.shared_expert_output", shared)
            y = y + shared
        return y

    def entries(self, names=None) -> list[Entry]:
        """Its checkpoint tensors relative to it: ``gate.weight`` (the router), the experts fused
        (``experts.gate_up_proj``, ``experts.down_proj``) or one per expert (``names["experts"]``: ``"proj"``
        for ``experts.{e}.gate_proj.weight`` …, ``"w"`` for Mixtral's ``w1`` / ``w3`` / ``w2``), and the shared
        expert (``shared_expert.*``, ``shared_expert_gate.weight``) where it has one."""
        experts, (embed, two_mlp) = self.num_experts, self.gate_up.shape[-2:]
        if (names or {}).get("experts") == "interleaved":
            return self.interleaved_entries()
        if (names or {}).get("experts") == "input_major":
            entries = [Entry(f"{(names or {}).get('router', 'gate')}.weight", "router", linear),
                       Entry("experts.gate_up_proj", "gate_up"), Entry("experts.down_proj", "down")]
            return entries + ([] if self.shared is None else
                               [e.under("shared_expert.", "shared.") for e in self.shared.entries()])
        gate, up, down = PER_EXPERT[(names or {}).get("experts", "proj")]
        per = lambda *parts: tuple(f"experts.{e}.{p}.weight" for e in range(experts) for p in parts)
        # transformers 5's [experts, out, in], transposed; as stored where the shape says it is ours (Qwen3-VL-MoE's
        # hub files; a square one is taken as transformers 5's, as its loader takes it)
        as_stored = lambda *ours: lambda w: w if w.shape[1:] == ours and ours[0] != ours[1] else w.transpose(0, 2, 1)
        fused_gate_up, fused_down = as_stored(embed, two_mlp), as_stored(two_mlp // 2, embed)
        entries = [
            Entry(f"{(names or {}).get('router', 'gate')}.weight", "router", linear),
            Entry("experts.gate_up_proj", "gate_up", fused_gate_up, alternatives=(
                Entry(per(gate, up), "gate_up", lambda w: w.reshape(experts, two_mlp, embed).transpose(0, 2, 1)),)),
            Entry("experts.down_proj", "down", fused_down, alternatives=(
                Entry(per(down), "down", lambda w: w.reshape(experts, embed, two_mlp // 2).transpose(0, 2, 1)),)),
        ]
        if self.score_correction_bias is not None:
            entries.append(Entry(f"{(names or {}).get('router', 'gate')}.e_score_correction_bias",
                                 "score_correction_bias"))
        if self.shared is not None:
            shared = (names or {}).get("shared", "shared_expert")
            entries += [e.under(f"{shared}.", "shared.") for e in self.shared.entries()]
            if self.shared_gate is not None:
                entries.append(Entry("shared_expert_gate.weight", "shared_gate", linear))
        return entries

    def interleaved_entries(self) -> list[Entry]:
        """gpt-oss' spelling: ``router.weight`` / ``router.bias``, and the experts fused and stored input-major
        (``experts.gate_up_proj`` ``[experts, embed, 2 · mlp]`` with each expert's gate and up columns interleaved,
        gate first; ``experts.down_proj`` ``[experts, mlp, embed]``) with their biases (``*_bias``)."""
        split = lambda w: np.concatenate([w[..., ::2], w[..., 1::2]], axis=-1)  # gate, up interleaved -> halves
        return present(self, [
            Entry("router.weight", "router", linear), Entry("router.bias", "router_bias"),
            Entry("experts.gate_up_proj", "gate_up", split), Entry("experts.gate_up_proj_bias", "gate_up_bias", split),
            Entry("experts.down_proj", "down"), Entry("experts.down_proj_bias", "down_bias"),
        ])

    @classmethod
    def skeleton(cls, embed: int, mlp: int, experts: int, top_k: int, act: str, normalize: bool, dtype,
                 weights_in_float32: bool = False, shared_mlp: int | None = None, biases: bool = False,
                 routing: str = "softmax", jitter_eps: float = 0.0, swiglu: tuple[float, float] | None = None,
                 weights_on_input: bool = False, groups: tuple[int, int] | None = None,
                 routed_scaling_factor: float = 1.0, score_correction_bias: bool = False, shared_gate: bool = True,
                 shared_bias: bool = False, router_dtype=None) -> "MoEMLP":
        """``experts`` SwiGLU experts ``embed`` -> ``mlp`` -> ``embed`` of which each token takes ``top_k``; a
        shared expert ``mlp`` = ``shared_mlp`` wide behind a sigmoid gate where ``shared_mlp`` is given
        (``shared_gate`` False: without a gate, Llama 4's and DeepSeek's; ``shared_bias``: its biases, ``mlp_bias``).
        ``biases``: a router bias and each expert's biases; ``routing`` (``ROUTINGS``), ``jitter_eps``, ``swiglu``,
        ``weights_on_input`` (Llama 4): the fields; DeepSeek's: ``groups`` (``(n_group, topk_group)``),
        ``routed_scaling_factor``, ``score_correction_bias`` (a float32 bias per expert), ``router_dtype`` (the
        router's dtype: float32 where transformers keeps it so). ValueError for an unknown routing, a top-k out of
        range, sparsemixer's top-k other than 2, or groups that do not cut the experts evenly or leave fewer than
        top-k to choose from."""
        if routing not in ROUTINGS:
            raise ValueError(f"unknown MoE routing {routing!r}; jstd has {', '.join(ROUTINGS)}")
        if routing == "sparsemixer" and top_k != 2:
            raise ValueError(f"num_experts_per_tok={top_k}: sparsemixer routing (Phi-3.5-MoE) chooses exactly 2 "
                             "experts a token (transformers' sparsemixer ignores any other top-k); use 2")
        if not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({experts})")
        if groups is not None:
            n_group, topk_group = groups
            if not (0 < n_group <= experts and experts % n_group == 0 and 0 < topk_group <= n_group
                    and top_k <= topk_group * (experts // n_group)):
                raise ValueError(f"n_group={n_group}, topk_group={topk_group}: the {experts} experts must split into "
                                 f"n_group equal groups of which topk_group (at most n_group) hold at least "
                                 f"num_experts_per_tok={top_k} experts")
            if routing == "group_limited_sigmoid" and experts // n_group < 2:
                raise ValueError(f"n_group={n_group}: sigmoid routing scores a group by its two best experts, so "
                                 f"each group needs 2 or more of the {experts} experts")
        shared = None if shared_mlp is None else GatedMLP.skeleton(embed, shared_mlp, act, shared_bias, dtype)
        return cls(shape(embed, experts, dtype=router_dtype or dtype), shape(experts, embed, 2 * mlp, dtype=dtype),
                   shape(experts, mlp, embed, dtype=dtype), shared,
                   None if shared_mlp is None or not shared_gate else shape(embed, 1, dtype=dtype), top_k, normalize,
                   weights_in_float32, act, *((shape(experts, dtype=dtype), shape(experts, 2 * mlp, dtype=dtype),
                                               shape(experts, embed, dtype=dtype)) if biases else (None,) * 3),
                   routing, float(jitter_eps), None if swiglu is None else tuple(map(float, swiglu)), bool(weights_on_input),
                   None if groups is None else tuple(map(int, groups)), float(routed_scaling_factor),
                   shape(experts, dtype=np.float32) if score_correction_bias else None)


def with_experts(config: ModelConfig, experts: int, top_k: int) -> ModelConfig:
    """``config`` with the router's sizes (``num_experts``, ``experts_per_token``)."""
    return dataclasses.replace(config, num_experts=int(experts), experts_per_token=int(top_k))


class _Quiet:
    """The taps of the shared expert's interior: none (its values are not standard sites)."""

    def __call__(self, site: str, value: Array) -> Array:
        return value

    def touches(self, *sites: str) -> bool:
        return False
