"""Tiny Llama 4 checkpoints and their torch reference (chunked attention, NoPE blocks with temperature tuning, the
L2 q/k norm, input-weighted top-k experts beside a shared expert, dense blocks between).

Sizes: 64 wide (4 heads of 16 over 2 key/value heads), 4 blocks, vocabulary 97, 4 experts 32 wide. The suite's
11 tokens cross chunks of 4 (``attention_chunk_size``) and the temperature's steps (``floor_scale`` 4,
``attn_scale`` 0.5: the NoPE queries grow by up to 1.5x along a row). ``no_rope_layers`` [1, 0, 1, 0]: blocks 0 and 2
rotary, chunked, L2-normed; 1 and 3 NoPE, global, temperature-tuned. ``llama4_text`` has experts on blocks 1 and 2
(``moe_layers``: each of the four block kinds once), top-1; ``llama4_text-top2`` has experts on every block
(``interleave_moe_layer_step`` 1, Scout's), top-2 (the experts' outputs summed), llama3 rope scaling and no
temperature tuning; ``llama4_text-noqk`` experts on every other block (Maverick's step 2), no q/k norm and a tied
head.

``Llama4Reference`` is ``TorchReference`` with the MoE values captured in transformers' own ``Llama4TextMoe``: its
router (an edited ``router_logits`` re-routes through the same router on the forced logits), the experts module on
the weighted inputs (each chosen expert's output at its token, ``expert_outputs``; unedited, the sum is the
module's own, bit for bit), the shared expert and the block's output.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import Llama4TextConfig

from reference.checkpoints import make_checkpoint
from reference.harness import LLAMA_PLAN, TorchReference
from reference.moe import DENSE, MOE_SITES, SHARED, forced_linear

BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=32, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1,
            max_position_embeddings=256, rms_norm_eps=1e-5, no_rope_layers=[1, 0, 1, 0], attention_chunk_size=4,
            attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
            moe_layers=[1, 2], rope_parameters=dict(rope_type="default", rope_theta=500000.0))
CASES = {
    "": {},
    "top2": dict(moe_layers=None, interleave_moe_layer_step=1, num_experts_per_tok=2, attn_temperature_tuning=False,
                 rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8)),
    "noqk": dict(moe_layers=None, interleave_moe_layer_step=2, use_qk_norm=False, tie_word_embeddings=True),
}
FF = "model.layers.{i}.feed_forward"
PLAN = {**{k: v for k, v in LLAMA_PLAN.items() if not k.startswith("layers.mlp.") and k != "layers.mlp_input"},
        "layers.mlp_input": (FF, "in"),
        "layers.mlp.mlp_activation": {DENSE: (FF + ".activation_fn", "out")},
        "layers.mlp.mlp_neurons": {DENSE: (FF + ".down_proj", "in")},
        "layers.mlp.mlp_output": {DENSE: (FF, "out")}}


def config(case: str = "") -> Llama4TextConfig:
    return Llama4TextConfig(**{**BASE, **CASES[case]})


def make(config, folder, seed: int = 0):
    return make_checkpoint(config, folder, seed)


def _forward(block, i: int, tap, hidden_states: torch.Tensor):
    """``Llama4TextMoe.forward`` with its values tapped (see the module docstring)."""
    b, s, h = hidden_states.shape
    x = hidden_states.reshape(-1, h)
    scores, logits = block.router(x)
    view = logits.reshape(b, s, -1)
    edited = tap("layers.mlp.router_logits", i, view)
    if edited is not view:
        with forced_linear(edited.reshape(-1, edited.shape[-1]).to(logits.dtype)):
            scores, logits = block.router(x)
    _, indices = torch.topk(logits, block.top_k, dim=1)  # the router's own choice
    tap("layers.mlp.router_weights", i, scores.gather(1, indices).reshape(b, s, -1))  # read-only in jstd
    tap("layers.mlp.expert_indices", i, indices.reshape(b, s, -1))
    routed_in = x.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)
    routed_out = block.experts(routed_in).reshape(scores.shape[1], -1, h)  # [experts, tokens, hidden]
    outputs = routed_out[indices, torch.arange(x.shape[0])[:, None]]  # [tokens, top_k, hidden]
    view = outputs.reshape(b, s, -1, h)
    new = tap("layers.mlp.expert_outputs", i, view)
    routed = routed_out.sum(dim=0) if new is view else new.reshape(-1, block.top_k, h).sum(dim=1)
    out = tap(SHARED, i, block.shared_expert(x).reshape(b, s, h)).reshape(-1, h)
    out = out + routed
    return tap("layers.mlp.mlp_output", i, out.reshape(b, s, h)), logits


class Llama4Reference(TorchReference):
    """transformers' Llama 4 text model (eager attention) with every value jstd serves."""

    def __init__(self, folder, dtype=torch.float32, plan=PLAN):
        super().__init__(folder, dtype, plan)

    def sites(self):
        return super().sites() + MOE_SITES + (SHARED,)

    def _blocks(self, entry):
        if isinstance(entry, dict) and set(entry) == {DENSE}:
            return [(i, entry[DENSE]) for i, layer in enumerate(self.model.model.layers)
                    if not hasattr(layer.feed_forward, "experts")]
        return super()._blocks(entry)

    @contextlib.contextmanager
    def _hooks(self, tap):
        bound = []
        for i, layer in enumerate(self.model.model.layers):
            if hasattr(layer.feed_forward, "experts"):
                layer.feed_forward.forward = lambda hidden_states, m=layer.feed_forward, i=i: _forward(
                    m, i, tap, hidden_states)
                bound.append(layer.feed_forward)
        try:
            with super()._hooks(tap):
                yield
        finally:
            for m in bound:
                del m.forward

    def run(self, *args, **kwargs):
        out = super().run(*args, **kwargs)
        if "layers.mlp.expert_indices" in out:
            out["layers.mlp.expert_indices"] = out["layers.mlp.expert_indices"].astype("int32")
        return out
