"""OLMo-Hybrid forward speed against transformers, and compile time versus depth.

The model: an 8-block, 512-wide OLMo-Hybrid (the released layout: three
DeltaNet blocks then one attention block, twice; 8 heads, DeltaNet keys 48 and
values 96 wide per head as the config derives them, intermediate 1408, vocab
8192, no rotary), batch 4 x 256 tokens, float32 on the CPU; torch runs
transformers' model (sdpa attention, its pure-torch chunked delta rule: the
path without flash-linear-attention) in the same process, runs interleaved.
Prints a markdown table of ratios.

    python benchmarks/olmo_hybrid.py [--repeats 7]
"""

from __future__ import annotations

from common import repeats_parser, text_benchmark

SIZE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=8, vocab_size=8192,
            max_position_embeddings=1024, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
            rope_parameters=dict(rope_type="default", rope_theta=None))
STATES = ("layers.layer_output", "layers.linear_attn.state_output")


def olmo_config(layers):
    from transformers import OlmoHybridConfig

    return OlmoHybridConfig(num_hidden_layers=layers, **{**SIZE, "rope_parameters": dict(SIZE["rope_parameters"])})


def main():
    args = repeats_parser().parse_args()
    from jstd.models.olmo_hybrid import OlmoHybrid

    text_benchmark(OlmoHybrid, olmo_config, "olmo-hybrid-8x512", SIZE["vocab_size"], STATES,
                   "every block's layer_output and DeltaNet state_output", args.repeats)


if __name__ == "__main__":
    main()
