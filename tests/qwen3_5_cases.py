"""Tiny Qwen3.5 text configurations and the torch capture plan (shared by the Qwen3.5 tests, conformance and
benchmark)."""

import contextlib
import copy
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3_5TextConfig

from reference.checkpoints import make_checkpoint as make_random_checkpoint
from reference.harness import LLAMA_PLAN, TorchReference

LINEAR, FULL = "linear_attention", "full_attention"

BASE = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
    rms_norm_eps=1e-6, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
)

CASES = {
    # the released layout (LLLA LLLA): grouped value heads, grouped-query attention, a partial rotary with
    # interleaved multimodal sections (head_dim 32 · 0.5: 8 frequencies, 3 + 3 + 2)
    "released": dict(num_hidden_layers=8, head_dim=32,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                          mrope_section=[3, 3, 2], mrope_interleaved=True)),
    # not a whole number of periods (LLLA LL), a tied head, biased attention projections, equal key and value
    # heads, the default quarter rotary without multimodal sections
    "tail": dict(num_hidden_layers=6, hidden_size=48, tie_word_embeddings=True, attention_bias=True,
                 linear_num_value_heads=2, layer_types=[LINEAR, LINEAR, LINEAR, FULL, LINEAR, LINEAR]),
}


def config(case: str, **overrides) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**copy.deepcopy({**BASE, **CASES[case], **overrides}))


ZERO_CENTRED = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "model.norm")


def make_checkpoint(config, folder, seed: int = 0, branch_scale: float = 0.3) -> Path:
    """A random Qwen3.5 checkpoint (``reference.checkpoints.make_checkpoint``) with the zero-centred norms'
    weights near 0 (so they multiply by about 1, as trained ones do, not 2) and every block's contributions times
    ``branch_scale`` (``out_proj`` / ``o_proj`` and ``down_proj``), as in a depth-scaled init: O(1) contributions
    over eight random blocks amplify rounding (transformers' own: float32 against float64 past 1e-5 relative,
    bfloat16 against float32 past the conformance suite's 5e-2: at 0.5, torch's own bfloat16 logits were 3-5%
    off its float32 ones).
    Returns the folder."""

    return make_random_checkpoint(config, folder, seed=seed, adjust=lambda model: adjust(model.model, branch_scale))


def adjust(text, branch_scale: float = 0.3) -> None:
    """``make_checkpoint``'s changes, in place, on ``text``: the text model (``embed_tokens``, ``layers``,
    ``norm``; a wrapper's ``model.language_model``)."""
    for name, p in text.named_parameters():
        if name.endswith("weight") and p.ndim == 1 and any(n in "model." + name for n in ZERO_CENTRED):
            p.sub_(1.0)
    for layer in text.layers:
        mixer = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj
        for w in (mixer.weight, layer.mlp.down_proj.weight):
            w.mul_(branch_scale)


# site -> entry, or {layer type: entry}: the mixers are different modules on the two kinds
PLAN = {
    **{k: v for k, v in LLAMA_PLAN.items() if not k.startswith("layers.self_attn.")},
    "layers.self_attn.attention_premix": {FULL: ("model.layers.{i}.self_attn.o_proj", "in")},
    "layers.self_attn.attention_output": {FULL: ("model.layers.{i}.self_attn", "out0")},
    "layers.linear_attn.attention_output": {LINEAR: ("model.layers.{i}.linear_attn", "out")},
}


class Qwen3_5Reference(TorchReference):
    """``TorchReference`` with ``PLAN`` that also captures ``positions`` when the rotary is multimodal (the config
    has ``mrope_section``): the three position streams the text model's ``rotary_emb`` receives, [3, batch, seq]."""

    def __init__(self, folder, dtype=torch.float32):
        super().__init__(folder, dtype, PLAN)
        self.mrope = "mrope_section" in (self.model.config.rope_parameters or {})

    def sites(self):
        return super().sites() + (("positions",) if self.mrope else ())

    @contextlib.contextmanager
    def _hooks(self, tap):
        def pre(module, args):
            tap("positions", None, args[1])  # read-only: recorded, never edited

        handle = self.model.model.rotary_emb.register_forward_pre_hook(pre) if self.mrope else None
        try:
            with super()._hooks(tap):
                yield
        finally:
            if handle is not None:
                handle.remove()

    def run(self, tokens, reads=(), edits=(), attention_mask=None) -> dict[str, np.ndarray]:
        out = super().run(tokens, reads, edits, attention_mask)
        if "positions" in out:
            out["positions"] = out["positions"].astype(np.int64)
        return out
