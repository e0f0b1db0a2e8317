"""The merge every vision-language wrapper shares: image features scattered into the token embeddings at the
image tokens, with static shapes.

The ``k``-th image token of the batch (row-major: batch rows in order, positions in order within a row) takes
the ``k``-th feature row: a cumulative sum over the mask gives each position its feature index, a gather reads
the features and ``where`` keeps the text embeddings elsewhere. No shape depends on the data, so it jits and
vmaps; a prompt without images simply has no image tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jstd.core.checks import checked


def image_token_mask(tokens: Int[Array, "batch seq"], image_token_id: int) -> Bool[Array, "batch seq"]:
    return tokens == image_token_id


def check_image_tokens(tokens: Int[Array, "batch seq"], image_token_id: int, features: int, what: str):
    """``tokens``, checked to hold exactly ``features`` image tokens: a ValueError at once for concrete ids, an
    equinox runtime error under jit. ``what`` says where the features come from (the images)."""
    msg = (f"the prompts hold {{}} image tokens (id {image_token_id}) but {what} give {features} image features; "
           "build the prompt and the images with the model's processor, one image placeholder per image "
           "(jstd.Inputs.of(processor(text=..., images=..., return_tensors='np')))")
    return checked(tokens, lambda xp, t: (t == image_token_id).sum() != features, msg.format("a different number of"),
                   concrete=lambda t, _: msg.format(int((t == image_token_id).sum())))


def scatter(embeddings: Float[Array, "batch seq hidden"], mask: Bool[Array, "batch seq"],
            features: Float[Array, "image_tokens hidden"]) -> Float[Array, "batch seq hidden"]:
    """``embeddings`` with the ``k``-th True position of ``mask`` (row-major) replaced by ``features[k]``, cast to
    the embeddings' dtype. The caller has checked that ``mask`` holds ``len(features)`` positions."""
    if features.shape[0] == 0:
        return embeddings
    return jnp.where(mask[..., None], gathered(mask, features).astype(embeddings.dtype), embeddings)


def scatter_add(stream: Float[Array, "batch seq hidden"], mask: Bool[Array, "batch seq"],
                features: Float[Array, "image_tokens hidden"]) -> Float[Array, "batch seq hidden"]:
    """``stream`` with ``features[k]`` (cast to the stream's dtype) added at the ``k``-th True position of ``mask``
    (row-major) and nothing added elsewhere (Qwen3-VL's DeepStack). The caller has checked the count."""
    if features.shape[0] == 0:
        return stream
    return jnp.where(mask[..., None], stream + gathered(mask, features).astype(stream.dtype), stream)


def gathered(mask: Bool[Array, "batch seq"], features: Float[Array, "image_tokens hidden"]
             ) -> Float[Array, "batch seq hidden"]:
    """At each position, the feature row of its rank among the True positions of ``mask`` (row-major); rows at
    False positions are arbitrary (the callers mask them)."""
    index = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, features.shape[0] - 1).reshape(mask.shape)
    return features[index]
