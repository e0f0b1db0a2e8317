"""OLMo-Hybrid (``model_type`` olmo_hybrid): gated DeltaNet blocks and OLMo-3's post-norm attention blocks.

    # linear_attention blocks (DeltaNetBlock): pre-norm, as Llama
    h   = x + linear_attn(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))
    # full_attention blocks (PostNormBlock): no input norm, post-norms
    h   = x + post_attention_layernorm(self_attn(x))
    out = h + post_feedforward_layernorm(mlp(h))
    logits = lm_head(norm(out))

``config.layer_types`` gives each block's kind (on the released checkpoints
every fourth block is ``full_attention``). The model is a ``CausalLM`` whose
stack runs one repeating period of kinds per scan step (``jstd.nn.stack``),
so compile time does not grow with depth; a tail that is not a whole period
runs after the scan.

The values, in the standard vocabulary:

- ``layers.linear_attn.*`` on the DeltaNet blocks (``layers_with("linear_attn")``),
  ``layers.self_attn.*`` on the attention blocks, ``layers.mlp.*`` and the
  stream sites on every block. ``attention_norm_output`` and
  ``mlp_norm_output`` exist only on the DeltaNet blocks (the attention block
  has no input norms): ``blocks_for`` says so (it follows from the blocks'
  structure) and their stacks hold the DeltaNet blocks only.
- On an attention block ``attention_output`` / ``mlp_output`` are the
  post-norms' outputs (what the stream receives); on a DeltaNet block the
  mixer's / MLP's own outputs. ``layer_input + attention_output + mlp_output ==
  layer_output`` on both kinds.
- The attention's ``q_norm`` / ``k_norm`` cover the whole projection (every
  head) before the split into heads. Rotary applies only when transformers
  builds one: ``rope_parameters`` present with a non-null ``rope_theta``
  (Olmo-Hybrid-Think-SFT: ``rope_parameters`` null, which transformers fills
  with theta 10000); the released base checkpoints have none, so queries are
  q_norm's output split into heads.
- The DeltaNet's gated output norm ``o_norm`` has eps 1e-5 whatever
  ``rms_norm_eps`` says (transformers hard-codes FLA's default).
"""

from __future__ import annotations

from jstd.kernels.rope_config import rotary_from_config
from jstd.models.family import HybridTextFamily
from jstd.nn.deltanet import GatedDeltaNet
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.nn.mlp import GatedMLP
from jstd.nn.norms import RMSNorm

LINEAR, FULL = HybridTextFamily.LINEAR, HybridTextFamily.FULL
# transformers hard-codes the gated output norm's eps (FLA's FusedRMSNormGated default), ignoring rms_norm_eps
O_NORM_EPS = 1e-5


class OlmoHybrid(HybridTextFamily):
    family = "olmo_hybrid"
    model_types = ("olmo_hybrid",)
    # linear_a_log_* and linear_dt_* only initialize the DeltaNet's decay parameters
    handled = HybridTextFamily.handled | {
        "attention_bias", "linear_allow_neg_eigval", "linear_a_log_min", "linear_a_log_max", "linear_dt_min",
        "linear_dt_max", "linear_dt_init_floor"}

    @classmethod
    def rotary(cls, hf, c):
        """transformers' rule: a rotary embedding only with ``rope_parameters`` holding a non-null ``rope_theta``."""
        params = getattr(hf, "rope_parameters", None)
        return rotary_from_config(hf, c.head_dim) if params is not None and params.get("rope_theta") is not None else None

    @classmethod
    def extra(cls, hf) -> dict:
        return {"rotary_in_float32": True}  # OLMo's rotary module returns float32 cos/sin whatever the dtype

    @classmethod
    def norm(cls, hf, c, dtype) -> RMSNorm:
        return RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype, True)

    @classmethod
    def block(cls, hf, c, kind, dtype) -> Block:
        norm = lambda: cls.norm(hf, c, dtype)
        mlp = GatedMLP.skeleton(c.hidden_size, c.intermediate_size, hf.hidden_act, False, dtype)
        if kind == LINEAR:  # pre-norm, as Llama
            mixer = GatedDeltaNet.skeleton(
                c.hidden_size, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
                hf.linear_value_head_dim, hf.linear_conv_kernel_dim, hf.hidden_act, hf.linear_allow_neg_eigval,
                O_NORM_EPS, dtype)
            return Block(attention_norm=norm(), attn=mixer, attention_post_norm=None, mlp_norm=norm(), mlp=mlp,
                         mlp_post_norm=None)
        bias = bool(getattr(hf, "attention_bias", False))
        attention = Attention.skeleton(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim ** -0.5,
                                       bias, bias, dtype, qk_norm_eps=hf.rms_norm_eps)
        return Block(attention_norm=None, attn=attention, attention_post_norm=norm(),  # post-norms only
                     mlp_norm=None, mlp=mlp, mlp_post_norm=norm())

    @classmethod
    def names(cls, hf, kind) -> dict:
        # Names as stored (OLMo-core's, which transformers renames on load): attention_layer_norm is
        # input_layernorm; feedforward_layer_norm is post_attention_layernorm on both kinds: the MLP's input norm
        # on a DeltaNet block, the attention's output norm on an attention block.
        if kind == LINEAR:
            return {"attention_norm": "attention_layer_norm", "attn": "linear_attn",
                    "mlp_norm": "feedforward_layer_norm", "mlp": "mlp"}
        return {"attn": "self_attn", "attention_post_norm": "feedforward_layer_norm", "mlp": "mlp",
                "mlp_post_norm": "post_feedforward_layernorm"}

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # multi-token-prediction heads (transformers ignores them too)
        return ("mtp.*",) + super().ignored(hf)
