"""Tiny configurations of the Llama-like text families Gemma, OLMo-2, Qwen3, Phi-3 and SmolLM3, and the torch
capture plans of those whose modules differ from Llama's (shared by the conformance cases and their own tests)."""

from transformers import AutoConfig

from reference.harness import LLAMA_PLAN

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
            bos_token_id=2)

CASES = {
    # Gemma 1: zero-centred norms, sqrt(hidden) embedding scale, GeGLU, tied head, head_dim not hidden / heads
    # (hidden 48: sqrt(48) rounds in bfloat16, to 6.9375, where sqrt(64) would not)
    "gemma-2b": dict(model_type="gemma", hidden_size=48, head_dim=24, num_key_value_heads=1,
                     hidden_act="gelu_pytorch_tanh"),
    # OLMo-2: post-norms only, whole-width q/k norms
    "olmo2-1b": dict(model_type="olmo2", rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    # Qwen3: per-head q/k norms, no biases, the ordinary rotary
    "qwen3-0.6b": dict(model_type="qwen3", head_dim=24, tie_word_embeddings=True),
    # use_sliding_window: the blocks from max_window_layers on attend the last 4 keys (of 11)
    "qwen3-sliding": dict(model_type="qwen3", head_dim=24, use_sliding_window=True, sliding_window=4,
                          max_window_layers=1),
    # Phi-3: fused qkv_proj / gate_up_proj; longrope in its short regime (every position below the original 16)
    "phi3-longrope": dict(model_type="phi3", num_key_value_heads=4, max_position_embeddings=64,
                          original_max_position_embeddings=16,
                          rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                               short_factor=[1.0 + 0.25 * j for j in range(8)],
                                               long_factor=[2.0 + 1.5 * j for j in range(8)])),
    # ... and past it (11 positions, original 8: the long factors), with a partial rotary and a sliding window
    "phi3-longrope_long": dict(model_type="phi3", num_key_value_heads=4, max_position_embeddings=64,
                               original_max_position_embeddings=8, sliding_window=5,
                               rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                    partial_rotary_factor=0.5,
                                                    short_factor=[1.0 + 0.25 * j for j in range(4)],
                                                    long_factor=[2.0 + 1.5 * j for j in range(4)])),
    # SmolLM3: every second block without rotary (NoPE): rope, nope, rope
    "smollm3-3b": dict(model_type="smollm3", no_rope_layer_interval=2),
    # use_sliding_window: the NoPE block attends the last 4 keys
    "smollm3-sliding": dict(model_type="smollm3", no_rope_layer_interval=2, use_sliding_window=True,
                            sliding_window=4),
}


def config(case: str):
    kw = {**BASE, **CASES[case]}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


# OLMo-2: no norm before either sublayer (the sublayers read the stream); the contributions are the post-norms'
# outputs, post_attention_layernorm being the norm after the attention
OLMO2_PLAN = {
    "token_embeddings": ("model.embed_tokens", "out"),
    "layers.layer_input": ("model.layers.{i}", "in"),
    "layers.layer_mid": ("model.layers.{i}.mlp", "in"),
    "layers.mlp_input": ("model.layers.{i}.mlp", "in"),
    "layers.layer_output": ("model.layers.{i}", "out"),
    "layers.self_attn.attention_premix": ("model.layers.{i}.self_attn.o_proj", "in"),
    "layers.self_attn.attention_output": ("model.layers.{i}.post_attention_layernorm", "out"),
    "layers.mlp.mlp_activation": ("model.layers.{i}.mlp.act_fn", "out"),
    "layers.mlp.mlp_neurons": ("model.layers.{i}.mlp.down_proj", "in"),
    "layers.mlp.mlp_output": ("model.layers.{i}.post_feedforward_layernorm", "out"),
    "final_norm_output": ("model.norm", "out"),
    "lm_head_output": ("lm_head", "out"),
}
# Phi-3: the MLP's activation module is activation_fn (on the gate half of gate_up_proj's output)
PHI3_PLAN = {**LLAMA_PLAN, "layers.mlp.mlp_activation": ("model.layers.{i}.mlp.activation_fn", "out")}
PLANS = {"olmo2": OLMO2_PLAN, "phi3": PHI3_PLAN}


def plan(case: str) -> dict:
    return PLANS.get(case.split("-")[0], LLAMA_PLAN)
