"""Capture every standard value from the torch model, and apply edits, through hooks.

``TorchReference(folder).run(tokens, reads, edits)`` returns a dict with the
same names and layouts as ``jstd.run``: block sites stacked over blocks, block
axis first. Values that are module inputs or outputs come from hooks; the
attention interior (queries after the rotary, keys and values before the
grouped-query repeat, masked scores, probabilities, head outputs) comes from a
capturing copy of transformers' eager attention, bound in place of the
family's ``eager_attention_forward`` for the duration of a call.

Edits are ``TorchEdit(site, fn, layer=None)``: ``fn`` maps the site's value (in
jstd's layout) to the new value. Inputs of modules are edited in place, so the
residual stream that shares the tensor sees the edit too (as nnsight does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM

# site -> (module path with {i} for the block, where: "in" | "out" | "out0")
LLAMA_PLAN = {
    "token_embeddings": ("model.embed_tokens", "out"),
    "layers.layer_input": ("model.layers.{i}", "in"),
    "layers.attention_norm_output": ("model.layers.{i}.input_layernorm", "out"),
    "layers.layer_mid": ("model.layers.{i}.post_attention_layernorm", "in"),
    "layers.mlp_norm_output": ("model.layers.{i}.post_attention_layernorm", "out"),
    "layers.mlp_input": ("model.layers.{i}.mlp", "in"),
    "layers.layer_output": ("model.layers.{i}", "out"),
    "layers.self_attn.attention_premix": ("model.layers.{i}.self_attn.o_proj", "in"),
    "layers.self_attn.attention_output": ("model.layers.{i}.self_attn", "out0"),
    "layers.mlp.mlp_activation": ("model.layers.{i}.mlp.act_fn", "out"),
    "layers.mlp.mlp_neurons": ("model.layers.{i}.mlp.down_proj", "in"),
    "layers.mlp.mlp_output": ("model.layers.{i}.mlp", "out"),
    "final_norm_output": ("model.norm", "out"),
    "lm_head_output": ("lm_head", "out"),
}

ATTENTION_INTERIOR = (
    "layers.self_attn.attention_queries",
    "layers.self_attn.attention_keys",
    "layers.self_attn.attention_values",
    "layers.self_attn.attention_scores",
    "layers.self_attn.attention_probabilities",
    "layers.self_attn.attention_head_outputs",
)


@dataclasses.dataclass
class TorchEdit:
    site: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    layer: int | None = None


def _to_jstd(site, t, model):
    if site == "layers.self_attn.attention_premix":
        return t.reshape(*t.shape[:-1], model.config.num_attention_heads, -1)
    return t


def _from_jstd(site, t, like):
    return t.reshape(like.shape)


class TorchReference:
    """A transformers causal LM loaded from ``folder`` with eager attention, in ``dtype``."""

    def __init__(self, folder, dtype=torch.float32, plan=LLAMA_PLAN):
        self.model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype).eval()
        self.plan = plan
        self.modeling = importlib.import_module(type(self.model).__module__)

    @property
    def num_layers(self):
        return self.model.config.num_hidden_layers

    def sites(self):
        return tuple(self.plan) + ATTENTION_INTERIOR + ("logits", "next_token_probs")

    def run(self, tokens, reads=(), edits=(), attention_mask=None) -> dict[str, np.ndarray]:
        reads = tuple(reads) or self.sites()
        got: dict[str, dict] = {}
        edits = list(edits)

        def tap(site, layer, value):
            for e in edits:
                if e.site == site and (e.layer is None or e.layer == layer):
                    value = _from_jstd(site, e.fn(_to_jstd(site, value, self.model)), value)
            if site in reads:
                got.setdefault(site, {})[layer] = _to_jstd(site, value, self.model).detach().float().clone()
            return value

        with torch.no_grad(), self._hooks(tap), self._attention(tap):
            ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
            mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        logits = tap("logits", None, logits)
        out = {}
        for site, per in got.items():
            if None in per:
                out[site] = per[None].numpy()
            else:
                out[site] = np.stack([per[i].numpy() for i in sorted(per)])
        if "logits" in reads:
            out["logits"] = logits.float().numpy()
        if "next_token_probs" in reads:
            out["next_token_probs"] = torch.softmax(logits[:, -1].float(), -1).numpy()
        return out

    def _module(self, path):
        m = self.model
        for part in path.split("."):
            m = getattr(m, part)
        return m

    @contextlib.contextmanager
    def _hooks(self, tap):
        handles = []
        for site, (path, where) in self.plan.items():
            layers = range(self.num_layers) if "{i}" in path else [None]
            for i in layers:
                module = self._module(path.format(i=i))
                handles.append(self._hook(module, site, i, where, tap))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @staticmethod
    def _hook(module, site, layer, where, tap):
        if where == "in":
            def pre(mod, args, kwargs):
                x = args[0] if args else kwargs["hidden_states"]
                new = tap(site, layer, x)
                if new is not x:
                    x.copy_(new)
            return module.register_forward_pre_hook(pre, with_kwargs=True)

        def post(mod, args, output):
            if where == "out0":
                return (tap(site, layer, output[0]),) + tuple(output[1:])
            return tap(site, layer, output)
        return module.register_forward_hook(post)

    @contextlib.contextmanager
    def _attention(self, tap):
        original = self.modeling.eager_attention_forward

        def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            i = module.layer_idx
            query = tap("layers.self_attn.attention_queries", i, query)
            key = tap("layers.self_attn.attention_keys", i, key)
            value = tap("layers.self_attn.attention_values", i, value)
            groups = query.shape[1] // key.shape[1]
            k = key.repeat_interleave(groups, dim=1)
            v = value.repeat_interleave(groups, dim=1)
            scores = torch.matmul(query, k.transpose(2, 3)) * scaling
            if attention_mask is not None:
                scores = scores + attention_mask
            scores = tap("layers.self_attn.attention_scores", i, scores)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            probs = tap("layers.self_attn.attention_probabilities", i, probs)
            out = torch.matmul(probs, v).transpose(1, 2).contiguous()
            out = tap("layers.self_attn.attention_head_outputs", i, out)
            return out, probs

        self.modeling.eager_attention_forward = eager
        try:
            yield
        finally:
            self.modeling.eager_attention_forward = original
