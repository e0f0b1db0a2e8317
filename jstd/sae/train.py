"""``jstd.sae.train``: a sparse dictionary trained in JAX on an activation dataset, with optax.

The losses are SAELens' (per token, averaged over the batch):

- ``standard`` (ReLU): ``‖x - x̂‖² + l1 · Σᵢ fᵢ ‖W_dec[i]‖``;
- ``topk``: ``‖x - x̂‖²`` plus the auxiliary loss on dead latents (``aux_k`` of them, coefficient
  ``aux_coefficient``: the residual ``x - x̂`` reconstructed from the top dead latents, scaled by 1/‖residual‖²'s
  mean as in SAELens);
- ``batchtopk``: ``topk`` with the ``k · batch`` largest activations of the whole batch kept; the threshold for
  inference (the mean over steps of the smallest kept activation) makes the result a ``jumprelu`` dictionary;
- ``jumprelu``: ``‖x - x̂‖² + l0 · Σᵢ H(preᵢ - θᵢ)``, the step's and JumpReLU's gradients to θ through the
  rectangle-kernel straight-through estimator of width ``bandwidth`` (DeepMind's JumpReLU).

Batches stream from the dataset in a shuffled order (a permutation of the rows per epoch from ``key``), read from
the memory-mapped shards one ahead on a thread. Each step tracks, per latent, the tokens since it last fired; a
latent silent for ``dead_after`` tokens is dead (``dead`` in the log). With ``resample_every``, dead latents are
re-initialized every so many steps from the batch's worst-reconstructed inputs (their encoder rows scaled to 0.2 of
the live ones' mean norm, their optimizer moments zeroed). Every ``log_every`` steps the log gets the loss, the
explained variance ``1 - Σ‖x - x̂‖² / Σ‖x - x̄‖²``, L0 (active latents per token) and the dead fraction, and the
progress line shows them. A ``checkpoint`` folder holds the state every ``checkpoint_every`` steps (atomically);
a call with the same folder continues from it exactly, the batches included. With a ``mesh``, the batch is spread
over its ``data`` axis and the dictionary's ``d_sae`` axis over ``model``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

from jstd.core.progress import Progress, quiet_unless_terminal
from jstd.core.sites import parse
from jstd.io.staging import atomic
from jstd.sae.format import hook_name_of, save_sae
from jstd.sae.module import SAE, init, topk

TRAINED = ("standard", "relu", "topk", "batchtopk", "jumprelu")


class Trained(NamedTuple):
    """What ``train`` returns: the dictionary (``batchtopk`` as ``jumprelu``) and the log (one dict per
    ``log_every`` steps: ``step``, ``loss``, ``mse``, ``explained_variance``, ``l0``, ``dead``)."""

    sae: SAE
    log: list[dict[str, float]]


class Rows:
    """The training rows of one site of a dataset: ``len``, ``width`` and ``read(indices) -> [n, width]`` float32.

    ``dataset``: a ``jstd.ActivationDataset`` (``site`` as collected, with ``layer`` picking a block of a site read
    on every block; ``layers.3.X`` picks it too) or an array ``[rows, width]``."""

    def __init__(self, dataset, site: str | None, layer: int | None):
        self.dataset, self.block = dataset, None
        if isinstance(dataset, (np.ndarray, jax.Array)):
            if np.ndim(dataset) != 2:
                raise ValueError(f"train: an array dataset is [rows, width], got shape {np.shape(dataset)}")
            self.site, self.n, self.width = site, len(dataset), int(np.shape(dataset)[1])
            return
        sites = tuple(dataset.sites)
        name = site
        if name not in sites and name is not None:
            base, index = parse(name)
            if index is not None and base in sites:
                name, layer = base, index
        if name not in sites:
            raise ValueError(f"train: the dataset holds no {site!r}; it holds {', '.join(sites)}")
        layout, shape = dataset.layout(name), dataset.shape(name)
        entry = dataset.index["sites"][name]
        if "layers" in layout:
            blocks = list(entry.get("blocks") or range(shape[1]))
            if layer is None:
                if len(blocks) != 1:
                    raise ValueError(f"train: {name} is collected on blocks {blocks}; pass layer= (one of them)")
                layer = blocks[0]
            if layer not in blocks:
                raise ValueError(f"train: {name} is collected on blocks {blocks}, not {layer}")
            self.block = blocks.index(layer)
        elif entry.get("blocks"):
            layer = entry["blocks"][0]
        if len(layout) != 2 + (self.block is not None):
            raise ValueError(f"train: {name} rows have layout {layout}; a dictionary trains on one vector per row")
        self.site, self.layer, self.n, self.width = name, layer, shape[0], shape[-1]

    def __len__(self) -> int:
        return self.n

    def read(self, rows: np.ndarray) -> np.ndarray:
        if isinstance(self.dataset, (np.ndarray, jax.Array)):
            return np.asarray(np.asarray(self.dataset)[rows], np.float32)
        x = self.dataset.read(self.site, rows, dense=True)
        return np.asarray(x[:, self.block] if self.block is not None else x, np.float32)


class State(eqx.Module):
    """The training state: the dictionary's arrays, the optimizer's, the tokens since each latent last fired, the
    running threshold of BatchTopK (sum and count of the smallest kept activations) and the step."""

    sae: SAE
    opt: Any
    since: Float[Array, "d_sae"]
    threshold_sum: Float[Array, ""]
    threshold_count: Float[Array, ""]
    step: Float[Array, ""]


@jax.custom_vjp
def _step(pre, threshold, bandwidth):
    return (pre > threshold).astype(pre.dtype)


def _step_fwd(pre, threshold, bandwidth):
    return _step(pre, threshold, bandwidth), (pre, threshold, bandwidth)


def _step_bwd(res, g):
    pre, threshold, bandwidth = res
    kernel = (jnp.abs((pre - threshold) / bandwidth) < 0.5).astype(pre.dtype) / bandwidth
    grad_t = -(kernel * g).reshape(-1, pre.shape[-1]).sum(0)
    return jnp.zeros_like(pre), grad_t, None


_step.defvjp(_step_fwd, _step_bwd)


@jax.custom_vjp
def _jumprelu(pre, threshold, bandwidth):
    return pre * (pre > threshold).astype(pre.dtype)


def _jumprelu_fwd(pre, threshold, bandwidth):
    return _jumprelu(pre, threshold, bandwidth), (pre, threshold, bandwidth)


def _jumprelu_bwd(res, g):
    pre, threshold, bandwidth = res
    kernel = (jnp.abs((pre - threshold) / bandwidth) < 0.5).astype(pre.dtype) / bandwidth
    grad_t = -(threshold * kernel * g).reshape(-1, pre.shape[-1]).sum(0)
    return (pre > threshold).astype(pre.dtype) * g, grad_t, None


_jumprelu.defvjp(_jumprelu_fwd, _jumprelu_bwd)
jumprelu_estimated = _jumprelu  # ``pre · (pre > θ)``; θ's gradient through the rectangle kernel (width ``bandwidth``)


class Settings(NamedTuple):
    architecture: str
    k: int | None
    l1: float
    l0: float
    bandwidth: float
    aux_k: int
    aux_coefficient: float
    dead_after: int


def _column_sums(a: Float[Array, "rows columns"]) -> Float[Array, "columns"]:
    """``a.sum(0)`` as a product with a row of ones: XLA:CPU runs it about 3x faster than its reduction over a
    [4096, 8192] array (5 vs 15 ms), and a step takes two."""
    return jnp.ones(a.shape[0], a.dtype) @ a


@jax.custom_vjp
def _encode(x, shift, W_enc, b_enc):
    """``(x - shift) @ W_enc + b_enc`` for training: ``x`` is data (its cotangent is zero, never computed), so the
    gradient to ``shift`` (``b_dec``) is ``-W_enc @ Σ_rows g``, a matrix-vector product, where autodiff of the
    plain expression computes the ``[batch, d_in]`` cotangent of the input (a sixth full product per step)."""
    return (x - shift) @ W_enc + b_enc


def _encode_fwd(x, shift, W_enc, b_enc):
    return _encode(x, shift, W_enc, b_enc), (x, shift, W_enc)


def _encode_bwd(res, g):
    x, shift, W_enc = res
    g_b = _column_sums(g)
    return jnp.zeros_like(x), -(W_enc @ g_b), (x - shift).T @ g, g_b


_encode.defvjp(_encode_fwd, _encode_bwd)


def _pre_activations(sae: SAE, x):
    """``sae.pre_activations(x)`` for a batch ``[rows, d_in]``, through ``_encode``."""
    x = sae._norm_in(jnp.asarray(x).astype(sae.dtype))
    shift = sae.b_dec if sae.apply_b_dec_to_input and not sae.transcoder else jnp.zeros(sae.d_in, sae.dtype)
    pre = _encode(x, shift, sae.W_enc, sae.b_enc)
    return pre * jnp.linalg.norm(sae.W_dec, axis=-1) if sae.rescale_acts_by_decoder_norm else pre


def _latents(sae: SAE, x, s: Settings):
    """``(latents, pre)`` as trained (BatchTopK over the whole batch; JumpReLU through its estimator)."""
    pre = _pre_activations(sae, x)
    if s.architecture in ("standard", "relu"):
        return jax.nn.relu(pre), pre
    if s.architecture == "topk":
        return topk(pre, s.k), pre
    if s.architecture == "batchtopk":
        flat = jax.nn.relu(pre).reshape(-1)
        kept = topk(flat[None], s.k * x.shape[0])[0]
        return kept.reshape(pre.shape), pre
    return _jumprelu(pre, jnp.maximum(sae.threshold, 1e-6), s.bandwidth), pre


def _loss(sae: SAE, x, since, s: Settings):
    latents, pre = _latents(sae, x, s)
    recon = latents @ sae.W_dec + sae.b_dec
    residual = x - recon
    mse = (residual ** 2).sum(-1).mean()
    loss = mse
    if s.architecture in ("standard", "relu"):  # Σ over rows first: one pass over the latents, shared below
        loss = loss + s.l1 * _column_sums(latents) @ jnp.linalg.norm(sae.W_dec, axis=-1) / x.shape[0]
    elif s.architecture == "jumprelu":
        loss = loss + s.l0 * _step(pre, jnp.maximum(sae.threshold, 1e-6), s.bandwidth).sum(-1).mean()
    elif s.aux_coefficient:  # topk, batchtopk: the dead latents reconstruct what the live ones miss
        dead = since >= s.dead_after
        aux = topk(jnp.where(dead, pre, -1e30), min(s.aux_k, sae.d_sae))  # live latents drawn (if any) are 0
        aux_recon = aux @ sae.W_dec
        scale = jax.lax.stop_gradient((residual ** 2).sum(-1).mean())
        aux_loss = ((jax.lax.stop_gradient(residual) - aux_recon) ** 2).sum(-1).mean() / jnp.maximum(scale, 1e-12)
        loss = loss + s.aux_coefficient * jnp.where(dead.any(), aux_loss, 0.0)
    return loss, (latents, recon, mse)


def _train_step(state: State, x, optimizer, s: Settings, measure: bool = True):
    """One update; with ``measure`` also the logged metrics (the L0 count is a pass over the ``[batch, d_sae]``
    latents, so steps that log nothing skip it)."""
    (loss, (latents, recon, mse)), grads = jax.value_and_grad(_loss, has_aux=True)(state.sae, x, state.since, s)
    updates, opt = optimizer.update(grads, state.opt, state.sae)
    sae = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), state.sae, updates)  # optax.apply_updates
    if s.architecture == "topk" or s.architecture == "batchtopk":  # unit decoder rows, as SAELens keeps them
        sae = eqx.tree_at(lambda m: m.W_dec, sae, sae.W_dec / jnp.linalg.norm(sae.W_dec, axis=-1, keepdims=True))
    fired = _column_sums(latents) > 0  # latents are never negative: the column sums the loss already took
    since = jnp.where(fired, 0.0, state.since + x.shape[0])
    t_sum, t_count = state.threshold_sum, state.threshold_count
    if s.architecture == "batchtopk":
        smallest = jnp.min(jnp.where(latents > 0, latents, jnp.inf))
        t_sum, t_count = t_sum + jnp.where(jnp.isfinite(smallest), smallest, 0.0), t_count + jnp.isfinite(smallest)
    state = State(sae, opt, since, t_sum, t_count, state.step + 1)
    if not measure:
        return state, dict(loss=loss)
    variance = ((x - x.mean(0)) ** 2).sum()
    metrics = dict(loss=loss, mse=mse, explained_variance=1.0 - ((x - recon) ** 2).sum() / jnp.maximum(variance, 1e-12),
                   l0=(latents > 0).sum(-1).mean(), dead=(since >= s.dead_after).mean())
    return state, metrics


def _resample(state: State, x, s: Settings) -> State:
    """Dead latents re-initialized toward the batch's worst-reconstructed inputs; their moments zeroed."""
    sae = state.sae
    dead = state.since >= s.dead_after
    latents, _ = _latents(sae, x, s)
    residual = x - (latents @ sae.W_dec + sae.b_dec)
    worst = jnp.argsort(-(residual ** 2).sum(-1))
    directions = residual[worst[jnp.arange(sae.d_sae) % x.shape[0]]]
    directions = directions / jnp.maximum(jnp.linalg.norm(directions, axis=-1, keepdims=True), 1e-8)
    alive_norm = jnp.where(dead.all(), 1.0, (jnp.linalg.norm(sae.W_enc, axis=0) * ~dead).sum()
                           / jnp.maximum((~dead).sum(), 1))
    col = dead[None, :]
    W_dec = jnp.where(dead[:, None], directions * jnp.linalg.norm(sae.W_dec, axis=-1, keepdims=True).mean(), sae.W_dec)
    W_enc = jnp.where(col, directions.T * 0.2 * alive_norm, sae.W_enc)
    b_enc = jnp.where(dead, 0.0, sae.b_enc)
    sae = eqx.tree_at(lambda m: (m.W_dec, m.W_enc, m.b_enc), sae, (W_dec, W_enc, b_enc))

    def zero_rows(node):
        if not isinstance(node, SAE):
            return node
        return eqx.tree_at(lambda m: (m.W_dec, m.W_enc, m.b_enc), node,
                           (jnp.where(dead[:, None], 0.0, node.W_dec), jnp.where(col, 0.0, node.W_enc),
                            jnp.where(dead, 0.0, node.b_enc)))

    opt = jax.tree.map(zero_rows, state.opt, is_leaf=lambda n: isinstance(n, SAE))
    since = jnp.where(dead, 0.0, state.since)
    return State(sae, opt, since, state.threshold_sum, state.threshold_count, state.step)


