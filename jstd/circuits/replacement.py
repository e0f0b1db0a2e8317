"""The local replacement model of a prompt, and the batched derivatives that give an attribution graph its edges.

The model runs once on the prompt (``prompt_values``). Its *linearisation* (``linearised``) is the same
forward with every norm's ``1 / rms`` and every attention pattern held (``jstd.nn.frozen``) and each block's MLP
output ``y_l`` held except for the transcoders' skip path:

    y_l  <-  stop_gradient(y_l) + (skip_l(x_l) - stop_gradient(skip_l(x_l)))     (forward value: y_l itself)

so the derivative of anything read downstream with respect to a perturbation ``δ_l`` added at ``y_l`` (and ``ε``
at the token embeddings) follows only residual additions, attention's value/output maps mixed by the held
patterns, the held norms' diagonals and the skips: circuit-tracer's "direct effect". The freezing lives in the
layers and in two edits at the transcoders' sites, so it works on any family built from ``jstd.nn``'s layers.

``target_gradients`` takes a batch of targets — an input vector ``v`` read at block ``l``'s transcoder input at
position ``p`` (a feature's encoder row), or at the final norm's output at the last position (``l = L``: a
logit's demeaned unembedding) — and returns, for each, ``∂⟨v, x⟩/∂y_{l',p'}`` and ``∂⟨v, x⟩/∂embedding_p``: one
compiled program (a ``vmap`` over the cotangents of one ``jax.vjp``) per batch shape, depth and length, reused
for every batch. ``source_columns`` contracts them on the device with every source vector ``u`` placed at
``(l', p')`` (``⟨∂⟨v, x⟩/∂y_{l',p'}, u⟩``), the errors and the token embeddings: the batch's rows.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.circuits.inputs import merged_edits
from jstd.circuits.sharding import axis_size, laid_out
from jstd.circuits.transcoders import Transcoders
from jstd.core.edits import Add, Edit
from jstd.core.sites import SITES
from jstd.nn.params import DATA, MODEL
from jstd.nn.frozen import frozen
from jstd.run import run
from jstd.sae.splice import Source, source_value


class SkipOnly(Edit):
    """At the transcoders' output site: ``stop_gradient(y) + (skip(x) - stop_gradient(skip(x))) + delta``. The forward value is
    ``y + delta``; the derivative reaches ``x`` only through the skip (``W_skip [L, d_in, d_out]`` or None) and
    ``delta`` (stacked over blocks, ``[L, batch, seq, d]``) is where a perturbation of ``y`` enters. ``x``: what
    ``jstd.sae.splice.Source`` at the transcoders' input site hands it. ``held`` (stacked like ``delta``, or None):
    the prompt's MLP outputs, used for ``y`` instead of the value the forward computes — the same value, but the
    MLPs' own products are then dead code and a compiled program does not run them."""

    W_skip: Float[Array, "layers d_in d_out"] | None
    value: Float[Array, "layers batch seq d_out"]
    held: Float[Array, "layers batch seq d_out"] | None

    def __init__(self, site: str, W_skip, delta, held=None):
        self._init_site(site, None, None)
        self.W_skip = W_skip
        self.value = delta
        self.held = held

    def arrays(self) -> tuple[str, ...]:
        return ("value",) if self.held is None else ("value", "held")

    def op(self, value):
        raise NotImplementedError("SkipOnly runs inside the forward (within)")

    def within(self, y: Array, scope) -> Array:
        y = y if self.held is None else self.held.astype(y.dtype)
        out = jax.lax.stop_gradient(y) + self.value.astype(y.dtype)
        if self.W_skip is None:
            return out
        x = source_value(scope, self.site)
        skip = (x.astype(self.W_skip.dtype) @ self.W_skip[scope.stack_index]).astype(y.dtype)
        return out + (skip - jax.lax.stop_gradient(skip))


@functools.partial(jax.jit, static_argnames=("input_site", "output_site"))
def prompt_values(model, tokens: Int[Array, "batch seq"], input_site: str, output_site: str) -> dict:
    """One plain forward: the transcoders' inputs and outputs ``[L, batch, seq, d]``, the token embeddings, the
    final norm's output and the logits."""
    reads = (input_site, output_site, "token_embeddings", "final_norm_output")
    out = run(model, tokens, reads=reads)
    return {"x": out[input_site], "y": out[output_site], "embeddings": out["token_embeddings"],
            "final": out["final_norm_output"], "logits": out.logits}


def shallow(model, depth: int):
    """``model`` with only its first ``depth`` blocks (``Stack.first``): a target read at block ``depth - 1``
    depends on nothing later, so its backward need not pass the later blocks."""
    if depth == model.config.num_layers:
        return model
    return eqx.tree_at(lambda m: m.stacks["layers"], model, model.stacks["layers"].first(depth))  # a wrapper's too


