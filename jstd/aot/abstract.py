"""A model from its config alone: every parameter a ``jax.ShapeDtypeStruct`` carrying its sharding.

    hf = config("llama-3.1-8b", blocks=2)                       # a preset, a config.json, a checkpoint folder
    model = abstract_model(hf, mesh, jstd.sharding.FSDP_TP, dtype=jnp.bfloat16)

No weight is read: the family's skeleton (``Family.skeleton``, the shapes ``jstd.load`` fills) gets, leaf by leaf,
the ``NamedSharding`` that ``jstd.sharding.shardings`` gives it, so ``jax.jit(f).lower(model, ...)`` compiles
``f`` for the model as ``jstd.load(..., mesh=mesh, rules=rules)`` would place it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jstd.circuits.transcoders import Transcoders
from jstd.families import family_for
from jstd.io.torchless import transformers
from jstd.sharding import FSDP, shardings

# config.json shapes of released checkpoints (no download: the compile needs the shapes alone)
PRESETS = {
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False, dtype="bfloat16"),
    # the shape of Qwen3.5-4B's text model: 32 blocks, three gated-DeltaNet blocks to one gated-attention block
    "qwen3.5-4b": dict(
        model_type="qwen3_5_text", hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
        layer_types=["linear_attention"] * 3 + ["full_attention"], dtype="bfloat16"),
    # llava-hf/llava-1.5-7b-hf: CLIP ViT-L/14 at 336 px, a two-layer projector, a Llama-2-7B-shaped text model
    "llava-1.5-7b": dict(
        model_type="llava", image_token_index=32000, projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_seq_length=576, dtype="bfloat16",
        vision_config=dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
                           projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5),
        text_config=dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                         max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=0)),
    # openai/gpt-oss-20b without its quantization_config (a dequantised copy: the hub's experts are MXFP4): 24
    # blocks alternating sliding (128) and full attention with sinks, 32 experts top-4
    "gpt-oss-20b": dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, experts_per_token=4,
        vocab_size=201088, max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True,
        sliding_window=128, swiglu_limit=7.0, initial_context_length=4096, router_aux_loss_coef=0.9,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=4096, truncate=False),
        layer_types=["sliding_attention", "full_attention"], eos_token_id=200002, pad_token_id=199999,
        tie_word_embeddings=False, dtype="bfloat16"),
    # deepseek-ai/DeepSeek-V2-Lite: 27 blocks (the first dense), multi-head latent attention (kv_lora_rank 512, no
    # query compression), 64 routed experts top-6 with 2 shared
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, moe_layer_freq=1, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
        topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax",
        vocab_size=102400, max_position_embeddings=163840, rms_norm_eps=1e-6, attention_bias=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0, beta_slow=1.0,
                             mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=4096),
        bos_token_id=100000, eos_token_id=100001, tie_word_embeddings=False, dtype="bfloat16"),
}


def config(source, *, blocks: int | None = None):
    """A transformers config from ``source``: a preset name (``PRESETS``), a ``config.json`` path, a checkpoint
    folder holding one, a dict as config.json holds, or a transformers config. ``blocks``: every stack cut to its
    first ``blocks`` blocks (the text model's and a tower's; a hybrid's layer types cut alike), for a small
    compile of the same shapes.

    Raises ValueError for a source that is none of these (naming the presets) or a ``model_type`` jstd has no
    family for.
    """
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):  # a transformers config (the user's or ours)
        raw = source.to_dict()
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    elif isinstance(source, str) and source.lower() in PRESETS:
        raw = copy.deepcopy(PRESETS[source.lower()])
    else:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"{source!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json or a "
                             "checkpoint folder holding one")
        raw = json.loads(path.read_text())
    raw = _cut(raw, blocks)
    family_for(raw.get("model_type"), repr(source))
    kind = raw.pop("model_type")
    with transformers() as library:  # without importing torch (jstd.io.torchless)
        return library.AutoConfig.for_model(kind, **raw)


def _cut(raw: dict, blocks: int | None) -> dict:
    """``raw`` with its stacks cut to ``blocks`` (None: as they are) and a short ``layer_types`` pattern repeated
    to the number of blocks."""
    if blocks is not None and blocks < 1:
        raise ValueError(f"blocks={blocks}: pass at least 1")
    for key in ("text_config", "vision_config"):
        if isinstance(raw.get(key), dict):
            raw[key] = _cut(raw[key], blocks)
    for key in ("num_hidden_layers", "depth"):
        if key in raw and blocks is not None:
            raw[key] = min(raw[key], blocks)
    if isinstance(raw.get("layer_types"), list):
        kinds = raw["layer_types"]
        raw["layer_types"] = [kinds[i % len(kinds)] for i in range(raw.get("num_hidden_layers", len(kinds)))]
        if len(set(kinds)) > 1 and len(raw["layer_types"]) >= 2 and len(set(raw["layer_types"])) == 1:
            # a cut that would leave one kind of block keeps the other kind in its last block
            raw["layer_types"][-1] = next(k for k in kinds if k != raw["layer_types"][0])
    return raw


def abstract_model(hf, mesh=None, rules=FSDP, *, dtype=jnp.bfloat16):
    """The model of config ``hf`` with ``jax.ShapeDtypeStruct`` leaves of ``dtype``, each with its
    ``NamedSharding`` on ``mesh`` under ``rules`` (``jstd.sharding.shardings``); without a mesh, no shardings."""
    family = family_for(hf.model_type)
    skeleton = family.skeleton(hf, jnp.dtype(dtype))
    if mesh is None:
        return skeleton
    placed = shardings(skeleton, mesh, rules)
    return jax.tree.map(lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s), skeleton, placed)


def abstract_transcoders(layers: int, features: int, width: int, mesh=None, rules=FSDP, *, dtype=jnp.bfloat16,
                         cross_layer: bool = True, skip: bool = False) -> Transcoders:
    """A ``jstd.circuits.Transcoders`` of ``jax.ShapeDtypeStruct`` leaves: ``layers`` blocks of ``features`` ReLU
    features reading and writing ``width``; cross-layer (decoders from block l to every block >= l) or per-layer;
    with ``skip``, a skip path per block. Each leaf carries its ``NamedSharding`` on ``mesh`` under ``rules``
    (the transcoders' logical axes, as ``jstd.attribute(..., mesh=)`` places them); without a mesh, none."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    dec = tuple(s(features, layers - l, width) for l in range(layers)) if cross_layer else s(layers, features, width)
    tc = Transcoders(s(layers, features, width), s(layers, features), dec, s(layers, width), None,
                     s(layers, width, width) if skip else None, cross_layer)
    if mesh is None:
        return tc
    placed = shardings(tc, mesh, rules)
    return jax.tree.map(lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh), tc, placed)
