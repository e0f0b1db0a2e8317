"""Every family and tower the conformance suite runs, each as tiny random checkpoints (one line a case).

A case names a transformers config, how its checkpoint is made, and its torch
reference. ``MAIN`` holds one case per family and tower: the conformance tests
that compile many runs use those; the every-value tests run on every case.
Adding a family is adding its cases here (and its reference plan, where its
modules differ from Llama's).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
from transformers import (CLIPVisionConfig, DeepseekVLConfig, HyperCLOVAXConfig, LlavaConfig, SiglipVisionConfig,
                          VipLlavaConfig)
from transformers import LlavaNextConfig

import classic_cases
import deepseek_cases
import gpt2_neox_cases
import gpt_oss_cases
import llama4_cases
import llama_cases
import moe_cases
import olmo_hybrid_cases
import qwen3_5_cases
import qwen_vl_cases
import qwen3_vl_cases
import sliding_cases
import text_cases
from reference.checkpoints import make_checkpoint
from reference.moe import MoEQwenVLReference, MoEReference
from reference.harness import LLAMA_PLAN, TorchReference
from reference.vision import TowerReference, make_tower_checkpoint
from reference.qwen_vl import QwenVLReference
from reference.gemma3 import Gemma3Reference
from reference.wrapper import WrapperReference, make_wrapper_checkpoint

HYPERCLOVAX_PLAN = {
    **LLAMA_PLAN,
    # the contributions are computed copies in torch: post_normN's output times residual_multiplier
    "layers.self_attn.attention_raw_output": ("model.layers.{i}.self_attn", "out0"),
    "layers.self_attn.attention_output": ("model.layers.{i}.post_norm1", "out", "residual_multiplier"),
    "layers.mlp.mlp_raw_output": ("model.layers.{i}.mlp", "out"),
    "layers.mlp.mlp_output": ("model.layers.{i}.post_norm2", "out", "residual_multiplier"),
}
HYPERCLOVAX_HEAD_DIM = 16
HYPERCLOVAX_BASE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
)
HYPERCLOVAX_THINK_14B = dict(use_post_norm=True, embedding_multiplier=10.0, residual_multiplier=1.0,
                             attention_multiplier=1 / HYPERCLOVAX_HEAD_DIM, logits_scaling=0.125)
HYPERCLOVAX_CASES = {
    "think14b": HYPERCLOVAX_THINK_14B,                                      # post-norms, 1 / head_dim scale
    "residual": {**HYPERCLOVAX_THINK_14B, "residual_multiplier": 0.3},     # a multiplier the round trip rounds
    "text32b": dict(use_post_norm=False, embedding_multiplier=1.0, residual_multiplier=1.0,
                    attention_multiplier=HYPERCLOVAX_HEAD_DIM ** -0.5, logits_scaling=1.0),
}
TOWER = dict(hidden_size=64, num_attention_heads=4, intermediate_size=96, num_hidden_layers=3, image_size=32,
             patch_size=8)

SEQ = 11
IMAGES = 2
# a wrapper's text model: the image token is the vocabulary's last id
WRAPPER_TEXT = dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
IMAGE_TOKEN = 96
ASSET_TOKENIZER = __import__("pathlib").Path(__file__).parents[1] / "jstd" / "assets" / "tiny-llama"
LLAVA_PATHS = dict(tower="model.vision_tower", text="model.language_model", projector="model.multi_modal_projector")


@dataclasses.dataclass(frozen=True)
class Spec:
    """A conformance case: ``config()`` the transformers config; ``make(config, folder, seed=)`` its checkpoint;
    ``reference(folder, dtype)`` its torch reference; ``tower``: a vision tower alone (runs on images)."""

    config: Callable[[], object]
    make: Callable = make_checkpoint
    reference: Callable = lambda folder, dtype: TorchReference(folder, dtype, LLAMA_PLAN)
    tower: bool = False
    seed: int = 1
    images: Callable | None = None  # a wrapper's batch: images(model, rng, counts) -> the processor's arrays

    @property
    def wrapper(self) -> bool:
        return self.images is not None

    def inputs(self, model, seed: int = 0, batch: int = 2, counts=(2, 1)):
        """(jstd inputs, the reference's inputs) for one random batch (a wrapper's: ``counts[r]`` images in row
        ``r``)."""
        rng = np.random.default_rng(seed)
        if self.wrapper:
            arrays = self.images(model, rng, counts)
            import jstd

            return jstd.Inputs.of(arrays), arrays
        if self.tower:
            v = model.config.vision
            pixels = rng.normal(size=(IMAGES, v.num_channels, v.image_size, v.image_size)).astype(np.float32)
            import jstd

            return jstd.Inputs(images={"pixel_values": pixels}), pixels
        tokens = rng.integers(0, model.config.vocab_size, (batch, SEQ))
        return tokens, tokens


def _olmo(case):
    return Spec(lambda: olmo_hybrid_cases.config(case), make=olmo_hybrid_cases.make_checkpoint,
                reference=lambda folder, dtype: TorchReference(folder, dtype, olmo_hybrid_cases.PLAN), seed=3)


def _qwen3_5(case):
    return Spec(lambda: qwen3_5_cases.config(case), make=qwen3_5_cases.make_checkpoint,
                reference=qwen3_5_cases.Qwen3_5Reference, seed=3)


def _hyperclovax(case):
    return Spec(lambda: HyperCLOVAXConfig(**HYPERCLOVAX_BASE, **HYPERCLOVAX_CASES[case]),
                reference=lambda folder, dtype: TorchReference(folder, dtype, HYPERCLOVAX_PLAN), seed=2)


def prompts(model, rng, counts, per_image) -> dict:
    """Token ids and mask for rows holding ``counts[r]`` images of ``per_image[k]`` image tokens each (the k-th
    image of the batch), text around them, the last row left-padded by two."""
    rows = []
    k = 0
    for n in counts:
        row = list(rng.integers(0, IMAGE_TOKEN, 2))
        for _ in range(n):
            row += [IMAGE_TOKEN] * per_image[k] + list(rng.integers(0, IMAGE_TOKEN, 2))
            k += 1
        rows.append(row)
    seq = max(map(len, rows)) + 2
    ids = np.zeros((len(rows), seq), np.int64)
    mask = np.zeros((len(rows), seq), np.int64)
    for r, row in enumerate(rows):
        ids[r, seq - len(row):], mask[r, seq - len(row):] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


def llava_images(model, rng, counts) -> dict:
    """A Llava-style batch: one tower row per image, ``tokens_per_image`` image tokens each."""
    v = model.config.vision
    n = sum(counts)
    pixels = rng.normal(size=(n, v.num_channels, v.image_size, v.image_size)).astype(np.float32)
    return {**prompts(model, rng, counts, [model.tokens_per_image] * n), "pixel_values": pixels}


# LLaVA-NeXT: original (height, width) sizes cut into different crop grids by LLAVA_NEXT_PINPOINTS (a wide 1x2,
# a tall 2x1, a 2x2 one), each unpadded differently; at each size the scaled side's fraction is >= 0.5, so
# truncating it (transformers' int(round(x, 7))) and rounding it to the nearest integer keep different grids
LLAVA_NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64]]
LLAVA_NEXT_SIZES = ((9, 26), (41, 34), (35, 12), (33, 28))


def llava_next_tokens(config, size) -> int:
    """An image's LLaVA-NeXT features by transformers' own functions: base crop's patches, then the unpadded crop
    grid's patches with a newline per row."""
    import torch
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    v = config.vision_config
    side = v.image_size // v.patch_size
    rows, cols = get_anyres_image_grid_shape(list(size), config.image_grid_pinpoints, v.image_size)
    _, height, width = unpad_image(torch.zeros(1, rows * side, cols * side), list(size)).shape
    return side * side + height * (width + 1)