@functools.lru_cache(maxsize=16)
def default_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """The default optimizer, SAELens' update: the gradients clipped to global norm 1 (its trainer always clips),
    then Adam (β 0.9, 0.999). One object per learning rate, so the compiled step is reused across calls."""
    import optax  # here: importing jstd does not import optax

    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))


@functools.lru_cache(maxsize=16)
def _compiled(optimizer, settings: Settings):
    """The jitted training step (lean, and measuring for logged steps) and resampling for ``optimizer`` and
    ``settings`` (kept across calls)."""
    step = lambda measure: jax.jit(lambda st, x: _train_step(st, x, optimizer, settings, measure), donate_argnums=0)
    return step(False), step(True), jax.jit(lambda st, x: _resample(st, x, settings))


def _placement(mesh, sae: SAE):
    """(batch sharding, dictionary shardings) on ``mesh``: rows over ``data``, ``d_sae`` over ``model``."""
    if mesh is None:
        return None, None
    names = mesh.axis_names
    data = "data" if "data" in names else None
    model = "model" if "model" in names else None
    specs = SAE(P(None, model), P(model), P(model, None), P(), None if sae.threshold is None else P(model),
                architecture=sae.architecture, k=sae.k, apply_b_dec_to_input=sae.apply_b_dec_to_input,
                normalize_activations=sae.normalize_activations, hook_name=sae.hook_name,
                hook_name_out=sae.hook_name_out, extra=sae.extra)
    return NamedSharding(mesh, P(data, None)), jax.tree.map(lambda p: NamedSharding(mesh, p), specs,
                                                             is_leaf=lambda p: isinstance(p, P))


