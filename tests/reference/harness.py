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

A plan entry is ``(module path, where)`` or ``(module path, where, scale)``.
With a scale, the site is a computed copy, not the module's tensor: its value
is the module's tensor times ``scale`` (a number, or the name of a config
attribute such as ``"residual_multiplier"``), and an edit reaches the model as
the edited copy divided by ``scale``, handed back in the module's place (the
round trip nnsight makes for HyperCLOVA X's ``attention_output``).

On hybrids a plan value may be a dict from layer type (``config.layer_types``)
to an entry: each block is hooked by its own type's entry, and a type without
one has no such site (e.g. ``attention_norm_output`` on OLMo-Hybrid's
attention blocks). Block sites come back stacked over the blocks that have them.

The gated DeltaNet interior (``layers.linear_attn.*`` but ``attention_output``)
comes from a capturing wrapper bound in place of the family's
``torch_chunk_gated_delta_rule`` during a call: it taps the kernel's inputs
(queries and keys before the kernel's l2 norm), the initial state (zeros
without a cache; an edit there is what the kernel starts from), the final
state (asked for whatever ``output_final_state`` says) and the output.
``states`` is recomputed, only when read, token by token with the family's
``torch_recurrent_gated_delta_rule`` from the same (edited) inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM

# site -> (module path with {i} for the block, where: "in" | "out" | "out0"[, scale])
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


LINEAR_INTERIOR = (
    "layers.linear_attn.attention_queries",
    "layers.linear_attn.attention_keys",
    "layers.linear_attn.attention_values",
    "layers.linear_attn.decays",
    "layers.linear_attn.betas",
    "layers.linear_attn.state_input",
    "layers.linear_attn.states",
    "layers.linear_attn.state_output",
    "layers.linear_attn.attention_head_outputs",
)


def sunk(tap, i: int, scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss' eager attention's probabilities over the keys beside the heads' sink logits (one more softmax
    column, dropped after), tapping ``attention_sinks`` and ``sink_probability``; an edited sink probability
    re-normalises the keys (the softmax over the keys alone times ``1 - sink_probability``, jstd's definition)."""
    tap("layers.self_attn.attention_sinks", i, sinks)
    column = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[-2], -1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    joint = torch.softmax(combined, dim=-1, dtype=combined.dtype)
    sink = joint[..., -1]
    edited = tap("layers.self_attn.sink_probability", i, sink)
    if edited is sink:
        return joint[..., :-1]
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype) * (1 - edited)[..., None]


NORMALIZED = {"attention_norm_output": "attention_norm_normalized", "mlp_norm_output": "mlp_norm_normalized"}


def with_normalized(plan: dict) -> dict:
    """``plan`` with each block norm's normalized value (``X_norm_normalized``: ``x / rms(x)`` before the weight)
    computed from the same norm module's input, wherever the plan hooks that norm's output."""
    def entry(e):
        if isinstance(e, dict):
            return {k: entry(v) for k, v in e.items()}
        return (e[0], "normalized") if e[1] == "out" else None

    out = dict(plan)
    for site, e in plan.items():
        stack, _, rel = site.rpartition(".")
        if rel in NORMALIZED and (new := entry(e)) is not None:
            out[f"{stack}.{NORMALIZED[rel]}"] = new
    return out


