"""The standard vocabulary: one table of every site jstd knows.

A *site* is a named internal value of a transformer that interpretability work
reads or writes. Its name is dotted and says where it lives (its *host*):
``token_embeddings`` on the model, ``layers.layer_output`` on every block,
``layers.self_attn.attention_queries`` inside a block's attention. Its layout
names the axes of the value one host computes (per block for block sites).

``"layers.X"`` addresses site X on every block that has its host (stacked,
block axis first); ``"layers.5.X"`` addresses block 5 alone (negative indices
count from the end). Everything else in jstd — the docs in ``docs/values.md``,
the errors for unknown names, the edit checks — is derived from this table.
"""

from __future__ import annotations

import dataclasses
import difflib
import re


@dataclasses.dataclass(frozen=True)
class Site:
    """One standard value.

    name: the full dotted name without a block index (``layers.mlp.mlp_output``).
    host: the part of the model that computes it (``model``, ``layers``,
        ``layers.self_attn``, ``vision``, ``vision.layers.mlp``…).
    layout: the value's axes, in order, for one host (one block for block sites).
    meaning: what the value is, in one or two sentences.
    editable: whether edits may replace it; derived values are read-only.
    family: the family that alone serves it, for family-specific sites; None for
        the shared vocabulary.
    stack: the stack of blocks a block site belongs to (``layers``,
        ``vision.layers``); None for a site computed once per call.
    parent: for a dictionary's site (``layers.layer_output.sae.latents``),
        the site the dictionary is spliced at; served wherever the parent is,
        on calls that splice a dictionary there (``jstd.splice``). None otherwise.
    """

    name: str
    host: str
    layout: tuple[str, ...]
    meaning: str
    editable: bool = True
    family: str | None = None
    stack: str | None = None
    parent: str | None = None

    @property
    def per_block(self) -> bool:
        return self.stack is not None

    @property
    def relative(self) -> str:
        """The name inside its block (``self_attn.attention_queries``), or the whole name for other sites."""
        return self.name[len(self.stack) + 1:] if self.stack else self.name


RESIDUAL = ("batch", "seq", "hidden")
STACKS = ("layers", "vision.layers")
# a tower's values name their axes after images and patches, and the tower's own width
VISION_AXES = {"batch": "images", "seq": "patches", "hidden": "vision_hidden"}


def _site(name, layout, meaning, editable=True, family=None):
    host = name.rsplit(".", 1)[0] if "." in name else "model"
    return Site(name, host, tuple(layout), meaning, editable, family)