def llava_next_images(model, rng, counts, sizes=LLAVA_NEXT_SIZES) -> dict:
    """A LLaVA-NeXT batch: image ``k`` of original size ``sizes[k]`` as the processor lays it out,
    ``pixel_values [images, max_crops, C, H, W]`` (an image's crops first, zeros after) and ``image_sizes``."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    v = model.config.vision
    config = LlavaNextConfig(vision_config=dict(model_type="clip_vision_model", image_size=v.image_size,
                                                patch_size=v.patch_size),
                             image_grid_pinpoints=[list(p) for p in model.grid_pinpoints])
    n = sum(counts)
    sizes = [tuple(sizes[k % len(sizes)]) for k in range(n)]
    crops = [image_size_to_num_patches(list(s), config.image_grid_pinpoints, v.image_size) for s in sizes]
    pixels = np.zeros((n, max(crops), v.num_channels, v.image_size, v.image_size), np.float32)
    for k, c in enumerate(crops):
        pixels[k, :c] = rng.normal(size=(c, v.num_channels, v.image_size, v.image_size))
    per_image = [llava_next_tokens(config, s) for s in sizes]
    return {**prompts(model, rng, counts, per_image), "pixel_values": pixels,
            "image_sizes": np.array(sizes, np.int64)}


# Idefics 3 / SmolVLM: image k is IDEFICS3_TILES[k] tiles (the processor's crops and the whole image), each a slot
# of pixel_values [batch, max_tiles, C, H, W]; a row with fewer tiles is padded with all-zero slots; the last real
# tile is padded below and to the right (pixel_attention_mask 0 there, pixels 0), its last real patch row and
# column half real
IDEFICS3_TILES = (2, 2, 1)
IDEFICS3_PATHS = dict(tower="model.vision_model", text="model.text_model", projector="model.connector")


def idefics3_images(model, rng, counts) -> dict:
    """An Idefics 3 batch as its processor lays it out: ``pixel_values`` and ``pixel_attention_mask``."""
    v = model.config.vision
    tiles, k = [], 0
    for n in counts:
        tiles.append(sum(IDEFICS3_TILES[(k + i) % len(IDEFICS3_TILES)] for i in range(n)))
        k += n
    size = v.image_size
    pixels = np.zeros((len(counts), max(tiles), v.num_channels, size, size), np.float32)
    mask = np.zeros((len(counts), max(tiles), size, size), np.int64)
    for r, t in enumerate(tiles):
        pixels[r, :t] = rng.normal(size=(t, v.num_channels, size, size))
        mask[r, :t] = 1
    r, t = len(counts) - 1, tiles[-1] - 1
    high, wide = size - v.patch_size - v.patch_size // 2, size // 2 + v.patch_size // 2
    mask[r, t] = 0
    mask[r, t, :high, :wide] = 1
    pixels[r, t] *= mask[r, t]
    per_tile = (v.image_size // v.patch_size) ** 2 // model.scale ** 2
    return {**prompts(model, rng, tiles, [per_tile] * sum(tiles)), "pixel_values": pixels,
            "pixel_attention_mask": mask}


def _wrapper(config, paths, images, seed=4):
    return Spec(config, make=make_wrapper_checkpoint, seed=seed, images=images,
                reference=lambda folder, dtype: WrapperReference(folder, dtype, paths))


CASES: dict[str, Spec] = {
    **{f"llama-{c}": Spec(lambda c=c: llama_cases.config(c)) for c in llama_cases.CASES},
    **{f"hyperclovax-{c}": _hyperclovax(c) for c in HYPERCLOVAX_CASES},
    **{f"olmo_hybrid-{c}": _olmo(c) for c in olmo_hybrid_cases.CASES},
    **{f"qwen3_5_text-{c}": _qwen3_5(c) for c in qwen3_5_cases.CASES},
    # Gemma, OLMo-2, Qwen3, Phi-3, SmolLM3 (tests/text_cases.py)
    **{c: Spec(lambda c=c: text_cases.config(c), seed=6,
               reference=lambda folder, dtype, c=c: TorchReference(folder, dtype, text_cases.plan(c)))
       for c in text_cases.CASES},
    # Mistral, Qwen2, Gemma 2, Gemma 3, OLMo-3: sliding windows, soft-capping (tests/sliding_cases.py)
    **{c: Spec(lambda c=c: sliding_cases.config(c), seed=8,
               reference=lambda folder, dtype, c=c: TorchReference(folder, dtype, sliding_cases.plan(c)))
       for c in sliding_cases.CASES},
    # GPT-2 (learned positions, Conv1D, LayerNorm) and GPT-NeoX / Pythia (parallel residual, partial rotary)
    **{f"gpt2-{c}": Spec(lambda c=c: gpt2_neox_cases.gpt2_config(c), make=gpt2_neox_cases.make_checkpoint, seed=7,
                         reference=gpt2_neox_cases.GPT2Reference) for c in gpt2_neox_cases.GPT2_CASES},
    **{f"gpt_neox-{c}": Spec(lambda c=c: gpt2_neox_cases.neox_config(c), make=gpt2_neox_cases.make_checkpoint, seed=7,
                             reference=gpt2_neox_cases.neox_reference) for c in gpt2_neox_cases.NEOX_CASES},
    # the classic families (tests/classic_cases.py): GPT-Neo (unscaled scores, local blocks), GPT-J, Phi, OPT, BLOOM
    **{f"gpt_neo-{c}": Spec(lambda c=c: classic_cases.gpt_neo_config(c), make=classic_cases.make_checkpoint, seed=7,
                            reference=classic_cases.GPTNeoReference) for c in classic_cases.GPT_NEO_CASES},
    **{f"gptj-{c}": Spec(lambda c=c: classic_cases.gptj_config(c), make=classic_cases.make_checkpoint, seed=7,
                         reference=classic_cases.gptj_reference) for c in classic_cases.GPTJ_CASES},
    **{f"phi-{c}": Spec(lambda c=c: classic_cases.phi_config(c), make=classic_cases.make_checkpoint, seed=7,
                        reference=classic_cases.phi_reference) for c in classic_cases.PHI_CASES},
    **{f"opt-{c}": Spec(lambda c=c: classic_cases.opt_config(c), make=classic_cases.make_checkpoint, seed=7,
                        reference=classic_cases.OPTReference) for c in classic_cases.OPT_CASES},
    **{f"bloom-{c}": Spec(lambda c=c: classic_cases.bloom_config(c), make=classic_cases.make_checkpoint, seed=7,
                          reference=classic_cases.BloomReference) for c in classic_cases.BLOOM_CASES},
    "clip": Spec(lambda: CLIPVisionConfig(**TOWER, hidden_act="quick_gelu"), make=make_tower_checkpoint,
                 reference=TowerReference, tower=True),
    "siglip": Spec(lambda: SiglipVisionConfig(**TOWER), make=make_tower_checkpoint, reference=TowerReference,
                   tower=True),
    # Llava 1.5: block -2 without the class token
    "llava": _wrapper(lambda: LlavaConfig(vision_config=dict(model_type="clip_vision_model", **TOWER,
                                                             hidden_act="quick_gelu"),
                                          text_config=WRAPPER_TEXT, image_token_index=IMAGE_TOKEN),
                      LLAVA_PATHS, llava_images),
    # the whole stream of two blocks, concatenated (one of them block 0's input)
    "llava-full": _wrapper(lambda: LlavaConfig(vision_config=dict(model_type="clip_vision_model", **TOWER,
                                                                  hidden_act="quick_gelu"),
                                               text_config=WRAPPER_TEXT, image_token_index=IMAGE_TOKEN,
                                               vision_feature_select_strategy="full", vision_feature_layer=[-1, 0],
                                               multimodal_projector_bias=False, tie_word_embeddings=True),
                           LLAVA_PATHS, llava_images),
    # VipLlava: blocks in the config's order, normed
    "vipllava": _wrapper(lambda: VipLlavaConfig(vision_config=dict(model_type="clip_vision_model", **TOWER,
                                                                   hidden_act="quick_gelu"),
                                                text_config=WRAPPER_TEXT, image_token_index=IMAGE_TOKEN,
                                                vision_feature_layers=[-2, 1, 3]),
                         LLAVA_PATHS, llava_images),
    # DeepSeek-VL: the aligner on the SigLIP tower's normed output, a tied head
    "deepseek_vl": _wrapper(lambda: DeepseekVLConfig(vision_config=dict(model_type="siglip_vision_model", **TOWER),
                                                     text_config=WRAPPER_TEXT, image_token_id=IMAGE_TOKEN),
                            dict(tower="model.vision_model", text="model.language_model", projector="model.aligner"),
                            llava_images),
    # LLaVA-NeXT: crops of a best-fit grid, the projector's output unpadded, a newline per row
    "llava_next": _wrapper(lambda: LlavaNextConfig(vision_config=dict(model_type="clip_vision_model", **TOWER,
                                                                      hidden_act="quick_gelu"),
                                                   text_config=WRAPPER_TEXT, image_token_index=IMAGE_TOKEN,
                                                   image_grid_pinpoints=LLAVA_NEXT_PINPOINTS),
                           LLAVA_PATHS, llava_next_images),
    # Idefics 3: 4 × 4 patches per tile, a 2 × 2 pixel shuffle (4 tokens a tile)
    "idefics3": _wrapper(lambda: __import__("transformers").Idefics3Config(
                             vision_config=dict(model_type="idefics3_vision", **TOWER), text_config=WRAPPER_TEXT,
                             image_token_id=IMAGE_TOKEN, scale_factor=2),
                         IDEFICS3_PATHS, idefics3_images),
    # SmolVLM: 6 × 6 patches per tile, a 3 × 3 pixel shuffle (4 tokens a tile), a tied head
    "smolvlm": _wrapper(lambda: __import__("transformers").SmolVLMConfig(
                            vision_config=dict(model_type="smolvlm_vision", **{**TOWER, "image_size": 48}),
                            text_config=WRAPPER_TEXT, image_token_id=IMAGE_TOKEN, scale_factor=3,
                            tie_word_embeddings=True),
                        IDEFICS3_PATHS, idefics3_images),
    # Gemma 3: SigLIP pooled 2 × 2 into 9 tokens an image, each image's tokens attending bidirectionally, a sliding
    # window (4) shorter than an image (tests/gemma3_cases.py; its cases module reads this one, so imported late)
    "gemma3": Spec(lambda: __import__("gemma3_cases").config(), make=make_wrapper_checkpoint, seed=4,
                   images=lambda *a: __import__("gemma3_cases").images(*a), reference=Gemma3Reference),
    # the Qwen ViT line: every image of a call in one packed row, M-RoPE (Qwen2-VL, Qwen2.5-VL) or HyperCLOVA X text
    **{name: Spec(config, make=qwen_vl_cases.make_qwen_checkpoint, seed=5, images=qwen_vl_cases.qwen_images,
                  reference=QwenVLReference)
       for name, config in qwen_vl_cases.CONFIGS.items()},
    # Qwen3-VL: the Qwen ViT with learned positions and DeepStack taps into the first text blocks, Qwen3 text
    "qwen3_vl": Spec(qwen3_vl_cases.config, make=qwen_vl_cases.make_qwen_checkpoint, seed=5,
                     images=qwen_vl_cases.qwen_images, reference=QwenVLReference),
    # Qwen3.5: that tower without DeepStack, the hybrid Qwen3.5 text model (DeltaNet values captured too); seed 3 as
    # the qwen3_5_text cases (on seed 5 torch's own float32 DeltaNet output sits at the 1e-5 bound, jstd 3x closer
    # to float64)
    "qwen3_5": Spec(qwen3_vl_cases.qwen3_5_config, make=qwen3_vl_cases.make_qwen3_5_checkpoint, seed=3,
                    images=qwen_vl_cases.qwen_images,
                    reference=lambda folder, dtype: QwenVLReference(folder, dtype, qwen3_5_cases.PLAN)),
}
# mixture-of-experts (tests/moe_cases.py): the text families, and the two Qwen MoE wrappers
CASES.update({name: Spec(config, reference=MoEReference, seed=2) for name, config in moe_cases.TEXT.items()})
CASES.update({
    "qwen3_vl_moe": Spec(moe_cases.qwen3_vl_moe_config, make=qwen_vl_cases.make_qwen_checkpoint, seed=5,
                         images=qwen_vl_cases.qwen_images, reference=MoEQwenVLReference),
    "qwen3_5_moe": Spec(moe_cases.qwen3_5_moe_config, make=moe_cases.make_qwen3_5_moe_checkpoint, seed=3,
                        images=qwen_vl_cases.qwen_images,
                        reference=lambda folder, dtype: MoEQwenVLReference(folder, dtype, {
                            k: v for k, v in qwen3_5_cases.PLAN.items() if not k.startswith("layers.mlp.mlp_") or k.endswith("output")})),
})
# gpt-oss: attention sinks, a biased router over clamped SwiGLU experts (tests/gpt_oss_cases.py)
CASES.update({"-".join(filter(None, ("gpt_oss", c))): Spec(lambda c=c: gpt_oss_cases.config(c), make=gpt_oss_cases.make,
                                                          reference=gpt_oss_cases.GptOssReference, seed=3)
              for c in gpt_oss_cases.CASES})
# Llama 4: chunked attention, NoPE blocks with temperature tuning, input-weighted experts (tests/llama4_cases.py)
CASES.update({"-".join(filter(None, ("llama4_text", c))): Spec(lambda c=c: llama4_cases.config(c), make=llama4_cases.make,
                                                              reference=llama4_cases.Llama4Reference, seed=3)
              for c in llama4_cases.CASES})
# DeepSeek-V2 / V3: multi-head latent attention, DeepSeek's routers (tests/deepseek_cases.py)
CASES.update({name: Spec(config, make=deepseek_cases.make, reference=deepseek_cases.DeepseekReference, seed=4)
              for name, config in deepseek_cases.CASES.items()})
MAIN = ("llama-gqa", "hyperclovax-residual", "olmo_hybrid-rotary_grouped", "qwen3_5_text-released", "clip", "siglip",
        "llava", "idefics3", "qwen2_5_vl", "gemma-2b",
        "gpt2-small", "gpt_neox-parallel", "qwen3_moe", "gptj-6b", "opt-125m", "bloom-560m")
# GPT-Neo (GPT-2's declaration with a local window and unscaled float32 scores) and Phi (GPT-J's parallel block and
# float32 scores with NeoX's partial rotary) are outside MAIN for the suite's time: every value of every case in
# float32 (test_conformance), their own quirks (test_classic) and collect cover what they add
TEXT_MAIN = tuple(c for c in MAIN if not CASES[c].tower and not CASES[c].wrapper)
# the first case of each family and tower ("llama-mha", …, "llava"; a case's family is its name before "-")
_FIRST: dict[str, str] = {}
for _case in CASES:
    _FIRST.setdefault(_case.split("-")[0], _case)
FAMILY_CASES = tuple(_FIRST.values())
WRAPPERS = tuple(c for c in CASES if CASES[c].wrapper)
