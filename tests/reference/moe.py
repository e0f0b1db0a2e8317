"""The torch reference's mixture-of-experts values: ``layers.mlp.router_logits``, ``router_weights``,
``expert_indices``, ``expert_outputs`` and ``shared_expert_output``, captured and edited in transformers' own
sparse-MoE blocks (Qwen3-MoE, OLMoE, Mixtral, Qwen3-VL-MoE, Qwen3.5-MoE).

``moe_blocks(text, tap)`` binds, for a call, a capturing forward on each block's ``mlp`` that has experts:

- the router is transformers' own (``mlp.gate``); its logits pass the tap, and an edited value re-routes by
  running the same router again with ``torch.nn.functional.linear`` returning the edited logits: transformers'
  softmax, top-k, renormalisation and casts on the forced logits (a hook forcing the logits);
- each chosen expert's output before weighting is computed by the experts loop of transformers
  (``*Experts.forward``: expert by expert over the tokens that chose it, the same products in the same order),
  passes the tap as ``[batch, seq, top_k, hidden]``, and is then weighted and summed as that loop does
  (``index_add_`` in ascending expert order). Unedited, the result is asserted bit-equal to the experts module's
  own output, so the copy is the reference's code path;
- Qwen3.5-MoE's shared expert output after its sigmoid gate passes the tap before it is added (DeepSeek's
  ``shared_experts``, without a gate, too).

``MoEReference`` is ``TorchReference`` with these values and ``PLAN`` (Llama's, the dense MLP's interior only on
the blocks without experts); ``MoEQwenVLReference`` the same for the wrappers.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from reference.harness import LLAMA_PLAN, TorchReference
from reference.qwen_vl import QwenVLReference

DENSE = "dense"  # a plan entry by block: only the blocks whose mlp has no experts
MOE_SITES = tuple("layers.mlp." + s for s in ("router_logits", "router_weights", "expert_indices", "expert_outputs"))
SHARED = "layers.mlp.shared_expert_output"
PLAN = {**{k: v for k, v in LLAMA_PLAN.items() if k not in ("layers.mlp.mlp_activation", "layers.mlp.mlp_neurons")},
        "layers.mlp.mlp_activation": {DENSE: LLAMA_PLAN["layers.mlp.mlp_activation"]},
        "layers.mlp.mlp_neurons": {DENSE: LLAMA_PLAN["layers.mlp.mlp_neurons"]}}


@contextlib.contextmanager
def forced_linear(logits: torch.Tensor):
    """``torch.nn.functional.linear`` returning ``logits`` whatever it is given (the router's one product)."""
    original = F.linear
    F.linear = lambda *args, **kwargs: logits
    try:
        yield
    finally:
        F.linear = original


def _hit(indices: torch.Tensor, experts: int):
    """transformers' expert mask and the experts chosen at least once, ascending."""
    mask = F.one_hot(indices, num_classes=experts + 1).permute(2, 1, 0)
    return mask, [int(e) for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0] if e != experts]


def expert_outputs(experts, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Each chosen expert's output ``[tokens, top_k, hidden]`` by transformers' experts loop, before weighting."""
    out = x.new_zeros(*indices.shape, x.shape[-1])
    mask, hit = _hit(indices, experts.num_experts)
    for e in hit:
        top_k_pos, token_idx = torch.where(mask[e])
        if hasattr(experts, "gate_up_proj_bias"):  # gpt-oss: input-major, biases, interleaved clamped SwiGLU
            gate_up = x[token_idx] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
            out[token_idx, top_k_pos] = experts._apply_gate(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]
            continue
        gate, up = F.linear(x[token_idx], experts.gate_up_proj[e]).chunk(2, dim=-1)
        out[token_idx, top_k_pos] = F.linear(experts.act_fn(gate) * up, experts.down_proj[e])
    return out


def combined(experts, x, outputs, indices, weights) -> torch.Tensor:
    """transformers' weighting and sum of ``outputs`` (``[tokens, top_k, hidden]``), expert by expert."""
    final = torch.zeros_like(x)
    mask, hit = _hit(indices, experts.num_experts)
    for e in hit:
        top_k_pos, token_idx = torch.where(mask[e])
        current = outputs[token_idx, top_k_pos] * weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, current.to(final.dtype))
    return final