# The values a block computes, by name relative to its block. Every stack serves
# the ones its blocks compute (``layers.X`` on the text model, ``vision.layers.X``
# on a tower), so one Attention or MLP taps the same relative names in any stack.
BLOCK_SITES = [
    # the stream
    ("layer_input", RESIDUAL, "The residual stream entering the block."),
    ("attention_norm_normalized", RESIDUAL, "The stream normalised by the block's input norm before its weight: x / rms(x) (a LayerNorm's (x - mean) / std, before weight and bias), in the stream's dtype; TransformerLens' ln1.hook_normalized. Editing it changes what the weight multiplies."),
    ("attention_norm_output", RESIDUAL, "The normed stream entering the mixer (the output of the block's input norm)."),
    ("layer_mid", RESIDUAL, "The residual stream after the mixer's add: layer_input + attention_output."),
    ("mlp_norm_normalized", RESIDUAL, "The stream normalised by the MLP's input norm before its weight: x / rms(x) (a LayerNorm's (x - mean) / std, before weight and bias), in the stream's dtype; TransformerLens' ln2.hook_normalized (Gemma 2 / 3: pre_feedforward_layernorm's). Editing it changes what the weight multiplies."),
    ("mlp_norm_output", RESIDUAL, "The normed stream entering the MLP (the output of the MLP's input norm)."),
    ("mlp_input", RESIDUAL, "What the MLP is called with."),
    ("layer_output", RESIDUAL, "The residual stream leaving the block: layer_mid + mlp_output."),
    # softmax attention
    ("self_attn.attention_queries", ("batch", "heads", "seq", "qk_head_dim"), "The queries entering attention, after the rotary embedding where the family has one (and, on Llama 4, its L2 norm or attention temperature: what enters the product)."),
    ("self_attn.attention_keys", ("batch", "kv_heads", "seq", "qk_head_dim"), "The keys entering attention, after the rotary embedding, before the grouped-query repeat."),
    ("self_attn.attention_values", ("batch", "kv_heads", "seq", "head_dim"), "The values entering attention, before the grouped-query repeat."),
    ("self_attn.attention_scores", ("batch", "heads", "query", "key"), "The attention scores entering the softmax: scaled q·k (soft-capped, tanh(s / cap) · cap, where the family caps them: Gemma 2) with the causal, padding and sliding-window mask applied (masked entries hold the dtype's minimum; the key axis spans every key, a window's keys outside it masked)."),
    ("self_attn.attention_probabilities", ("batch", "heads", "query", "key"), "The attention pattern the values are mixed with (softmax of the scores in float32, cast back; with attention sinks, gpt-oss: the softmax over the keys and the sink, the sink's column dropped, so a row sums to 1 - sink_probability)."),
    ("self_attn.attention_sinks", ("heads",), "Each head's learned sink logit: one more column of every row's softmax, which takes probability mass and mixes in no value; a parameter, read-only.", False, "gpt_oss"),
    ("self_attn.sink_probability", ("batch", "heads", "query"), "The probability each query gives its head's sink (the mass the keys do not receive: 1 - the row's sum of attention_probabilities); an edit re-normalises the keys' mass, their probabilities becoming the softmax over the keys alone times 1 - sink_probability.", True, "gpt_oss"),
    ("self_attn.attention_head_outputs", ("batch", "seq", "heads", "head_dim"), "The per-head outputs of the attention, before the output projection (and before the output gate, where the attention has one: Qwen3.5)."),
    ("self_attn.attention_premix", ("batch", "seq", "heads", "head_dim"), "Every head's output side by side, as the output projection takes it (after the output gate, where the attention has one)."),
    ("self_attn.attention_output", RESIDUAL, "What the attention adds to the residual stream."),
    ("self_attn.attention_raw_output", RESIDUAL, "The attention's own output (the output projection's), before the post-norm and the residual multiplier that turn it into attention_output; the post-norm undoes a scaling here (up to its eps), so scale attention_output instead.", True, "hyperclovax"),
    # multi-head latent attention (DeepSeek-V2 / V3: jstd.nn.latent_attention)
    ("self_attn.q_latent", ("batch", "seq", "q_lora_rank"), "The queries' low-rank latent after its norm (q_a_layernorm's output: what q_b_proj reads); where the family has q_lora_rank.", True, "deepseek_v2"),
    ("self_attn.kv_latent", ("batch", "seq", "kv_lora_rank"), "The keys' and values' shared latent after its norm (kv_a_layernorm's output: what kv_b_proj expands into each head's unrotated key part and its values); what a block caches, with rope_keys.", True, "deepseek_v2"),
    ("self_attn.rope_keys", ("batch", "seq", "qk_rope_head_dim"), "The keys' rotary part after the rotary, one for all heads: attention_keys[..., qk_nope_head_dim:] on every head; cached with kv_latent.", True, "deepseek_v2"),
    # the MLP
    ("mlp.mlp_activation", ("batch", "seq", "mlp"), "The activation function's output."),
    ("mlp.mlp_neurons", ("batch", "seq", "mlp"), "What the down projection receives: act(gate)·up on a gated MLP, the activation itself otherwise."),
    ("mlp.mlp_output", RESIDUAL, "What the MLP adds to the residual stream."),
    # a mixture-of-experts MLP (jstd.nn.moe): the router, the chosen experts, their outputs, a shared expert
    ("mlp.router_logits", ("batch", "seq", "experts"), "The router's logits, one per expert (what the softmax and the top-k read; an edit re-routes: -inf at an expert removes it from the top-k)."),
    ("mlp.router_weights", ("batch", "seq", "top_k"), "The weights of the chosen experts (after the family's renormalisation and scaling), in the router's top-k order (DeepSeek: ascending expert order); derived, read-only (edit router_logits to re-route, expert_outputs to change a contribution).", False),
    ("mlp.expert_indices", ("batch", "seq", "top_k"), "The chosen experts (integer ids), in the router's top-k order; derived, read-only.", False),
    ("mlp.expert_outputs", ("batch", "seq", "top_k", "hidden"), "Each chosen expert's output before its router weight, in expert_indices' order (zero one to ablate that expert's contribution; mlp_output = sum of router_weights times expert_outputs, plus shared_expert_output). Llama 4 weights the experts' inputs instead: each is the expert's output on its weighted input, and mlp_output their plain sum plus shared_expert_output."),
    ("mlp.shared_expert_output", RESIDUAL, "The shared expert's output after its sigmoid gate (Qwen3.5-MoE, Qwen2-MoE; ungated on Llama 4 and DeepSeek), added to the routed experts' sum."),
    ("mlp.mlp_raw_output", RESIDUAL, "The MLP's own output (the down projection's), before the post-norm and the residual multiplier that turn it into mlp_output; the post-norm undoes a scaling here (up to its eps), so scale mlp_output instead.", True, "hyperclovax"),
    # the gated DeltaNet mixer (linear attention)
    ("linear_attn.attention_queries", ("batch", "seq", "heads", "key_dim"), "The queries entering the delta rule (after the convolution and its activation, before the kernel's l2 norm)."),
    ("linear_attn.attention_keys", ("batch", "seq", "heads", "key_dim"), "The keys entering the delta rule (after the convolution and its activation, before the kernel's l2 norm)."),
    ("linear_attn.attention_values", ("batch", "seq", "heads", "value_dim"), "The values entering the delta rule."),
    ("linear_attn.decays", ("batch", "seq", "heads"), "The per-token log decay of the recurrent state."),
    ("linear_attn.betas", ("batch", "seq", "heads"), "The per-token write strength into the state."),
    ("linear_attn.state_input", ("batch", "heads", "key_dim", "value_dim"), "The recurrent state entering the layer (zeros at the start of a prompt)."),
    ("linear_attn.state_output", ("batch", "heads", "key_dim", "value_dim"), "The recurrent state leaving the layer (what a cache keeps; nothing in the call reads it, so it is read-only: edit state_input or the values that write it).", False),
    ("linear_attn.states", ("batch", "seq", "heads", "key_dim", "value_dim"), "The recurrent state after every token of the call; derived, read-only.", False),
    ("linear_attn.attention_head_outputs", ("batch", "seq", "heads", "value_dim"), "The per-head outputs of the delta rule, before the gated norm and the output projection."),
    ("linear_attn.attention_output", RESIDUAL, "What the mixer adds to the residual stream."),
]
# hosts a vision tower's blocks may have (towers have no DeltaNet mixers and no family multipliers)
VISION_BLOCK_HOSTS = ("", "self_attn", "mlp")