def normalized(module, x: torch.Tensor) -> torch.Tensor:
    """A norm module's normalized input, before its weight: ``x / rms(x)`` (LayerNorm: ``(x - mean) / std``)
    in float32 with the module's eps, cast to ``x``'s dtype (what TransformerLens' ``hook_normalized`` holds)."""
    x32 = x.float()
    eps = next(getattr(module, k) for k in ("variance_epsilon", "eps", "epsilon") if hasattr(module, k))
    if isinstance(module, torch.nn.LayerNorm):
        c = x32 - x32.mean(-1, keepdim=True)
        return (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclasses.dataclass
class TorchEdit:
    site: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    layer: int | None = None


class TorchReference:
    """A transformers causal LM loaded from ``folder`` with eager attention, in ``dtype``."""

    def __init__(self, folder, dtype=torch.float32, plan=LLAMA_PLAN):
        self.model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype).eval()
        self.plan = plan
        self.modeling = importlib.import_module(type(self.model).__module__)

    @property
    def plan(self) -> dict:
        return self._plan

    @plan.setter
    def plan(self, plan: dict):
        self._plan = with_normalized(plan)

    @property
    def num_layers(self):
        return self.model.config.num_hidden_layers

    def sites(self):
        return tuple(self.plan) + ATTENTION_INTERIOR + self.linear_sites() + ("logits", "next_token_probs")

    def linear_sites(self) -> tuple[str, ...]:
        """The gated DeltaNet interior where the text model has one (``_linear_attention`` captures it)."""
        return LINEAR_INTERIOR if hasattr(self.modeling, "torch_chunk_gated_delta_rule") else ()

    def _to_jstd(self, site, t):
        """A captured tensor in jstd's layout (premix split into heads)."""
        if site.endswith("self_attn.attention_premix"):
            return t.reshape(*t.shape[:-1], self.model.config.num_attention_heads, -1)
        return t

    def _from_jstd(self, site, t, like):
        """An edited value back in the module's layout."""
        return t.reshape(like.shape)

    def _tap(self, reads, edits):
        """``(tap, got)``: ``tap(site, layer, value)`` applies the edits at the site and records it if read into
        ``got`` (site -> {layer: value in jstd's layout}); returns the (edited) value."""
        got: dict[str, dict] = {}

        def tap(site, layer, value):
            for e in edits:
                if e.site == site and (e.layer is None or e.layer == layer):
                    value = self._from_jstd(site, e.fn(self._to_jstd(site, value)), value)
            if site in reads:
                got.setdefault(site, {})[layer] = self._to_jstd(site, value).detach().float().clone()
            return value

        return tap, got

    @staticmethod
    def _stacked(got) -> dict[str, np.ndarray]:
        """Each recorded site as one array: block sites stacked over blocks, block axis first."""
        return {site: per[None].numpy() if None in per else np.stack([per[i].numpy() for i in sorted(per)])
                for site, per in got.items()}

    def run(self, tokens, reads=(), edits=(), attention_mask=None) -> dict[str, np.ndarray]:
        reads = tuple(reads) or self.sites()
        tap, got = self._tap(reads, list(edits))
        with torch.no_grad(), self._hooks(tap), self._attention(tap), self._linear_attention(tap, reads):
            ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
            mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask), dtype=torch.long)
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        logits = tap("logits", None, logits)
        out = self._stacked(got)
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
        for site, entry in self.plan.items():
            for i, (path, where, *scale) in self._blocks(entry):
                through = tap if not scale else self._scaled(tap, scale[0])
                module = self._module(path.format(i=i))
                handles.append(self._hook(module, site, i, where, through))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _blocks(self, entry):
        """(block index or None, entry) for each module a plan entry hooks."""
        if isinstance(entry, dict):  # by layer type: a block whose type has no entry has no such site
            types = self.model.config.layer_types
            return [(i, entry[t]) for i, t in enumerate(types) if t in entry]
        return [(i, entry) for i in (range(self.num_layers) if "{i}" in entry[0] else [None])]

    def _scaled(self, tap, scale):
        """``tap`` for a site that is the module's tensor times ``scale``; edits come back divided by it."""
        factor = getattr(self.model.config, scale) if isinstance(scale, str) else scale

        def through(site, layer, x):
            copy = x * factor
            new = tap(site, layer, copy)
            return x if new is copy else new / factor
        return through

    @staticmethod
    def _hook(module, site, layer, where, tap):
        if where == "normalized":  # read-only here: computed from the norm's input, what follows is torch's own
            def read(mod, args, output):
                tap(site, layer, normalized(mod, args[0]))
            return module.register_forward_hook(read)
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
    def _attention(self, tap, modeling=None):
        """The capturing eager attention bound in ``modeling`` (the family's modeling module by default)."""
        modeling = modeling or self.modeling
        original = modeling.eager_attention_forward

        def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
            i = module.layer_idx
            query = tap("layers.self_attn.attention_queries", i, query)
            key = tap("layers.self_attn.attention_keys", i, key)
            value = tap("layers.self_attn.attention_values", i, value)
            groups = query.shape[1] // key.shape[1]
            k = key.repeat_interleave(groups, dim=1)
            v = value.repeat_interleave(groups, dim=1)
            scores = torch.matmul(query, k.transpose(2, 3)) * scaling
            if kwargs.get("softcap") is not None:  # Gemma 2's soft-capped scores: attention_scores after the cap
                scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
            if attention_mask is not None:
                scores = scores + attention_mask
            scores = tap("layers.self_attn.attention_scores", i, scores)
            if getattr(module, "sinks", None) is None:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            else:
                probs = sunk(tap, i, scores, module.sinks).to(value.dtype)
            probs = tap("layers.self_attn.attention_probabilities", i, probs)
            out = torch.matmul(probs, v).transpose(1, 2).contiguous()
            out = tap("layers.self_attn.attention_head_outputs", i, out)
            return out, probs

        modeling.eager_attention_forward = eager
        try:
            yield
        finally:
            modeling.eager_attention_forward = original

    @contextlib.contextmanager
    def _linear_attention(self, tap, reads):
        chunk = getattr(self.modeling, "torch_chunk_gated_delta_rule", None)
        if chunk is None:
            yield
            return
        recurrent = self.modeling.torch_recurrent_gated_delta_rule
        current = {}
        handles = [
            m.register_forward_pre_hook(lambda mod, args, i=m.layer_idx: current.update(layer=i))
            for name, m in self.model.named_modules() if name.endswith("linear_attn")
        ]

        def capture(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
            i = current["layer"]
            site = "layers.linear_attn."
            query = tap(site + "attention_queries", i, query)
            key = tap(site + "attention_keys", i, key)
            value = tap(site + "attention_values", i, value)
            g = tap(site + "decays", i, g)
            beta = tap(site + "betas", i, beta)
            if initial_state is None:
                b, _, _, dk = key.shape
                initial_state = torch.zeros(b, value.shape[2], dk, value.shape[3], dtype=torch.float32)
            initial_state = tap(site + "state_input", i, initial_state)
            out, final = chunk(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                               output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
            if site + "states" in reads:
                state, states = initial_state, []
                for t in range(query.shape[1]):
                    one = lambda x: x[:, t:t + 1]
                    _, state = recurrent(one(query), one(key), one(value), g=one(g), beta=one(beta),
                                         initial_state=state, output_final_state=True,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
                    states.append(state)
                tap(site + "states", i, torch.stack(states, dim=1))
            final = tap(site + "state_output", i, final)
            out = tap(site + "attention_head_outputs", i, out)
            return out, (final if output_final_state else None)

        self.modeling.torch_chunk_gated_delta_rule = capture
        try:
            yield
        finally:
            self.modeling.torch_chunk_gated_delta_rule = chunk
            for h in handles:
                h.remove()
