"""The standard sizes every model carries as ``model.config``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A vision tower's sizes (``model.config.vision``; hashable: static pytree data).

    num_patches: the patch grid's size, ``(image_size // patch_size) ** 2``;
    positions: the tower's stream length per image (the grid, plus one for a
    class token). A tower that cuts each image into its own grid (Qwen ViT)
    has no ``image_size``, ``num_patches`` or ``positions`` (None) and says
    instead how many patches fold into one image token per side
    (``spatial_merge_size``), how many frames a patch spans
    (``temporal_patch_size``) and, with window attention, a window's side in
    pixels (``window_size``).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    image_size: int | None = None
    patch_size: int | None = None
    num_channels: int = 3
    num_patches: int | None = None
    positions: int | None = None
    spatial_merge_size: int | None = None
    temporal_patch_size: int | None = None
    window_size: int | None = None

    def __str__(self):
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                         if getattr(self, f.name) is not None)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Standard sizes of a loaded model (hashable: it is static pytree data).

    The text sizes are None on a standalone vision tower; ``vision`` is None
    on a text model. layer_types: one entry per text block, the block's kind
    (``"full_attention"`` on every Llama block); hybrids mix kinds.
    eos_token_ids, pad_token_id: the checkpoint's generation defaults
    (``generation_config.json``, else ``config.json``; set by ``jstd.load``):
    what ``jstd.generate`` stops at and pads with unless told otherwise.
    """

    model_type: str
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qk_head_dim: int | None = None
    vocab_size: int | None = None
    intermediate_size: int | None = None
    layer_types: tuple[str, ...] = ()
    # a mixture-of-experts text model's router: experts per MoE block, and how many each token takes (else None)
    num_experts: int | None = None
    experts_per_token: int | None = None
    vision: VisionConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __str__(self):
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                         if f.name not in ("layer_types", "vision") and getattr(self, f.name) not in (None, ()))
