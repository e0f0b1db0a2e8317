"""LLaVA-NeXT (``llava_next``): Llava 1.5's CLIP tower and MLP projector on crops, the projector's output unpadded
to each image's aspect ratio, with an ``image_newline`` row after each row of patches.

The processor cuts each image into a base image (the whole image, resized) and the crops of the resolution
``image_grid_pinpoints`` best fits (``select_best_resolution``): ``pixel_values`` is ``[images, max_crops,
channels, image_size, image_size]``, an image's ``1 + grid_rows * grid_cols`` crops first and padding after
(dropped, as transformers drops them). The tower runs on the kept crops as one batch, in image order, and the
projector reads block ``vision_feature_layer`` (-2: ``vision.layers[-2].layer_output``) without the class
token, as Llava 1.5's does (``vision_feature_select_strategy="full"`` keeps it, which only a tower without a
class token can pack). So ``projector.input`` is ``[crops, patches, width]`` and ``projector.output`` ``[crops,
patches, hidden]``.

Each image's features, in image order, are its base crop's ``patches`` rows, then its other crops' patches laid
out as one ``grid_rows·side × grid_cols·side`` grid (``side = image_size // patch_size``), unpadded to the
image's aspect ratio (rows or columns cut evenly from both ends, transformers' ``unpad_image``), each row of
the grid followed by ``image_newline``, in raster order. ``vision.image_features`` is ``[image_tokens,
hidden]``, those rows of every image: ``projector.output``'s ``crops · patches`` rows less the rows and columns
unpadding cuts, plus one newline per kept grid row (a base image and one uncut 2 × 2-patch crop: 8 rows in, 10
out). Every crop count, grid and unpadded size depends only on the images' original sizes, which are static:
``inputs.static("image_sizes")``, recorded by ``jstd.Inputs.of`` from the processor's ``image_sizes`` (build
the inputs outside jit).
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jstd.core.inputs import Inputs
from jstd.nn.params import shape
from jstd.nn.namemap import Entry
from jstd.vision.llava import LLAVA_STORED, Llava, LlavaModel

LLAVA_NEXT_STORED = {**LLAVA_STORED, "model.image_newline": ("image_newline", "model.image_newline")}


def select_best_resolution(original_size, possible_resolutions) -> tuple[int, int]:
    """transformers' ``select_best_resolution``: the ``(height, width)`` of ``possible_resolutions`` that keeps
    most of an image of ``original_size`` ``(height, width)`` when fitted inside, then wastes least."""
    original_height, original_width = original_size
    best_fit = None
    max_effective_resolution = 0
    min_wasted_resolution = float("inf")
    for height, width in possible_resolutions:
        scale = min(width / original_width, height / original_height)
        downscaled_width, downscaled_height = int(original_width * scale), int(original_height * scale)
        effective_resolution = min(downscaled_width * downscaled_height, original_width * original_height)
        wasted_resolution = (width * height) - effective_resolution
        if effective_resolution > max_effective_resolution or (
                effective_resolution == max_effective_resolution and wasted_resolution < min_wasted_resolution):
            max_effective_resolution = effective_resolution
            min_wasted_resolution = wasted_resolution
            best_fit = (height, width)
    return best_fit


def crop_grid(image_size, pinpoints, crop: int) -> tuple[int, int]:
    """``(grid_rows, grid_cols)``: the crops of side ``crop`` an image of ``image_size`` ``(height, width)`` is cut
    into (transformers' ``get_anyres_image_grid_shape``)."""
    height, width = select_best_resolution(image_size, pinpoints)
    if height % crop or width % crop:
        raise ValueError(f"image_grid_pinpoints holds {height}x{width}, not a multiple of the vision tower's "
                         f"image_size {crop}; LLaVA-NeXT cuts images into whole crops")
    return height // crop, width // crop


def unpadded_size(image_size, current: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rows and columns ``((top, bottom), (left, right))`` of a ``current`` ``(height, width)`` patch grid that
    transformers' ``unpad_image`` keeps for an image of original ``image_size`` ``(height, width)``, computed as it
    does (Python floats, rounded to 7 digits, then truncated)."""
    original_height, original_width = image_size
    current_height, current_width = current
    original_aspect_ratio = original_width / original_height
    current_aspect_ratio = current_width / current_height
    if original_aspect_ratio > current_aspect_ratio:
        scale_factor = current_width / original_width
        new_height = int(round(original_height * scale_factor, 7))
        padding = (current_height - new_height) // 2
        return (padding, current_height - padding), (0, current_width)
    scale_factor = current_height / original_height
    new_width = int(round(original_width * scale_factor, 7))
    padding = (current_width - new_width) // 2
    return (0, current_height), (padding, current_width - padding)


class LlavaNextModel(LlavaModel):
    """Llava's tower and projector on every image's crops; ``features`` unpads and adds ``image_newline``."""

    image_newline: Float[Array, "hidden"] | None = eqx.field(default=None, metadata={"axes": ("embed",)})
    grid_pinpoints: tuple[tuple[int, int], ...] = eqx.field(static=True, default=())

    # ---- the static plan, from the images' original sizes ----------------------
    def image_sizes(self, inputs: Inputs) -> tuple[tuple[int, int], ...]:
        sizes = inputs.static("image_sizes")
        if sizes is None:
            raise ValueError(f"this {self.family} model needs the images' original sizes as static data "
                             "(inputs.layout's image_sizes): build the inputs with "
                             "jstd.Inputs.of(processor(text=..., images=..., return_tensors='np')) outside jit")
        return sizes

    @property
    def side(self) -> int:
        return self.config.vision.image_size // self.config.vision.patch_size

    def grid(self, size) -> tuple[int, int]:
        return crop_grid(size, self.grid_pinpoints, self.config.vision.image_size)

    def crops(self, size) -> int:
        """An image's crops: the base image and its grid (transformers' ``image_size_to_num_patches``)."""
        rows, cols = self.grid(size)
        return rows * cols + 1

    def kept(self, size) -> tuple[tuple[int, int], tuple[int, int]]:
        rows, cols = self.grid(size)
        return unpadded_size(size, (rows * self.side, cols * self.side))

    def image_tokens(self, size) -> int:
        """One image's features: its base crop's patches and, per kept grid row, its kept columns and a newline."""
        (top, bottom), (left, right) = self.kept(size)
        return self.side ** 2 + (bottom - top) * (right - left + 1)

    # ---- the wrapper's hooks ----------------------------------------------------
    def check_images(self, images: dict) -> None:
        v = self.config.vision
        pixels = images.get("pixel_values")
        want = (v.num_channels, v.image_size, v.image_size)
        if np.ndim(pixels) != 5 or tuple(np.shape(pixels)[2:]) != want:
            raise ValueError(f"pixel_values has shape {tuple(np.shape(pixels))}; this {self.family} model takes "
                             f"[images, crops, {', '.join(map(str, want))}] (its image processor makes them)")
        if self.tokens_per_image != self.side ** 2:
            raise ValueError(f"the projector reads {self.tokens_per_image} rows per crop (the class token "
                             f"{'dropped' if self.drop_class else 'kept'} by vision_feature_select_strategy), which "
                             f"do not tile the {self.side}x{self.side} patch grid LLaVA-NeXT unpads; transformers "
                             "fails on it too (use 'default' with a CLIP tower)")

    def check_layout(self, inputs: Inputs) -> tuple[tuple[int, int], ...]:
        sizes = self.image_sizes(inputs)
        images, max_crops = np.shape(inputs.images["pixel_values"])[:2]
        if len(sizes) != images:
            raise ValueError(f"image_sizes holds {len(sizes)} sizes for {images} images in pixel_values")
        for i, size in enumerate(sizes):
            if self.crops(size) > max_crops:
                raise ValueError(f"image {i} of size {size} is cut into {self.crops(size)} crops but pixel_values "
                                 f"holds {max_crops} per image; pass the processor's pixel_values and image_sizes")
        return sizes

    def tower_images(self, inputs: Inputs):
        sizes = self.check_layout(inputs)
        pixels = jnp.asarray(inputs.images["pixel_values"])
        return jnp.concatenate([pixels[i, :self.crops(size)] for i, size in enumerate(sizes)]), None

    def features(self, projected: Float[Array, "crops patches hidden"],
                 inputs: Inputs) -> Float[Array, "image_tokens hidden"]:
        sizes = self.check_layout(inputs)
        hidden, side = projected.shape[-1], self.side
        newline = self.image_newline.astype(projected.dtype)
        out, start = [], 0
        for size in sizes:
            n = self.crops(size)
            crops = projected[start:start + n]
            start += n
            rows, cols = self.grid(size)
            # [rows, cols, side, side, hidden] -> [rows·side, cols·side, hidden]: patch (r, c) of crop (i, j) at
            # (i·side + r, j·side + c)
            grid = crops[1:].reshape(rows, cols, side, side, hidden).transpose(0, 2, 1, 3, 4)
            grid = grid.reshape(rows * side, cols * side, hidden)
            (top, bottom), (left, right) = self.kept(size)
            grid = grid[top:bottom, left:right]
            grid = jnp.concatenate([grid, jnp.broadcast_to(newline, (grid.shape[0], 1, hidden))], axis=1)
            out += [crops[0], grid.reshape(-1, hidden)]
        return jnp.concatenate(out)

    def num_features(self, inputs: Inputs) -> int:
        return sum(self.image_token_counts(inputs))

    def image_token_counts(self, inputs: Inputs) -> tuple[int, ...]:
        return tuple(self.image_tokens(size) for size in self.image_sizes(inputs))


class LlavaNext(Llava):
    family = "llava_next"
    model_types = ("llava_next",)
    handled = Llava.handled | {"image_grid_pinpoints"}
    model_class = LlavaNextModel

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        return LLAVA_NEXT_STORED

    @classmethod
    def extra(cls, hf) -> dict:
        return {**super().extra(hf), "grid_pinpoints": tuple(tuple(int(v) for v in p) for p in hf.image_grid_pinpoints)}

    @classmethod
    def skeleton(cls, hf, dtype) -> LlavaNextModel:
        model = super().skeleton(hf, dtype)
        return eqx.tree_at(lambda m: m.image_newline, model, shape(hf.text_config.hidden_size, dtype=dtype),
                           is_leaf=lambda x: x is None)

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        skeleton = skeleton if skeleton is not None else cls.skeleton(hf, jnp.float32)
        return super().name_map(hf, skeleton) + [Entry("model.image_newline", "image_newline")]
