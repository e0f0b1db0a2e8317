"""Prompts with images for ``jstd.attribute``: an image-text wrapper's image tokens as input nodes.

Every vision-language wrapper jstd serves (Llava / VipLlava / DeepSeek-VL, LLaVA-NeXT, Idefics 3 / SmolVLM, Gemma
3, the Qwen-VL line: ``jstd.vision.wrapper``) puts its images into the text model one way: the ``k``-th image
token of the prompt takes the ``k``-th row of ``vision.image_features`` (the projector's output, packed), in place
of its token embedding, before the embedding multiplier (``jstd.vision.scatter``). So an image token's input to
the text model — its *merged embedding* — sits exactly where a text token's embedding sits, and attribution
treats it the same way: the token slot of its position (circuit-tracer's node order is unchanged, ``[features |
errors | tokens | logits]``, ``n`` token slots) holds the text token's embedding at a text position and the image
feature row at an image position. Its edges are the direct effects of that vector; ``Graph.image_patches`` labels
it ("img ``i`` patch ``j``": image ``i`` of the prompt in the tower's order, its ``j``-th image token).

The vision tower and the projector are frozen and out of the graph: the features are computed once on the prompt
and held (``ImagePrompt.features``), and the linearised model (``jstd.circuits.replacement.linearised``) sets
``vision.image_features`` to them plus the perturbation of the input at each image position (``merged_edits``),
so a gradient at the token slots is the gradient at the merged embeddings, and the tower does not run again in
the backward programs (nothing reads its output). What the wrapper adds beside the merge stays as on the prompt:
the multimodal rotary's positions (Qwen's M-RoPE), the image tokens' bidirectional blocks (Gemma 3, held like
every attention pattern), and Qwen3-VL's DeepStack additions to the first blocks' outputs (held constants, like
biases: not nodes).

One prompt with images is one ``ImagePrompt``; several prompts with images are attributed one at a time.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.core.edits import Set
from jstd.core.inputs import Inputs, with_layout
from jstd.run import run
from jstd.vision.wrapper import VisionLanguageModel


class ImagePrompt(Inputs):
    """One prompt with images, as ``jstd.run`` takes it (``tokens [1, n]``, the images, no attention mask), plus
    ``positions [image_tokens]`` (the image tokens' positions, in order) and ``features [image_tokens, d]`` (the
    merged image features, held; None until ``with_features``)."""

    positions: Int[Array, "image_tokens"] | None = None
    features: Float[Array, "image_tokens hidden"] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    @property
    def cuttable(self) -> bool:
        """False: a prompt with images is never cut to its first positions (``cuttable``): that would cut image
        tokens from their images, and Gemma 3's bidirectional blocks."""
        return False


def cuttable(prompt) -> bool:
    """Whether ``attribute`` may run ``prompt`` (token ids ``[1, N]`` or an ``ImagePrompt``) cut to its first ``P``
    positions for targets before ``P`` (a causal model: nothing later reaches them): token ids may; an
    ``ImagePrompt`` says (``ImagePrompt.cuttable``)."""
    return prompt.cuttable if isinstance(prompt, ImagePrompt) else True


def has_images(prompt) -> bool:
    """Whether ``prompt`` (anything ``attribute`` takes) carries images: a ``jstd.Inputs`` with images, or a
    processor's output holding ``pixel_values``."""
    if isinstance(prompt, Inputs):
        return prompt.images is not None
    return isinstance(prompt, Mapping) and any(str(k).startswith("pixel_values") for k in prompt.keys())


def image_prompt(model, prompt, tokens: Callable[[np.ndarray], np.ndarray]):
    """``(ids [n], ImagePrompt, image_patches [n, 2])`` of one prompt with images: ``prompt`` a ``jstd.Inputs`` or
    a processor's output (``processor(text=..., images=..., return_tensors="np")``) of one row (padding, where its
    attention mask has some, dropped); ``tokens`` turns its ids into the attributed ids (``attribute``'s BOS rule).
    ``image_patches``: ``(image, patch)`` at each image token, ``(-1, -1)`` at text positions.

    Raises ValueError for a model that takes no images, more than one row, or image tokens that do not match the
    images (the wrapper's own check: how many the prompt holds and how many the images give)."""
    if not isinstance(model, VisionLanguageModel):
        raise ValueError(f"attribute: this {model.family} model is a text model and takes no images; attribute a "
                         "vision-language model (Llava, LLaVA-NeXT, Idefics 3, Gemma 3, Qwen-VL, ...) or drop them")
    inputs = with_layout(Inputs.of(prompt))
    ids = np.asarray(inputs.tokens)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"attribute: the inputs hold {ids.shape[0] if ids.ndim == 2 else ids.shape} rows of tokens; "
                         "with images, pass one prompt per jstd.Inputs (the processor's output for one text and its "
                         "images), or a list of them for several graphs")
    ids = ids[0]
    if inputs.attention_mask is not None:
        ids = ids[np.asarray(inputs.attention_mask).reshape(-1).astype(bool)]
    ids = tokens(ids)
    positions = np.flatnonzero(ids == model.image_token_id)
    prompt = ImagePrompt(jnp.asarray(ids[None], jnp.int32), None, inputs.images, inputs.layout,
                         jnp.asarray(positions, jnp.int32))
    type(model).check_inputs(model, prompt)  # the image tokens against the images: the wrapper's ValueError
    counts = model.image_token_counts(prompt)
    if sum(counts) != len(positions):  # (check_inputs has compared the total: a wrapper's count is wrong)
        raise ValueError(f"attribute: {model.family} labels {sum(counts)} image tokens but the prompt holds "
                         f"{len(positions)}")
    patches = np.full((len(ids), 2), -1, np.int64)
    patches[positions, 0] = np.repeat(np.arange(len(counts)), counts)
    patches[positions, 1] = np.concatenate([np.arange(c) for c in counts]) if counts else []
    return ids, prompt, patches


def with_features(model, prompt: ImagePrompt, embeddings: Float[Array, "batch seq hidden"]):
    """``(prompt with its features held, merged [1, n, d])``: the image features of ``prompt`` (one forward of the
    tower and projector) and ``embeddings`` (its ``token_embeddings``) with them at the image positions: every
    position's input vector (float32)."""
    features = run(model, prompt, reads=("vision.image_features",))["vision.image_features"]
    merged = jnp.asarray(embeddings, jnp.float32).at[:, prompt.positions].set(features.astype(jnp.float32))
    return ImagePrompt(prompt.tokens, None, prompt.images, prompt.layout, prompt.positions, features), merged


def merged_edits(tokens, d_e: Float[Array, "1 seq hidden"]) -> list:
    """The edits that make ``d_e`` at the image positions a perturbation of the merged embeddings: none for token
    ids; for an ``ImagePrompt``, ``vision.image_features`` set to the held features plus ``d_e`` at its image
    positions (``Add("token_embeddings", d_e)`` alone reaches the text positions only: the merge replaces the rest)."""
    if not isinstance(tokens, ImagePrompt):
        return []
    if tokens.features is None:
        raise ValueError("an ImagePrompt's features are not held yet (jstd.circuits.inputs.with_features)")
    return [Set("vision.image_features", tokens.features + d_e[0, tokens.positions].astype(tokens.features.dtype))]
