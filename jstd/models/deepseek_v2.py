"""DeepSeek-V2 and DeepSeek-V3 (``model_type`` deepseek_v2: DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2;
deepseek_v3: DeepSeek-V3, R1 and the models built on them): Llama's block with multi-head latent attention and a
DeepSeek mixture of experts after the first ``first_k_dense_replace`` dense blocks.

    a   = input_layernorm(x)
    h   = x + latent_attention(a)                       # jstd.nn.latent_attention: q_latent, kv_latent, rope_keys
    y   = post_attention_layernorm(h)
    l   = y @ gate  (float32)                           # router_logits
    V2: s = softmax(l); e = top_k(s) within the best topk_group of n_group groups (topk_method
        group_limited_greedy; greedy: no groups); w = s[e] · routed_scaling_factor
    V3: s = sigmoid(l); e = top_k(s + e_score_correction_bias) within the best groups (a group's score: its two
        best); w = s[e] (/ Σ w where norm_topk_prob) · routed_scaling_factor
    out = h + Σ_k w_k · expert_e(y) + shared_experts(y)  # shared experts: one MLP moe_intermediate_size ·
                                                          # n_shared_experts wide, no gate
    dense blocks (i < first_k_dense_replace): out = h + mlp(y), intermediate_size wide

The attention: ``q_lora_rank`` (None on V2-Lite: a full ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim`` (``model.config.head_dim`` is ``v_head_dim``, ``qk_head_dim`` the queries' and
keys' ``nope + rope``), the softmax scale ``qk_head_dim ** -0.5`` times ``mscale(factor, mscale_all_dim) ** 2``
under YaRN. V2's rotary multiplies adjacent pairs as complex numbers in float32 (output interleaved); V3's turns the
same pairs in the model dtype and lays the result out as halves (``rope_interleave``; without it Llama's rotary).
Every key and value head is its own (``num_key_value_heads`` must equal ``num_attention_heads``, as transformers'
MLA needs). The router's weight and V3's bias stay float32 in a bfloat16 model (transformers keeps them so), so
``router_logits`` are float32; ``expert_indices`` come in ascending expert order (torch's ``topk(sorted=False)``
leaves the order unspecified). V2 ignores ``norm_topk_prob`` and ``scoring_func`` (transformers does: softmax,
never renormalised). ``generate`` caches each block's ``kv_latent`` and ``rope_keys`` (``kv_lora_rank +
qk_rope_head_dim`` numbers a position: 576 on V2-Lite and V3, against ``heads · (qk_head_dim + v_head_dim)`` for
per-head keys and values: 5120 on V2-Lite, 40960 on V3). DeepSeek-V3's multi-token-prediction layers
(``model.layers.{num_hidden_layers}.*``) are ignored, as transformers ignores them; its hub checkpoints are FP8
(``quantization_config``): refused, with the fix.
"""

from __future__ import annotations

import math

import numpy as np

from jstd.core.config import ModelConfig
from jstd.kernels.rope import Rotary
from jstd.kernels.rope_config import rotary_from_config
from jstd.models.family import TextFamily, refuse_quantized
from jstd.models.qwen3_moe import DENSE
from jstd.nn.block import LLAMA_NAMES, Block
from jstd.nn.latent_attention import LatentAttention
from jstd.nn.mlp import GatedMLP
from jstd.nn.moe import MoEMLP, with_experts

FULL = "full_attention"
NAMES = {**LLAMA_NAMES, "shared": "shared_experts"}
TOPK_METHODS = ("greedy", "group_limited_greedy")
KEYS = frozenset({"attention_bias", "attention_dropout", "mlp_bias", "pretraining_tp", "first_k_dense_replace",
                  "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
                  "n_group", "topk_group", "n_routed_experts", "num_experts", "num_local_experts", "n_shared_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor", "norm_topk_prob",
                  "topk_method", "scoring_func", "output_router_logits", "aux_loss_alpha", "seq_aux", "ep_size",
                  "moe_layer_freq", "router_aux_loss_coef"})


