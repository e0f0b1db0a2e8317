"""Llama 4 (``model_type`` llama4_text: the text model; llama4: Llama-4-Scout / Maverick's image-text checkpoints,
served as their text model): Llama's block with chunked local attention on the rotary blocks, global NoPE blocks
with attention temperature tuning, a weightless L2 q/k norm, and mixture-of-experts blocks routed top-1 by a
sigmoid applied to the expert's input, beside a shared expert.

    a   = input_layernorm(x)
    q, k = rope(q_proj(a)), rope(k_proj(a))        # rotary blocks (no_rope_layers[i] == 1): Llama 4's complex
                                                   # rotary, which turns adjacent pairs (2i, 2i + 1)
    q, k = l2(q), l2(k)                            # rotary blocks with use_qk_norm: x · rsqrt(mean(x²) + eps)
    q   = q · (log1p(floor((p + 1) / floor_scale)) · attn_scale + 1)   # NoPE blocks with attn_temperature_tuning
    h   = x + o_proj(softmax(q·kᵀ / √head_dim + mask) @ v_proj(a))   # chunked blocks: keys of the query's chunk only
    y   = post_attention_layernorm(h)
    out = h + shared_expert(y) + Σ_k expert_e(sigmoid(l_e) · y)      # MoE blocks: l = router(y), e its top-k
    out = h + feed_forward(y)                                        # dense blocks: intermediate_size_mlp wide

``config.layer_types`` marks the ``chunked_attention`` blocks (the rotary ones when ``attention_chunk_size`` is
set): a query attends only the keys of its own chunk of ``attention_chunk_size`` positions, counted from the row's
first real token (transformers' chunked mask; ``Attention.attention_chunk``). The other blocks attend every earlier
key. ``no_rope_layers[i]`` is 1 where block ``i`` has the rotary (3 in 4 by default); the others (NoPE) have no
rotary, no q/k norm, and, with ``attn_temperature_tuning``, their queries scaled by the temperature at the token's
position (``Attention.temperature``; ``attention_queries`` is the scaled value, what enters the product). On a
left-padded row the position is the count of real tokens before the token, so each row gives its unpadded values
(transformers' forward counts the padding there; its ``generate`` does too: a padded row's NoPE queries then
differ from the row alone once ``floor_scale`` positions pass — 8192 on the released checkpoints).

Blocks listed in ``moe_layers`` (every ``interleave_moe_layer_step``-th by default: every block on Scout, every
other on Maverick) have the MoE MLP (``jstd.nn.moe``, routing ``top_k_sigmoid``, ``weights_on_input``): its
``router_weights`` are the sigmoids of the top-k logits (not normalised), ``expert_outputs`` the experts' outputs
on their weighted inputs, ``mlp_output`` their sum plus ``shared_expert_output`` (the shared expert, ungated,
``intermediate_size`` wide as each expert). The others (kind ``dense_mlp_…``) have a gated MLP
``intermediate_size_mlp`` wide. The rotary is computed and applied in float32 and cast back, as transformers'
complex product. The checkpoints store the experts fused and input-major (``feed_forward.experts.gate_up_proj``
``[experts, hidden, 2 · mlp]``, gate then up; ``down_proj`` ``[experts, mlp, hidden]``).

``llama4`` checkpoints hold the text model under ``language_model.`` beside a vision tower and projector: jstd
serves the text model (the tower's tensors are not read) and refuses images. Llama 4's tower is not a tower jstd's
mechanism serves cheaply (``jstd.vision``): a ViT with a class token, a 2-D rotary inside every attention block and
a pixel-shuffle MLP adapter before the projector, none of which ``VisionTower`` has.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jstd.core.config import ModelConfig
from jstd.models.family import Family, TextFamily
from jstd.models.llama import Llama
from jstd.models.qwen3_moe import DENSE
from jstd.nn.block import LLAMA_NAMES, Block
from jstd.nn.causal_lm import CausalLM
from jstd.nn.mlp import GatedMLP
from jstd.nn.moe import MoEMLP, with_experts
from jstd.nn.norms import L2Norm

CHUNKED, FULL, NOPE = "chunked_attention", "full_attention", "+nope"
KINDS = (CHUNKED, FULL)
NAMES = {**LLAMA_NAMES, "mlp": "feed_forward", "router": "router", "experts": "input_major"}


class Llama4Text(Llama):
    family = "llama4_text"
    model_types = ("llama4_text",)
    # no_rope_layer_interval and interleave_moe_layer_step act through no_rope_layers and moe_layers (transformers'
    # config derives them so); router_aux_loss_coef, router_jitter_noise and output_router_logits act in training
    handled = Llama.handled | {
        "intermediate_size_mlp", "attention_dropout", "num_experts_per_tok", "num_local_experts", "moe_layers",
        "interleave_moe_layer_step", "use_qk_norm", "output_router_logits", "router_aux_loss_coef",
        "router_jitter_noise", "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size", "layer_types",
        "attn_temperature_tuning", "floor_scale", "attn_scale"}

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return with_experts(super().standard_config(hf), hf.num_local_experts, hf.num_experts_per_tok)

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        """Each block's kind: ``config.layer_types``' attention kind, ``+nope`` without the rotary, ``dense_mlp_``
        before it without experts. ValueError for an unknown kind, too few ``no_rope_layers``, a chunked block
        without ``attention_chunk_size`` or a ``moe_layers`` entry that is no block."""
        n = hf.num_hidden_layers
        kinds, rope, moe = tuple(hf.layer_types)[:n], list(hf.no_rope_layers), set(hf.moe_layers)
        if unknown := set(kinds) - set(KINDS):
            raise ValueError(f"{cls.family}: layer_types holds {sorted(unknown)}; Llama 4 has {', '.join(KINDS)}")
        if len(kinds) < n or len(rope) < n:
            raise ValueError(f"{cls.family}: layer_types has {len(kinds)} and no_rope_layers {len(rope)} entries for "
                             f"{n} blocks; give one per block")
        if CHUNKED in kinds:
            chunk = hf.attention_chunk_size
            if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
                raise ValueError(f"{cls.family}: attention_chunk_size={chunk!r} is not a chunk for the "
                                 "chunked_attention blocks: give a positive number of positions")
        if bad := sorted(i for i in moe if not (isinstance(i, int) and 0 <= i < n)):
            raise ValueError(f"{cls.family}: moe_layers lists {bad}, which are not blocks (0 .. {n - 1})")
        return tuple(("" if i in moe else DENSE) + kind + ("" if rope[i] else NOPE) for i, kind in enumerate(kinds))

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype) -> Block:
        block = super().block(hf, c, kind, dtype)
        rope, attention = not kind.endswith(NOPE), kind.removeprefix(DENSE).removesuffix(NOPE)
        attn = dataclasses.replace(
            block.attn, rotary_interleaved=True,
            attention_chunk=int(hf.attention_chunk_size) if attention == CHUNKED else None,
            qk_l2_norm=L2Norm(float(hf.rms_norm_eps)) if hf.use_qk_norm and rope else None,
            temperature=(float(hf.floor_scale), float(hf.attn_scale)) if hf.attn_temperature_tuning and not rope
            else None)
        if kind.startswith(DENSE):
            mlp = GatedMLP.skeleton(c.hidden_size, hf.intermediate_size_mlp, hf.hidden_act, False, dtype)
        else:
            mlp = MoEMLP.skeleton(c.hidden_size, hf.intermediate_size, hf.num_local_experts, hf.num_experts_per_tok,
                                  hf.hidden_act, False, dtype, shared_mlp=hf.intermediate_size,
                                  routing="top_k_sigmoid", weights_on_input=True, shared_gate=False)
        return dataclasses.replace(block, attn=attn, mlp=mlp)

    @classmethod
    def names(cls, hf, kind: str) -> dict:
        return NAMES

    @classmethod
    def extra(cls, hf) -> dict:
        # NoPE blocks: no rotary; the rotary's cos/sin in float32 (transformers' complex product is float32)
        kinds = cls.layer_types(hf)
        return {"rotary_in_float32": True, "kind_rotary": tuple((k, None) for k in dict.fromkeys(kinds) if
                                                                k.endswith(NOPE))}


class Llama4TextOfImageText(CausalLM):
    """The text model of a ``llama4`` image-text checkpoint: images refused, saying why."""

    def check_inputs(self, inputs) -> None:
        if inputs.images is not None:
            raise ValueError("jstd serves a llama4 checkpoint's text model only and takes no images: Llama 4's vision "
                             "tower (a class token, a 2-D rotary in every attention block, a pixel-shuffle adapter) "
                             "is not one jstd's towers serve; drop the images (and their image tokens), or run the "
                             "image path in transformers")
        super().check_inputs(inputs)


class Llama4VisionUnread(Family):
    """The vision config of a ``llama4`` checkpoint, whose tower jstd does not build: every key of transformers'
    ``Llama4VisionConfig`` is knowingly not read (images are refused), so none is reported as unread."""

    family = "llama4_vision_model"
    model_types = ()
    handled = frozenset({"hidden_size", "hidden_act", "num_hidden_layers", "num_attention_heads", "num_channels",
                         "intermediate_size", "vision_output_dim", "image_size", "patch_size", "norm_eps",
                         "vision_feature_select_strategy", "vision_feature_layer", "initializer_range",
                         "pixel_shuffle_ratio", "projector_input_dim", "projector_output_dim",
                         "multi_modal_projector_bias", "projector_dropout", "attention_dropout", "rope_parameters",
                         "rope_theta"})


class Llama4(TextFamily):
    """``llama4`` (Llama4ForConditionalGeneration checkpoints): ``Llama4Text`` on ``config.text_config``, stored
    under ``language_model.``; the vision tower and projector are not read."""

    family = "llama4"
    model_types = ("llama4",)
    # the image-text config's own keys (its text_config is checked against llama4_text, its vision_config against
    # Llama4VisionUnread); the image tokens belong to the image path jstd refuses
    handled = frozenset({"text_config", "vision_config", "boi_token_index", "eoi_token_index", "image_token_index",
                         "tie_word_embeddings"})

    @classmethod
    def text_family(cls, hf) -> type[Llama4Text]:
        """The family ``config.text_config`` is read by (its keys are checked against it: ``io.hf.unhandled``)."""
        return Llama4Text

    @classmethod
    def tower_for(cls, hf) -> type[Llama4VisionUnread]:
        return Llama4VisionUnread

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return dataclasses.replace(Llama4Text.standard_config(hf.text_config), model_type=hf.model_type)

    @classmethod
    def skeleton(cls, hf, dtype) -> Llama4TextOfImageText:
        text = Llama4Text.skeleton(hf.text_config, dtype)
        fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
        return Llama4TextOfImageText(**{**fields, "family": cls.family, "config": cls.standard_config(hf)})

    @classmethod
    def name_map(cls, hf, skeleton=None):
        return Llama4Text.name_map(hf.text_config, skeleton if skeleton is not None else cls.skeleton(hf, jnp.float32))

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        return {"model.": ("language_model.model.", "model."), "lm_head.": ("language_model.lm_head.", "lm_head.")}

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        return Llama4Text.ignored(hf.text_config) + ("vision_model.*", "multi_modal_projector.*")
