"""Qwen3.5 text forward speed against transformers, and compile time versus depth.

The model: an 8-block, 512-wide Qwen3.5 text model (the released layout: three
gated DeltaNet blocks then one gated-attention block, twice; attention 8 query
heads over 2 key/value heads of 64, a quarter-width interleaved multimodal
rotary; DeltaNet 4 key heads and 8 value heads, 64 wide each; intermediate
1408, vocab 8192), batch 4 x 256 tokens, float32 on the CPU; torch runs
transformers' ``Qwen3_5ForCausalLM`` (sdpa attention, its pure-torch chunked
delta rule: the path without flash-linear-attention) with random weights in the
same process. Prints a markdown table of ratios.

    python benchmarks/qwen3_5.py [--repeats 7]
"""

from __future__ import annotations

from common import repeats_parser, text_benchmark

SIZE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
            vocab_size=8192, max_position_embeddings=1024, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
            rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                 mrope_section=[3, 3, 2], mrope_interleaved=True))
STATES = ("layers.layer_output", "layers.linear_attn.state_output")


def qwen3_5_config(layers):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(num_hidden_layers=layers, **{**SIZE, "rope_parameters": dict(SIZE["rope_parameters"])})


def main():
    args = repeats_parser(no_compile="skip the compile-time rows").parse_args()
    from jstd.models.qwen3_5 import Qwen3_5Text

    text_benchmark(Qwen3_5Text, qwen3_5_config, "qwen3_5-8x512", SIZE["vocab_size"], STATES,
                   "every block's layer_output and DeltaNet state_output", args.repeats, interleaved=True,
                   no_compile=args.no_compile)


if __name__ == "__main__":
    main()
