"""Attribution: direct logit attribution of blocks and heads, and attribution patching.

    dla = jstd.direct_logit_attribution(model, tokens, target=paris, other=london)
    dla.attention[5], dla.mlp[5], dla.heads[5, :, 3]          # per block, per head, per row
    dla.experts[5, :, 7], dla.shared_expert[5]                # per expert of a mixture-of-experts MLP
    est = jstd.attribution_patching(model, clean, corrupt, "layers.layer_output", metric)   # [layers, positions]

Direct logit attribution splits the residual stream at one position into what
enters block 0 and what each block's attention and MLP add, and reads each
part through the final norm *with its scale frozen* at the value it takes on the
whole stream (as TransformerLens does), then through the head. Because the
final RMSNorm is linear once its scale is frozen, and the head is linear, the
parts sum to the logit (difference) the model returns, up to float rounding.
A mixture-of-experts MLP's part splits further, by expert: each chosen expert's
weighted output and the shared expert's, which sum to the block's MLP part.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.kernels.moe import weighted
from jstd.core.edits import Add, check_index, check_left_padded, site_axes
from jstd.core.inputs import Inputs, as_inputs
from jstd.interventions.metrics import check_token_ids
from jstd.interventions.patching import checked_metric, pair_inputs
from jstd.interventions.reading import read
from jstd.run import run
from jstd.core.sites import SITES, SiteError, parse

HEAD_OUTPUTS = "layers.self_attn.attention_head_outputs"
STREAM = ("layers.layer_input", "layers.mlp.mlp_output", "layers.layer_output")
MIXERS = ("self_attn", "linear_attn")
ROUTED = ("layers.mlp.router_weights", "layers.mlp.expert_indices", "layers.mlp.expert_outputs")
SHARED_EXPERT = "layers.mlp.shared_expert_output"


class LogitAttribution(eqx.Module):
    """Direct logit attribution at one position, per batch row.

    embeddings: what enters block 0 (``layers.0.layer_input``).
    attention, mlp: what each block's mixer (softmax attention or, on hybrids,
        DeltaNet) and MLP add (``attention_output``, ``mlp_output``).
    heads: each head's share of ``attention`` (its head output through its
        slice of o_proj; the o_proj bias, when there is one, is in ``attention``
        but in no head), None when not asked for.
    experts: on a mixture-of-experts model, each expert's share of ``mlp``:
        ``router_weights[k] · expert_outputs[k]`` of the expert ``e`` chosen
        in place ``k``, at ``experts[block, row, e]`` (zero for the experts a
        row did not choose, and on blocks with a dense MLP); None when not
        asked for.
    shared_expert: the shared expert's share of ``mlp`` (Qwen3.5-MoE: its gated
        output; zero on blocks with a dense MLP), None on models without one or
        when experts are not asked for. On each MoE block ``experts.sum(-1) +
        shared_expert == mlp`` up to float rounding.
    logit: the model's own logit (difference) at the position; with a final
        soft-cap (Gemma 2), the logit *before* the cap: what the parts decompose.
    final_norm_bias: a final LayerNorm's bias through the head (GPT-2, GPT-NeoX: the norm centres each part and
        adds its bias once, a term of no part), and the head's own bias where it has one (GPT-J, Phi); None after
        an RMSNorm.
    """

    embeddings: Float[Array, "batch"]
    attention: Float[Array, "layers batch"]
    mlp: Float[Array, "layers batch"]
    heads: Float[Array, "layers batch heads"] | None
    logit: Float[Array, "batch"]
    final_norm_bias: Float[Array, "batch"] | None = None
    experts: Float[Array, "layers batch experts"] | None = None
    shared_expert: Float[Array, "layers batch"] | None = None
    # False when the model soft-caps its logits (tanh(x / cap) · cap is not linear): the parts then sum to the
    # logit before the cap, not to the logits the model returns
    exact: bool = eqx.field(static=True, default=True)

    def total(self) -> Float[Array, "batch"]:
        """The sum of the parts (and of ``final_norm_bias``), equal to ``logit`` up to float rounding."""
        parts = self.embeddings + self.attention.sum(0) + self.mlp.sum(0)
        return parts if self.final_norm_bias is None else parts + self.final_norm_bias


def _mixer_sites(model) -> tuple[str, ...]:
    """Each mixer host's ``attention_output`` the model has (both on a hybrid)."""
    return tuple(f"layers.{h}.attention_output" for h in MIXERS if model.layers_with(h))