def yarn_mscale(scale: float, mscale: float) -> float:
    """transformers' ``yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class DeepseekV2(TextFamily):
    family = "deepseek_v2"
    model_types = ("deepseek_v2",)
    handled = TextFamily.handled | KEYS

    @classmethod
    def rotary_layout(cls, hf) -> str:
        """``LatentAttention.rotary``: V2 multiplies complex pairs in float32."""
        return "complex"

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        refuse_quantized(hf, cls.family, "FP8 weights with per-block scales",
                         "use a bfloat16 copy (DeepSeek's fp8_cast_bf16.py, or a published BF16 conversion), without "
                         "the quantization_config")
        if (hf.num_key_value_heads or hf.num_attention_heads) != hf.num_attention_heads:
            raise ValueError(f"{cls.family}: num_key_value_heads={hf.num_key_value_heads} differs from "
                             f"num_attention_heads={hf.num_attention_heads}; multi-head latent attention expands its "
                             "latent into every head's own key and value (transformers' MLA fails otherwise): set "
                             "num_key_value_heads to num_attention_heads")
        if not hf.num_experts_per_tok:
            raise ValueError(f"{cls.family}: num_experts_per_tok={hf.num_experts_per_tok!r}: the router needs the "
                             "number of experts each token takes (6 on DeepSeek-V2-Lite and V2, 8 on V3); set it")
        c = ModelConfig(
            model_type=hf.model_type, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads, num_kv_heads=hf.num_attention_heads, head_dim=hf.v_head_dim,
            qk_head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim, vocab_size=hf.vocab_size,
            intermediate_size=hf.intermediate_size, layer_types=cls.layer_types(hf))
        return with_experts(c, hf.n_routed_experts, hf.num_experts_per_tok)

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        dense = hf.first_k_dense_replace or 0
        return tuple(DENSE + FULL if i < dense else FULL for i in range(hf.num_hidden_layers))

    @classmethod
    def rotary(cls, hf, c: ModelConfig) -> Rotary | None:
        return rotary_from_config(hf, hf.qk_rope_head_dim)

    @classmethod
    def extra(cls, hf) -> dict:
        return {"rotary_in_float32": True}  # V2's rotary multiplies float32 complex numbers whatever the dtype

    @classmethod
    def attention_scale(cls, hf) -> float:
        """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a scaled rope with
        ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
        scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
        params = hf.rope_parameters or {}
        if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim", 0):
            mscale = yarn_mscale(params["factor"], params["mscale_all_dim"])
            scale = scale * mscale * mscale
        return scale

    @classmethod
    def routing(cls, hf) -> dict:
        """The router's options (``MoEMLP.skeleton``): V2's softmax over ``topk_method``'s groups."""
        method = hf.topk_method or "greedy"
        if method not in TOPK_METHODS:
            raise ValueError(f"{cls.family}: topk_method={method!r} is not one transformers' DeepSeek-V2 router has; "
                             f"it has {', '.join(TOPK_METHODS)}")
        groups = (hf.n_group, hf.topk_group) if method == "group_limited_greedy" else None
        return dict(routing="group_limited_softmax", groups=groups, normalize=False)

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        attn = LatentAttention.skeleton(c.hidden_size, c.num_heads, hf.q_lora_rank, hf.kv_lora_rank,
                                        hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim,
                                        cls.attention_scale(hf), bool(hf.attention_bias), dtype, cls.rotary_layout(hf))
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        if kind.startswith(DENSE):
            mlp = GatedMLP.skeleton(c.hidden_size, hf.intermediate_size, hf.hidden_act, mlp_bias, dtype)
        else:
            routing = cls.routing(hf)
            shared = hf.moe_intermediate_size * hf.n_shared_experts if hf.n_shared_experts else None
            mlp = MoEMLP.skeleton(c.hidden_size, hf.moe_intermediate_size, hf.n_routed_experts,
                                  hf.num_experts_per_tok, hf.hidden_act, routing.pop("normalize"), dtype,
                                  weights_in_float32=True, shared_mlp=shared, shared_gate=False,
                                  shared_bias=mlp_bias, routed_scaling_factor=hf.routed_scaling_factor,
                                  router_dtype=np.float32, **routing)
        return Block(attention_norm=cls.norm(hf, c, dtype), attn=attn, attention_post_norm=None,
                     mlp_norm=cls.norm(hf, c, dtype), mlp=mlp, mlp_post_norm=None)

    @classmethod
    def names(cls, hf, kind: str) -> dict:
        return NAMES


class DeepseekV3(DeepseekV2):
    family = "deepseek_v3"
    model_types = ("deepseek_v3",)
    handled = DeepseekV2.handled | {"rope_interleave", "num_mtp_layers", "num_nextn_predict_layers"}

    @classmethod
    def extra(cls, hf) -> dict:
        return {}  # V3's cos/sin are cast to the model dtype

    @classmethod
    def rotary_layout(cls, hf) -> str:
        """V3 turns the pairs in the model dtype, laid out as halves (``rope_interleave``; else Llama's rotary)."""
        return "deinterleaved" if getattr(hf, "rope_interleave", True) else "halves"

    @classmethod
    def routing(cls, hf) -> dict:
        """V3's sigmoid over the groups (always group-limited), its bias moving the choice, ``norm_topk_prob``."""
        if not hf.n_group or not hf.topk_group:
            raise ValueError(f"{cls.family}: n_group={hf.n_group}, topk_group={hf.topk_group}: DeepSeek-V3's router "
                             "always limits the choice to the best groups; set both (1 and 1: no limit)")
        return dict(routing="group_limited_sigmoid", groups=(hf.n_group, hf.topk_group),
                    normalize=bool(hf.norm_topk_prob), score_correction_bias=True)

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        mtp = getattr(hf, "num_mtp_layers", 0) or 0  # the multi-token-prediction layers, after the last block
        return super().ignored(hf) + tuple(f"model.layers.{hf.num_hidden_layers + j}.*" for j in range(mtp))
