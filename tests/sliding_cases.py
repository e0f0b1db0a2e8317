"""Tiny configurations of the families with sliding-window or soft-capped attention (Mistral, Qwen2, Gemma 2,
Gemma 3, OLMo-3) and the torch capture plans of those whose modules differ from Llama's. Windows of 4 keys on
sequences of 11 (``families.SEQ``), so every window is passed."""

from transformers import AutoConfig

from reference.harness import LLAMA_PLAN

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
GEMMA = dict(head_dim=24, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=20)

CASES = {
    # Mistral-7B-v0.1: every block sliding
    "mistral-window": dict(model_type="mistral", sliding_window=4),
    # Qwen2: q/k/v biases; use_sliding_window makes the blocks from max_window_layers on sliding (full, sliding, sliding)
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    # Gemma 2: post-norms, soft-capped scores (a cap the scores reach) and logits, sliding / full alternating
    "gemma2-softcap": dict(model_type="gemma2", **GEMMA, sliding_window=4, attn_logit_softcapping=1.5,
                           final_logit_softcapping=10.0),
    # Gemma 3: q/k norms, local blocks under their own rotary base, global blocks under a scaled one
    "gemma3_text-local": dict(model_type="gemma3_text", **GEMMA, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10.0),
                                               "full_attention": dict(rope_type="linear", factor=8.0,
                                                                      rope_theta=1000.0)},
                              final_logit_softcapping=10.0),
    # OLMo-3: OLMo-2's post-norm block, sliding blocks between full ones
    "olmo3-window": dict(model_type="olmo3", sliding_window=4, eos_token_id=2,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}


def config(case: str):
    kw = {**BASE, **CASES[case]}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


# Gemma 2 / 3: the MLP reads pre_feedforward_layernorm's output; the block adds the post-norms' outputs
GEMMA2_PLAN = {
    **LLAMA_PLAN,
    "layers.layer_mid": ("model.layers.{i}.pre_feedforward_layernorm", "in"),
    "layers.mlp_norm_output": ("model.layers.{i}.pre_feedforward_layernorm", "out"),
    "layers.self_attn.attention_output": ("model.layers.{i}.post_attention_layernorm", "out"),
    "layers.mlp.mlp_output": ("model.layers.{i}.post_feedforward_layernorm", "out"),
}


def plan(case: str) -> dict:
    family = case.split("-")[0]
    if family in ("gemma2", "gemma3_text"):
        return GEMMA2_PLAN
    if family == "olmo3":
        from text_cases import OLMO2_PLAN
        return OLMO2_PLAN
    return LLAMA_PLAN
