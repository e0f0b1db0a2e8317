"""Qwen2-VL and Qwen2.5-VL (``qwen2_vl``, ``qwen2_5_vl``), and HyperCLOVA X Vision V2 (``hyperclovax_vision_v2``):
the Qwen ViT, its patch merger, and a text model, merged at the image tokens.

    h        = vision(pixel_values, image_grid_thw)      # one packed row: vision.layers.* [1, patches, …]
    merged   = merger(h)                                 # Qwen2-VL line: projector.input -> projector.output
    features = merged back in the images' order          # vision.image_features [image tokens, hidden]
    logits   = text(scatter(embed[tokens], features), positions)   # M-RoPE positions from the grids

- Qwen2-VL / Qwen2.5-VL: the projector *is* the merger (``projector.input`` is the last block's stream,
  ``[patches, vision_hidden]``, ``projector.output`` the merged tokens, in window order on Qwen2.5-VL); the text
  model is Qwen2's under multimodal RoPE (``models.qwen2``), and ``positions`` are computed from the tokens and the
  grids (``vision.mrope``).
- HyperCLOVA X Vision V2: the Qwen2.5-VL encoder with its merger inside (``vision.merger.output``, window order),
  the merged tokens put back in order (``projector.input``), one biased linear (``projector.output``), then the
  HyperCLOVA X text model with ordinary 1-D positions.

``vision.tower_output`` is the last block's stream, read after the merger has taken it (as in transformers): an
edit there changes nothing (``model.discarded``). The grids are static (``Inputs.layout``, recorded by
``jstd.Inputs.of`` from ``image_grid_thw``); one image is ``t·h·w`` patches and ``t·h·w / merge²`` image tokens.
Videos are not supported.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import numpy as np
from jaxtyping import Array, Float

from jstd.core.config import ModelConfig, VisionConfig
from jstd.core.inputs import Inputs
from jstd.nn.block import Block
from jstd.nn.mlp import MLP, GatedMLP
from jstd.nn.norms import LayerNorm, RMSNorm
from jstd.nn.stack import Stack
from jstd.models.family import Family
from jstd.nn.model import Model
from jstd.nn.params import shape
from jstd.kernels.mrope import mrope_positions
from jstd.vision.projector import LinearProjector
from jstd.vision.qwen_vit import (QWEN2_MERGER_NAMES, Grids, PackedAttention, PatchMerger, QwenViT, check_grids,
                                  vision_inv_freq)
from jstd.vision.wrapper import VisionLanguageModel, WrapperFamily

QWEN_VIT_NAMES = {"attention_norm": "norm1", "attn": "attn", "mlp_norm": "norm2", "mlp": "mlp"}


class QwenViTFamily:
    """The Qwen ViT declared from a vision config: Qwen2-VL's (``qwen2_vl_vision``: LayerNorm, fc1-QuickGELU-fc2,
    ``embed_dim`` wide) or Qwen2.5-VL's (``qwen2_5_vl_vision``: RMSNorm, biased SwiGLU, windows). A subclass
    overrides the parts that differ (``vision.qwen3_vl.Qwen3ViTFamily``: learned positions, DeepStack)."""

    names = QWEN_VIT_NAMES
    # tokens_per_second times video frames (jstd runs images)
    handled = frozenset({"depth", "embed_dim", "hidden_size", "hidden_act", "mlp_ratio", "num_heads", "in_channels",
                         "patch_size", "spatial_merge_size", "temporal_patch_size", "intermediate_size", "window_size",
                         "out_hidden_size", "fullatt_block_indexes", "rope_parameters", "tokens_per_second"})

    @staticmethod
    def qwen2(hf) -> bool:
        return hf.model_type == "qwen2_vl_vision"

    @classmethod
    def rms(cls, hf) -> bool:
        """Whether the block and merger norms are RMSNorms (Qwen2.5-VL) rather than LayerNorms."""
        return not cls.qwen2(hf)

    @classmethod
    def vision_config(cls, hf) -> VisionConfig:
        width = hf.embed_dim if cls.qwen2(hf) else hf.hidden_size
        mlp = int(hf.embed_dim * hf.mlp_ratio) if cls.qwen2(hf) else hf.intermediate_size
        return VisionConfig(
            num_layers=hf.depth, hidden_size=width, num_heads=hf.num_heads, head_dim=width // hf.num_heads,
            intermediate_size=mlp, patch_size=hf.patch_size, num_channels=hf.in_channels,
            spatial_merge_size=hf.spatial_merge_size, temporal_patch_size=hf.temporal_patch_size,
            window_size=None if cls.qwen2(hf) else hf.window_size,
        )

    @classmethod
    def out_width(cls, hf) -> int:
        """The merger's output width."""
        return hf.hidden_size if cls.qwen2(hf) else hf.out_hidden_size

    @classmethod
    def kinds(cls, hf) -> tuple[str, ...]:
        full = set(getattr(hf, "fullatt_block_indexes", None) or ())
        if cls.qwen2(hf):
            return ("full_attention",) * hf.depth
        return tuple("full_attention" if i in full else "window_attention" for i in range(hf.depth))

    @classmethod
    def merger(cls, hf, dtype, postshuffle: bool = False) -> PatchMerger:
        v = cls.vision_config(hf)
        return PatchMerger.skeleton(v.hidden_size, cls.out_width(hf), v.spatial_merge_size, cls.rms(hf), dtype,
                                    postshuffle)

    @classmethod
    def mlp(cls, hf, v: VisionConfig, dtype):
        if cls.rms(hf):
            return GatedMLP.skeleton(v.hidden_size, v.intermediate_size, hf.hidden_act, True, dtype)
        return MLP.skeleton(v.hidden_size, v.intermediate_size, hf.hidden_act, dtype)

    @classmethod
    def learned(cls, hf, v: VisionConfig, dtype) -> dict:
        """The tower's parts beyond the shared encoder: ``patch_bias``, ``pos_embed``, ``deepstack_mergers`` and
        ``deepstack`` (none here)."""
        return dict(patch_bias=None, pos_embed=None, deepstack_mergers=(), deepstack=())

    @classmethod
    def tower(cls, hf, dtype, merger: bool = False) -> QwenViT:
        v = cls.vision_config(hf)
        rms = cls.rms(hf)
        norm = lambda: RMSNorm.skeleton(v.hidden_size, 1e-6, dtype) if rms else LayerNorm.skeleton(v.hidden_size, 1e-6, dtype)
        block = lambda kind: Block(
            attention_norm=norm(),
            attn=PackedAttention.skeleton(v.hidden_size, v.num_heads, kind == "window_attention", dtype),
            attention_post_norm=None, mlp_norm=norm(), mlp=cls.mlp(hf, v, dtype), mlp_post_norm=None,
        )
        unit = v.num_channels * v.temporal_patch_size * v.patch_size ** 2
        window = None if v.window_size is None else v.window_size // v.spatial_merge_size // v.patch_size
        return QwenViT(
            patch_embedding=shape(unit, v.hidden_size, dtype=dtype),
            layers=Stack.skeleton("vision.layers", cls.kinds(hf), block),
            merger=cls.merger(hf, dtype) if merger else None,
            inv_freq=vision_inv_freq(hf, v.head_dim), merge=v.spatial_merge_size, window=window,
            **cls.learned(hf, v, dtype),
        )

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        return ("*rotary_pos_emb.inv_freq",)


