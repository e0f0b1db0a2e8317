"""Tiny Llama configurations covering the family's variants (shared by the Llama tests)."""

from transformers import LlamaConfig

BASE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
)

CASES = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(),
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16)),
    "bias": dict(attention_bias=True, mlp_bias=True),
    "head_dim": dict(head_dim=24),
    "yarn_rope": dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                           original_max_position_embeddings=16)),
}


def config(case: str) -> LlamaConfig:
    return LlamaConfig(**{**BASE, **CASES[case]})