def _forward(block, i: int, tap, hidden_states: torch.Tensor) -> torch.Tensor:
    b, s, h = hidden_states.shape
    x = hidden_states.reshape(-1, h)
    router = block.router if hasattr(block, "router") else block.gate  # gpt-oss names it router
    logits, weights, indices = router(x)
    view = logits.reshape(b, s, -1)
    edited = tap("layers.mlp.router_logits", i, view)
    if edited is not view:
        with forced_linear(edited.reshape(-1, edited.shape[-1]).to(logits.dtype)):
            logits, weights, indices = router(x)
    k = indices.shape[-1]
    tap("layers.mlp.router_weights", i, weights.reshape(b, s, k))
    tap("layers.mlp.expert_indices", i, indices.reshape(b, s, k))
    outputs = expert_outputs(block.experts, x, indices)
    view = outputs.reshape(b, s, k, h)
    new = tap("layers.mlp.expert_outputs", i, view)
    routed = combined(block.experts, x, new.reshape(-1, k, h), indices, weights)
    if new is view:  # the copy is transformers' loop: bit-equal to the experts module
        assert torch.equal(routed, block.experts(x, indices, weights)), "the experts copy left transformers' loop"
    if hasattr(block, "shared_expert"):
        shared = F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        routed = routed + tap(SHARED, i, shared.reshape(b, s, h)).reshape(-1, h)
    if hasattr(block, "shared_experts"):  # DeepSeek's: no gate, added after the routed sum
        shared = block.shared_experts(hidden_states)
        routed = routed + tap(SHARED, i, shared).reshape(-1, h)
    if hasattr(block.experts, "gate_up_proj_bias"):  # gpt-oss' MLP returns its router scores too
        return routed.reshape(b, s, h), weights
    return routed.reshape(b, s, h)


@contextlib.contextmanager
def moe_blocks(text, tap):
    """The capturing forward bound on every sparse-MoE block of ``text`` (a module with ``layers``) for a call."""
    bound = []
    for i, layer in enumerate(text.layers):
        if hasattr(layer.mlp, "experts"):
            layer.mlp.forward = lambda hidden_states, block=layer.mlp, i=i: _forward(block, i, tap, hidden_states)
            bound.append(layer.mlp)
    try:
        yield
    finally:
        for block in bound:
            del block.forward


class _MoECapture:
    """The MoE values for a reference whose text model is ``self._module(self.text_path)``."""

    text_path = "model"

    def eager_experts(self):
        """transformers' experts loop (``experts_implementation="eager"``), not its default grouped product."""
        self.model.set_experts_implementation("eager")

    def sites(self):
        shared = any(hasattr(layer.mlp, "shared_expert") or hasattr(layer.mlp, "shared_experts")
                     for layer in self._module(self.text_path).layers)
        return super().sites() + MOE_SITES + ((SHARED,) if shared else ())

    def _blocks(self, entry):
        if isinstance(entry, dict) and set(entry) == {DENSE}:
            layers = self._module(self.text_path).layers
            return [(i, entry[DENSE]) for i, layer in enumerate(layers) if not hasattr(layer.mlp, "experts")]
        return super()._blocks(entry)

    @contextlib.contextmanager
    def _hooks(self, tap):
        with super()._hooks(tap), moe_blocks(self._module(self.text_path), tap):
            yield

    def run(self, *args, **kwargs) -> dict[str, np.ndarray]:
        out = super().run(*args, **kwargs)
        if "layers.mlp.expert_indices" in out:
            out["layers.mlp.expert_indices"] = out["layers.mlp.expert_indices"].astype(np.int32)
        return out


class MoEReference(_MoECapture, TorchReference):
    """A transformers MoE causal LM (eager attention and experts) with every MoE value."""

    def __init__(self, folder, dtype=torch.float32, plan=PLAN):
        super().__init__(folder, dtype, plan)
        self.eager_experts()


class MoEQwenVLReference(_MoECapture, QwenVLReference):
    """A Qwen MoE wrapper (Qwen3-VL-MoE, Qwen3.5-MoE) with every MoE value; ``text_plan`` as ``QwenVLReference``'s
    (by default ``PLAN``)."""

    text_path = "model.language_model"

    def __init__(self, folder, dtype=torch.float32, text_plan=PLAN):
        super().__init__(folder, dtype, text_plan)
        self.eager_experts()