NO_PATTERN = ("the Qwen ViT attends within each image (each window on windowed blocks) separately, so no one tensor is "
              "the block's pattern; a softmax over each image's slice of vision.layers.self_attn.attention_queries and "
              "attention_keys (times head_dim ** -0.5) gives that image's pattern")


def unavailable(model, site: str) -> str:
    """Why a Qwen-ViT model does not serve ``site`` (the attention pattern has its own reason)."""
    if site.startswith("vision.layers.self_attn.attention_") and site.endswith(("scores", "probabilities")):
        return NO_PATTERN
    return Model.unavailable(model, site)


class QwenVisionModel(Model):
    """A Qwen ViT loaded alone (``qwen2_vl_vision``, ``qwen2_5_vl_vision``; ``qwen3_vl_vision``, ``qwen3_5_vision``):
    every ``vision.*`` value and the merger's output (``vision.merger.output``, window order on Qwen2.5-VL),
    ``logits`` None. Runs on
    ``jstd.Inputs(images={"pixel_values", "image_grid_thw"})`` from the image processor (``Inputs.of``)."""

    vision: QwenViT

    model_sites: ClassVar[frozenset[str]] = QwenViT.sites | {"vision.merger.output"}

    @property
    def stacks(self) -> dict:
        return {"vision.layers": self.vision.layers}

    unavailable = unavailable

    def check_inputs(self, inputs: Inputs) -> None:
        if inputs.tokens is not None:
            raise ValueError(f"this {self.family} model is a vision tower alone: it takes images, not tokens "
                             "(jstd.Inputs.of(image_processor(images, return_tensors='np')))")
        if inputs.images is None or inputs.images.get("pixel_values") is None:
            raise ValueError(f"this {self.family} model runs on images: pass jstd.Inputs.of(image_processor(images, "
                             "return_tensors='np')) (pixel_values and image_grid_thw)")
        check_packed(self, inputs)

    def forward(self, inputs: Inputs, tap, context=None):
        _, _, reads = self.vision(inputs.images["pixel_values"], tap, (), grids_of(self, inputs))
        return None, reads


