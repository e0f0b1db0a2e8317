"""The torch reference for the vision-language wrappers: every tower, projector, merge and text value captured,
and edits applied, through hooks.

``WrapperReference(folder, dtype, paths)`` loads the wrapper (``AutoModelForImageTextToText``, eager attention)
and ``run(batch, reads, edits)`` calls it on ``batch`` (the processor's arrays: ``input_ids``,
``attention_mask``, ``pixel_values``, …) and returns a dict with jstd's names and layouts, as
``TorchReference.run`` does (with an attention mask, position ids counting each row's real tokens, so a
left-padded row gives its unpadded prompt's values, as in jstd). ``paths`` names the wrapper's modules: ``tower`` (the vision transformer, whose
``encoder.layers`` are the blocks), ``text`` (the decoder: ``embed_tokens``, ``layers``, ``norm``) and
``projector``.

- Tower values come from ``reference.vision.TOWER_PLAN`` under ``tower`` and the capturing eager attention bound
  in the tower's modeling module; ``vision.tower_output`` is the tower's ``last_hidden_state`` (an edit replaces
  it in the returned output).
  A block's output is edited in place: the projector reads the tower's hidden states, which transformers records
  with hooks that run before the harness's.
- Text values come from ``LLAMA_PLAN`` under ``text`` and the capturing attention in the text model's module.
- ``projector.input`` / ``projector.output``: the projector's input and output.
- ``vision.image_features`` is read at the text model's entry: ``inputs_embeds[image_token_mask]`` after the
  wrapper's scatter, so it is what the text model receives, whatever the wrapper did in between (unpadding,
  newlines, ``inputs_merger``); an edit writes the rows back there. ``vision.image_token_mask`` is
  ``input_ids == image_token_id``.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForImageTextToText

from reference.checkpoints import randomize
from reference.harness import ATTENTION_INTERIOR, LLAMA_PLAN, TorchReference
from reference.vision import TOWER_PLAN

VISION_INTERIOR = tuple("vision." + s for s in ATTENTION_INTERIOR)


def make_wrapper_checkpoint(config, folder: str | Path, seed: int = 0, adjust=None) -> Path:
    """Save a random float32 wrapper for ``config`` (``randomize``d; patch convs — CLIP's ``patch_embedding``, the
    Qwen ViT's Conv3d ``patch_embed.proj`` — to std 1/sqrt(fan-in), the Qwen merger's norm ``ln_q`` (which
    ``randomize`` does not take for a norm) to 1 + 0.1·normal, layer-norm biases to 0.1·normal; then
    ``adjust(model)`` if given) to ``folder``. Returns ``folder`` as a Path."""
    torch.manual_seed(seed)
    config.dtype = torch.float32
    model = AutoModelForImageTextToText.from_config(config)
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("patch_embedding.weight", "patch_embed.proj.weight")):
                p.mul_(1.0 / math.sqrt(p[0].numel()))
            elif name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias") and "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        if adjust is not None:
            adjust(model)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


class WrapperReference(TorchReference):
    """A transformers vision-language wrapper loaded from ``folder`` with eager attention, in ``dtype``."""

    def __init__(self, folder, dtype=torch.float32, paths: dict | None = None):
        self.model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager", dtype=dtype).eval()
        self.paths = paths
        text, tower = paths["text"], paths["tower"]
        self.plan = {site: (path.replace("model.", text + ".", 1) if path.startswith("model.") else path, *rest)
                     for site, (path, *rest) in LLAMA_PLAN.items()}
        self.plan = {**self.plan, **{site: (f"{tower}.{path}", *rest) for site, (path, *rest) in TOWER_PLAN.items()},
                     "projector.input": (paths["projector"], "in"), "projector.output": (paths["projector"], "out")}
        self.modeling = importlib.import_module(type(self._module(text)).__module__)
        self.tower_modeling = importlib.import_module(type(self._module(tower)).__module__)
        for i, layer in enumerate(self._module(tower).encoder.layers):
            layer.self_attn.layer_idx = i
        config = self.model.config
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = config.image_token_index
        self.vision_layers = config.vision_config.num_hidden_layers

    @property
    def num_layers(self):
        return self.model.config.text_config.num_hidden_layers

    def _blocks(self, entry):
        if entry[0].startswith(self.paths["tower"] + ".") and "{i}" in entry[0]:
            return [(i, entry) for i in range(self.vision_layers)]
        return super()._blocks(entry)

    @staticmethod
    def _hook(module, site, layer, where, tap):
        if where == "out" and site.startswith("vision.layers."):
            # the wrapper reads a block's output from the tower's captured hidden states, recorded by hooks that run
            # before this one: edit the tensor in place so they hold the edit too
            def post(mod, args, output):
                new = tap(site, layer, output)
                if new is not output:
                    output.copy_(new)
                return output
            return module.register_forward_hook(post)
        return TorchReference._hook(module, site, layer, where, tap)

    def sites(self):
        return (tuple(self.plan) + ATTENTION_INTERIOR + VISION_INTERIOR
                + ("vision.tower_output", "vision.image_features", "vision.image_token_mask", "logits", "next_token_probs"))

    def _to_jstd(self, site, t):
        if site == "vision.patch_embeddings":
            return t.flatten(2).transpose(1, 2)
        if site.endswith("self_attn.attention_premix"):
            config = self.model.config.vision_config if site.startswith("vision.") else self.model.config.text_config
            return t.reshape(*t.shape[:-1], config.num_attention_heads, -1)
        return t

    def _from_jstd(self, site, t, like):
        if site == "vision.patch_embeddings":
            return t.transpose(1, 2).reshape(like.shape)
        return super()._from_jstd(site, t, like)

    @contextlib.contextmanager
    def _merge(self, tap, ids):
        """Capture and edit ``vision.image_features`` and ``vision.tower_output``."""
        mask = ids == self.image_token_id

        def enter(module, args, kwargs):
            embeds = kwargs.get("inputs_embeds")
            if embeds is None or not mask.any():
                return None
            features = embeds[mask]
            new = tap("vision.image_features", None, features)
            if new is not features:
                embeds = embeds.clone()
                embeds[mask] = new.to(embeds.dtype)
                kwargs["inputs_embeds"] = embeds
            return args, kwargs

        def leave(module, args, output):
            output.last_hidden_state = tap("vision.tower_output", None, output.last_hidden_state)
            return output

        handles = [self._module(self.paths["text"]).register_forward_pre_hook(enter, with_kwargs=True),
                   self._module(self.paths["tower"]).register_forward_hook(leave)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def run(self, batch, reads=(), edits=()) -> dict[str, np.ndarray]:
        reads = tuple(reads) or self.sites()
        tap, got = self._tap(reads, list(edits))
        arrays = {k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()}
        arrays["input_ids"] = arrays["input_ids"].long()
        if "attention_mask" in arrays:  # left padding: each row's positions count its real tokens (as generate does)
            arrays["attention_mask"] = arrays["attention_mask"].long()
            real = arrays["attention_mask"].bool()
            arrays["position_ids"] = torch.where(real, real.long().cumsum(-1) - 1, 1)  # padding: 1, as generate
        vision_tap = lambda site, i, x: tap("vision." + site, i, x)
        with torch.no_grad(), self._hooks(tap), self._attention(tap), self._merge(tap, arrays["input_ids"]), \
                self._attention(vision_tap, self.tower_modeling):
            logits = self.model(**arrays).logits
        return self._outputs(tap, got, logits, reads, arrays["input_ids"])

    def _outputs(self, tap, got, logits, reads, ids) -> dict[str, np.ndarray]:
        """The captured values, the image-token mask, the (tapped) logits and the next-token probabilities."""
        logits = tap("logits", None, logits)
        out = self._stacked(got)
        if "vision.image_token_mask" in reads:
            out["vision.image_token_mask"] = (ids == self.image_token_id).numpy()
        if "logits" in reads:
            out["logits"] = logits.float().numpy()
        if "next_token_probs" in reads:
            out["next_token_probs"] = torch.softmax(logits[:, -1].float(), -1).numpy()
        return out
