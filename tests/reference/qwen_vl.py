"""The torch reference for the Qwen-ViT vision-language wrappers (Qwen2-VL, Qwen2.5-VL, HyperCLOVA X Vision V2,
Qwen3-VL, Qwen3.5):
every encoder, merger, projector, merge and text value captured, and edits applied, through hooks.

``QwenVLReference(folder, dtype)`` loads the wrapper (``AutoModelForImageTextToText``, eager attention) and
``run(batch, reads, edits)`` calls it on ``batch`` (``tests/qwen_vl_cases.qwen_images``'s arrays: ``input_ids``,
``attention_mask``, ``pixel_values`` [patches, C·T·p·p], ``image_grid_thw`` [images, 3]; or text alone) and returns
a dict with jstd's names and layouts, as ``WrapperReference.run`` does: block sites stacked over blocks, block axis
first; edits are ``TorchEdit(site, fn, layer=None)``, ``fn`` mapping the value in jstd's layout to the new one.

Modules: Qwen2-VL / Qwen2.5-VL: encoder ``model.visual`` (blocks ``blocks.{i}``, merger ``merger`` = the
projector), text ``model.language_model``, head ``lm_head``. HyperCLOVA X Vision V2: encoder ``model.vision_model``
(Qwen2.5-VL's), its ``merger`` served as ``vision.merger.output``, then the linear ``model.projector``; the text model
is HyperCLOVA X (``families.HYPERCLOVAX_PLAN``: its attention_output / mlp_output are post-norm outputs times the
*text config's* residual_multiplier).

Layouts (P: the patches of every image of the batch, concatenated; vh: the encoder's width):

- ``vision.patch_embeddings``: ``patch_embed``'s output, [1, P, vh] (merge-block order, before any window permute).
- ``vision.layers.*`` stream values (layer_input, attention_norm_output, self_attn.attention_output, layer_mid,
  mlp_norm_output, mlp_input, mlp.mlp_activation, mlp.mlp_neurons, mlp.mlp_output, layer_output): the native
  [P, width] with a leading 1. On Qwen2.5-VL / HCX they are in the encoder's window order, as computed.
- ``vision.layers.self_attn.attention_queries`` / ``attention_keys`` [1, heads, P, head_dim]: the outputs of the
  modeling module's ``apply_rotary_pos_emb_vision`` (after the 2-D rotary, whole row, before the split per image or
  window); ``attention_values`` [1, heads, P, head_dim]: the third of ``attn.qkv``'s output; ``attention_premix``
  and ``attention_head_outputs`` [1, P, heads, head_dim]: ``attn.proj``'s input (the per-chunk outputs concatenated
  back). No scores or probabilities: the attention runs once per image / window.
- ``vision.tower_output``: the encoder's ``last_hidden_state`` [1, P, vh] (an edit changes nothing downstream).
- Qwen2-VL / 2.5: ``projector.input`` the merger's input [P, vh] (no leading 1), ``projector.output`` its output
  [P/4, text hidden] (window order on 2.5). HCX V2: ``vision.merger.output`` [P/4, out_hidden] (window order),
  ``projector.input`` [P/4, out_hidden] (token order), ``projector.output`` [P/4, text hidden].
- ``vision.image_features`` [image tokens, hidden]: ``inputs_embeds[image_token_mask]`` at the text model's entry
  (on HCX before the embedding multiplier, which the text model applies); ``vision.image_token_mask`` [batch, seq].
- ``positions`` (Qwen2-VL / 2.5 only): the M-RoPE position ids [3, batch, seq] the text model's ``rotary_emb``
  receives.
- Text sites: ``LLAMA_PLAN`` (HCX: ``HYPERCLOVAX_PLAN``) under ``model.language_model``, the text attention
  interior, ``logits``, ``next_token_probs``.

Inputs: with images, Qwen2-VL / 2.5 get ``mm_token_type_ids`` (1 at the image tokens) and no position ids, so the
model computes M-RoPE itself (``get_rope_index``); without images they get ``position_ids`` [3, batch, seq] counting
each row's real tokens (0 at padding), what ``get_rope_index`` gives for text. HCX V2 (1-D rotary) gets
``position_ids`` counting the real tokens, 1 at padding.
"""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import torch
from transformers import AutoModelForImageTextToText