def _block_site(stack, rel, layout, meaning, editable=True, family=None):
    if stack != "layers":
        layout = tuple(VISION_AXES.get(a, a) for a in layout)
    name = f"{stack}.{rel}"
    return Site(name, name.rsplit(".", 1)[0], tuple(layout), meaning, editable, family, stack)


SITES: dict[str, Site] = {
    s.name: s
    for s in [
        # the text model
        _site("token_embeddings", RESIDUAL, "The embedding lookup of the tokens; on most families what enters block 0 (a family that scales embeddings says so)."),
        _site("position_embeddings", RESIDUAL, "The learned absolute position embeddings of the tokens' positions (GPT-2, GPT-Neo; OPT's row position + 2), added to token_embeddings: token_embeddings + position_embeddings is what enters block 0 (OPT: after project_in). With left padding a token's position counts the real tokens before it."),
        _site("final_norm_output", RESIDUAL, "The residual stream after the final norm, what the head reads."),
        _site("lm_head_output", ("batch", "seq", "vocab"), "The head's logits, before anything the family does past the head (a scale, a softcap)."),
        _site("logits", ("batch", "seq", "vocab"), "The logits the model returns, after anything it does past the head."),
        _site("positions", ("streams", "batch", "seq"), "The position ids the text model's multimodal rotary reads (time, height, width; equal on text), computed from the tokens and the images' grids; read-only.", editable=False),
        _site("next_token_probs", ("batch", "vocab"), "The next-token distribution at the last position (softmax of logits in float32); derived, read-only.", editable=False),
        *(_block_site("layers", *entry) for entry in BLOCK_SITES),
        _block_site("layers", "deepstack_output", ("image_tokens", "hidden"), "A DeepStack tap: one tower block's output through its own merger, one row per image token (prompt order), added to the stream at the image tokens after this block's layer_output, so the next block's layer_input there is layer_output + deepstack_output (served on the blocks that take one; editing it changes what the text model adds).", True, "qwen3_vl"),
        # vision towers
        _site("vision.patch_embeddings", ("images", "grid", "vision_hidden"), "The tower's patch embeddings, the patch grid in raster order, before any class token or position embedding."),
        *(_block_site("vision.layers", *entry) for entry in BLOCK_SITES
          if entry[0].rpartition(".")[0] in VISION_BLOCK_HOSTS and len(entry) < 5),
        _site("vision.tower_output", ("images", "patches", "vision_hidden"), "The vision tower's output: the last block's output, through the tower's final norm where it has one that norms every patch."),
        _site("vision.merger.output", ("image_tokens", "merged_hidden"), "The tower's own patch merger's output, one row per image token, in the tower's order (HyperCLOVA X Vision V2: window order), before the projector."),
        # vision-language wrappers
        _site("projector.input", ("images", "patches", "projector_in"), "What the projector reads."),
        _site("projector.output", ("images", "tokens", "hidden"), "What the projector returns."),
        _site("vision.image_features", ("image_tokens", "hidden"), "The image features the text model receives at the image tokens (read and edited at the scatter)."),
        _site("vision.image_token_mask", ("batch", "seq"), "Which positions are image tokens; read-only.", editable=False),
    ]
}

