"""A vision-language wrapper: a vision tower, a projector and a causal LM, merged at the image tokens.

    streams, out = vision(images)                       # vision.patch_embeddings, vision.layers.*, vision.tower_output
    x            = projector.input   ← select(out, streams)   # the family's choice: a block's stream, tower_output…
    y            = projector.output  ← projector(x)
    features     = vision.image_features ← pack(y)      # [image_tokens, hidden]: what the text model receives
    h0           = scatter(embed[tokens], tokens == image_token_id, features)
    logits       = text(h0)                             # token_embeddings, layers.*, final_norm_output, logits

A family subclasses ``VisionLanguageModel`` for what differs (which streams the
projector reads, how projected rows become features, how the images enter the
tower) and declares itself with a ``WrapperFamily``: its tower family, its
projector's skeleton and names, its checkpoint's prefixes. The tower and the
text model are the same modules as when loaded alone, so every tower and text
value is served under the same names. ``vision.image_features`` is read and
edited at the scatter: an edit there is what the text model receives.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jstd.core.config import ModelConfig
from jstd.core.inputs import Inputs
from jstd.nn.namemap import Entry
from jstd.models.family import Family
from jstd.nn.model import Model
from jstd.models import TEXT_FAMILIES
from jstd.nn.causal_lm import TEXT_MODEL_SITES, CausalLM
from jstd.vision.scatter import check_image_tokens, image_token_mask, scatter
from jstd.vision.tower import VisionTower, check_pixels
from jstd.vision.towers import TOWERS

WRAPPER_SITES = frozenset({"projector.input", "projector.output", "vision.image_features", "vision.image_token_mask"})


class VisionLanguageModel(Model):
    """Arrays: ``vision`` (a ``VisionTower``), ``projector`` (the family's), ``text`` (a ``CausalLM``).

    Subclasses override ``tower_images`` (which images the tower runs on), ``select`` (what the projector
    reads), ``features`` (projected rows -> image features) and ``num_features`` (their static count).
    """

    vision: VisionTower
    projector: eqx.Module
    text: CausalLM
    image_token_id: int = eqx.field(static=True)
    streams: tuple[int, ...] = eqx.field(static=True, default=())  # hidden-state indices the projector reads

    model_sites: ClassVar[frozenset[str]] = VisionTower.sites | TEXT_MODEL_SITES | WRAPPER_SITES

    @property
    def sites(self) -> frozenset[str]:
        return super().sites | self.text.rope_sites

    @property
    def stacks(self) -> dict:
        return {"layers": self.text.layers, "vision.layers": self.vision.layers}

    @property
    def decoder(self) -> CausalLM:
        """The text model: after the prefill it decodes alone (the image is in the cache by then)."""
        return self.text

    # ---- what a family overrides ---------------------------------------------
    def tower_images(self, inputs: Inputs):
        """``(pixel_values [images, channels, height, width], patch_mask or None)``: the tower's batch."""
        return jnp.asarray(inputs.images["pixel_values"]), None

    def select(self, tower_output, streams):
        """What the projector reads, from the tower's output and the ``streams`` it kept."""
        return tower_output

    def features(self, projected: Float[Array, "images tokens hidden"], inputs: Inputs) -> Float[Array, "image_tokens hidden"]:
        """The image features, in image-token order, from the projector's output."""
        return projected.reshape(-1, projected.shape[-1])

    def rope_positions(self, tokens, inputs: Inputs):
        """A multimodal rotary's position ids ``[3, batch, seq]`` for a prompt with images (None: the text model's
        own, from the tokens)."""
        return None

    def between_blocks(self, streams, mask, tap):
        """``(after, reads)``: what the wrapper adds to the text stream between blocks (``CausalLM.forward``'s
        ``after_block``; None: nothing) from the tower's ``streams``, and the values it read doing so (Qwen3-VL's
        DeepStack features)."""
        return None, {}

    def attention_blocks(self, image_mask: Bool[Array, "batch seq"]) -> Int[Array, "batch seq"] | None:
        """The text model's bidirectional blocks ``[batch, seq]`` from the image-token mask (``CausalLM.forward``'s
        ``blocks``; None: every token attends causally, the image tokens too)."""
        return None

    def num_features(self, inputs: Inputs) -> int:
        """How many image features ``inputs`` give (static: from the shapes and ``inputs.layout``)."""
        pixels = inputs.images["pixel_values"]
        return int(np.shape(pixels)[0]) * self.tokens_per_image

    def image_token_counts(self, inputs: Inputs) -> tuple[int, ...]:
        """The image tokens of each image the tower runs on, in image-token order (static; they sum to
        ``num_features``): what labels an image token "image ``i``, patch ``j``" (``jstd.attribute``)."""
        return (self.tokens_per_image,) * int(np.shape(inputs.images["pixel_values"])[0])

    @property
    def tokens_per_image(self) -> int:
        return self.config.vision.num_patches

    @property
    def discarded(self) -> frozenset[str]:
        """Values the model computes that nothing downstream reads (edits there change nothing):
        ``vision.tower_output`` where the projector reads the tower's hidden states (Llava 1.5, VipLlava,
        LLaVA-NeXT), as transformers does — even the last one, which is the last block's ``layer_output``."""
        return frozenset({"vision.tower_output"}) if self.streams else frozenset()

    # ---- shared ----------------------------------------------------------------
    def check_images(self, images: dict) -> None:
        """Raise ValueError where the image arrays do not fit the tower (the default: ``[images, C, H, W]``)."""
        v = self.config.vision
        check_pixels(images["pixel_values"], (v.num_channels, v.image_size, v.image_size), f"this {self.family} model")

    def check_inputs(self, inputs: Inputs) -> None:
        if inputs.tokens is None:
            raise ValueError(f"this {self.family} model reads a prompt: pass token ids with the images "
                             "(jstd.Inputs.of(processor(text=..., images=..., return_tensors='np')))")
        if inputs.images is not None:
            if inputs.images.get("pixel_values") is None:
                raise ValueError(f"the images hold no pixel_values (keys: {sorted(inputs.images)}); pass the "
                                 "processor's output")
            self.check_images(inputs.images)
        if not isinstance(inputs.tokens, jax.core.Tracer):  # concrete ids: the count is checked now, not at run time
            features = 0 if inputs.images is None else self.num_features(inputs)
            check_image_tokens(inputs.tokens, self.image_token_id, features, "no images" if inputs.images is None
                               else "the images")

    def forward(self, inputs: Inputs, tap, context=None):
        s = tap.scope()
        tokens = inputs.tokens
        mask = s("vision.image_token_mask", image_token_mask(tokens, self.image_token_id))
        merge = rope = after = None
        reads, added = {}, {}
        if inputs.images is None:
            tokens = check_image_tokens(tokens, self.image_token_id, 0, "no images")
            imaged = self.sites - self.text.sites - {"vision.image_token_mask"}  # the tower's, the merge's, DeepStack's
            touched = sorted(site for site in tap.reads | set(tap.edits) if site in imaged)
            if touched:
                raise ValueError(f"{touched[0]} needs images, and these inputs have none")
        else:
            tokens = check_image_tokens(tokens, self.image_token_id, self.num_features(inputs), "the images")
            pixels, patch_mask = self.tower_images(inputs)
            out, streams, reads = self.vision(pixels, tap, self.streams, patch_mask)
            x = s("projector.input", self.select(out, streams))
            y = s("projector.output", self.projector(x))
            features = s("vision.image_features", self.features(y, inputs))
            merge = lambda embeddings: scatter(embeddings, mask, features)
            rope = self.rope_positions(tokens, inputs)
            after, added = self.between_blocks(streams, mask, tap)
        logits, text_reads = self.text.forward(Inputs(tokens, inputs.attention_mask), tap, context, merge, rope, after,
                                               self.attention_blocks(mask))
        return logits, {**reads, **s.records, **added, **text_reads}

    # the text model's head, for the lens and direct logit attribution
    def project_on_vocab(self, hidden):
        return self.text.project_on_vocab(hidden)

    def readout(self):
        return self.text.readout()

    @property
    def conv_width(self):
        return self.text.conv_width


class WrapperFamily(Family):
    """The declaration of a vision-language wrapper: ``model_class`` (its ``VisionLanguageModel``),
    ``tower_for`` (a ``ViTFamily`` for ``hf.vision_config``), the text family from
    ``hf.text_config.model_type``, the projector (``projector``, ``projector_entries``), and the checkpoint's
    module prefixes (``keys``: ``tower``, ``text``; the projector's are in its entries)."""

    model_class: ClassVar[type]
    keys: ClassVar[dict]
    # text_config and vision_config are checked against the text and tower families (jstd.io.hf.unhandled)
    handled = frozenset({"text_config", "vision_config", "image_token_id", "image_token_index", "tie_word_embeddings"})

    @classmethod
    def text_family(cls, hf):
        model_type = getattr(hf.text_config, "model_type", None)
        family = TEXT_FAMILIES.get(model_type)
        if family is None:
            text = sorted(TEXT_FAMILIES)
            raise ValueError(f"{hf.model_type}: its text model's model_type {model_type!r} is not supported; "
                             f"jstd's text families: {', '.join(text)}")
        return family

    @classmethod
    def tower_for(cls, hf):
        """The tower family of ``hf.vision_config`` (CLIP or SigLIP by its model_type; a family may fix it)."""
        tower = TOWERS.get(getattr(hf.vision_config, "model_type", None))
        if tower is None:
            raise ValueError(f"{hf.model_type}: its vision tower's model_type {hf.vision_config.model_type!r} is "
                             f"not supported; jstd's towers: {', '.join(sorted(TOWERS))}")
        return tower

    @classmethod
    def text_config(cls, hf):
        """``hf.text_config`` with the wrapper's ``tie_word_embeddings`` (the head is the wrapper's)."""
        import copy

        text = copy.copy(hf.text_config)
        text.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        return text

    @classmethod
    def image_token_id(cls, hf) -> int:
        token = getattr(hf, "image_token_id", None)
        return token if token is not None else hf.image_token_index

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        text = cls.text_family(hf).standard_config(cls.text_config(hf))
        return dataclasses.replace(text, model_type=hf.model_type, vision=cls.tower_for(hf).vision_config(hf.vision_config))

    @classmethod
    def projector(cls, hf, dtype) -> eqx.Module:
        raise NotImplementedError

    @classmethod
    def projector_entries(cls, hf, projector) -> list[Entry]:
        """The projector's entries, placed (keys from the checkpoint's root, paths from the model's)."""
        raise NotImplementedError

    @classmethod
    def extra(cls, hf) -> dict:
        """The model class's static fields besides the shared ones (``streams``, …)."""
        return {}

    @classmethod
    def tower(cls, hf, dtype):
        """The tower's skeleton (the tower family's for ``hf.vision_config``)."""
        return cls.tower_for(hf).tower(hf.vision_config, dtype)

    @classmethod
    def skeleton(cls, hf, dtype) -> VisionLanguageModel:
        return cls.model_class(
            config=cls.standard_config(hf), family=cls.family,
            vision=cls.tower(hf, dtype), projector=cls.projector(hf, dtype),
            text=cls.text_family(hf).skeleton(cls.text_config(hf), dtype), image_token_id=cls.image_token_id(hf),
            **cls.extra(hf),
        )

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        skeleton = skeleton if skeleton is not None else cls.skeleton(hf, jnp.float32)
        def moved(e: Entry) -> Entry:  # a text entry under the wrapper's text prefix (its other spellings too)
            keys = tuple(cls.keys["text"] + k[len("model."):] if k.startswith("model.") else k for k in e.keys)
            return dataclasses.replace(e, key=keys[0] if isinstance(e.key, str) else keys, path="text." + e.path,
                                       alternatives=tuple(map(moved, e.alternatives)))

        text = [moved(e) for e in cls.text_family(hf).name_map(cls.text_config(hf), skeleton.text)]
        return (skeleton.vision.name_map("vision", cls.keys["tower"], cls.tower_for(hf).names) + text
                + cls.projector_entries(hf, skeleton.projector))

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        tower = tuple(cls.keys["tower"] + p for p in cls.tower_for(hf).ignored(hf.vision_config))
        return tower + cls.text_family(hf).ignored(cls.text_config(hf))
