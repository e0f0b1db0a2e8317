"""``jstd.Inputs``: what a model runs on — token ids, their padding mask, and images."""

from __future__ import annotations

from typing import Any, Mapping

import equinox as eqx
import jax
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
        other array (``pixel_values``…) into ``images``. An unbatched tokenizer output (``tokenizer(text)``:
        1-D ``input_ids``) is one row. Raises TypeError for anything else (strings: tokenize first)."""
        if isinstance(batch, Inputs):
            return batch
        if not hasattr(batch, "keys"):
            raise TypeError(f"Inputs.of takes a tokenizer or processor output (a mapping with input_ids or "
                            f"pixel_values), got {type(batch).__name__}")
        data = {k: _array(k, batch[k]) for k in batch.keys() if k not in IGNORED_KEYS}
        tokens = data.pop("input_ids", None)
        mask = data.pop("attention_mask", None)
        if tokens is not None and tokens.ndim == 1:  # one text, unbatched (tokenizer(text)): one row
            tokens, mask = tokens[None], None if mask is None else mask.reshape(1, -1)
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
        raise ValueError(f"Inputs.of: {key} is ragged (rows of different lengths); call the tokenizer with "
                         "padding=True and return_tensors='np'") from None


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
        if isinstance(tokens, jax.core.Tracer) or any(isinstance(tokens[k], jax.core.Tracer) for k in tokens.keys()):
            raise TypeError("a processor output (a dict of arrays) cannot be traced: convert it outside jit with "
                            "jstd.Inputs.of(batch) and pass the jstd.Inputs")
        inputs = Inputs.of(tokens)
        if attention_mask is not None:
            raise ValueError("pass attention_mask inside the processor output, not beside it")
        return inputs
    return Inputs(tokens, attention_mask)


def token_array(tokens) -> Int[Array, "batch seq"] | Int[np.ndarray, "batch seq"]:
    """``tokens`` checked to be integer token ids ``[batch, seq]`` with at least one row and one token.

    Ids that are not a JAX array (numpy, lists, torch) come back as a numpy
    array of their own dtype, not yet cast to JAX's int32 (``check_tokens``
    checks their range first, so an int64 id past 2**31 cannot wrap to a
    valid one); JAX arrays (traced or not) come back as they are.
    Raises TypeError for text and ValueError for ragged rows, non-integers,
    other ranks and empty batches or sequences, each naming the fix.
    """
    if not isinstance(tokens, jax.Array):  # jax arrays (traced or not) are int32 already and stay where they are
        try:
            tokens = np.asarray(tokens.detach().cpu() if hasattr(tokens, "detach") else tokens)
        except ValueError:
            raise ValueError("tokens are ragged (rows of different lengths): pad them to one length, e.g. call the "
                             "tokenizer with padding=True and return_tensors='np'") from None
    if tokens.dtype.kind in "US":
        raise TypeError(f"tokens must be token ids, got an array of {tokens.dtype} (text?); tokenize first, e.g. "
                         "jstd.Inputs.of(jstd.load_processor(path)(texts, return_tensors='np', padding=True))")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq] token ids, got shape {tokens.shape}; add a batch axis with tokens[None]")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if 0 in tokens.shape:
        raise ValueError(f"tokens have shape {tokens.shape}: a run needs at least one row and one token per row "
                         "(an empty prompt has nothing to compute; check the texts and add_special_tokens)")
    return tokens