def linearised(model, tokens, tc: Transcoders, depth: int | None = None, outputs=None):
    """``f(δ_y [D, batch, seq, d], ε [batch, seq, d]) -> (x [D, batch, seq, d], final norm output)``: the local
    replacement model (module docstring) of the first ``D = depth`` blocks (None: all), a function whose
    derivative at zero gives the direct effects. ``tokens``: ids, or a prompt with images
    (``jstd.circuits.inputs.ImagePrompt``, one row: ``ε`` at an image token perturbs its merged embedding).
    Below the full depth the final norm's output is that of the truncated stream (no logit target reads it).
    ``outputs`` (``[>= D, batch, seq, d]`` or None): the prompt's MLP outputs (``prompt_values``' ``y``) held in
    place of the forward's own (``SkipOnly``: no MLP runs)."""
    depth = depth or tc.num_layers
    model = frozen(shallow(model, depth))
    x_site, y_site = tc.input_site, tc.output_site
    W_skip = None if tc.W_skip is None else tc.W_skip[:depth]
    held = None if outputs is None else outputs[:depth]

    def f(deltas):
        d_y, d_e = deltas
        edits = [Source(x_site, y_site), SkipOnly(y_site, W_skip, d_y, held), Add("token_embeddings", d_e),
                 *merged_edits(tokens, d_e)]  # a prompt with images: d_e at its image tokens (circuits.inputs)
        out = run(model, tokens, edits, reads=(x_site, "final_norm_output"))
        return out[x_site], out["final_norm_output"]

    return f


def gradients(model, tokens, tc: Transcoders, layers, positions, vectors, depth: int | None = None, outputs=None):
    """For each target ``b`` (``layers[b]`` in ``0..L``, ``L``: the final norm's output; ``positions[b]``;
    ``vectors[b] [d]``): ``(g_y [batch_targets, D, seq, d], g_embed [batch_targets, seq, d])``, the gradient of
    ``⟨v, x⟩`` at every block's MLP output and at the embeddings in the linearised model (one prompt row).
    ``depth`` (static; None: all blocks): run only the first ``D`` blocks; every feature target must then read a
    block before ``D``, and no logit target may be among them (the caller's promise). ``outputs``: the prompt's
    MLP outputs ``[L, 1, seq, d]`` (``linearised``; None: recomputed)."""
    depth = depth or tc.num_layers
    L = depth if depth < tc.num_layers else tc.num_layers
    n = tokens.shape[1]
    d = tc.d_out
    f = linearised(model, tokens, tc, depth, outputs)
    zeros = (jnp.zeros((L, 1, n, d), jnp.float32), jnp.zeros((1, n, d), jnp.float32))
    (x, final), pullback = jax.vjp(f, zeros)
    B = vectors.shape[0]
    rows = jnp.arange(B)
    feature = layers < tc.num_layers
    ct_x = jnp.zeros((B,) + x.shape, x.dtype).at[rows, jnp.minimum(layers, L - 1), 0, positions].set(
        jnp.where(feature[:, None], vectors, 0).astype(x.dtype))
    ct_f = jnp.zeros((B,) + final.shape, final.dtype).at[rows, 0, positions].set(
        jnp.where(feature[:, None], 0, vectors).astype(final.dtype))
    (g_y, g_e), = jax.vmap(pullback)((ct_x, ct_f))
    return g_y[:, :, 0], g_e[:, 0]


@functools.partial(jax.jit, static_argnames="depth")
def target_gradients(model, tokens, tc: Transcoders, layers, positions, vectors, outputs, depth: int | None = None):
    """``gradients`` compiled, with the prompt's MLP outputs held (``outputs [L, 1, seq, d]``, so no MLP runs): one
    program per (batch, ``depth``, prompt length), whatever the prompt's sources."""
    return gradients(model, tokens, tc, layers, positions, vectors, depth, outputs)


