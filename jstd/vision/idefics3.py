"""Idefics 3 (``idefics3``) and SmolVLM (``smolvlm``): a SigLIP-shaped NaViT tower over image tiles, a pixel
shuffle with a bias-free linear, a Llama-style text model at ``model.text_model``.

    pixel_values     [batch, max_images, C, H, W]      # the processor's tiles (+ each image resized whole), zero-padded
    tiles            = the real rows of pixel_values    # static: Inputs.layout's real_images (all-zero rows dropped)
    patch_mask       = any pixel of the patch real      # from pixel_attention_mask [batch, max_images, H, W]
    vision.tower_output = tower(tiles, patch_mask)      # post_layernorm on every patch
    projector.input  = vision.tower_output              # [tiles, patches, vision_hidden]
    projector.output = modality_projection(pixel_shuffle(projector.input, scale_factor))   # [tiles, tokens, hidden]
    vision.image_features = projector.output flattened, tiles in order (batch rows, then image slots)

The processor splits each image into ``image_size`` tiles and appends the whole image resized to one tile; each
tile is a row of the tower's batch. ``pixel_values`` is padded to the batch's most images with all-zero images,
which transformers drops before the tower; jstd drops the same ones, statically, from ``inputs.layout``'s
``real_images`` (build the inputs with ``jstd.Inputs.of`` outside jit). A patch is real where any of its pixels is
(``pixel_attention_mask``; all real without one); padding patches are masked as keys in every tower block and take
position 0, and each tile's real patch grid is resampled onto the position table by bucketized fractional
coordinates (``jstd.vision.tower.resampled_positions``), as transformers does. The pixel shuffle folds each
``scale_factor`` × ``scale_factor`` block of neighbouring patches into one token (transformers' order), so a tile
of ``(H / patch)²`` patches gives ``(H / patch)² / scale_factor²`` image tokens; every other token of the prompt
(``<fake_token_around_image>``, ``<global-img>``, the row/column tags) is ordinary text. The ``k``-th image token
of the batch takes the ``k``-th feature row: ``layers.0.layer_input[vision.image_token_mask] ==
vision.image_features``.

SmolVLM is the same model (its transformers code differs only in running one blank image when a batch holds no
real image, where jstd refuses the all-padding images). Hub checkpoints and transformers 5 store the tensors as
held in memory: ``model.vision_model.``, ``model.connector.modality_projection.proj``, ``model.text_model.``,
``lm_head``.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from jstd.core.inputs import Inputs
from jstd.nn.namemap import Entry
from jstd.vision.projector import PixelShuffleProjector
from jstd.vision.tower import check_pixels
from jstd.vision.towers import ViTFamily
from jstd.vision.wrapper import VisionLanguageModel, WrapperFamily

IDEFICS3_KEYS = {"tower": "model.vision_model.", "text": "model.text_model.", "projector": "model.connector."}
PROJECTOR_NAMES = {"proj": "modality_projection.proj"}


class Idefics3Vision(ViTFamily):
    """The NaViT-style SigLIP tower (``idefics3_vision``, ``smolvlm_vision``): no class token, a biased patch conv,
    ``post_layernorm`` on every patch. Served inside the wrapper only (its positions depend on the patch mask)."""

    family = "idefics3_vision"
    model_types = ("idefics3_vision", "smolvlm_vision")
    class_token, patch_bias, pre_norm, post_norm = False, True, False, True
    unused = ()


class Idefics3Model(VisionLanguageModel):
    """The tower runs on the real tiles only; the projector reads ``vision.tower_output``."""

    scale: int = eqx.field(static=True, default=2)

    def real_tiles(self, inputs: Inputs) -> np.ndarray:
        """The flat indices (over ``[batch·max_images]``) of the real images, from the static layout."""
        real = inputs.static("real_images")
        shape = tuple(np.shape(inputs.images["pixel_values"])[:2])
        if real is None:
            raise ValueError(f"this {self.family} model needs to know which of the padded images are real "
                             "(Inputs.layout's real_images): build the inputs with jstd.Inputs.of(processor(...)) "
                             "outside jit, or jstd.core.inputs.with_layout(inputs)")
        real = np.asarray(real, bool)
        if real.shape != shape:
            raise ValueError(f"Inputs.layout's real_images has shape {real.shape} but pixel_values holds {shape} "
                             "images: rebuild the inputs with jstd.Inputs.of")
        return np.flatnonzero(real.reshape(-1))

    def tower_images(self, inputs: Inputs):
        pixels = jnp.asarray(inputs.images["pixel_values"])
        batch, slots, c, height, width = pixels.shape
        real = self.real_tiles(inputs)
        tiles = pixels.reshape(batch * slots, c, height, width)[real]
        p = self.vision.patch_size
        pixel_mask = inputs.images.get("pixel_attention_mask")
        if pixel_mask is None:
            return tiles, jnp.ones((len(real), height // p, width // p), bool)
        pixel_mask = jnp.asarray(pixel_mask).reshape(batch * slots, height, width)[real]
        if pixel_mask.dtype == jnp.bool_:
            pixel_mask = pixel_mask.astype(jnp.int32)
        blocks = pixel_mask.reshape(len(real), height // p, p, width // p, p)
        return tiles, blocks.sum(axis=(2, 4)) > 0

    def num_features(self, inputs: Inputs) -> int:
        return sum(self.image_token_counts(inputs))

    def image_token_counts(self, inputs: Inputs) -> tuple[int, ...]:
        """Per real tile (the processor's crops and the whole image, each its own tower image)."""
        _, _, _, height, width = np.shape(inputs.images["pixel_values"])
        p = self.vision.patch_size
        return ((height // p) * (width // p) // self.scale ** 2,) * len(self.real_tiles(inputs))

    def check_images(self, images: dict) -> None:
        v = self.config.vision
        pixels = images.get("pixel_values")
        shape = tuple(np.shape(pixels))
        side = v.patch_size * self.scale
        if (len(shape) != 5 or shape[2] != v.num_channels or shape[3] != shape[4] or shape[3] % side):
            raise ValueError(f"pixel_values has shape {shape}; this {self.family} model takes [batch, images, "
                             f"{v.num_channels}, size, size] with size a multiple of {side} (patch_size "
                             f"{v.patch_size} × scale_factor {self.scale}), as its processor makes them")
        mask = images.get("pixel_attention_mask")
        if mask is not None and tuple(np.shape(mask)) != shape[:2] + shape[3:]:
            raise ValueError(f"pixel_attention_mask has shape {tuple(np.shape(mask))}; pixel_values {shape} needs "
                             f"{shape[:2] + shape[3:]}")
        check_pixels(pixels, shape[1:], f"this {self.family} model")  # floating point

    def check_inputs(self, inputs: Inputs) -> None:
        super().check_inputs(inputs)
        if inputs.images is not None and len(self.real_tiles(inputs)) == 0:
            raise ValueError("every image in pixel_values is all zeros (padding): pass images=None for text alone")


class Idefics3(WrapperFamily):
    family = "idefics3"
    model_types = ("idefics3",)
    handled = WrapperFamily.handled | {"scale_factor"}
    model_class = Idefics3Model
    keys = IDEFICS3_KEYS

    @classmethod
    def tower_for(cls, hf):
        model_type = getattr(hf.vision_config, "model_type", None)
        if model_type not in Idefics3Vision.model_types:
            raise ValueError(f"{hf.model_type}: its vision tower's model_type {model_type!r} is not supported; "
                             f"jstd's {cls.family} towers: {', '.join(Idefics3Vision.model_types)}")
        return Idefics3Vision

    @classmethod
    def projector(cls, hf, dtype) -> PixelShuffleProjector:
        return PixelShuffleProjector.skeleton(hf.vision_config.hidden_size, hf.text_config.hidden_size,
                                              hf.scale_factor, dtype)

    @classmethod
    def projector_entries(cls, hf, projector) -> list[Entry]:
        return [e.under(cls.keys["projector"], "projector.") for e in projector.entries(PROJECTOR_NAMES)]

    @classmethod
    def extra(cls, hf) -> dict:
        return {"scale": hf.scale_factor}


class SmolVLM(Idefics3):
    family = "smolvlm"
    model_types = ("smolvlm",)