from reference.harness import ATTENTION_INTERIOR, LLAMA_PLAN, TorchEdit  # noqa: F401  (TorchEdit: re-exported)
from reference.wrapper import WrapperReference

QWEN_VISION_INTERIOR = tuple("vision.layers.self_attn." + s for s in (
    "attention_queries", "attention_keys", "attention_values", "attention_head_outputs"))

# jstd's vision sites whose native layout is [P, width] (served with a leading 1)
_STREAM = ("vision.patch_embeddings", "vision.tower_output")

# HyperCLOVA X's text plan (tests/families.py's HYPERCLOVAX_PLAN): the contributions are post-norm outputs times the
# text config's residual_multiplier
HYPERCLOVAX_TEXT_PLAN = {
    **LLAMA_PLAN,
    "layers.self_attn.attention_raw_output": ("model.layers.{i}.self_attn", "out0"),
    "layers.self_attn.attention_output": ("model.layers.{i}.post_norm1", "out", "residual_multiplier"),
    "layers.mlp.mlp_raw_output": ("model.layers.{i}.mlp", "out"),
    "layers.mlp.mlp_output": ("model.layers.{i}.post_norm2", "out", "residual_multiplier"),
}


def vision_plan(tower: str, family: str) -> dict:
    """The encoder's sites under ``tower`` (Qwen2-VL's MLP is fc1/act/fc2, Qwen2.5-VL's gate/up/down, Qwen3-VL's
    linear_fc1/act_fn/linear_fc2)."""
    block = tower + ".blocks.{i}"
    act, down = {"qwen2_vl": ("mlp.act", "mlp.fc2"),
                 "qwen3_vl": ("mlp.act_fn", "mlp.linear_fc2"),
                 "qwen3_5": ("mlp.act_fn", "mlp.linear_fc2"),
                 "qwen3_vl_moe": ("mlp.act_fn", "mlp.linear_fc2"),
                 "qwen3_5_moe": ("mlp.act_fn", "mlp.linear_fc2")}.get(family, ("mlp.act_fn", "mlp.down_proj"))
    return {
        "vision.patch_embeddings": (tower + ".patch_embed", "out"),
        "vision.layers.layer_input": (block, "in"),
        "vision.layers.attention_norm_output": (block + ".norm1", "out"),
        "vision.layers.layer_mid": (block + ".norm2", "in"),
        "vision.layers.mlp_norm_output": (block + ".norm2", "out"),
        "vision.layers.mlp_input": (block + ".mlp", "in"),
        "vision.layers.layer_output": (block, "out"),
        "vision.layers.self_attn.attention_premix": (block + ".attn.proj", "in"),
        "vision.layers.self_attn.attention_head_outputs": (block + ".attn.proj", "in"),
        "vision.layers.self_attn.attention_output": (block + ".attn", "out"),
        "vision.layers.mlp.mlp_activation": (f"{block}.{act}", "out"),
        "vision.layers.mlp.mlp_neurons": (f"{block}.{down}", "in"),
        "vision.layers.mlp.mlp_output": (block + ".mlp", "out"),
    }