def _head_slot(model):
    """The block whose heads are split: every block must be one softmax-attention block that adds o_proj's
    output linearly (times its multiplier); raises NotImplementedError otherwise."""
    stack = model.stacks["layers"]
    block = stack.slots[0]
    if stack.period != 1 or not block.has("self_attn"):
        raise NotImplementedError("per-head attribution reads every block's attention heads; this "
                                  f"{model.family} model has blocks without self_attn (pass heads=False)")
    if block.attention_post_norm is not None:
        raise NotImplementedError("per-head attribution needs a block that adds o_proj's output linearly; "
                                  "this one passes it through a post-norm (attribute attention_output instead)")
    return block


def _splits_heads(model) -> bool:
    """Whether per-head attribution is exact on ``model`` (see :func:`_head_slot`)."""
    try:
        _head_slot(model)
    except NotImplementedError:
        return False
    return True


def _expert_multiplier(model) -> float:
    """The factor from a mixture-of-experts MLP's weighted sum to what its block adds: every block with a router
    must add that sum linearly (no post-norm); raises NotImplementedError on a model without a router or where a
    post-norm follows the experts."""
    stack = model.stacks["layers"]
    routed = [getattr(slot, "rows", (slot,))[0] for slot in stack.slots if "mlp.expert_outputs" in slot.sites()]
    if not routed:
        raise NotImplementedError(f"per-expert attribution needs a mixture-of-experts MLP; this {model.family} "
                                  "model has none (pass experts=False)")
    if any(block.mlp_post_norm is not None for block in routed):
        raise NotImplementedError("per-expert attribution needs a block that adds its experts' weighted sum "
                                  "linearly; this one passes it through a post-norm (attribute mlp_output instead)")
    return routed[0].residual_multiplier


def _splits_experts(model) -> bool:
    """Whether per-expert attribution is exact on ``model`` (see :func:`_expert_multiplier`)."""
    try:
        _expert_multiplier(model)
    except NotImplementedError:
        return False
    return True


def direct_logit_attribution(
    model, tokens: Int[Array, "batch seq"], target, other=None, *, position: int = -1, heads: bool | None = None,
    experts: bool | None = None, edits=(),
    attention_mask: Int[Array, "batch seq"] | None = None,
) -> LogitAttribution:
    """Each block's (and head's) direct contribution to ``logit[target] - logit[other]`` at ``position``.

    ``target`` / ``other`` are token ids (an int, or one per row); with
    ``other`` None the attribution is of ``logit[target]`` alone. A part ``c``
    of the residual stream ``x`` at the position contributes
    ``readout(w · c · s)``, where ``w`` is the final norm's weight, ``s =
    1/sqrt(mean(x²) + eps)`` the final norm's scale frozen at ``x``, and
    ``readout`` the head (and the family's linear scaling after it). The parts
    sum to the logit (difference) exactly up to float rounding. On a model that
    soft-caps its logits (Gemma 2's ``final_logit_softcapping``) the cap is not
    linear: the decomposition is of the logits before the cap (``logit`` is
    that logit difference, ``exact`` is False) and a UserWarning says so.

    ``heads`` splits each block's attention into its heads, exact where the
    block adds o_proj's output itself (Llama; HyperCLOVA X without post-norms,
    times its residual multiplier). ``heads=None`` (the default) splits them
    where that is exact and leaves ``heads`` None on other models (hybrids,
    post-norms); ``heads=True`` raises NotImplementedError there.

    ``experts`` splits each mixture-of-experts block's MLP part by expert
    (``LogitAttribution.experts``, ``shared_expert``): each chosen expert's
    ``router_weights[k] · expert_outputs[k]`` in the dtype the model forms it
    before the sum, through the same frozen final norm and head, so the parts
    sum to the block's ``mlp`` up to float rounding, and expert ``e``'s part is
    the change in the block's (linearized) MLP part when its output is zeroed
    (``jstd.Zero("layers.mlp.expert_outputs", layer=block, where=...)`` at the
    place ``k`` where it was chosen). It is the direct effect only: what the
    expert's output changes downstream is not in it. ``experts=None`` (the
    default) splits them on models with a router; ``experts=True`` raises
    NotImplementedError on others.

    Raises ValueError for ids outside the vocabulary, SiteError for a
    ``position`` outside ``-seq..seq-1``, ValueError for a negative position
    on rows padded on the right (pad on the left).
    """
    model.readout()  # raises for a model without a final RMSNorm and a linear head
    if heads is None:
        heads = _splits_heads(model)
    elif heads:
        _head_slot(model)
    if experts is None:
        experts = _splits_experts(model)
    elif experts:
        _expert_multiplier(model)
    inputs = as_inputs(tokens, attention_mask)
    batch, seq = np.shape(inputs.tokens)
    who = "direct_logit_attribution"
    target, other = (None if ids is None else check_token_ids(ids, model.config.vocab_size, batch, f"{who}: {name}")
                     for ids, name in ((target, "target"), (other, "other")))
    check_index(position, seq, f"{who}: position", "seq")
    if position < 0:
        inputs = Inputs(inputs.tokens, check_left_padded(inputs.attention_mask, f"{who} (position={position})"),
                        inputs.images, inputs.layout)
    capped = getattr(model.decoder, "logit_softcap", None) is not None
    if capped:
        warnings.warn(f"direct_logit_attribution: this {model.family} model soft-caps its logits "
                      f"(tanh(x / {model.decoder.logit_softcap}) · cap), which is not linear; the attribution is of "
                      "the logits before the cap (LogitAttribution.exact is False)", UserWarning, stacklevel=2)
    routed = (ROUTED + ((SHARED_EXPERT,) if SHARED_EXPERT in model.sites else ())) if experts else ()
    reads = (STREAM + _mixer_sites(model) + ((HEAD_OUTPUTS,) if heads else ()) + (("final_norm_output",) if capped else ())
             + routed)
    out = read(model, inputs, reads, edits)
    return _dla(model, out, target, other, position, heads, capped, experts)


