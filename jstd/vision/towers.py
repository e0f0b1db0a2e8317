"""The CLIP and SigLIP vision towers, declared on the shared ``VisionTower`` and ``Block``.

CLIP (``clip_vision_model``): a class token prepended after the patch
embedding, ``pre_layrnorm`` before block 0 (``vision.layers.0.layer_input`` is
its output), and no norm on the patches after the last block
(``post_layernorm`` norms the pooled class token only, so it is not part of
any value: ``vision.tower_output`` is the last block's output). QuickGELU MLPs.

SigLIP (``siglip_vision_model``): no class token (the patch axis is the patch
grid on every value), a biased patch conv, no pre-norm, and ``post_layernorm``
norms every patch (``vision.tower_output`` is its output). GELU(tanh) MLPs.
The pooling head (``vision_use_head``) produces no standard value and is not
loaded.

Both store their tensors under ``vision_model.`` (hub checkpoints) or at the
top level (what transformers 5 saves for a vision model alone); both load.
"""

from __future__ import annotations

from jstd.core.config import ModelConfig, VisionConfig
from jstd.models.family import Family
from jstd.nn.params import shape
from jstd.nn.attention import Attention
from jstd.nn.block import Block
from jstd.nn.mlp import MLP
from jstd.nn.norms import LayerNorm
from jstd.nn.stack import Stack
from jstd.vision.tower import VisionModel, VisionTower

VIT_NAMES = {"attention_norm": "layer_norm1", "attn": "self_attn", "mlp_norm": "layer_norm2", "mlp": "mlp",
             "out": "out_proj", "layers": "encoder.layers", "pre_norm": "pre_layrnorm", "post_norm": "post_layernorm"}


class ViTFamily(Family):
    """A ViT tower loaded alone; subclasses say whether it has a class token, a pre-norm and a patch norm."""

    class_token: bool
    patch_bias: bool
    pre_norm: bool
    post_norm: bool
    unused: tuple[str, ...]  # checkpoint tensors no standard value reads
    names = VIT_NAMES  # the checkpoint's module names (VisionTower.name_map)
    handled = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_channels", "image_size", "patch_size", "hidden_act", "layer_norm_eps"})

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        return cls.unused + ("*position_ids",)

    @classmethod
    def vision_config(cls, hf) -> VisionConfig:
        grid = (hf.image_size // hf.patch_size) ** 2
        return VisionConfig(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads, intermediate_size=hf.intermediate_size,
            image_size=hf.image_size, patch_size=hf.patch_size, num_channels=hf.num_channels,
            num_patches=grid, positions=grid + cls.class_token,
        )

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        return ModelConfig(model_type=hf.model_type, vision=cls.vision_config(hf))

    @classmethod
    def tower(cls, hf, dtype) -> VisionTower:
        v = cls.vision_config(hf)
        norm = lambda: LayerNorm.skeleton(v.hidden_size, hf.layer_norm_eps, dtype)
        block = lambda kind: Block(
            attention_norm=norm(),
            attn=Attention.skeleton(v.hidden_size, v.num_heads, v.num_heads, v.head_dim, v.head_dim ** -0.5, True,
                                    True, dtype),
            attention_post_norm=None, mlp_norm=norm(),
            mlp=MLP.skeleton(v.hidden_size, v.intermediate_size, hf.hidden_act, dtype), mlp_post_norm=None,
        )
        return VisionTower(
            patch_embedding=shape(v.num_channels * v.patch_size ** 2, v.hidden_size, dtype=dtype),
            patch_bias=shape(v.hidden_size, dtype=dtype) if cls.patch_bias else None,
            class_embedding=shape(v.hidden_size, dtype=dtype) if cls.class_token else None,
            position_embedding=shape(v.positions, v.hidden_size, dtype=dtype),
            pre_norm=norm() if cls.pre_norm else None,
            layers=Stack.skeleton("vision.layers", ("full_attention",) * v.num_layers, block),
            post_norm=norm() if cls.post_norm else None,
            patch_size=v.patch_size,
        )

    @classmethod
    def skeleton(cls, hf, dtype) -> VisionModel:
        return VisionModel(config=cls.standard_config(hf), family=cls.family, vision=cls.tower(hf, dtype))

    @classmethod
    def name_map(cls, hf, skeleton=None):
        skeleton = skeleton if skeleton is not None else cls.skeleton(hf, "float32")
        return skeleton.vision.name_map("vision", "", VIT_NAMES)

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        """Hub checkpoints keep the tower under ``vision_model.``; transformers 5 saves it at the top level."""
        return {"": ("vision_model.", "")}


class CLIPVision(ViTFamily):
    family = "clip_vision"
    model_types = ("clip_vision_model",)
    class_token, patch_bias, pre_norm, post_norm = True, False, True, False
    unused = ("post_layernorm.*",)  # it norms the pooled class token only: no standard value reads it
    handled = ViTFamily.handled | {"projection_dim"}  # CLIPVisionModelWithProjection's head, not the tower


class SiglipVision(ViTFamily):
    family = "siglip_vision"
    model_types = ("siglip_vision_model",)
    class_token, patch_bias, pre_norm, post_norm = False, True, False, True
    unused = ("head.*",)  # the attention-pooling head produces the pooled output, no standard value
    handled = ViTFamily.handled | {"vision_use_head"}


TOWERS = {t: f for f in (CLIPVision, SiglipVision) for t in f.model_types}
