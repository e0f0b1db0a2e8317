"""config.json of more released checkpoints (Qwen3 0.6B, Gemma 2B, OLMo-2 1B, Phi-3-mini 4k and 128k, SmolLM3 3B,
Llama-4-Scout's text_config), as the hub holds them (keys and spellings as stored, legacy ``rope_scaling`` /
``rope_theta`` included), cut to 2 blocks: ``tests/test_text_families.py`` reads them without weights,
``scripts/check_published_configs.py`` runs them with random weights against transformers.
(``published_configs.py`` holds the sliding-window families' ones.)

Written from the published files; Phi-3-mini-128k's 48 ``short_factor`` / ``long_factor`` values are of the
published form (rising from 1) but not the published digits.
"""

BLOCKS = 2

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": BLOCKS, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

GEMMA_2B = {
    "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
    "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_activation": None, "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 16384, "max_position_embeddings": 8192, "model_type": "gemma",
    "num_attention_heads": 8, "num_hidden_layers": BLOCKS, "num_key_value_heads": 1, "pad_token_id": 0,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "transformers_version": "4.38.0.dev0", "use_cache": True, "vocab_size": 256000,
}

OLMO2_1B = {
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 16,
    "num_hidden_layers": BLOCKS, "num_key_value_heads": 16, "pad_token_id": 100277, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.48.3", "use_cache": True, "vocab_size": 100352,
}

PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                 "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3",
    "num_attention_heads": 32, "num_hidden_layers": BLOCKS, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": True, "vocab_size": 32064,
}

PHI3_MINI_128K = {
    **PHI3_MINI_4K, "max_position_embeddings": 131072, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope",
                     "short_factor": [round(1.0 + 0.02 * j, 4) for j in range(48)],
                     "long_factor": [round(1.0 + 1.3 * j, 4) for j in range(48)]},
}

SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
    "eos_token_id": 128012, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 65536, "max_window_layers": 28, "mlp_bias": False,
    "model_type": "smollm3", "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 0],  # the published 36 entries are 1, 1, 1, 0 repeated: a rotary block and a NoPE one
    "num_attention_heads": 16, "num_hidden_layers": BLOCKS, "num_key_value_heads": 4, "pad_token_id": 128004,
    "pretraining_tp": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.54.0.dev0",
    "use_cache": False, "use_sliding_window": False, "vocab_size": 128256,
}

# Llama-4-Scout-17B-16E's text_config (tests/test_llama4.py wraps it in the image-text config.json); moe_layers and
# no_rope_layers cut to the 2 blocks; the hub's attn_temperature_tuning 4 spelled true (transformers 5.24's strict
# config refuses the int)
LLAMA4_SCOUT_TEXT = {
    "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0, "attn_scale": 0.1,
    "attn_temperature_tuning": True, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
    "floor_scale": 8192, "for_llm_compressor": False, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
    "intermediate_size_mlp": 16384, "max_position_embeddings": 262144, "model_type": "llama4_text",
    "moe_layers": [0, 1], "no_rope_layers": [1, 0], "num_attention_heads": 40, "num_experts_per_tok": 1,
    "num_hidden_layers": BLOCKS, "num_key_value_heads": 8, "num_local_experts": 16, "output_router_logits": False,
    "pad_token_id": 200018, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 202048,
}

PUBLISHED = {
    "Qwen/Qwen3-0.6B": QWEN3_0_6B, "google/gemma-2b": GEMMA_2B, "allenai/OLMo-2-0425-1B": OLMO2_1B,
    "microsoft/Phi-3-mini-4k-instruct": PHI3_MINI_4K, "microsoft/Phi-3-mini-128k-instruct": PHI3_MINI_128K,
    "HuggingFaceTB/SmolLM3-3B": SMOLLM3_3B, "meta-llama/Llama-4-Scout-17B-16E": LLAMA4_SCOUT_TEXT,
}