@eqx.filter_jit
def _dla(model, out, target, other, position, heads, capped=False, experts=False):
    final_norm, logits_from_norm = model.readout()
    at = lambda name: out[name][:, :, position].astype(jnp.float32)  # [layers, batch, hidden]
    x = at("layers.layer_output")[-1]  # the final residual stream, [batch, hidden]
    layer_norm = getattr(final_norm, "bias", None) is not None  # a LayerNorm: centred, then a bias
    if layer_norm:
        centered = x - jnp.mean(x, -1, keepdims=True)
        scale = jax.lax.rsqrt(jnp.mean(centered * centered, -1, keepdims=True) + final_norm.eps)  # frozen
        weight = final_norm.weight.astype(jnp.float32)
    else:
        scale = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + final_norm.eps)  # frozen, [batch, 1]
        weight = final_norm.effective_weight
    batch = x.shape[0]

    # the readout direction: the gradient of the (linear) head's logit difference, one per row
    def readout_rows(normed):
        logits = logits_from_norm(normed.astype(out.logits.dtype)).astype(jnp.float32)
        pick = lambda ids: jnp.take_along_axis(logits, jnp.broadcast_to(ids, (batch,))[:, None], -1)[:, 0]
        return pick(target) - (0.0 if other is None else pick(other))

    readout = lambda normed: jnp.sum(readout_rows(normed))

    gradient = jax.grad(readout)(jnp.zeros_like(x))  # [batch, hidden]
    head_bias = readout_rows(jnp.zeros_like(x)) if getattr(model.decoder, "lm_head_bias", None) is not None else 0.0
    direction = gradient * weight * scale
    if layer_norm:  # centring is linear and symmetric: <c - mean(c), d> = <c, d - mean(d)>
        direction = direction - jnp.mean(direction, -1, keepdims=True)
    dot = lambda c: jnp.einsum("...bh,bh->...b", c, direction)
    logits = out.logits[:, position].astype(jnp.float32)
    if capped:  # the logits before the cap, as the model computes them
        logits = logits_from_norm(out["final_norm_output"][:, position]).astype(jnp.float32)
    pick = lambda ids: jnp.take_along_axis(logits, jnp.broadcast_to(ids, (batch,))[:, None], -1)[:, 0]
    logit = pick(target) - (0.0 if other is None else pick(other))

    per_head = None
    if heads:
        block = _head_slot(model)
        h = out[HEAD_OUTPUTS][:, :, position].astype(jnp.float32)  # [layers, batch, heads, head_dim]
        o = block.attn.o.astype(jnp.float32)  # [layers, heads, head_dim, hidden]
        through_o = jnp.einsum("lbnd,lnde,be->lbn", h, o, direction)
        per_head = through_o * block.residual_multiplier
    per_expert = shared = None
    if experts:
        per_expert, shared = _expert_parts(model, out, position, direction)
    mixer = jnp.zeros((model.depth(),) + x.shape, jnp.float32)
    for site in _mixer_sites(model):  # each block's mixer, whichever host it has
        mixer = mixer.at[jnp.asarray(model.blocks_for(site))].set(at(site))
    return LogitAttribution(
        embeddings=dot(at("layers.layer_input")[0]),
        attention=dot(mixer),
        mlp=dot(at("layers.mlp.mlp_output")),
        heads=per_head,
        logit=logit,
        # a head's own bias (GPT-J, Phi) is what the readout gives a zero input: the identity elsewhere
        final_norm_bias=(jnp.sum(gradient * final_norm.bias.astype(jnp.float32), -1) + head_bias) if layer_norm
        else None,
        exact=not capped,
        experts=per_expert,
        shared_expert=shared,
    )


