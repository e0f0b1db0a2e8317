"""GPT-J (``model_type`` gptj: GPT-J-6B, the model of ROME / MEMIT): parallel residual blocks with one LayerNorm, and
an interleaved rotary on the first ``rotary_dim`` dims of each head.

    a      = ln_1(x)
    out    = attn(a) + mlp(a) + x                            # one norm, both sublayers read it (Block.parallel)
    logits = ln_f(out) @ lm_head + lm_head.bias              # untied, with a bias

The quirks a port gets wrong silently:

* The rotary pairs **adjacent** dims (``rotate_every_two``: frequency ``i`` turns dims ``2i, 2i + 1``), not the two
  halves, and only the first ``rotary_dim`` dims of a head (64 of GPT-J-6B's 256); the rest pass through
  (``Attention.rotary_interleaved``; ``kernels.rope.apply_rotary``). The frequencies are the default rotary's with
  base 10000 over ``rotary_dim``: the sinusoid table GPT-J builds holds exactly ``Rotary.cos_sin``'s values.
* The block is parallel with a single norm: attention and MLP both read ``ln_1``'s output (``mlp_input`` is
  ``attention_norm_output``), ``layer_output = layer_input + attention_output + mlp_output``, and there is no
  ``layer_mid``.
* Queries and keys are cast to float32 before the scaled product (``Attention.float32_scores``; its
  ``eager_attention_forward``).
* The head has a bias (``CausalLM.lm_head_bias``), which ``lm_head_output`` includes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jstd.core.config import ModelConfig
from jstd.kernels.rope import Rotary
from jstd.kernels.rope_init import default_inv_freq
from jstd.models.family import TextFamily, tied
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.nn.mlp import MLP
from jstd.nn.norms import LayerNorm

GPTJ_NAMES = {"attention_norm": "ln_1", "attn": "attn", "mlp": "mlp", "out": "out_proj", "fc1": "fc_in",
              "fc2": "fc_out"}


class GPTJ(TextFamily):
    family = "gptj"
    model_types = ("gptj",)
    head_bias = True
    embed_name, final_norm_name, blocks_name = "transformer.wte", "transformer.ln_f", "transformer.h.{i}"
    block_names = GPTJ_NAMES
    handled = TextFamily.handled | {"n_embd", "n_layer", "n_head", "n_positions", "n_inner", "rotary_dim",
                                    "activation_function", "layer_norm_epsilon",
                                    # the hub config's flags for what GPT-J always does (rotary, scaled scores), and
                                    # a classification head's summary_* keys
                                    "rotary", "scale_attn_weights", "summary_type", "summary_use_proj",
                                    "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
                                    "gradient_checkpointing", "tokenizer_class"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        head_dim = hf.n_embd // hf.n_head
        return ModelConfig(
            model_type=hf.model_type, num_layers=hf.n_layer, hidden_size=hf.n_embd, num_heads=hf.n_head,
            num_kv_heads=hf.n_head, head_dim=head_dim, qk_head_dim=head_dim, vocab_size=hf.vocab_size,
            intermediate_size=hf.n_inner or 4 * hf.n_embd, layer_types=cls.layer_types(hf))

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> LayerNorm:
        return LayerNorm.skeleton(c.hidden_size, hf.layer_norm_epsilon, dtype)

    @classmethod
    def rotary(cls, hf, c: ModelConfig) -> Rotary:
        """The default rotary over ``rotary_dim`` with base 10000 (GPT-J's ``create_sinusoid_positions``)."""
        inv = default_inv_freq(10000.0, hf.rotary_dim)
        return Rotary("default", tuple(float(f) for f in np.asarray(inv, np.float32)), 1.0, hf.rotary_dim, c.head_dim)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        attn = Attention.skeleton(c.hidden_size, c.num_heads, c.num_heads, c.head_dim, c.head_dim ** -0.5, False,
                                  False, dtype)
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=dataclasses.replace(attn, rotary_interleaved=True, float32_scores=True),
            attention_post_norm=None,
            mlp_norm=None,
            mlp=MLP.skeleton(c.hidden_size, c.intermediate_size, hf.activation_function, dtype),
            mlp_post_norm=None,
            parallel=True,
        )

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # the causal-mask buffers and the sinusoid table older checkpoints saved; a tied head is the embedding itself
        return ("transformer.h.*.attn.bias", "transformer.h.*.attn.masked_bias", "transformer.h.*.attn.embed_positions",
                "transformer.rotary_emb.embed_positions") + (("lm_head.weight",) if tied(hf) else ())