@functools.partial(jax.jit, static_argnames=("reach", "mesh"))
def source_columns(g_y, g_e, sources: tuple, errors, token_vectors, columns, reach: int | None = None, mesh=None):
    """The rows of a batch of targets against every source, from their gradients (``target_gradients``: ``g_y [B,
    D, P, d]``, ``g_e [B, P, d]``, of the first ``D`` blocks and ``P`` positions): ``[B, A + L·n + n]`` = feature
    columns ``[B, A]``, errors ``[B, L·n]`` (block-major), tokens ``[B, n]`` (zeros past ``D`` and ``P``).

    sources: per block ``lo``, ``[n, K_lo, d]`` the (activation-scaled) vectors the features write there, padded
    with zeros; columns ``[L, A]`` int: feature ``f``'s slot at block ``lo`` in that block's flattened ``[n,
    K_lo]`` (``position · K_lo + slot``; -1: it writes nothing there). A feature's column is the sum over blocks
    of its slots' products (a cross-layer feature writes at several), gathered block by block and summed as it
    goes: no ``[B, A, L]``. errors ``[L, n, d]``, token_vectors ``[n, d]``. On the device, so no gradient reaches
    the host. reach (static; None: D): only blocks before it are contracted (a batch of feature targets of blocks
    at most ``reach``: a target of block ``l`` reads nothing from block ``l``'s MLP output or later ones).

    mesh (static; None: one device): the products are taken where ``sharding.Sources`` places the sources
    (positions over ``data``, slots over ``model``: the batch's gradients move there), then each block's ``[B,
    P, K_lo]`` products move to the rows' shards (rows over ``data``, slots still over ``model``); each ``model``
    shard gathers and sums over blocks the slots it holds (``[B, M, A]``, ``M`` the ``model`` axis' size, one
    row a shard) and one sum over ``M`` at the end joins them: the rows come out split over ``data``, and the
    only collective of a whole ``[B / data, A]`` is that one all-reduce over ``model``.
    """
    B, D, P, _ = g_y.shape
    D = D if reach is None else min(D, reach)
    L, n, _ = errors.shape
    prec = jax.lax.Precision.HIGHEST
    at_sources = lambda x, *axes: laid_out(mesh, x, None, *axes)  # the batch whole, beside the sources
    as_rows = lambda x, *axes: laid_out(mesh, x, DATA, *axes)  # the batch over data
    M = axis_size(mesh, MODEL)
    features = as_rows(jnp.zeros((B, M, columns.shape[1]), g_y.dtype), MODEL)
    errs, done = [], [features]
    for lo in range(D):
        # block lo's gradients are read (moved, relaid for the product: a copy of [B / data, P, d]) once block
        # lo - 2 is summed, not every block's at once: an index XLA cannot see through
        at, _ = jax.lax.optimization_barrier((jnp.int32(lo), done[max(lo - 1, 0)]))
        g = at_sources(jax.lax.dynamic_index_in_dim(g_y, at, 1, keepdims=False), DATA)  # [B, P, d], moved once
        errs.append(jnp.einsum("bpd,pd->bp", g, errors[lo, :P], precision=prec))
        c = at_sources(jnp.einsum("bpd,pkd->bpk", g, sources[lo][:P], precision=prec), DATA, MODEL)
        K = c.shape[2]
        m = M if K % M == 0 else 1  # the slots as [m, K / m], the model shards' (as sharding.fitted splits them)
        k = K // m
        c = as_rows(c.reshape(B, P, m, k).transpose(0, 2, 1, 3), MODEL if m > 1 else None).reshape(B, m, P * k)
        f = columns[lo]  # [A]
        hit = (f >= 0) & (f < P * K)  # a causal batch of P positions: nothing at a later one reaches it
        part = _take_each(c, jnp.where(hit, f // K * k + f % k, 0))  # [B, m, A]
        part = jnp.where(hit & (jnp.arange(m)[:, None] == f % K // k), part, 0)  # from the shard holding it
        features = features + jnp.pad(part, ((0, 0), (0, M - m), (0, 0)))
        done.append(features)
    features = as_rows(features.sum(1))
    errs = as_rows(jnp.stack(errs, 1) if errs else jnp.zeros((B, 0, P), g_y.dtype))
    errs = jnp.pad(errs, ((0, 0), (0, L - D), (0, n - P))).reshape(B, L * n)
    toks = at_sources(jnp.einsum("bpd,pd->bp", g_e, token_vectors[:P], precision=prec), DATA)
    toks = jnp.pad(as_rows(toks), ((0, 0), (0, n - P)))
    return as_rows(jnp.concatenate([features, errs, toks], 1))


def _take_each(x: Float[Array, "b m k"], index: Int[Array, " a"]) -> Float[Array, "b m a"]:
    """``x[:, :, index]`` (``index`` in bounds) as a gather whose rows are batch dimensions, one element an index:
    the result lies ``a``-minor. (``jnp.take`` gathers ``[a, b · m]`` slices, which XLA:TPU lays out ``b``-minor,
    a tile padding a few rows to 128: 64 MiB a block for Llama-3.1-8B's CLT, docs/scale.md.)"""
    b, m, _ = x.shape
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(2,), start_index_map=(2,),
                                          operand_batching_dims=(0, 1), start_indices_batching_dims=(0, 1))
    at = jnp.broadcast_to(index[None, None, :, None], (b, m, index.shape[0], 1))
    return jax.lax.gather(x, at, dims, (1, 1, 1), mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