def train(
    dataset,
    site: str | None = None,
    *,
    d_sae: int,
    steps: int,
    key: jax.Array,
    architecture: str = "standard",
    layer: int | None = None,
    optimizer: "optax.GradientTransformation | None" = None,
    learning_rate: float = 4e-4,
    batch_size: int = 4096,
    l1: float = 5.0,
    k: int | None = None,
    l0: float = 1.0,
    bandwidth: float = 0.05,
    threshold: float = 0.001,
    aux_k: int | None = None,
    aux_coefficient: float = 1 / 32,
    dead_after: int = 1_000_000,
    resample_every: int | None = None,
    log_every: int = 100,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 1000,
    out: str | os.PathLike | None = None,
    mesh: jax.sharding.Mesh | None = None,
    init_sae: SAE | None = None,
    progress: bool = True,
) -> Trained:
    """Train a dictionary of ``d_sae`` latents on ``site`` of ``dataset`` for ``steps`` batches of ``batch_size``.

    dataset: a ``jstd.ActivationDataset`` (``site`` as collected; ``layer`` or ``"layers.3.X"`` picks a block of
        a site collected on every block) or an array ``[rows, width]``.
    architecture: ``standard`` (``relu``: ReLU with the ``l1`` penalty), ``topk`` (``k``, auxiliary loss on dead
        latents), ``batchtopk`` (``k`` per token on average; returned as ``jumprelu``), ``jumprelu`` (``l0`` penalty,
        ``bandwidth`` of the estimator, initial ``threshold``).
    optimizer: any optax transformation (default SAELens' update: ``optax.chain(optax.clip_by_global_norm(1.0),
        optax.adam(learning_rate))``).
    dead_after: tokens without firing after which a latent counts as dead; ``resample_every``: steps between
        resamplings of the dead latents (None: never).
    checkpoint: a folder for the state, written every ``checkpoint_every`` steps and at the end; an existing one
        is continued (the same arguments, the same batches). out: an SAELens folder for the result.
    mesh: a ``jax.sharding.Mesh`` with ``data`` and/or ``model`` axes (``jstd.sharding.mesh(data=…, model=…)``;
        batch rows over ``data``, latents over ``model``). init_sae: start from this dictionary instead of SAELens' initialization.

    Returns ``Trained(sae, log)``. Raises ValueError, before anything runs, for an unknown architecture, a missing
    ``k``, ``d_sae``, ``batch_size``, ``log_every`` or ``checkpoint_every`` not a positive int, ``steps`` not an int
    of 0 or more, an ``init_sae`` whose latents are not ``d_sae`` or whose width is not the rows', a batch larger
    than the dataset, or a checkpoint written by a different call.
    """
    if architecture not in TRAINED:
        raise ValueError(f"train: architecture {architecture!r} is not trained here; pass one of {', '.join(TRAINED)}")
    if architecture in ("topk", "batchtopk") and not k:
        raise ValueError(f"train: a {architecture} dictionary needs k= (active latents per token)")
    _check_counts(d_sae=(d_sae, 1, "latents"), steps=(steps, 0, "batches to train on"),
                  batch_size=(batch_size, 1, "rows a step"), log_every=(log_every, 1, "steps between log entries"),
                  checkpoint_every=(checkpoint_every, 1, "steps between checkpoints"))
    if init_sae is not None:
        if not isinstance(init_sae, SAE) or init_sae.stacked:
            raise ValueError("train: init_sae must be one jstd.sae.SAE (not a stack); index a stack first (sae[i])")
        if init_sae.d_sae != d_sae:
            raise ValueError(f"train: d_sae={d_sae} but init_sae has {init_sae.d_sae} latents; pass "
                             f"d_sae={init_sae.d_sae} (the dictionary trained is init_sae's)")
    rows = Rows(dataset, site, layer)
    init_key, data_key = jax.random.split(key)
    order = shuffled_batches(len(rows), batch_size, data_key)  # refuses a batch larger than the rows, up front
    if init_sae is not None and (init_sae.d_in, init_sae.d_out) != (rows.width, rows.width):
        raise ValueError(f"train: init_sae reads {init_sae.d_in} and writes {init_sae.d_out} features, but the "
                         f"rows it trains on are {rows.width} wide; pass a dictionary of width {rows.width} (one "
                         "trained at this site)")
    settings = Settings(architecture, k, float(l1), float(l0), float(bandwidth), int(aux_k or max(rows.width // 2, 1)),
                        float(aux_coefficient), int(dead_after))
    hook = None
    if rows.site is not None and getattr(rows, "layer", None) is not None:
        hook = hook_name_of(parse(rows.site)[0], rows.layer)
    elif rows.site is not None:
        hook = rows.site
    sae = init_sae if init_sae is not None else init(
        init_key, rows.width, d_sae, architecture={"batchtopk": "topk", "relu": "standard"}.get(architecture, architecture),
        k=k, threshold=threshold, hook_name=hook)
    optimizer = optimizer or default_optimizer(float(learning_rate))
    batch_sharding, sae_sharding = _placement(mesh, sae)
    if sae_sharding is not None:
        sae = jax.device_put(sae, sae_sharding)
    state = State(sae, optimizer.init(sae), jnp.zeros(sae.d_sae), jnp.zeros(()), jnp.zeros(()), jnp.zeros(()))
    fingerprint = dict(architecture=architecture, d_sae=d_sae, width=rows.width, rows=len(rows), batch_size=batch_size,
                       k=k, site=rows.site, block=rows.block)
    try:
        step_fn, measured_fn, resample_fn = _compiled(optimizer, settings)
    except TypeError:  # an optimizer that does not hash: compiled for this call alone
        step_fn, measured_fn, resample_fn = _compiled.__wrapped__(optimizer, settings)
    batch = lambda i: placed(rows.read(order(i)), batch_sharding)

    def after(state, i, x):
        if resample_every and (i + 1) % resample_every == 0 and i + 1 < steps:
            return resample_fn(state, x)
        return state

    describe = lambda last: (f"train sae (explained variance {last['explained_variance']:.3f}, L0 {last['l0']:.1f}, "
                             f"dead {last['dead']:.1%})")
    state, log = streamed(state, steps, batch, step_fn, measured_fn, log_every=log_every, checkpoint=checkpoint,
                          checkpoint_every=checkpoint_every, fingerprint=fingerprint, label="train sae",
                          describe=describe, after=after, progress=progress)
    result = state.sae
    if architecture == "batchtopk":
        theta = float(state.threshold_sum / jnp.maximum(state.threshold_count, 1))
        result = SAE(result.W_enc, result.b_enc, result.W_dec, result.b_dec, jnp.full(result.d_sae, theta, result.dtype),
                     architecture="jumprelu", apply_b_dec_to_input=result.apply_b_dec_to_input,
                     hook_name=result.hook_name)
    result = jax.device_get(result)
    result = jax.tree.map(jnp.asarray, result)
    if out is not None:
        save_sae(result, out)
    return Trained(result, log)


def _check_counts(**counts) -> None:
    """ValueError unless each ``name=(value, least, meaning)`` is an int of at least ``least``."""
    for name, (value, least, meaning) in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"train: {name}={value!r} must be an int of at least {least} ({meaning})")


def placed(x, sharding):
    """``x`` on ``sharding`` (None: as it is)."""
    return x if sharding is None else jax.device_put(x, sharding)


def shuffled_batches(n_rows: int, batch_size: int, key: jax.Array):
    """``rows_of(i) -> [batch_size]`` sorted row indices of batch ``i``: one permutation of the ``n_rows`` rows per
    epoch (``fold_in(key, epoch)``), cut into ``n_rows // batch_size`` batches (the remainder left out of that
    epoch). A pure function of ``i``, so a resumed run reads the same batches."""
    if batch_size > n_rows:
        raise ValueError(f"train: batch_size={batch_size} is larger than the dataset's {n_rows} rows")
    per_epoch = n_rows // batch_size
    orders: dict[int, np.ndarray] = {}

    def rows_of(i: int) -> np.ndarray:
        epoch, at = divmod(i, per_epoch)
        if epoch not in orders:  # only the current epoch's permutation kept
            orders.clear()
            orders[epoch] = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), n_rows))
        return np.sort(orders[epoch][at * batch_size:(at + 1) * batch_size])

    return rows_of


