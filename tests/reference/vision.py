"""The torch reference for the CLIP and SigLIP vision towers: every site captured, and edits applied, through hooks.

``TowerReference(folder).run(pixel_values, reads, edits)`` loads a ``CLIPVisionModel`` or ``SiglipVisionModel``
with eager attention and returns a dict with jstd's names and layouts, as ``reference.harness.TorchReference.run``
does for text models: block sites (``vision.layers.*``) come back stacked over blocks, block axis first; edits are
``TorchEdit(site, fn, layer=None)`` from ``reference.harness``, ``fn`` mapping the value in jstd's layout to the new
value (``layer`` None: every block). Inputs of modules are edited in place, so the residual stream sees the edit;
outputs are replaced. The machinery (module hooks, the capturing eager attention) is ``TorchReference``'s; only the
plan, the layouts and the entry point differ.

Sites and where they come from (module paths relative to the model; both families share the encoder's layout):

- ``vision.patch_embeddings`` [images, grid, hidden]: ``embeddings.patch_embedding``'s output (the conv's
  [images, hidden, h, w], flattened row-major), before CLIP's class token and the position embeddings.
- ``vision.layers.*`` from ``encoder.layers.{i}``: ``layer_input`` (its input; on CLIP block 0's is
  ``pre_layrnorm``'s output), ``attention_norm_output`` (``layer_norm1`` out), ``layer_mid`` (``layer_norm2`` in),
  ``mlp_norm_output`` (``layer_norm2`` out), ``mlp_input`` (``mlp`` in), ``layer_output`` (its output),
  ``self_attn.attention_premix`` (``self_attn.out_proj`` in, as [images, patches, heads, head_dim]),
  ``self_attn.attention_output`` (``self_attn`` out[0]), ``mlp.mlp_activation`` (``mlp.activation_fn`` out),
  ``mlp.mlp_neurons`` (``mlp.fc2`` in), ``mlp.mlp_output`` (``mlp`` out); and the attention interior
  (``self_attn.attention_queries``/``keys``/``values`` [images, heads, patches, head_dim], ``attention_scores`` and
  ``attention_probabilities`` [images, heads, query, key], ``attention_head_outputs`` [images, patches, heads,
  head_dim]) from ``TorchReference``'s capturing copy of the family's ``eager_attention_forward``.
- ``vision.tower_output`` [images, patches, hidden]: the model's ``last_hidden_state`` (CLIP: the last block's
  output, ``post_layernorm`` norms only the pooled class token; SigLIP: ``post_layernorm`` of every patch). An edit
  replaces the returned value (the pooled outputs, not part of the contract, do not see it).

``make_tower_checkpoint(config, folder)`` saves a random tower and its PIL image processor (crop or resize to
``config.image_size``) to ``folder``.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModel, CLIPVisionConfig
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from reference.checkpoints import randomize
from reference.harness import ATTENTION_INTERIOR, TorchEdit, TorchReference  # noqa: F401  (TorchEdit: re-exported)

_BLOCK = "encoder.layers.{i}"
TOWER_PLAN = {
    "vision.patch_embeddings": ("embeddings.patch_embedding", "out"),
    "vision.layers.layer_input": (_BLOCK, "in"),
    "vision.layers.attention_norm_output": (_BLOCK + ".layer_norm1", "out"),
    "vision.layers.layer_mid": (_BLOCK + ".layer_norm2", "in"),
    "vision.layers.mlp_norm_output": (_BLOCK + ".layer_norm2", "out"),
    "vision.layers.mlp_input": (_BLOCK + ".mlp", "in"),
    "vision.layers.layer_output": (_BLOCK, "out"),
    "vision.layers.self_attn.attention_premix": (_BLOCK + ".self_attn.out_proj", "in"),
    "vision.layers.self_attn.attention_output": (_BLOCK + ".self_attn", "out0"),
    "vision.layers.mlp.mlp_activation": (_BLOCK + ".mlp.activation_fn", "out"),
    "vision.layers.mlp.mlp_neurons": (_BLOCK + ".mlp.fc2", "in"),
    "vision.layers.mlp.mlp_output": (_BLOCK + ".mlp", "out"),
}


def make_tower_checkpoint(config, folder: str | Path, seed: int = 0) -> Path:
    """Save a random float32 ``CLIPVisionModel``/``SiglipVisionModel`` for ``config`` (``randomize``d, then the patch
    conv rescaled to std 1/sqrt(channels·patch²) and the layer norms' biases to 0.1·normal) and the family's PIL image
    processor for ``config.image_size`` to ``folder`` (safetensors). Returns ``folder`` as a Path."""
    torch.manual_seed(seed)
    config.dtype = torch.float32
    model = AutoModel.from_config(config, attn_implementation="eager")
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # randomize treats every weight named like "embed" as an embedding (std 1) and every vector named like "norm"
        # as a norm's scale (1 ± 0.1): give the conv its fan-in and the norms' biases bias-sized values instead.
        conv = model.embeddings.patch_embedding.weight
        conv.mul_(1.0 / math.sqrt(conv[0].numel()))
        for name, p in model.named_parameters():
            if name.endswith("bias") and "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    folder = Path(folder)
    model.save_pretrained(folder)
    size = config.image_size
    if isinstance(config, CLIPVisionConfig):  # shortest edge to image_size, then a center crop
        processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    else:  # resized to image_size × image_size, no crop
        processor = SiglipImageProcessorPil(size={"height": size, "width": size})
    processor.save_pretrained(folder)
    return folder


class TowerReference(TorchReference):
    """A transformers CLIP or SigLIP vision tower loaded from ``folder`` with eager attention, in ``dtype``."""

    def __init__(self, folder, dtype=torch.float32):
        self.model = AutoModel.from_pretrained(folder, attn_implementation="eager", dtype=dtype).eval()
        self.plan = TOWER_PLAN
        self.modeling = importlib.import_module(type(self.model).__module__)
        for i, layer in enumerate(self.model.encoder.layers):  # TorchReference._attention finds the block here
            layer.self_attn.layer_idx = i

    def sites(self):
        return tuple(self.plan) + tuple("vision." + s for s in ATTENTION_INTERIOR) + ("vision.tower_output",)

    def _to_jstd(self, site, t):
        if site == "vision.patch_embeddings":  # [images, hidden, h, w] -> [images, grid, hidden]
            return t.flatten(2).transpose(1, 2)
        return super()._to_jstd(site, t)

    def _from_jstd(self, site, t, like):
        if site == "vision.patch_embeddings":
            return t.transpose(1, 2).reshape(like.shape)
        return super()._from_jstd(site, t, like)

    def run(self, pixel_values, reads=(), edits=()) -> dict[str, np.ndarray]:
        reads = tuple(reads) or self.sites()
        tap, got = self._tap(reads, list(edits))
        with torch.no_grad(), self._hooks(tap), self._attention(lambda site, i, x: tap("vision." + site, i, x)):
            pixels = torch.as_tensor(np.asarray(pixel_values, np.float32))
            tap("vision.tower_output", None, self.model(pixel_values=pixels).last_hidden_state)
        return self._stacked(got)