def grids_of(model, inputs: Inputs) -> Grids:
    """The images' static grids (``Inputs.layout``'s ``image_grid_thw``); ValueError naming the fix without."""
    grids = inputs.static("image_grid_thw")
    if grids is None:
        raise ValueError(f"{model.family} needs each image's patch grid statically (Inputs.layout's image_grid_thw): "
                         "build the inputs with jstd.Inputs.of(processor(...)) outside jit, or "
                         "jstd.core.inputs.with_layout(inputs)")
    return grids


def check_packed(model, inputs: Inputs) -> None:
    """Raise ValueError where a packed tower's images do not fit it (videos, a missing or stale grid, the pixels'
    shape)."""
    images = inputs.images
    if images.get("pixel_values_videos") is not None or images.get("video_grid_thw") is not None:
        raise ValueError(f"{model.family}: videos are not supported; pass images (pixel_values, image_grid_thw)")
    thw = images.get("image_grid_thw")
    if thw is None:
        raise ValueError(f"{model.family} needs image_grid_thw with pixel_values (the image processor returns both)")
    grids = grids_of(model, inputs)
    if not isinstance(thw, jax.core.Tracer):
        if np.shape(thw) != (len(grids), 3) or tuple(map(tuple, np.asarray(thw).tolist())) != tuple(grids):
            raise ValueError(f"image_grid_thw {np.asarray(thw).tolist()} differs from the inputs' recorded layout "
                             f"{list(grids)}: rebuild the inputs with jstd.Inputs.of")
    v = model.config.vision
    check_grids(images["pixel_values"], grids, v.num_channels * v.temporal_patch_size * v.patch_size ** 2,
                f"this {model.family} model")


