"""GPT-NeoX and Pythia (``model_type`` gpt_neox): parallel residual blocks, partial rotary, a fused per-head q|k|v.

    a      = attention(input_layernorm(x))
    m      = mlp(post_attention_layernorm(x))               # use_parallel_residual: the MLP reads x too
    out    = m + a + x                                       # else: h = x + a; out = h + mlp(post_attention_layernorm(h))
    logits = final_layer_norm(out) @ embed_out               # untied (lm_head in transformers 5's memory)

``query_key_value`` is a Linear whose output is interleaved per head: for
head ``h`` rows ``h·3d … h·3d + 3d`` hold its query, key and value (``d`` each),
so the name map splits it by head, not in thirds. The rotary turns the first
``rotary_pct · head_dim`` dims of each head (``partial_rotary_factor``), the
rest pass through. The MLP is ``dense_4h_to_h(gelu(dense_h_to_4h(a)))``.

With ``use_parallel_residual`` the block identity is
``layer_input + attention_output + mlp_output == layer_output`` and there is
no ``layer_mid`` (``Block.parallel``; the error says why). The hub's
checkpoints store the head as ``embed_out``; transformers 5 renames it
``lm_head`` on load and saves it so; both spellings load.
"""

from __future__ import annotations

from jstd.core.config import ModelConfig
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.models.family import TextFamily
from jstd.nn.mlp import MLP
from jstd.nn.namemap import Entry, present, split_in
from jstd.nn.norms import LayerNorm

NEOX_NAMES = {"attention_norm": "input_layernorm", "attn": "attention", "mlp_norm": "post_attention_layernorm",
              "mlp": "mlp", "fc1": "dense_h_to_4h", "fc2": "dense_4h_to_h"}


def per_head(part: int, heads: int):
    """Linear ``query_key_value`` ``[heads * 3 * dim, in]`` (per head: q, k, v) -> part ``part`` as
    ``[in, heads, dim]``; on its bias ``[heads * 3 * dim]`` -> ``[heads, dim]``."""
    def take(w):
        if w.ndim == 1:
            return w.reshape(heads, 3, -1)[:, part]
        return w.reshape(heads, 3, -1, w.shape[-1])[:, part].transpose(2, 0, 1)
    return take


class FusedQKVAttention(Attention):
    """``Attention`` whose checkpoint holds GPT-NeoX's ``query_key_value`` (interleaved per head) and ``dense``."""

    def entries(self, names=None) -> list[Entry]:
        H = self.q.shape[-2]
        return present(self, [
            *(Entry("query_key_value.weight", p, per_head(i, H)) for i, p in enumerate(("q", "k", "v"))),
            *(Entry("query_key_value.bias", p, per_head(i, H)) for i, p in enumerate(("q_bias", "k_bias", "v_bias"))),
            Entry("dense.weight", "o", split_in(H)), Entry("dense.bias", "o_bias"),
        ])


class GPTNeoX(TextFamily):
    family = "gpt_neox"
    model_types = ("gpt_neox",)
    embed_name, final_norm_name, blocks_name = "gpt_neox.embed_in", "gpt_neox.final_layer_norm", "gpt_neox.layers.{i}"
    block_names = NEOX_NAMES
    # rotary_pct / rotary_emb_base: the hub configs' spellings, which transformers folds into rope_parameters;
    # classifier_dropout: a sequence-classification head's
    handled = TextFamily.handled | {"use_parallel_residual", "layer_norm_eps", "attention_bias", "rotary_pct",
                                    "rotary_emb_base", "is_decoder"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        if getattr(hf, "is_decoder", False):
            raise ValueError("gpt_neox: is_decoder=True (cross-attention to an encoder) is not supported; jstd runs "
                             "the causal LM (GPTNeoXForCausalLM)")
        return super().standard_config(hf)

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> LayerNorm:
        return LayerNorm.skeleton(c.hidden_size, hf.layer_norm_eps, dtype)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        bias = bool(hf.attention_bias)
        return Block(
            attention_norm=cls.norm(hf, c, dtype),
            attn=FusedQKVAttention.skeleton(c.hidden_size, c.num_heads, c.num_heads, c.head_dim, c.head_dim ** -0.5,
                                            bias, bias, dtype),
            attention_post_norm=None,
            mlp_norm=cls.norm(hf, c, dtype),
            mlp=MLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, dtype),
            mlp_post_norm=None,
            parallel=bool(hf.use_parallel_residual),
        )

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        return {"lm_head.": ("embed_out.", "lm_head.")}

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # the causal-mask buffers and rotary frequencies older checkpoints saved
        return super().ignored(hf) + ("gpt_neox.layers.*.attention.bias", "gpt_neox.layers.*.attention.masked_bias")
