"""Tiny GPT-2 and GPT-NeoX (Pythia) configurations, their checkpoints and torch capture plans (shared by the
conformance suite and tests/test_gpt2_neox.py)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPTNeoXConfig

from reference.checkpoints import make_checkpoint as make_random_checkpoint
from reference.harness import TorchReference

GPT2_BASE = dict(vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=96, eos_token_id=96)
GPT2_CASES = {
    "small": dict(),                                                       # GPT-2 small's shape, shrunk
    "untied": dict(n_inner=80, tie_word_embeddings=False, scale_attn_weights=False, activation_function="gelu"),
}
NEOX_BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                 max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
NEOX_CASES = {
    "parallel": dict(),                                                    # Pythia: parallel residual, rotary_pct 0.25
    "sequential": dict(use_parallel_residual=False, rotary_pct=0.5, attention_bias=False, tie_word_embeddings=True),
}


def gpt2_config(case: str) -> GPT2Config:
    return GPT2Config(**{**GPT2_BASE, **GPT2_CASES[case]})


def neox_config(case: str) -> GPTNeoXConfig:
    return GPTNeoXConfig(**{**NEOX_BASE, **NEOX_CASES[case]})


def make_checkpoint(config, folder, seed: int = 0):
    """``reference.checkpoints.make_checkpoint`` with every LayerNorm's gain near 1 (GPT-2's ``ln_*`` names do not
    say "norm", so the random init would give them bias-sized gains) and the learned positions as large as the
    token embeddings."""

    def adjust(model):
        g = torch.Generator().manual_seed(seed + 100)
        for name, p in model.named_parameters():
            if p.ndim == 1 and ".ln_" in "." + name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return make_random_checkpoint(config, folder, seed=seed, adjust=adjust)


GPT2_PLAN = {
    "token_embeddings": ("transformer.wte", "out"),
    "position_embeddings": ("transformer.wpe", "out"),
    "layers.layer_input": ("transformer.h.{i}", "in"),
    "layers.attention_norm_output": ("transformer.h.{i}.ln_1", "out"),
    "layers.layer_mid": ("transformer.h.{i}.ln_2", "in"),
    "layers.mlp_norm_output": ("transformer.h.{i}.ln_2", "out"),
    "layers.mlp_input": ("transformer.h.{i}.mlp", "in"),
    "layers.layer_output": ("transformer.h.{i}", "out"),
    "layers.self_attn.attention_premix": ("transformer.h.{i}.attn.c_proj", "in"),
    "layers.self_attn.attention_output": ("transformer.h.{i}.attn", "out0"),
    "layers.mlp.mlp_activation": ("transformer.h.{i}.mlp.act", "out"),
    "layers.mlp.mlp_neurons": ("transformer.h.{i}.mlp.c_proj", "in"),
    "layers.mlp.mlp_output": ("transformer.h.{i}.mlp", "out"),
    "final_norm_output": ("transformer.ln_f", "out"),
    "lm_head_output": ("lm_head", "out"),
}

NEOX_PLAN = {
    "token_embeddings": ("gpt_neox.embed_in", "out"),
    "layers.layer_input": ("gpt_neox.layers.{i}", "in"),
    "layers.attention_norm_output": ("gpt_neox.layers.{i}.input_layernorm", "out"),
    "layers.mlp_norm_output": ("gpt_neox.layers.{i}.post_attention_layernorm", "out"),
    "layers.mlp_input": ("gpt_neox.layers.{i}.mlp", "in"),
    "layers.layer_output": ("gpt_neox.layers.{i}", "out"),
    "layers.self_attn.attention_premix": ("gpt_neox.layers.{i}.attention.dense", "in"),
    "layers.self_attn.attention_output": ("gpt_neox.layers.{i}.attention", "out0"),
    "layers.mlp.mlp_activation": ("gpt_neox.layers.{i}.mlp.act", "out"),
    "layers.mlp.mlp_neurons": ("gpt_neox.layers.{i}.mlp.dense_4h_to_h", "in"),
    "layers.mlp.mlp_output": ("gpt_neox.layers.{i}.mlp", "out"),
    "final_norm_output": ("gpt_neox.final_layer_norm", "out"),
    "lm_head_output": ("lm_head", "out"),
}
# a sequential GPT-NeoX block has the stream between its adds: post_attention_layernorm's input
NEOX_SEQUENTIAL_PLAN = {**NEOX_PLAN, "layers.layer_mid": ("gpt_neox.layers.{i}.post_attention_layernorm", "in")}


class GPT2Reference(TorchReference):
    """GPT-2's torch reference (GPT-Neo's too, with its ``plan``): ``wpe`` runs on ``[1, seq]`` position ids, so
    ``position_embeddings`` is its output broadcast over the batch (and an edit there hands the model the
    batch-shaped value, which the add broadcasts the same way)."""

    def __init__(self, folder, dtype=torch.float32, plan=GPT2_PLAN):
        super().__init__(folder, dtype, plan)
        self._batch = 1

    def run(self, tokens, reads=(), edits=(), attention_mask=None):
        self._batch = len(tokens)
        return super().run(tokens, reads, edits, attention_mask)

    def _to_jstd(self, site, t):
        if site == "position_embeddings":
            return t.expand(self._batch, *t.shape[1:])
        return super()._to_jstd(site, t)

    def _from_jstd(self, site, t, like):
        return t if site == "position_embeddings" else super()._from_jstd(site, t, like)


def neox_reference(folder, dtype=torch.float32):
    model_parallel = GPTNeoXConfig.from_pretrained(folder).use_parallel_residual
    return TorchReference(folder, dtype, NEOX_PLAN if model_parallel else NEOX_SEQUENTIAL_PLAN)