class QwenVLModel(VisionLanguageModel):
    """A Qwen2-VL-line wrapper: the packed tower, the merger as projector, M-RoPE positions from the grids."""

    @property
    def discarded(self) -> frozenset[str]:
        return frozenset({"vision.tower_output"})

    unavailable = unavailable

    def grids(self, inputs: Inputs) -> Grids:
        return grids_of(self, inputs)

    def check_images(self, images: dict) -> None:
        pass  # checked with the layout (check_inputs)

    def check_inputs(self, inputs: Inputs) -> None:
        super().check_inputs(inputs)
        if inputs.images is not None:
            check_packed(self, inputs)

    def tower_images(self, inputs: Inputs):
        return inputs.images["pixel_values"], self.grids(inputs)

    def select(self, tower_output, streams):
        return tower_output[0]

    def features(self, projected: Float[Array, "tokens hidden"], inputs: Inputs) -> Float[Array, "tokens hidden"]:
        return self.vision.restore(projected, self.grids(inputs))

    def num_features(self, inputs: Inputs) -> int:
        return sum(self.image_token_counts(inputs))

    def image_token_counts(self, inputs: Inputs) -> tuple[int, ...]:
        return tuple(t * h * w // self.vision.merge ** 2 for t, h, w in self.grids(inputs))

    def rope_positions(self, tokens, inputs: Inputs):
        if not self.text.mrope:
            return None
        return mrope_positions(tokens, inputs.attention_mask, self.image_token_id, self.grids(inputs),
                               self.vision.merge)


class HCXVisionModel(QwenVLModel):
    """HyperCLOVA X Vision V2: the merger inside the tower (``vision.merger.output``); the tower returns the merged
    tokens in order, which the linear projector reads."""

    model_sites: ClassVar[frozenset[str]] = VisionLanguageModel.model_sites | {"vision.merger.output"}

    def select(self, tower_output, streams):
        return tower_output

    def features(self, projected, inputs):
        return projected


class QwenVisionTower(Family):
    """A Qwen ViT alone, with its merger (``Qwen2VisionTransformerPretrainedModel`` and Qwen2.5-VL's); a subclass
    names another ``tower_family`` (``vision.qwen3_vl.Qwen3VisionTower``)."""

    family = "qwen_vit"
    model_types = ("qwen2_vl_vision", "qwen2_5_vl_vision")
    tower_family: ClassVar[type] = QwenViTFamily
    handled = QwenViTFamily.handled

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return ModelConfig(model_type=hf.model_type, vision=cls.tower_family.vision_config(hf))

    @classmethod
    def skeleton(cls, hf, dtype) -> QwenVisionModel:
        return QwenVisionModel(config=cls.standard_config(hf), family=cls.family,
                               vision=cls.tower_family.tower(hf, dtype, merger=True))

    @classmethod
    def name_map(cls, hf, skeleton=None):
        skeleton = skeleton if skeleton is not None else cls.skeleton(hf, "float32")
        return skeleton.vision.name_map("vision", "", cls.tower_family.names)

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        return cls.tower_family.ignored(hf)

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        return {"": ("visual.", "")}


class Qwen2VL(WrapperFamily):
    family = "qwen2_vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    # no videos; image tokens are found by image_token_id
    handled = WrapperFamily.handled | {"video_token_id", "vision_start_token_id", "vision_end_token_id"}
    model_class = QwenVLModel
    keys = {"tower": "model.visual.", "text": "model.language_model."}

    @classmethod
    def tower_for(cls, hf):
        return QwenViTFamily

    @classmethod
    def projector(cls, hf, dtype):
        return cls.tower_for(hf).merger(hf.vision_config, dtype)

    @classmethod
    def projector_entries(cls, hf, projector):
        names = cls.tower_for(hf).names.get("merger", QWEN2_MERGER_NAMES)
        return [e.under(cls.keys["tower"] + "merger.", "projector.") for e in projector.entries(names)]

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        """transformers 5 saves ``model.language_model.`` and ``model.visual.``; hub checkpoints keep the text model
        under ``model.`` and the tower under ``visual.``."""
        return {"model.language_model.": ("model.language_model.", "model."),
                "model.visual.": ("model.visual.", "visual.")}


class HyperCLOVAXVisionV2(Qwen2VL):
    family = "hyperclovax_vision_v2"
    model_types = ("hyperclovax_vision_v2",)
    model_class = HCXVisionModel
    keys = {"tower": "model.vision_model.", "text": "model.language_model."}

    @classmethod
    def tower(cls, hf, dtype):
        return QwenViTFamily.tower(hf.vision_config, dtype, merger=True)

    @classmethod
    def projector(cls, hf, dtype):
        return LinearProjector.skeleton(QwenViTFamily.out_width(hf.vision_config), hf.text_config.hidden_size, dtype)

    @classmethod
    def projector_entries(cls, hf, projector):
        return [e.under("model.projector.", "projector.") for e in projector.entries()]

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        """transformers saves the hub's layout: the head inside the text model, the projector as
        ``vision_projector``."""
        return {"lm_head.": ("lm_head.", "model.language_model.lm_head."),
                "model.projector.": ("model.projector.", "model.vision_projector.")}
