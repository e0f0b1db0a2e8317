"""Tiny GPT-Neo, GPT-J, Phi, OPT and BLOOM configurations, their checkpoints and torch references (shared by the
conformance suite and tests/test_classic.py).

Each family's torch attention is its own (GPT-Neo's ``_attn``, BLOOM's ``forward``) or its own
``eager_attention_forward`` with float32 scores (GPT-J): the references capture the attention interior through a
copy of that very computation, taps added, so a bf16 run keeps torch's roundings.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import BloomConfig, GPTJConfig, GPTNeoConfig, OPTConfig, PhiConfig

from gpt2_neox_cases import GPT2Reference, make_checkpoint
from reference.harness import TorchReference

__all__ = ["make_checkpoint"]

# ---- GPT-Neo ------------------------------------------------------------------------------------------------------

GPT_NEO_BASE = dict(vocab_size=97, hidden_size=64, num_layers=3, num_heads=4, max_position_embeddings=64,
                    attention_types=[[["global", "local"], 1], [["local"], 1]], window_size=4, bos_token_id=96,
                    eos_token_id=96)
GPT_NEO_CASES = {
    "tinystories": dict(),                              # global, local, local; a window of 4 within 11 tokens
    "untied": dict(tie_word_embeddings=False, intermediate_size=80, activation_function="gelu",
                   attention_types=[[["global"], 3]]),
}


def gpt_neo_config(case: str) -> GPTNeoConfig:
    return GPTNeoConfig(**{**GPT_NEO_BASE, **GPT_NEO_CASES[case]})


GPT_NEO_PLAN = {
    "token_embeddings": ("transformer.wte", "out"),
    "position_embeddings": ("transformer.wpe", "out"),
    "layers.layer_input": ("transformer.h.{i}", "in"),
    "layers.attention_norm_output": ("transformer.h.{i}.ln_1", "out"),
    "layers.layer_mid": ("transformer.h.{i}.ln_2", "in"),
    "layers.mlp_norm_output": ("transformer.h.{i}.ln_2", "out"),
    "layers.mlp_input": ("transformer.h.{i}.mlp", "in"),
    "layers.layer_output": ("transformer.h.{i}", "out0"),
    "layers.self_attn.attention_premix": ("transformer.h.{i}.attn.attention.out_proj", "in"),
    "layers.self_attn.attention_output": ("transformer.h.{i}.attn", "out0"),
    "layers.mlp.mlp_activation": ("transformer.h.{i}.mlp.act", "out"),
    "layers.mlp.mlp_neurons": ("transformer.h.{i}.mlp.c_proj", "in"),
    "layers.mlp.mlp_output": ("transformer.h.{i}.mlp", "out"),
    "final_norm_output": ("transformer.ln_f", "out"),
    "lm_head_output": ("lm_head", "out"),
}


def _interior(tap, i, query, key, value, scores_of, dtype_after):
    """The taps of the attention interior around a family's own score computation: queries, keys, values, scores
    (``scores_of(q, k)``, masked), probabilities (float32 softmax cast to ``dtype_after``), head outputs
    ``[batch, seq, heads, dim]``. Returns (head outputs, probabilities)."""
    site = "layers.self_attn."
    query = tap(site + "attention_queries", i, query)
    key = tap(site + "attention_keys", i, key)
    value = tap(site + "attention_values", i, value)
    scores = tap(site + "attention_scores", i, scores_of(query, key))
    probs = tap(site + "attention_probabilities", i, torch.softmax(scores, -1, dtype=torch.float32).to(dtype_after))
    out = tap(site + "attention_head_outputs", i, torch.matmul(probs, value).transpose(1, 2).contiguous())
    return out, probs


class GPTNeoReference(GPT2Reference):
    """GPT-Neo: GPT-2's learned positions, and ``GPTNeoSelfAttention._attn`` (unscaled float32 scores, the block's
    causal or local mask buffer, then the padding mask) with taps."""

    def __init__(self, folder, dtype=torch.float32):
        super().__init__(folder, dtype, GPT_NEO_PLAN)

    @contextlib.contextmanager
    def _attention(self, tap, modeling=None):
        cls = self.modeling.GPTNeoSelfAttention
        original = cls._attn

        def attn(module, query, key, value, attention_mask=None):
            def scores_of(q, k):
                s = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(-1, -2))
                ql, kl = q.size(-2), k.size(-2)
                causal = module.bias[:, :, kl - ql:kl, :kl]
                s = torch.where(causal, s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
                return s if attention_mask is None else s + attention_mask
            out, probs = _interior(tap, module.layer_id, query, key, value, scores_of, value.dtype)
            return out.transpose(1, 2), probs  # _attn returns [batch, heads, seq, dim]; forward merges the heads

        cls._attn = attn
        try:
            yield
        finally:
            cls._attn = original


class Float32ScoresReference(TorchReference):
    """A family whose ``eager_attention_forward`` casts queries and keys to float32 (GPT-J): the capture does too."""

    @contextlib.contextmanager
    def _attention(self, tap, modeling=None):
        modeling = self.modeling
        original = modeling.eager_attention_forward

        def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            def scores_of(q, k):
                s = torch.matmul(q.to(torch.float32), k.to(torch.float32).transpose(2, 3)) * scaling
                return s if attention_mask is None else s + attention_mask
            return _interior(tap, module.layer_idx, query, key, value, scores_of, value.dtype)

        modeling.eager_attention_forward = eager
        try:
            yield
        finally:
            modeling.eager_attention_forward = original


# ---- GPT-J --------------------------------------------------------------------------------------------------------

GPTJ_BASE = dict(vocab_size=97, n_embd=64, n_layer=3, n_head=4, n_positions=64, rotary_dim=8, bos_token_id=96,
                 eos_token_id=96)
GPTJ_CASES = {
    "6b": dict(),                                        # GPT-J-6B's shape, shrunk: rotary on 8 of 16 dims a head
    "tied": dict(rotary_dim=16, n_inner=80, tie_word_embeddings=True, activation_function="gelu"),
}


def gptj_config(case: str) -> GPTJConfig:
    return GPTJConfig(**{**GPTJ_BASE, **GPTJ_CASES[case]})


GPTJ_PLAN = {
    "token_embeddings": ("transformer.wte", "out"),
    "layers.layer_input": ("transformer.h.{i}", "in"),
    "layers.attention_norm_output": ("transformer.h.{i}.ln_1", "out"),
    "layers.mlp_input": ("transformer.h.{i}.mlp", "in"),
    "layers.layer_output": ("transformer.h.{i}", "out"),
    "layers.self_attn.attention_premix": ("transformer.h.{i}.attn.out_proj", "in"),
    "layers.self_attn.attention_output": ("transformer.h.{i}.attn", "out0"),
    "layers.mlp.mlp_activation": ("transformer.h.{i}.mlp.act", "out"),
    "layers.mlp.mlp_neurons": ("transformer.h.{i}.mlp.fc_out", "in"),
    "layers.mlp.mlp_output": ("transformer.h.{i}.mlp", "out"),
    "final_norm_output": ("transformer.ln_f", "out"),
    "lm_head_output": ("lm_head", "out"),
}


def gptj_reference(folder, dtype=torch.float32):
    return Float32ScoresReference(folder, dtype, GPTJ_PLAN)


# ---- Phi ----------------------------------------------------------------------------------------------------------

PHI_BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=64, partial_rotary_factor=0.5, bos_token_id=96, eos_token_id=96)
PHI_CASES = {
    "2": dict(),                                        # Phi-2's shape, shrunk: rotary on 8 of 16 dims a head
    "qk_layernorm": dict(qk_layernorm=True, num_key_value_heads=2, partial_rotary_factor=0.25,
                         tie_word_embeddings=True),
}


def phi_config(case: str) -> PhiConfig:
    return PhiConfig(**{**PHI_BASE, **PHI_CASES[case]})


PHI_PLAN = {
    "token_embeddings": ("model.embed_tokens", "out"),
    "layers.layer_input": ("model.layers.{i}", "in"),
    "layers.attention_norm_output": ("model.layers.{i}.input_layernorm", "out"),
    "layers.mlp_input": ("model.layers.{i}.mlp", "in"),
    "layers.layer_output": ("model.layers.{i}", "out"),
    "layers.self_attn.attention_premix": ("model.layers.{i}.self_attn.dense", "in"),
    "layers.self_attn.attention_output": ("model.layers.{i}.self_attn", "out0"),
    "layers.mlp.mlp_activation": ("model.layers.{i}.mlp.activation_fn", "out"),
    "layers.mlp.mlp_neurons": ("model.layers.{i}.mlp.fc2", "in"),
    "layers.mlp.mlp_output": ("model.layers.{i}.mlp", "out"),
    "final_norm_output": ("model.final_layernorm", "out"),
    "lm_head_output": ("lm_head", "out"),
}


def phi_reference(folder, dtype=torch.float32):
    return TorchReference(folder, dtype, PHI_PLAN)


# ---- OPT ----------------------------------------------------------------------------------------------------------

OPT_BASE = dict(vocab_size=97, hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=64, word_embed_proj_dim=64, bos_token_id=2, eos_token_id=2, pad_token_id=1)
OPT_CASES = {
    "125m": dict(),                                     # OPT-125M's shape, shrunk: pre-norm, tied, relu
    "projected": dict(word_embed_proj_dim=32, tie_word_embeddings=False, activation_function="gelu"),
    "350m": dict(do_layer_norm_before=False, word_embed_proj_dim=32),  # OPT-350M: post-norm, projected, tied
}


def opt_config(case: str) -> OPTConfig:
    return OPTConfig(**{**OPT_BASE, **OPT_CASES[case]})


OPT_PLAN = {
    "token_embeddings": ("model.decoder.embed_tokens", "out"),
    "position_embeddings": ("model.decoder.embed_positions", "out"),
    "layers.layer_input": ("model.decoder.layers.{i}", "in"),
    "layers.attention_norm_output": ("model.decoder.layers.{i}.self_attn_layer_norm", "out"),
    "layers.layer_mid": ("model.decoder.layers.{i}.final_layer_norm", "in"),
    "layers.mlp_norm_output": ("model.decoder.layers.{i}.final_layer_norm", "out"),
    "layers.mlp_input": ("model.decoder.layers.{i}.fc1", "in"),
    "layers.layer_output": ("model.decoder.layers.{i}", "out"),
    "layers.self_attn.attention_premix": ("model.decoder.layers.{i}.self_attn.out_proj", "in"),
    "layers.self_attn.attention_output": ("model.decoder.layers.{i}.self_attn", "out0"),
    "layers.mlp.mlp_activation": ("model.decoder.layers.{i}.activation_fn", "out"),
    "layers.mlp.mlp_neurons": ("model.decoder.layers.{i}.fc2", "in"),
    "layers.mlp.mlp_output": ("model.decoder.layers.{i}.fc2", "out"),
    "final_norm_output": ("model.decoder.final_layer_norm", "out"),
    "lm_head_output": ("lm_head", "out"),
}


# post-norm blocks (do_layer_norm_before=False): the stream the MLP reads is self_attn_layer_norm's output, and
# there is no pre-norm and no final norm
OPT_POST_NORM_PLAN = {
    **{k: v for k, v in OPT_PLAN.items() if k not in ("layers.attention_norm_output", "layers.mlp_norm_output",
                                                      "final_norm_output")},
    "layers.layer_mid": ("model.decoder.layers.{i}.self_attn_layer_norm", "out"),
}


class OPTReference(TorchReference):
    """OPT's reference: its queries leave ``q_proj`` already scaled by ``1/sqrt(head_dim)`` (and its eager attention
    scales by 1), so jstd's ``attention_queries`` (before the scale) are torch's divided by it, and an edit there
    comes back multiplied. The block's MLP half runs on ``[batch · seq, hidden]`` rows: captured values are reshaped
    to ``[batch, seq, …]``."""

    def __init__(self, folder, dtype=torch.float32):
        super().__init__(folder, dtype, OPT_PLAN)
        config = self.model.config
        self.plan = OPT_PLAN if config.do_layer_norm_before else OPT_POST_NORM_PLAN
        self.scaling = (config.hidden_size // config.num_attention_heads) ** -0.5

    def run(self, tokens, reads=(), edits=(), attention_mask=None):
        self._batch = len(tokens)
        return super().run(tokens, reads, edits, attention_mask)

    def _to_jstd(self, site, t):
        if t.ndim == 2 and site.startswith("layers."):  # the MLP half runs on [batch * seq, hidden] rows
            t = t.reshape(self._batch, -1, t.shape[-1])
        return t / self.scaling if site.endswith("attention_queries") else super()._to_jstd(site, t)

    def _from_jstd(self, site, t, like):
        return t * self.scaling if site.endswith("attention_queries") else super()._from_jstd(site, t, like)


# ---- BLOOM --------------------------------------------------------------------------------------------------------

BLOOM_BASE = dict(vocab_size=97, hidden_size=64, n_layer=3, n_head=4, bos_token_id=1, eos_token_id=2)
BLOOM_CASES = {
    "560m": dict(),                                     # BLOOM-560M's shape, shrunk: ALiBi over 4 heads
    "heads6": dict(n_head=6, hidden_size=96, tie_word_embeddings=False),   # 6 heads: the slopes of 4, then 2
}


def bloom_config(case: str) -> BloomConfig:
    return BloomConfig(**{**BLOOM_BASE, **BLOOM_CASES[case]})


BLOOM_PLAN = {
    "token_embeddings": ("transformer.word_embeddings", "out"),
    "layers.layer_input": ("transformer.h.{i}", "in"),
    "layers.attention_norm_output": ("transformer.h.{i}.input_layernorm", "out"),
    "layers.layer_mid": ("transformer.h.{i}.post_attention_layernorm", "in"),
    "layers.mlp_norm_output": ("transformer.h.{i}.post_attention_layernorm", "out"),
    "layers.mlp_input": ("transformer.h.{i}.mlp", "in"),
    "layers.layer_output": ("transformer.h.{i}", "out0"),
    "layers.self_attn.attention_premix": ("transformer.h.{i}.self_attention.dense", "in"),
    "layers.self_attn.attention_output": ("transformer.h.{i}.self_attention.dense", "out"),
    "layers.mlp.mlp_activation": ("transformer.h.{i}.mlp.gelu_impl", "out"),
    "layers.mlp.mlp_neurons": ("transformer.h.{i}.mlp.dense_4h_to_h", "in"),
    "layers.mlp.mlp_output": ("transformer.h.{i}.mlp.dense_4h_to_h", "out"),
    "final_norm_output": ("transformer.ln_f", "out"),
    "lm_head_output": ("lm_head", "out"),
}


class BloomReference(TorchReference):
    """BLOOM: ``BloomAttention.forward`` (ALiBi through ``baddbmm``, the padding mask, a float32 softmax) with taps."""

    def __init__(self, folder, dtype=torch.float32):
        super().__init__(folder, dtype, BLOOM_PLAN)

    @contextlib.contextmanager
    def _attention(self, tap, modeling=None):
        cls = self.modeling.BloomAttention
        original = cls.forward

        def forward(module, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                    output_attentions=False, **kwargs):
            batch, q_length, _ = hidden_states.shape
            query, key, value = module._reshape(module.query_key_value(hidden_states))
            if layer_past is not None:
                key, value = layer_past.update(key, value, module.layer_idx)

            def scores_of(q, k):
                q2 = q.reshape(batch * module.num_heads, -1, module.head_dim)
                k2 = k.reshape(batch * module.num_heads, -1, module.head_dim).transpose(-1, -2)
                s = alibi.baddbmm(batch1=q2, batch2=k2, beta=module.beta, alpha=module.inv_norm_factor)
                s = s.view(batch, module.num_heads, q_length, -1)
                return s if attention_mask is None else s + attention_mask
            out, probs = _interior(tap, module.layer_idx, query, key, value, scores_of, query.dtype)
            out = module.dense(out.reshape(batch, q_length, -1))
            return residual + out, probs

        cls.forward = forward
        try:
            yield
        finally:
            cls.forward = original
