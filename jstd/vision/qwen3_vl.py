"""Qwen3-VL (``qwen3_vl``): the Qwen ViT with learned positions and DeepStack, its merger, and Qwen3-VL's text model
(``models.qwen3_vl``), merged at the image tokens.

    x        = patch_embed(pixel_values) + pos_embed resampled to each grid   # vision.layers.0.layer_input
    h        = vision.layers(x)                          # one packed row: vision.layers.* [1, patches, …]
    features = merger(h)                                 # projector.input -> projector.output == vision.image_features
    taps[k]  = deepstack_merger_k(vision block b_k's output)                  # layers.deepstack_output, block k
    h0       = scatter(embed[tokens], features)
    h_{k+1}  = layers.k(h_k) + taps[k] at the image tokens (k < len(taps))    # DeepStack
    logits   = lm_head(norm(h_L))                        # interleaved M-RoPE positions from the grids

- **DeepStack.** The blocks ``deepstack_visual_indexes`` of the tower (taken in block order ``b_0 < b_1 < …``;
  block ``b`` goes through ``deepstack_merger_list[deepstack_visual_indexes.index(b)]``, whose LayerNorm comes
  after the 2 × 2 concatenation) give one ``[image tokens, hidden]`` tap each. Tap ``k`` is added to the text
  stream at the image tokens after text block ``k``'s output, as transformers' ``_deepstack_process`` does, so
  ``layers.(k+1).layer_input[mask] == layers.k.layer_output[mask] + layers.k.deepstack_output`` and
  ``layers.(k+1).layer_input == layers.k.layer_output`` elsewhere. ``layers.deepstack_output`` is served (read
  and edited) on the blocks that take a tap, ``0 … K - 1``, stacked ``[K, image tokens, hidden]``; an edit
  there is what the text model adds.
- **Removing the image.** ``vision.image_features`` reaches block 0 only; the taps carry the image into blocks
  1 … K too. To remove the image edit both (``docs/families/qwen3.md``).
- **Positions.** As Qwen2-VL's (``vision.mrope``): an image's tokens at ``start + (t, row, column)``, text after
  it resuming at ``start + max(rows, columns)``; transformers' Qwen3-VL ``get_rope_index`` gives the same ids on
  images (its timestamps concern videos, which jstd refuses).

Qwen3.5 (``qwen3_5``, ``Qwen3_5VL``) is this wrapper with the tower's DeepStack off and the Qwen3.5 text model. The
MoE lines (``qwen3_vl_moe``, ``qwen3_5_moe``) are these wrappers with MoE text models (``jstd.vision.qwen3_vl_moe``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jstd.core.config import VisionConfig
from jstd.nn.params import shape
from jstd.nn.mlp import MLP
from jstd.vision.qwen2_vl import QWEN_VIT_NAMES, Qwen2VL, QwenViTFamily, QwenVisionTower, QwenVLModel
from jstd.vision.qwen_vit import QWEN3_MERGER_NAMES
from jstd.vision.scatter import scatter_add

DEEPSTACK = "layers.deepstack_output"


class Qwen3ViTFamily(QwenViTFamily):
    """The Qwen ViT of Qwen3-VL (``qwen3_vl_vision``) and Qwen3.5 (``qwen3_5_vision``): LayerNorm blocks, a biased
    ``linear_fc1``-GELU(tanh)-``linear_fc2`` MLP, a biased patch embedding, a learned ``pos_embed`` table, the
    merger (``norm``, ``linear_fc1``, ``linear_fc2``) and, where the config lists ``deepstack_visual_indexes``
    (Qwen3-VL), one more merger per DeepStack block."""

    names = {**QWEN_VIT_NAMES, "fc1": "linear_fc1", "fc2": "linear_fc2", "merger": QWEN3_MERGER_NAMES}
    handled = QwenViTFamily.handled | {"num_position_embeddings", "deepstack_visual_indexes"}

    @staticmethod
    def qwen2(hf) -> bool:
        return False

    @classmethod
    def rms(cls, hf) -> bool:
        return False

    @classmethod
    def vision_config(cls, hf) -> VisionConfig:
        return VisionConfig(
            num_layers=hf.depth, hidden_size=hf.hidden_size, num_heads=hf.num_heads,
            head_dim=hf.hidden_size // hf.num_heads, intermediate_size=hf.intermediate_size,
            patch_size=hf.patch_size, num_channels=hf.in_channels, spatial_merge_size=hf.spatial_merge_size,
            temporal_patch_size=hf.temporal_patch_size,
        )

    @classmethod
    def kinds(cls, hf) -> tuple[str, ...]:
        return ("full_attention",) * hf.depth

    @classmethod
    def mlp(cls, hf, v: VisionConfig, dtype) -> MLP:
        return MLP.skeleton(v.hidden_size, v.intermediate_size, hf.hidden_act, dtype)

    @classmethod
    def deepstack(cls, hf) -> tuple[int, ...]:
        """The DeepStack blocks in the config's order (merger ``i`` reads block ``deepstack[i]``); () on Qwen3.5,
        whatever its config lists (hub configs carry an empty ``deepstack_visual_indexes``; transformers' Qwen3.5
        tower has no DeepStack mergers)."""
        if hf.model_type == "qwen3_5_vision":
            return ()
        blocks = tuple(int(i) for i in (getattr(hf, "deepstack_visual_indexes", None) or ()))
        bad = [i for i in blocks if not 0 <= i < hf.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {list(blocks)} name blocks {bad} outside the tower's "
                             f"{hf.depth} blocks")
        return blocks

    @classmethod
    def learned(cls, hf, v: VisionConfig, dtype) -> dict:
        blocks = cls.deepstack(hf)
        return dict(patch_bias=shape(v.hidden_size, dtype=dtype),
                    pos_embed=shape(hf.num_position_embeddings, v.hidden_size, dtype=dtype),
                    deepstack_mergers=tuple(cls.merger(hf, dtype, postshuffle=True) for _ in blocks),
                    deepstack=blocks)


class Qwen3VisionTower(QwenVisionTower):
    """Qwen3-VL's or Qwen3.5's vision model alone (``qwen3_vl_vision``, ``qwen3_5_vision``) with its merger: every
    ``vision.*`` value and ``vision.merger.output``; a Qwen3-VL tower's DeepStack taps are computed and dropped
    (they are the text model's)."""

    family = "qwen3_vit"
    model_types = ("qwen3_vl_vision", "qwen3_5_vision")
    tower_family = Qwen3ViTFamily
    handled = Qwen3ViTFamily.handled


class Qwen3VLModel(QwenVLModel):
    """A Qwen3-VL wrapper: ``QwenVLModel`` plus the DeepStack taps added to the text stream after its first
    blocks, served as ``layers.deepstack_output`` on those blocks (none when the tower has no DeepStack)."""

    @property
    def deepstack_depth(self) -> int:
        """How many text blocks take a DeepStack tap (one per DeepStack block of the tower, at most every block)."""
        return min(len(set(self.vision.deepstack)), self.text.layers.depth)

    @property
    def sites(self) -> frozenset[str]:
        return super().sites | ({DEEPSTACK} if self.deepstack_depth else frozenset())

    def blocks_for(self, site: str) -> tuple[int, ...]:
        if site == DEEPSTACK:
            return tuple(range(self.deepstack_depth))
        return super().blocks_for(site)

    def between_blocks(self, streams: list[Float[Array, "tokens hidden"]], mask: Bool[Array, "batch seq"], tap):
        """Tap ``k`` (``streams[k]``, block order) through ``layers.k.deepstack_output``, then added at the image
        tokens (``mask``) to text block ``k``'s output."""
        depth = self.deepstack_depth
        if not depth:
            return None, {}
        taps = []
        for k in range(depth):
            taps.append(tap.scope("layers.", k, k)("deepstack_output", streams[k]))
        taps = jnp.stack(taps)
        reads = {DEEPSTACK: taps} if DEEPSTACK in tap.reads else {}

        def after(h, block):
            if isinstance(block, int) and block >= depth:  # a block past the taps, known when traced
                return h
            return scatter_add(h, mask & (block < depth), taps[jnp.clip(block, 0, depth - 1)])

        return after, reads


class Qwen3VL(Qwen2VL):
    """Qwen3-VL (``Qwen3VLForConditionalGeneration``): the Qwen3 ViT (``Qwen3ViTFamily``) whose merger is the
    projector, the DeepStack taps, and the ``qwen3_vl_text`` model; checkpoints' prefixes as Qwen2-VL's."""

    family = "qwen3_vl"
    model_types = ("qwen3_vl",)
    model_class = Qwen3VLModel

    @classmethod
    def tower_for(cls, hf):
        return Qwen3ViTFamily


class Qwen3_5VL(Qwen3VL):
    """Qwen3.5 (``Qwen3_5ForConditionalGeneration``): Qwen3-VL's wrapper with the Qwen3.5 tower (no DeepStack: no
    ``layers.deepstack_output``) and the ``qwen3_5_text`` model (gated DeltaNet and gated attention blocks under
    interleaved M-RoPE, ``models.qwen3_5``); positions and checkpoints' prefixes as Qwen3-VL's. The hub's
    multi-token-prediction heads (``mtp.*``) are ignored."""

    family = "qwen3_5"
    model_types = ("qwen3_5",)
