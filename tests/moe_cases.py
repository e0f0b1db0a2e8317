"""Tiny mixture-of-experts checkpoints: Qwen3-MoE, OLMoE, Mixtral (text), Qwen3-VL-MoE and Qwen3.5-MoE (wrappers).

Text sizes: 64 wide (4 heads of 16 over 2 key/value heads), 3 blocks, vocabulary 97, experts 32 wide, top-2.
``qwen3_moe``: 8 experts, block 1 a dense MLP (``mlp_only_layers``: its MLP 96 wide), no renormalisation;
``qwen3_moe-normed``: ``norm_topk_prob`` and ``decoder_sparse_step`` 2 (blocks 0 and 2 dense); ``olmoe``: 8 experts;
``mixtral``: 4 experts (the dense product, ``kernels.moe.DENSE_EXPERTS``), weights kept in float32; ``qwen2_moe``:
8 experts, a sigmoid-gated shared expert 48 wide, block 1 dense (96 wide), no renormalisation; ``phimoe``: 8 experts
routed by sparsemixer (the released ``router_jitter_noise`` 0.01), LayerNorms, biased attention and head, a window of
6; ``phimoe-jitter``: ``router_jitter_noise`` 0.3, so many choices share their softmax with near experts (a weight
then jumps at the threshold: in bfloat16 one flip moves a block's MLP output by 10%, so the bfloat16 check runs on
``phimoe``). The wrappers:
Qwen3-VL's and Qwen3.5's tiny towers (``qwen3_vl_cases``) with these text models: Qwen3-VL-MoE 3 blocks, 6
experts, DeepStack on blocks 0 and 1; Qwen3.5-MoE one period (three DeltaNet blocks, one attention block), 6
experts top-2 and a shared expert 24 wide.
"""

from __future__ import annotations

import copy

from transformers import (MixtralConfig, OlmoeConfig, PhimoeConfig, Qwen2MoeConfig, Qwen3_5MoeConfig, Qwen3MoeConfig,
                          Qwen3VLMoeConfig)

import qwen3_5_cases
import qwen3_vl_cases
import qwen_vl_cases

BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-6)

TEXT = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**BASE, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1]),
    "qwen3_moe-normed": lambda: Qwen3MoeConfig(**BASE, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                               decoder_sparse_step=2, tie_word_embeddings=True),
    "olmoe": lambda: OlmoeConfig(**BASE, intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                 pad_token_id=0, eos_token_id=1),
    "mixtral": lambda: MixtralConfig(**BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(**BASE, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                        num_experts_per_tok=2, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "phimoe": lambda: PhimoeConfig(**{**BASE, "rms_norm_eps": 1e-5}, intermediate_size=32, num_local_experts=8,
                                   num_experts_per_tok=2, attention_bias=True, lm_head_bias=True, sliding_window=6),
    "phimoe-jitter": lambda: PhimoeConfig(**{**BASE, "rms_norm_eps": 1e-5}, intermediate_size=32, num_local_experts=8,
                                          num_experts_per_tok=2, router_jitter_noise=0.3),
}


def qwen3_vl_moe_config() -> Qwen3VLMoeConfig:
    text = dict(qwen3_vl_cases.TEXT, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2)
    return Qwen3VLMoeConfig(text_config=dict(model_type="qwen3_vl_moe_text", **text,
                                             rope_parameters=dict(qwen3_vl_cases.ROPE)),
                            vision_config=dict(model_type="qwen3_vl_moe", **qwen3_vl_cases.VISION),
                            tie_word_embeddings=False, **qwen_vl_cases.TOKENS)


def qwen3_5_moe_config() -> Qwen3_5MoeConfig:
    text = qwen3_5_cases.config("released", num_hidden_layers=4, tie_word_embeddings=False).to_dict()
    text = {k: v for k, v in text.items() if k not in ("intermediate_size", "model_type", "transformers_version")}
    text.update(model_type="qwen3_5_moe_text", moe_intermediate_size=16, shared_expert_intermediate_size=24,
                num_experts=6, num_experts_per_tok=2)
    return Qwen3_5MoeConfig(text_config=copy.deepcopy(text),
                            vision_config=dict(model_type="qwen3_5_moe", **qwen3_vl_cases.QWEN3_5_VISION),
                            tie_word_embeddings=False, **qwen_vl_cases.TOKENS)


def make_qwen3_5_moe_checkpoint(config, folder, seed: int = 0):
    """``qwen_vl_cases.make_qwen_checkpoint`` with the zero-centred norms near zero and the mixers' outputs scaled
    as ``qwen3_5_cases.adjust`` does (its ``down_proj`` scaling is the shared expert's here)."""

    def adjust(model):
        text = model.model.language_model
        for name, p in text.named_parameters():
            zero_centred = any(n in "model." + name for n in qwen3_5_cases.ZERO_CENTRED)
            if name.endswith("weight") and p.ndim == 1 and zero_centred:
                p.sub_(1.0)
        for layer in text.layers:
            mixer = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj
            mixer.weight.mul_(0.3)
            layer.mlp.experts.down_proj.mul_(0.3)
            layer.mlp.shared_expert.down_proj.weight.mul_(0.3)

    return qwen_vl_cases.make_qwen_checkpoint(config, folder, seed, adjust=adjust)