class QwenVLReference(WrapperReference):
    """A Qwen2-VL, Qwen2.5-VL, HyperCLOVA X Vision V2, Qwen3-VL or Qwen3.5 wrapper loaded from ``folder`` with eager
    attention, in ``dtype``; ``text_plan`` replaces the text model's plan (Qwen3.5: ``qwen3_5_cases.PLAN``, by layer
    type, whose DeltaNet interior comes from the harness's ``_linear_attention``)."""

    def __init__(self, folder, dtype=torch.float32, text_plan=None):
        self.model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager",
                                                                 dtype=dtype).eval()
        config = self.model.config
        self.family = config.model_type
        self.hyperclovax = self.family == "hyperclovax_vision_v2"
        tower = "model.vision_model" if self.hyperclovax else "model.visual"
        text = "model.language_model"
        projector = "model.projector" if self.hyperclovax else tower + ".merger"
        self.paths = dict(tower=tower, text=text, projector=projector)
        text_plan = text_plan or (HYPERCLOVAX_TEXT_PLAN if self.hyperclovax else LLAMA_PLAN)
        under = lambda path, *rest: (path.replace("model.", text + ".", 1) if path.startswith("model.") else path,
                                     *rest)
        self.plan = {site: {kind: under(*e) for kind, e in entry.items()} if isinstance(entry, dict) else under(*entry)
                     for site, entry in text_plan.items()}
        self.plan = {**self.plan, **vision_plan(tower, self.family)}
        # Qwen3-VL's DeepStack taps: tap k is the k-th listed block in block order, through the merger the config
        # lists that block with
        listed = list(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())
        self.deepstack = [listed.index(b) for b in sorted(set(listed))][:config.text_config.num_hidden_layers]
        if self.deepstack:
            self.plan["layers.deepstack_output"] = (tower + ".deepstack_merger_list.{i}", "out")
        self.plan.update({"projector.input": (self.paths["projector"], "in"),
                          "projector.output": (self.paths["projector"], "out")})
        if self.hyperclovax:
            self.plan["vision.merger.output"] = (tower + ".merger", "out")
        self.modeling = importlib.import_module(type(self._module(text)).__module__)
        self.tower_modeling = importlib.import_module(type(self._module(tower)).__module__)
        self.image_token_id = config.image_token_id
        self.text_config = config.text_config
        self.vision_config = config.vision_config
        self.vision_layers = config.vision_config.depth
        self.vision_heads = config.vision_config.num_heads

    def _blocks(self, entry):
        if isinstance(entry, dict):  # by the text model's layer type (Qwen3.5)
            return [(i, entry[t]) for i, t in enumerate(self.text_config.layer_types) if t in entry]
        if "deepstack_merger_list" in entry[0]:
            return [(k, (entry[0].format(i=m), *entry[1:])) for k, m in enumerate(self.deepstack)]
        return super()._blocks(entry)

    def sites(self):
        return (tuple(self.plan) + ATTENTION_INTERIOR + self.linear_sites() + QWEN_VISION_INTERIOR[:3]
                + (() if self.hyperclovax else ("positions",))
                + ("vision.tower_output", "vision.image_features", "vision.image_token_mask", "logits",
                   "next_token_probs"))

    # layouts ------------------------------------------------------------------------------------------------------

    def _to_jstd(self, site, t):
        if site.startswith("vision.layers.self_attn.attention_") and site.rsplit(".", 1)[1] in (
                "attention_queries", "attention_keys", "attention_values"):
            return t.transpose(0, 1)[None]  # [P, heads, d] -> [1, heads, P, d]
        if site in ("vision.layers.self_attn.attention_premix", "vision.layers.self_attn.attention_head_outputs"):
            return t.reshape(1, t.shape[0], self.vision_heads, -1)
        if site.startswith("vision.layers.") or site in _STREAM:
            return t[None]
        if site == "layers.self_attn.attention_premix":
            return t.reshape(*t.shape[:-1], self.text_config.num_attention_heads, -1)
        return t

    def _from_jstd(self, site, t, like):
        if site.rsplit(".", 1)[-1] in ("attention_queries", "attention_keys", "attention_values") \
                and site.startswith("vision."):
            return t[0].transpose(0, 1).reshape(like.shape)
        return t.reshape(like.shape)

    def _scaled(self, tap, scale):
        """As the harness's, with a named scale read off the text config (the wrapper's config has none)."""
        if isinstance(scale, str):
            scale = getattr(self.text_config, scale)
        return super()._scaled(tap, scale)

    # capture machinery --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _text_attention(self, tap):
        """The harness's capturing eager attention for the text blocks only: Qwen2-VL's and Qwen2.5-VL's text and
        vision attentions call the same module-level ``eager_attention_forward``; vision calls (non-causal modules)
        go to the original."""
        original = self.modeling.eager_attention_forward
        with self._attention(tap):
            capture = self.modeling.eager_attention_forward

            def dispatch(module, *args, **kwargs):
                if getattr(module, "is_causal", False):
                    return capture(module, *args, **kwargs)
                return original(module, *args, **kwargs)

            self.modeling.eager_attention_forward = dispatch
            yield  # the harness's context restores the original

    @contextlib.contextmanager
    def _vision_attention(self, tap):
        """Queries and keys from a wrapper of ``apply_rotary_pos_emb_vision`` (the block from a pre-hook on each
        block's ``attn``), values from a forward hook on ``attn.qkv``."""
        modeling = self.tower_modeling
        rotary = modeling.apply_rotary_pos_emb_vision
        current = {}
        site = "vision.layers.self_attn."
        handles = []
        for i, block in enumerate(self._module(self.paths["tower"]).blocks):
            handles.append(block.attn.register_forward_pre_hook(lambda mod, args, i=i: current.update(layer=i)))

            def values(mod, args, output, i=i):
                seq = output.shape[0]
                qkv = output.reshape(seq, 3, self.vision_heads, -1)
                v = qkv[:, 2]
                new = tap(site + "attention_values", i, v)
                if new is v:
                    return output
                qkv = qkv.clone()
                qkv[:, 2] = new.to(qkv.dtype)
                return qkv.reshape(output.shape)

            handles.append(block.attn.qkv.register_forward_hook(values))

        def capture(q, k, cos, sin):
            q, k = rotary(q, k, cos, sin)
            i = current["layer"]
            return tap(site + "attention_queries", i, q), tap(site + "attention_keys", i, k)

        modeling.apply_rotary_pos_emb_vision = capture
        try:
            yield
        finally:
            modeling.apply_rotary_pos_emb_vision = rotary
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def _positions(self, tap):
        """``positions``: the position ids the text model's rotary embedding receives, [3, batch, seq]."""
        if self.hyperclovax:
            yield
            return

        def pre(module, args, kwargs):
            args = list(args)
            ids = args[1] if len(args) > 1 else kwargs["position_ids"]
            if ids.ndim == 2:
                ids = ids[None].expand(3, -1, -1)
            new = tap("positions", None, ids)
            if new is ids:
                return None
            new = torch.as_tensor(new).to(ids.device, torch.long).reshape(ids.shape)
            if len(args) > 1:
                args[1] = new
            else:
                kwargs["position_ids"] = new
            return tuple(args), kwargs

        handle = self._module(self.paths["text"] + ".rotary_emb").register_forward_pre_hook(pre, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    # the call -----------------------------------------------------------------------------------------------------

    def inputs(self, batch) -> dict:
        """The torch model's keyword arguments for ``batch``."""
        arrays = {k: torch.as_tensor(np.asarray(v)) for k, v in batch.items()
                  if k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}
        ids = arrays["input_ids"] = arrays["input_ids"].long()
        images = "pixel_values" in arrays
        if images:
            arrays["pixel_values"] = arrays["pixel_values"].to(self.model.dtype)
            arrays["image_grid_thw"] = arrays["image_grid_thw"].long()
        mask = arrays.get("attention_mask")
        if mask is not None:
            mask = arrays["attention_mask"] = mask.long()
        if self.hyperclovax:
            if mask is not None:  # left padding: each row's positions count its real tokens (as generate does)
                real = mask.bool()
                arrays["position_ids"] = torch.where(real, real.long().cumsum(-1) - 1, 1)
        elif images:  # M-RoPE from the model's get_rope_index, which needs the token types
            arrays["mm_token_type_ids"] = (ids == self.image_token_id).int()
        elif mask is not None:  # text: get_rope_index's positions, the real tokens counted, 0 at padding
            real = mask.bool()
            pos = torch.where(real, real.long().cumsum(-1) - 1, 0)
            arrays["position_ids"] = pos[None].expand(3, -1, -1).contiguous()
        return arrays

    def run(self, batch, reads=(), edits=()) -> dict[str, np.ndarray]:
        reads = tuple(reads) or self.sites()
        tap, got = self._tap(reads, list(edits))
        arrays = self.inputs(batch)
        if hasattr(self.model.model, "rope_deltas"):
            self.model.model.rope_deltas = None  # no state from an earlier call
        with torch.no_grad(), self._hooks(tap), self._text_attention(tap), self._vision_attention(tap), \
                self._positions(tap), self._merge(tap, arrays["input_ids"]), self._linear_attention(tap, reads):
            logits = self.model(**arrays).logits
        out = self._outputs(tap, got, logits, reads, arrays["input_ids"])
        if "positions" in out:
            out["positions"] = out["positions"].astype(np.int64)
        return out
