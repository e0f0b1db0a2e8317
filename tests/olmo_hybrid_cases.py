"""Tiny OLMo-Hybrid configurations and the torch capture plan (shared by the OLMo-Hybrid tests and benchmark)."""

import copy
from pathlib import Path

from transformers import OlmoHybridConfig

from reference.checkpoints import make_checkpoint as make_random_checkpoint

LINEAR, FULL = "linear_attention", "full_attention"
NO_ROTARY = dict(rope_type="default", rope_theta=None)  # the released base checkpoints: no rotary embedding

BASE = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
    rms_norm_eps=1e-6, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
)

CASES = {
    # the released layout: three DeltaNet blocks then one attention block, no rotary, betas in (0, 2)
    "released": dict(num_hidden_layers=8, rope_parameters=NO_ROTARY, linear_allow_neg_eigval=True),
    # Think-SFT's rotary (rope_parameters null: transformers fills theta 10000), grouped value heads,
    # grouped-query attention, betas in (0, 1), a period of two
    "rotary_grouped": dict(num_hidden_layers=4, rope_parameters=None, linear_allow_neg_eigval=False,
                           num_key_value_heads=2, linear_num_value_heads=4,
                           layer_types=[LINEAR, FULL, LINEAR, FULL]),
    # not a whole number of periods: LLLA LL (a tail of two DeltaNet blocks), wider
    "tail": dict(num_hidden_layers=6, hidden_size=64, rope_parameters=NO_ROTARY, linear_allow_neg_eigval=True,
                 layer_types=[LINEAR, LINEAR, LINEAR, FULL, LINEAR, LINEAR]),
}


# the tail layout at its smallest, for the tests that compile many programs (each DeltaNet block compiles its kernel):
# LA L, one whole period scanned and a tail of one DeltaNet block
SHORT_TAIL = dict(num_hidden_layers=3, layer_types=[LINEAR, FULL, LINEAR])


def config(case: str, **overrides) -> OlmoHybridConfig:
    return OlmoHybridConfig(**copy.deepcopy({**BASE, **CASES[case], **overrides}))


def make_checkpoint(config, folder, seed: int = 0, branch_scale: float = 0.5) -> Path:
    """A random OLMo-Hybrid checkpoint (``reference.checkpoints.make_checkpoint``) whose blocks add
    ``branch_scale`` times what they would: every block's contributions are halved (o_proj and down_proj on the
    DeltaNet blocks, the post-norms on the attention blocks), as in a depth-scaled init. Returns the folder.

    Why: with O(1) contributions, eight random blocks amplify float32 rounding (transformers' own, against a
    float64 run, as much as jstd's) past 1e-5 relative, chiefly through the DeltaNet's gated o_norm, which
    rescales each head's output by 1/rms and so magnifies the rounding of heads whose output nearly cancels.
    """

    def scale_branches(model):
        for layer in model.model.layers:
            if hasattr(layer, "self_attn"):
                branches = [layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight]
            else:
                branches = [layer.linear_attn.o_proj.weight, layer.mlp.down_proj.weight]
            for w in branches:
                w.mul_(branch_scale)

    return make_random_checkpoint(config, folder, seed=seed, adjust=scale_branches)


# site -> entry, or {layer type: entry}: the two block classes hold the values at different modules
PLAN = {
    "token_embeddings": ("model.embed_tokens", "out"),
    "layers.layer_input": ("model.layers.{i}", "in"),
    "layers.attention_norm_output": {LINEAR: ("model.layers.{i}.input_layernorm", "out")},
    "layers.layer_mid": {LINEAR: ("model.layers.{i}.post_attention_layernorm", "in"),
                         FULL: ("model.layers.{i}.mlp", "in")},
    "layers.mlp_norm_output": {LINEAR: ("model.layers.{i}.post_attention_layernorm", "out")},
    "layers.mlp_input": ("model.layers.{i}.mlp", "in"),
    "layers.layer_output": ("model.layers.{i}", "out"),
    "layers.linear_attn.attention_output": {LINEAR: ("model.layers.{i}.linear_attn", "out")},
    "layers.self_attn.attention_premix": {FULL: ("model.layers.{i}.self_attn.o_proj", "in")},
    # the attention block's contributions are its post-norms' outputs
    "layers.self_attn.attention_output": {FULL: ("model.layers.{i}.post_attention_layernorm", "out")},
    "layers.mlp.mlp_activation": ("model.layers.{i}.mlp.act_fn", "out"),
    "layers.mlp.mlp_neurons": ("model.layers.{i}.mlp.down_proj", "in"),
    "layers.mlp.mlp_output": {LINEAR: ("model.layers.{i}.mlp", "out"),
                              FULL: ("model.layers.{i}.post_feedforward_layernorm", "out")},
    "final_norm_output": ("model.norm", "out"),
    "lm_head_output": ("lm_head", "out"),
}
