"""Tiny DeepSeek-V2 / V3 checkpoints and their torch reference (multi-head latent attention, DeepSeek's routers).

Sizes: 64 wide, 4 heads, 3 blocks (block 0 dense: ``first_k_dense_replace`` 1, its MLP 96 wide), vocabulary 97,
``kv_lora_rank`` 32, ``qk_nope_head_dim`` 16, ``qk_rope_head_dim`` 8, ``v_head_dim`` 12 (not the keys' 24), 8
experts 32 wide, top-2, two shared experts (one MLP 64 wide), no EOS id (a generation never ends early, in
transformers' ``generate`` as in jstd's). ``deepseek_v2``: V2-Lite's form (no ``q_lora_rank``:
a full ``q_proj``; ``attention_bias``), ``group_limited_greedy`` over 4 groups of which 2, ``routed_scaling_factor``
1.5, YaRN with
``mscale`` 1 and ``mscale_all_dim`` 0.8 (so both the cos/sin factor and the softmax scale's ``mscale ** 2`` differ
from 1). ``deepseek_v3``: V3's form (``q_lora_rank`` 24, sigmoid routing with an ``e_score_correction_bias`` of
O(0.3), so the choice differs from the weights' order, over 4 groups of which 2, ``norm_topk_prob``, scaling 2.5,
``rope_interleave``).

``DeepseekReference`` is ``MoEReference`` with the latent values: ``q_latent`` / ``kv_latent`` at the outputs of
``q_a_layernorm`` / ``kv_a_layernorm`` (hooks), ``rope_keys`` at the key output of the family's rotary function
(bound, for a call, in place of ``apply_rotary_emb`` / ``apply_rotary_pos_emb[_interleave]``: it taps the rotated
shared key and hands the edited one on). The router's outputs are sorted by expert index (torch's
``topk(sorted=False)`` order is unspecified; jstd gives ascending expert order); that moves only the order of the
experts loop's rows (float32 rounding).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from reference.checkpoints import make_checkpoint
from reference.moe import PLAN, MoEReference

BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
            num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-6, eos_token_id=None)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
CASES = {
    "deepseek_v2": lambda: DeepseekV2Config(**BASE, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                            topk_group=2, routed_scaling_factor=1.5, attention_bias=True,
                                            rope_parameters=dict(YARN)),
    "deepseek_v3": lambda: DeepseekV3Config(**BASE, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                            routed_scaling_factor=2.5, rope_parameters=dict(YARN)),
}
LATENT = "layers.self_attn."
ROTARIES = ("apply_rotary_emb", "apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")


def make(config, folder, seed: int = 0):
    """``make_checkpoint`` with V3's score-correction bias (a zero buffer at init) of O(0.3)."""
    def adjust(model):
        g = torch.Generator().manual_seed(seed + 11)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(0.3 * torch.randn(gate.e_score_correction_bias.shape, generator=g))
    return make_checkpoint(config, folder, seed, adjust=adjust)


def sorted_routers(model) -> None:
    """Every router of a transformers DeepSeek model returning its choices in ascending expert order."""
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.forward = _sorted_router(layer.mlp.gate)


def _sorted_router(router):
    """``router.forward`` returning its choices in ascending expert order (weights permuted alike)."""
    original = router.forward

    def forward(hidden_states):
        logits, weights, indices = original(hidden_states)
        indices, order = torch.sort(indices, dim=-1)
        return logits, torch.gather(weights, -1, order), indices
    return forward


class DeepseekReference(MoEReference):
    """transformers' DeepSeek-V2 / V3 (eager attention and experts) with every value jstd serves."""

    def __init__(self, folder, dtype=torch.float32):
        super().__init__(folder, dtype, dict(PLAN))
        plan = dict(PLAN)
        plan[LATENT + "kv_latent"] = ("model.layers.{i}.self_attn.kv_a_layernorm", "out")
        if self.model.config.q_lora_rank is not None:
            plan[LATENT + "q_latent"] = ("model.layers.{i}.self_attn.q_a_layernorm", "out")
        self.plan = plan
        sorted_routers(self.model)

    def sites(self):
        return super().sites() + (LATENT + "rope_keys",)

    @contextlib.contextmanager
    def _hooks(self, tap):
        current = {}
        handles = [layer.self_attn.register_forward_pre_hook(lambda mod, args, i=i: current.update(layer=i))
                   for i, layer in enumerate(self.model.model.layers)]
        originals = {name: getattr(self.modeling, name) for name in ROTARIES if hasattr(self.modeling, name)}

        def bound(original):
            def rotary(q, k, *args, **kwargs):
                q, k = original(q, k, *args, **kwargs)
                shared = k[:, 0]
                edited = tap(LATENT + "rope_keys", current["layer"], shared)
                return q, (k if edited is shared else edited[:, None].to(k.dtype))
            return rotary

        for name, original in originals.items():
            setattr(self.modeling, name, bound(original))
        try:
            with super()._hooks(tap):
                yield
        finally:
            for name, original in originals.items():
                setattr(self.modeling, name, original)
            for h in handles:
                h.remove()


def decode_step_flops(model, cached: int, reads: tuple = (), batch: int = 1) -> float:
    """The FLOPs XLA counts (``cost_analysis``) in one compiled decoding step (``generate.cache.decode``, one token
    a row) of ``model`` over a cache of ``cached`` positions, reading ``reads``. Only compiled: ``model``'s arrays
    may be abstract (``family.skeleton``). XLA counts a loop's body once, so the blocks run unrolled as the
    decoding loop runs them (``cache.stepper``) where the arrays are concrete; abstract, a stack whose blocks repeat
    (a scan over more than one block) is undercounted."""
    import jax
    import jax.numpy as jnp

    from jstd.core.context import cache_layout
    from jstd.generate.cache import Cache, decode, stepper

    (_, (_, latent)), (_, (_, rope)) = cache_layout(model)
    blocks = len(model.layers_with("self_attn"))
    S = jax.ShapeDtypeStruct
    dtype = jax.tree.leaves(model.decoder)[0].dtype
    cache = Cache(S((blocks, batch, 1, cached, latent), dtype), S((blocks, batch, 1, cached, rope), dtype), None,
                  None, S((batch, cached), jnp.bool_), None)
    step = jax.jit(lambda m, c, token: decode(m, c, token, cached - 1, (), reads)[0].logits)
    return step.lower(stepper(model), cache, S((batch,), jnp.int32)).compile().cost_analysis()["flops"]