def _expert_parts(model, out, position, direction):
    """``(experts [layers, batch, experts], shared_expert [layers, batch] or None)``: each chosen expert's weighted
    output (and the shared expert's) at ``position``, dotted with the readout ``direction`` [batch, hidden]."""
    multiplier = _expert_multiplier(model)
    weights, indices, outputs = (out[site][:, :, position] for site in ROUTED)  # [blocks, batch, top_k(, hidden)]
    parts = jnp.einsum("lbkh,bh->lbk", weighted(outputs, weights).astype(jnp.float32), direction) * multiplier
    chosen = jax.nn.one_hot(indices, model.config.num_experts, dtype=jnp.float32)  # [blocks, batch, top_k, experts]
    blocks = jnp.asarray(model.blocks_for(ROUTED[0]))
    depth, batch = model.depth(), direction.shape[0]
    per_expert = jnp.zeros((depth, batch, model.config.num_experts), jnp.float32).at[blocks].set(
        jnp.einsum("lbk,lbke->lbe", parts, chosen))
    shared = None
    if SHARED_EXPERT in out.values:
        gated = out[SHARED_EXPERT][:, :, position].astype(jnp.float32)
        shared = jnp.zeros((depth, batch), jnp.float32).at[jnp.asarray(model.blocks_for(SHARED_EXPERT))].set(
            jnp.einsum("lbh,bh->lb", gated, direction) * multiplier)
    return per_expert, shared


def attribution_patching(
    model, clean: Int[Array, "batch seq"] | Inputs, corrupt: Int[Array, "batch seq"] | Inputs,
    site: str | Sequence[str], metric, *, heads: bool | None = None, per_element: bool = False, attention_mask: Int[Array, "batch seq"] | None = None,
):
    """The linear estimate of ``patch_sweep``'s change in ``metric``: gradient × (clean − corrupt) values.

    One forward and one backward pass on ``corrupt`` give the gradient of
    ``metric(logits)`` with respect to every block's value at each site (all
    sites in ``site`` at once); times the clean-minus-corrupt difference of the
    values, summed over the batch rows and the feature axis, it estimates
    ``patch_sweep(...) - metric(corrupt run)`` entry by entry, on the same grid:
    ``[layers, positions(, heads)]`` (heads kept where the site has them and
    ``heads`` is not False). ``per_element`` returns the unreduced product in
    the site's stacked layout. Returns one array, or a dict for several sites.
    ``clean`` and ``corrupt`` are token ids of one shape (sharing
    ``attention_mask``) or ``jstd.Inputs`` (with images on a wrapper).
    """
    sites = (site,) if isinstance(site, str) else tuple(site)
    for s in sites:
        if parse(s)[1] is not None:
            raise SiteError(f"attribution_patching takes every block of a site ('layers.X'); got {s!r}")
    clean, corrupt = pair_inputs(clean, corrupt, attention_mask)
    corrupt = checked_metric(metric, corrupt, model, "attribution_patching")
    # both runs' values from one compiled program, so the difference is exactly zero where they agree
    clean_values = read(model, clean, sites, ()).values
    corrupt_values = read(model, corrupt, sites, ()).values
    grads = _gradients(model, corrupt, metric, sites, clean_values)
    result = {}
    for s in sites:
        product = grads[s].astype(jnp.float32) * (clean_values[s].astype(jnp.float32) - corrupt_values[s].astype(jnp.float32))
        result[s] = product if per_element else _to_grid(s, product, heads)
    return result[sites[0]] if isinstance(site, str) else result


@eqx.filter_jit
def _gradients(model, corrupt: Inputs, metric, sites, like):
    def f(deltas):
        edits = [Add(s, deltas[s]) for s in sites]
        return metric(run(model, corrupt, edits).logits)

    return jax.grad(f)({s: jnp.zeros_like(like[s]) for s in sites})


def _to_grid(site: str, product: Array, heads: bool | None) -> Array:
    """Sum a stacked per-element product down to the sweep grid [layers, positions(, heads)]."""
    per_block = SITES[site].per_block
    off = 1 if per_block else 0
    pos_axis, head_axis = site_axes(site)
    keep = ([0] if per_block else []) + ([off + pos_axis] if pos_axis is not None else [])
    if head_axis is not None and heads is not False:
        keep.append(off + head_axis)
    summed = tuple(a for a in range(product.ndim) if a not in keep)
    reduced = product.sum(axis=summed)
    # the sum leaves the kept axes in their layout order; put them in grid order (block, position, head)
    ranked = sorted(keep)
    return jnp.transpose(reduced, [ranked.index(a) for a in keep])
