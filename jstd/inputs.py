"""``jstd.Inputs``: what a model runs on — token ids, their padding mask, and images."""

from __future__ import annotations

from typing import Any, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

# processor outputs that carry nothing a jstd model reads
IGNORED_KEYS = ("token_type_ids", "position_ids", "mm_token_type_ids")  # Qwen2-VL's: the image tokens' mask


class Inputs(eqx.Module):
    """A model's inputs, a pytree (jit and vmap pass it through).

    tokens: ``[batch, seq]`` token ids, or None for a standalone vision tower.
    attention_mask: ``[batch, seq]`` (1: real token, 0: padding) or None.
    images: the family's image arrays and metadata as its processor returns
        them (``pixel_values``, ``image_sizes``, ``pixel_attention_mask``,
        ``image_grid_thw``, …), or None.
    layout: what about the images fixes the shapes of the computation, as
        static data (jit compiles once per layout, as once per shape):
        ``(("image_sizes", ((h, w), …)), ("real_images", ((True, False), …)))``.
        ``Inputs.of`` records it from the processor's arrays: each image's
        patch grid (``image_grid_thw``, Qwen2-VL: the packed row's segments
        and positions), the images'
        original sizes (LLaVA-NeXT unpads to them) and, for pixel values
        padded to ``[batch, images, …]`` with all-zero images (Idefics 3),
        which images are real. A model that needs it says so when it is
        missing.
    """

    tokens: Int[Array, "batch seq"] | None = None
    attention_mask: Int[Array, "batch seq"] | None = None
    images: dict[str, Array] | None = None
    layout: tuple = eqx.field(static=True, default=())

    def static(self, key: str):
        """The ``layout`` entry ``key`` (nested tuples), or None."""
        return dict(self.layout).get(key)

    @classmethod
    def of(cls, batch: Mapping[str, Any]) -> "Inputs":
        """The inputs in a HuggingFace tokenizer's or processor's output (``BatchEncoding``, ``BatchFeature``,
        a dict; numpy arrays, lists or torch tensors): ``input_ids`` -> tokens, ``attention_mask``, and every
        other array (``pixel_values``…) into ``images``. Raises TypeError for anything else."""
        if isinstance(batch, Inputs):
            return batch
        if not hasattr(batch, "keys"):
            raise TypeError(f"Inputs.of takes a tokenizer or processor output (a mapping with input_ids or "
                            f"pixel_values), got {type(batch).__name__}")
        data = {k: _array(k, batch[k]) for k in batch.keys() if k not in IGNORED_KEYS}
        tokens = data.pop("input_ids", None)
        mask = data.pop("attention_mask", None)
        if tokens is None and not any(k.startswith("pixel_values") for k in data):
            raise TypeError(f"Inputs.of found neither input_ids nor images (pixel_values) in keys {sorted(batch.keys())}")
        return cls(tokens, mask, data or None, image_layout(data))


def with_layout(inputs: Inputs) -> Inputs:
    """``inputs`` with its static ``layout`` recorded from concrete image arrays where it is missing (traced
    arrays are left as they are: build the inputs with ``Inputs.of`` outside jit)."""
    if inputs.layout or not inputs.images or any(isinstance(v, jax.core.Tracer) for v in inputs.images.values()):
        return inputs
    return Inputs(inputs.tokens, inputs.attention_mask, inputs.images, image_layout(inputs.images))


def image_layout(images: Mapping[str, np.ndarray]) -> tuple:
    """The static ``Inputs.layout`` of concrete image arrays (see ``Inputs``)."""
    layout = []
    if "image_grid_thw" in images:
        layout.append(("image_grid_thw", tuple(tuple(int(v) for v in row) for row in np.asarray(images["image_grid_thw"]))))
    if "image_sizes" in images:
        layout.append(("image_sizes", tuple(tuple(int(v) for v in row) for row in np.asarray(images["image_sizes"]))))
    pixels = images.get("pixel_values")
    if pixels is not None and np.ndim(pixels) == 5:
        real = np.asarray(pixels).reshape(*np.shape(pixels)[:2], -1).any(axis=-1)
        layout.append(("real_images", tuple(tuple(bool(v) for v in row) for row in real)))
    return tuple(layout)


def _array(key: str, value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, from return_tensors="pt"
        value = value.detach().cpu().numpy()
    if isinstance(value, str) or (isinstance(value, (list, tuple)) and value and isinstance(value[0], str)):
        raise TypeError(f"Inputs.of: {key} holds strings; pass the tokenizer's output (return_tensors='np')")
    try:
        return np.asarray(value)
    except ValueError as e:
        raise ValueError(f"Inputs.of: {key} is ragged ({e}); call the tokenizer with padding=True and "
                         "return_tensors='np'") from None


def as_inputs(tokens, attention_mask=None) -> Inputs:
    """``run``'s first argument as Inputs: a token array (with ``attention_mask``), Inputs, or a processor output."""
    if isinstance(tokens, Inputs):
        if attention_mask is not None:
            raise ValueError("pass attention_mask inside the jstd.Inputs, not beside it")
        return tokens
    if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], str)):
        raise TypeError("run takes token ids, not text: tokenize first, e.g. "
                        "jstd.Inputs.of(jstd.load_processor(path)(texts, return_tensors='np', padding=True))")
    if hasattr(tokens, "keys"):
        if isinstance(tokens, jax.core.Tracer):
            raise TypeError("a processor output cannot be traced: convert it outside jit with jstd.Inputs.of")
        inputs = Inputs.of(tokens)
        if attention_mask is not None:
            raise ValueError("pass attention_mask inside the processor output, not beside it")
        return inputs
    return Inputs(tokens, attention_mask)


def token_array(tokens) -> Int[Array, "batch seq"]:
    """``tokens`` as an integer ``[batch, seq]`` array; ValueError naming the fix for anything else."""
    tokens = jnp.asarray(tokens) if not isinstance(tokens, jax.core.Tracer) else tokens
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq] token ids, got shape {tokens.shape}; add a batch axis with tokens[None]")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    return tokens
