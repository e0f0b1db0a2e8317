"""The config.json of published checkpoints (Gemma 2 2B, Gemma 3 1B, Mistral 7B v0.1, Qwen2.5 0.5B, OLMo-3 7B, Gemma 3
4B's image-text model) as the hub holds them, cut to 2 (text) blocks: ``jstd.load`` must read every key (no
ConfigWarning) and match transformers (``benchmarks/published_configs.py`` builds each at its published size with
random weights; ``tiny`` cuts a wrapper's sizes for the suite, keeping every key)."""

OLMO3_KINDS = ["sliding_attention"] * 3 + ["full_attention"]

CONFIGS = {
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
        "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
    },
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
    },
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
    },
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    "OLMo-3-7B": {
        "architectures": ["Olmo3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 11008, "layer_types": OLMO3_KINDS * 8, "max_position_embeddings": 65536,
        "model_type": "olmo3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "pad_token_id": 100277, "rms_norm_eps": 1e-06,
        "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1, "factor": 8.0,
                         "original_max_position_embeddings": 8192, "rope_type": "yarn"},
        "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0", "use_cache": True, "vocab_size": 100278,
    },
    "gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
        "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False},
    },
}
# a wrapper's sizes cut for the suite (its other keys kept): 4 × 4 patches of 14 pooled 2 × 2, 2 tower blocks
TINY = {"text_config": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2),
        "vision_config": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2,
                              image_size=56),
        "mm_tokens_per_image": 4}


def tiny(name: str) -> dict:
    """The published wrapper config ``name`` with the sizes in ``TINY`` (every key it holds kept)."""
    config = dict(CONFIGS[name])
    for key, value in TINY.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    return config


def two_blocks(name: str, blocks: int = 2) -> dict:
    """The published config cut to ``blocks`` blocks (OLMo-3's layer_types: one sliding block, then a full one)."""
    if "text_config" in CONFIGS[name]:  # a wrapper: its text model's blocks
        return dict(CONFIGS[name], text_config=dict(CONFIGS[name]["text_config"], num_hidden_layers=blocks))
    config = dict(CONFIGS[name], num_hidden_layers=blocks)
    if "layer_types" in config:
        config["layer_types"] = OLMO3_KINDS[-blocks:]
    if "max_window_layers" in config:
        config["max_window_layers"] = blocks
    return config