# A sparse autoencoder or transcoder spliced at a site (``jstd.splice``) serves three values under it. They are
# not among a model's ``sites`` (nothing computes them unless a call splices a dictionary there); ``parent`` says
# where they live. Every text block site of one row per token position may be spliced at.
SAE_SITES = (
    ("latents", ("batch", "seq", "sae"), "The dictionary's feature activations at the site it is spliced at (a transcoder's: computed from its input site); editing them changes what the site passes on by the change in the reconstruction."),
    ("reconstruction", None, "The dictionary's reconstruction of the site's value (a transcoder's: of its output site) from the latents as edited."),
    ("error", None, "The site's value minus the reconstruction of the unedited latents: what the dictionary misses, added back so an unedited splice passes the value on exactly."),
)


def _sae_sites(parent: Site) -> list[Site]:
    return [Site(f"{parent.name}.sae.{rel}", f"{parent.name}.sae", layout or parent.layout, meaning, True, parent.family,
                 parent.stack, parent.name) for rel, layout, meaning in SAE_SITES]


SITES.update({s.name: s for parent in list(SITES.values())
              if parent.stack == "layers" and parent.editable and parent.layout[:2] == ("batch", "seq")
              and parent.layout[2:] in (("hidden",), ("mlp",)) for s in _sae_sites(parent)})

_INDEXED = re.compile(r"^(?P<prefix>(?:vision\.)?layers)\.(?P<index>-?\d+)\.(?P<rest>.+)$")


class SiteError(ValueError):
    """A site name that is unknown, unavailable on a family, or misused."""


def near(name: str, candidates, n: int = 5) -> list[str]:
    """The candidates closest to ``name`` (by spelling and by final component)."""
    candidates = sorted(set(candidates))
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.5)
    tail = name.rsplit(".", 1)[-1]
    close += [c for c in candidates if c.rsplit(".", 1)[-1] == tail and c not in close]
    return close[:n]


def parse(name: str) -> tuple[str, int | None]:
    """Split ``"layers.5.X"`` into ``("layers.X", 5)``; other names get ``None``.

    Raises SiteError, listing the nearest standard names, for a name that is not
    in the vocabulary.
    """
    if not isinstance(name, str):
        raise SiteError(f"a site name is a string like 'layers.layer_output', got {name!r}")
    index = None
    m = _INDEXED.match(name)
    if m:
        name, index = f"{m['prefix']}.{m['rest']}", int(m["index"])
    if name not in SITES:
        hint = near(name, SITES)
        raise SiteError(
            f"unknown site {name!r}. "
            + (f"Nearest standard names: {', '.join(hint)}. " if hint else "")
            + "docs/values.md lists every site."
        )
    if index is not None and not SITES[name].per_block:
        raise SiteError(f"site {name!r} is not a block site; drop the block index")
    return name, index