def streamed(state, steps: int, batch, step_fn, measured_fn, *, log_every: int, checkpoint, checkpoint_every: int,
             fingerprint: dict, label: str, describe=None, after=None, progress: bool = True):
    """The training loop every trainer here shares: continue ``state`` (a pytree with a scalar ``step``) from a
    ``checkpoint`` folder when it holds one written with the same ``fingerprint`` (else ValueError), then for each
    step ``i`` up to ``steps``: ``batch(i)`` (read one ahead on a thread), ``step_fn(state, x) -> (state, metrics)``
    (``measured_fn`` on steps that log: every ``log_every`` and the last), ``after(state, i, x) -> state``; the
    log gets ``{"step", **metrics}``; the state is saved atomically every ``checkpoint_every`` steps and at the
    end. Returns ``(state, log)``."""
    log: list[dict[str, float]] = []
    ckpt = None if checkpoint is None else Path(checkpoint)
    if ckpt is not None and (ckpt / "state.json").exists():
        state, log = _restore(ckpt, state, fingerprint)
    start = int(state.step)
    bar = Progress(label, count=steps, enabled=quiet_unless_terminal(progress), unit="steps")
    bar.update(start)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(batch, start) if start < steps else None
        for i in range(start, steps):
            x = ahead.result()
            ahead = pool.submit(batch, i + 1) if i + 1 < steps else None
            logged = (i + 1) % log_every == 0 or i + 1 == steps
            state, metrics = (measured_fn if logged else step_fn)(state, x)
            if after is not None:
                state = after(state, i, x)
            if logged:
                last = {"step": i + 1, **{name: float(v) for name, v in metrics.items()}}
                log.append(last)
                if describe is not None:
                    bar.label = describe(last)
            bar.update(1)
            if ckpt is not None and ((i + 1) % checkpoint_every == 0 or i + 1 == steps):
                _save(ckpt, state, log, fingerprint)
    bar.close()
    return state, log


def _save(folder: Path, state: State, log, fingerprint) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    leaves = [np.asarray(a) for a in jax.tree.leaves(state)]
    with atomic(folder / "state.npz", "wb") as f:
        np.savez(f, *leaves)
    with atomic(folder / "state.json", "w") as f:
        json.dump({"fingerprint": fingerprint, "step": int(state.step), "log": log}, f)


def _restore(folder: Path, state: State, fingerprint) -> tuple[State, list]:
    meta = json.loads((folder / "state.json").read_text())
    if meta["fingerprint"] != json.loads(json.dumps(fingerprint)):
        raise ValueError(f"train: the checkpoint in {folder} was written by a different call ({meta['fingerprint']}); "
                         f"pass the same arguments or a new checkpoint folder")
    with np.load(folder / "state.npz") as z:
        leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
    like = jax.tree.leaves(state)
    if len(leaves) != len(like):
        raise ValueError(f"train: the checkpoint in {folder} holds another optimizer's state; pass the same optimizer")
    restored = [jax.device_put(jnp.asarray(a, b.dtype), b.sharding) for a, b in zip(leaves, like)]
    return jax.tree.unflatten(jax.tree.structure(state), restored), meta["log"]
