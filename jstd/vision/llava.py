"""Llava 1.5 (``llava``) and VipLlava (``vipllava``): a CLIP (or SigLIP) tower, an MLP projector on blocks
before the last, one token per patch.

Llava's projector reads the tower's hidden state ``vision_feature_layer``
(transformers' count: 0 is the stream entering block 0, k > 0 block k - 1's
``layer_output``; -2 on Llava 1.5, so ``vision.layers[-2].layer_output``),
without the class token under ``vision_feature_select_strategy="default"``
and whole under ``"full"``; a list of layers is concatenated on the last
axis. VipLlava always drops the class token, concatenates its
``vision_feature_layer`` list in the config's order and norms the result with
``projector_layernorm`` before the MLP. The last block and
``vision.tower_output`` are computed and nothing reads them.
``vision.image_features`` is ``projector.output`` flattened over the images.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

from jstd.nn.namemap import Entry
from jstd.vision.projector import MLPProjector
from jstd.vision.wrapper import VisionLanguageModel, WrapperFamily

LLAVA_KEYS = {"tower": "model.vision_tower.", "text": "model.language_model.",
              "projector": "model.multi_modal_projector."}
# hub checkpoints: language_model.model.*, language_model.lm_head, vision_tower.vision_model.*; transformers 5
# saves language_model.model.*, vision_tower.* (and holds model.language_model.*, model.vision_tower.* in memory)
LLAVA_STORED = {
    "lm_head.": ("language_model.lm_head.", "lm_head."),
    "model.language_model.": ("language_model.model.", "model.language_model."),
    "model.vision_tower.": ("vision_tower.vision_model.", "model.vision_tower.vision_model.", "vision_tower.",
                            "model.vision_tower."),
    "model.multi_modal_projector.": ("multi_modal_projector.", "model.multi_modal_projector."),
}
PROJECTOR_NAMES = {"fc1": "linear_1", "fc2": "linear_2", "norm": "projector_layernorm"}


class LlavaModel(VisionLanguageModel):
    """The projector reads the kept ``streams``, each without the class token when ``drop_class``."""

    drop_class: bool = eqx.field(static=True, default=True)

    def select(self, tower_output, streams):
        return jnp.concatenate([x[:, 1:] if self.drop_class else x for x in streams], axis=-1)

    @property
    def tokens_per_image(self) -> int:
        return self.config.vision.positions - self.drop_class


def feature_layers(hf) -> tuple[int, ...]:
    layers = hf.vision_feature_layer
    return (layers,) if isinstance(layers, int) else tuple(layers)


class Llava(WrapperFamily):
    family = "llava"
    model_types = ("llava",)
    # image_seq_length is the processor's image token count; jstd counts the prompt's image tokens
    handled = WrapperFamily.handled | {"projector_hidden_act", "vision_feature_layer", "vision_feature_select_strategy",
                                       "multimodal_projector_bias", "image_seq_length"}
    model_class = LlavaModel
    keys = LLAVA_KEYS

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        return LLAVA_STORED

    @classmethod
    def norm_eps(cls, hf) -> float | None:
        return None

    @classmethod
    def bias(cls, hf) -> bool:
        return bool(getattr(hf, "multimodal_projector_bias", True))

    @classmethod
    def projector(cls, hf, dtype) -> MLPProjector:
        width = hf.vision_config.hidden_size * len(feature_layers(hf))
        return MLPProjector.skeleton(width, hf.text_config.hidden_size, hf.projector_hidden_act, cls.bias(hf), dtype,
                                     cls.norm_eps(hf))

    @classmethod
    def projector_entries(cls, hf, projector) -> list[Entry]:
        return [e.under(cls.keys["projector"], "projector.") for e in projector.entries(PROJECTOR_NAMES)]

    @classmethod
    def drop_class(cls, hf) -> bool:
        return getattr(hf, "vision_feature_select_strategy", "default") == "default"

    @classmethod
    def extra(cls, hf) -> dict:
        return {"streams": feature_layers(hf), "drop_class": cls.drop_class(hf)}


class VipLlava(Llava):
    family = "vipllava"
    model_types = ("vipllava",)
    handled = Llava.handled | {"projector_layernorm_eps"}

    @classmethod
    def norm_eps(cls, hf) -> float:
        return hf.projector_layernorm_eps

    @classmethod
    def bias(cls, hf) -> bool:
        return True

    @classmethod
    def drop_class(cls, hf) -> bool:
        return True
