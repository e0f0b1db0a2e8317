"""``jstd.circuits.train_clt``: a cross-layer transcoder (CLT) trained in JAX on an activation dataset.

A CLT of ``L`` blocks and ``F`` features per block (``jstd.circuits.Transcoders`` with ``cross_layer=True``): block
``l``'s encoder reads ``x_l`` (the value at the set's ``input_hook``, by default ``mlp.hook_in`` =
``layers.mlp_input``), ``pre_l = x_l @ W_enc[l].T + b_enc[l]``, ``a_l = act(pre_l)``; its decoder writes to every
block ``l' >= l``, so ``ŷ_{l'} = Σ_{l <= l'} a_l @ W_dec[l][:, l' - l] + b_dec[l']``, the reconstruction of
``y_{l'}`` (the value at ``output_hook``, by default ``mlp.hook_out`` = ``layers.mlp.mlp_output``).

The loss (Ameisen et al. 2025, "Circuit Tracing", section "Building an interpretable replacement model"), per
token, averaged over the batch:

    L = Σ_l ‖ŷ_l - y_l‖²                                                     (reconstruction, every block)
      + λ  · Σ_l Σ_i tanh(c · ‖W_dec[l][i]‖ · a_{l,i})                        (sparsity, ``sparsity`` = λ, ``c``)
      + λ_p · Σ_l Σ_i ReLU(-pre_{l,i}) · ‖W_dec[l][i]‖                        (pre-activation, ``preact`` = λ_p)

where ``‖W_dec[l][i]‖`` is the norm of feature ``i`` of block ``l``'s decoder vectors to all the blocks it writes,
concatenated (``[L - l, d]`` flattened): the decoder-norm weighting that keeps the penalty from being dodged by
small activations and large decoders. Activations:

- ``relu``: ``a = max(pre, 0)``;
- ``jumprelu``: ``a = pre · (pre > θ)``, ``θ`` learned per feature, its gradient through the rectangle-kernel
  straight-through estimator of width ``bandwidth`` (``jstd.sae.train``'s, DeepMind's JumpReLU), the sparsity
  term's gradient included;
- ``topk``: the ``k`` largest ``max(pre, 0)`` of each block at each token (no sparsity term by default:
  ``sparsity=0``). circuit-tracer has no TopK CLT, so the result is written as a JumpReLU CLT whose threshold at
  block ``l`` is the mean over steps of the smallest activation kept at that block (as BatchTopK dictionaries are
  turned into JumpReLU ones): an approximation of TopK at inference, said so here.

Initialisation (the paper's): ``W_enc ~ U(±1/√F)``, ``W_dec ~ U(±1/√(L·d))``, zero biases, ``θ = threshold``.
Training reuses ``jstd.sae.train``'s machinery (``streamed``: batches in a shuffled order, one permutation per
epoch from ``key``, read one ahead on a thread; a ``checkpoint`` folder continued exactly; SAELens' update by
default: clip to global norm 1, then Adam). With a ``mesh``, batch rows go over ``data`` and the features over
``model`` (every encoder row, threshold and decoder row of a feature on the same device). The result is a
``Transcoders`` in circuit-tracer's CLT format (``out=``: ``jstd.circuits.save_transcoders``), which
``jstd.attribute`` uses as it is.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float

from jstd.circuits.files import save_transcoders
from jstd.circuits.transcoders import Transcoders
from jstd.nn.params import DATA, MODEL
from jstd.sae.module import topk
from jstd.sae.train import default_optimizer, jumprelu_estimated, placed, shuffled_batches, streamed
from jstd.sharding import shard

ARCHITECTURES = ("relu", "jumprelu", "topk")


class TrainedCLT(NamedTuple):
    """What ``train_clt`` returns: the CLT and the log (one dict per ``log_every`` steps: ``step``, ``loss``,
    ``mse`` (Σ over blocks), ``sparsity`` (the penalty before λ), ``explained_variance`` (over all blocks), ``l0``
    (active features per token, all blocks together) and ``dead`` (fraction of features silent for
    ``dead_after`` tokens))."""

    transcoders: Transcoders
    log: list[dict[str, float]]


class CLTRows:
    """Training rows: ``read(indices) -> (x, y)``, each ``[L, n, d]`` float32 (blocks first).

    ``dataset``: a ``jstd.ActivationDataset`` holding ``input_site`` and ``output_site`` collected on every block
    (``jstd.collect(model, data, [input_site, output_site], out)``), or a pair of arrays ``(x, y)`` ``[rows, L, d]``."""

    def __init__(self, dataset, input_site: str, output_site: str):
        self.dataset = dataset
        self.sites = (input_site, output_site)
        if isinstance(dataset, tuple):
            if len(dataset) != 2 or np.ndim(dataset[0]) != 3 or np.shape(dataset[0])[:2] != np.shape(dataset[1])[:2]:
                raise ValueError("train_clt: an array dataset is a pair (x, y) of [rows, layers, width] arrays with the "
                                 f"same rows and layers, got shapes {[np.shape(a) for a in dataset]}")
            self.n, self.layers = np.shape(dataset[0])[:2]
            self.d_in, self.d_out = np.shape(dataset[0])[2], np.shape(dataset[1])[2]
            return
        held = tuple(dataset.sites)
        missing = [s for s in self.sites if s not in held]
        if missing:
            raise ValueError(f"train_clt: the dataset holds no {', '.join(missing)} (it holds {', '.join(held)}); "
                             f"collect the transcoders' input and output on every block: jstd.collect(model, data, "
                             f"{list(self.sites)}, out)")
        shapes = []
        for site in self.sites:
            layout, shape = dataset.layout(site), dataset.shape(site)
            blocks = dataset.index["sites"][site].get("blocks")
            if len(layout) != 3 or layout[1] != "layers":
                raise ValueError(f"train_clt: {site} rows have layout {layout}; a CLT trains on one vector per block")
            if blocks is not None and list(blocks) != list(range(shape[1])):
                raise ValueError(f"train_clt: {site} is collected on blocks {blocks}; a CLT needs every block 0..L-1")
            shapes.append(shape)
        if shapes[0][:2] != shapes[1][:2]:
            raise ValueError(f"train_clt: {self.sites[0]} has rows {shapes[0]} and {self.sites[1]} {shapes[1]}")
        self.n, self.layers, self.d_in = shapes[0]
        self.d_out = shapes[1][2]

    def __len__(self) -> int:
        return int(self.n)

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(self.dataset, tuple):
            got = [np.asarray(a)[rows] for a in self.dataset]
        else:
            got = [self.dataset.read(site, rows, dense=True) for site in self.sites]
        return tuple(np.ascontiguousarray(np.swapaxes(np.asarray(a, np.float32), 0, 1)) for a in got)


class Settings(NamedTuple):
    architecture: str
    k: int | None
    sparsity: float
    c: float
    preact: float
    bandwidth: float
    dead_after: int


class State(eqx.Module):
    """The training state: the CLT, the optimizer's state, tokens since each feature last fired ``[L, F]``, the
    running TopK threshold per block (sum and count of the smallest kept activations) and the step."""

    tc: Transcoders
    opt: Any
    since: Float[Array, "layers features"]
    threshold_sum: Float[Array, "layers"]
    threshold_count: Float[Array, ""]
    step: Float[Array, ""]


def init_clt(key: jax.Array, num_layers: int, d_in: int, d_features: int, *, d_out: int | None = None,
             architecture: str = "relu", threshold: float = 0.03, input_hook: str = "mlp.hook_in",
             output_hook: str = "mlp.hook_out", scan: str | None = None, dtype=jnp.float32) -> Transcoders:
    """A fresh CLT, initialised as Ameisen et al. 2025: ``W_enc ~ U(±1/√F)``, ``W_dec ~ U(±1/√(L·d_out))``, zero
    biases, JumpReLU thresholds (``architecture`` ``jumprelu`` or ``topk``) filled with ``threshold``."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"train_clt: architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    L, F, d_out = num_layers, d_features, d_out or d_in
    k_enc, *k_dec = jax.random.split(key, L + 1)
    enc = 1.0 / np.sqrt(F)
    dec = 1.0 / np.sqrt(L * d_out)
    W_enc = jax.random.uniform(k_enc, (L, F, d_in), dtype, -enc, enc)
    W_dec = tuple(jax.random.uniform(k_dec[l], (F, L - l, d_out), dtype, -dec, dec) for l in range(L))
    theta = None if architecture == "relu" else jnp.full((L, F), threshold, dtype)
    return Transcoders(W_enc, jnp.zeros((L, F), dtype), W_dec, jnp.zeros((L, d_out), dtype), theta, None,
                       cross_layer=True, input_hook=input_hook, output_hook=output_hook, scan=scan)


def decoder_norms(tc: Transcoders) -> Float[Array, "layers features"]:
    """``‖W_dec[l][i]‖``: the norm of each feature's decoder vectors to every block it writes, concatenated."""
    return jnp.stack([jnp.sqrt((w.astype(jnp.float32) ** 2).sum((1, 2))) for w in tc.W_dec])


def _decode(tc: Transcoders, acts: Float[Array, "layers batch features"]) -> Float[Array, "layers batch d_out"]:
    """``ŷ``: one product per source block (``[batch, F] @ [F, (L - l)·d]``), summed into the blocks it writes."""
    L, B = acts.shape[:2]
    d = tc.d_out
    out = jnp.zeros((L, B, d), acts.dtype)
    for l, w in enumerate(tc.W_dec):
        part = (acts[l] @ w.reshape(w.shape[0], -1)).reshape(B, L - l, d)
        out = out.at[l:].add(jnp.swapaxes(part, 0, 1))
    return out + tc.b_dec[:, None, :]


def _activations(tc: Transcoders, x, s: Settings):
    """``(acts, pre)`` ``[L, batch, F]`` as trained (JumpReLU through its estimator; TopK per block and token)."""
    pre = jnp.einsum("lbd,lfd->lbf", x, tc.W_enc) + tc.b_enc[:, None, :]
    if s.architecture == "relu":
        return jax.nn.relu(pre), pre
    if s.architecture == "topk":
        return topk(pre, s.k), pre
    estimated = lambda p, theta: jumprelu_estimated(p, theta, s.bandwidth)  # θ's gradient summed per block
    return jax.vmap(estimated)(pre, jnp.maximum(tc.threshold, 1e-6)), pre


def _loss(tc: Transcoders, x, y, s: Settings):
    acts, pre = _activations(tc, x, s)
    recon = _decode(tc, acts)
    B = x.shape[1]
    mse = ((recon - y) ** 2).sum() / B
    norms = decoder_norms(tc)[:, None, :]
    sparsity = jnp.tanh(s.c * norms * acts).sum() / B
    loss = mse + s.sparsity * sparsity
    if s.preact:
        loss = loss + s.preact * (jax.nn.relu(-pre) * norms).sum() / B
    return loss, (acts, recon, mse, sparsity)


def _train_step(state: State, batch, optimizer, s: Settings, measure: bool = True):
    x, y = batch
    (loss, (acts, recon, mse, sparsity)), grads = jax.value_and_grad(_loss, has_aux=True)(state.tc, x, y, s)
    updates, opt = optimizer.update(grads, state.opt, state.tc)
    tc = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), state.tc, updates)
    B = x.shape[1]
    fired = acts.sum(1) > 0  # [L, F]; activations are never negative
    since = jnp.where(fired, 0.0, state.since + B)
    t_sum, t_count = state.threshold_sum, state.threshold_count
    if s.architecture == "topk":
        smallest = jnp.min(jnp.where(acts > 0, acts, jnp.inf), axis=(1, 2))  # [L]
        t_sum, t_count = t_sum + jnp.where(jnp.isfinite(smallest), smallest, 0.0), t_count + 1
    state = State(tc, opt, since, t_sum, t_count, state.step + 1)
    if not measure:
        return state, dict(loss=loss)
    variance = ((y - y.mean(1, keepdims=True)) ** 2).sum()
    return state, dict(loss=loss, mse=mse, sparsity=sparsity,
                       explained_variance=1.0 - ((y - recon) ** 2).sum() / jnp.maximum(variance, 1e-12),
                       l0=(acts > 0).sum() / B, dead=(since >= s.dead_after).mean())


@functools.lru_cache(maxsize=16)
def _compiled(optimizer, settings: Settings):
    step = lambda measure: jax.jit(lambda st, b: _train_step(st, b, optimizer, settings, measure), donate_argnums=0)
    return step(False), step(True)


def placement(mesh, tc: Transcoders):
    """``(batch sharding, tc placed)`` on ``mesh``: batch rows (axis 1 of ``[L, batch, d]``) over ``data``, the
    features over ``model`` (encoder rows, biases, thresholds and decoder rows of a feature together)."""
    if mesh is None:
        return None, tc
    names = mesh.axis_names
    data = DATA if DATA in names else None
    # the feature axis (logical "mlp": W_enc's rows, b_enc, the threshold, W_dec's rows) over model; the rest whole
    tc = shard(tc, mesh, (("mlp", MODEL),) if MODEL in names else ())
    return NamedSharding(mesh, P(None, data, None)), tc


def train_clt(
    dataset,
    *,
    d_features: int,
    steps: int,
    key: jax.Array,
    architecture: str = "relu",
    input_hook: str = "mlp.hook_in",
    output_hook: str = "mlp.hook_out",
    optimizer: "optax.GradientTransformation | None" = None,
    learning_rate: float = 1e-3,
    batch_size: int = 4096,
    sparsity: float | None = None,
    c: float = 1.0,
    preact: float = 0.0,
    k: int | None = None,
    bandwidth: float = 0.05,
    threshold: float = 0.03,
    dead_after: int = 1_000_000,
    log_every: int = 100,
    checkpoint=None,
    checkpoint_every: int = 1000,
    out=None,
    scan: str | None = None,
    model_name: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    init: Transcoders | None = None,
    progress: bool = True,
) -> TrainedCLT:
    """Train a CLT of ``d_features`` features per block (module docstring) for ``steps`` batches of
    ``batch_size`` tokens.

    dataset: a ``jstd.ActivationDataset`` with the transcoders' input and output sites collected on every block
        (``layers.mlp_input`` and ``layers.mlp.mlp_output`` for the default hooks), or arrays ``(x, y)``
        ``[rows, L, d]``. input_hook / output_hook: the TransformerLens names the CLT reads and writes (saved in
        its ``config.yaml``; they pick the dataset's sites).
    architecture: ``relu``, ``jumprelu`` (``bandwidth``, initial ``threshold``) or ``topk`` (``k`` per block and
        token; written as JumpReLU). sparsity: λ (default 1e-3, 0 for ``topk``); ``c`` the tanh's scale;
        ``preact``: λ_p of the pre-activation term.
    optimizer: any optax transformation (default: clip to global norm 1, then ``optax.adam(learning_rate)``).
    checkpoint: a folder for the state, every ``checkpoint_every`` steps and at the end; an existing one is
        continued (the same arguments, the same batches). out: a circuit-tracer CLT folder for the result
        (``scan`` and ``model_name`` go in its ``config.yaml``). mesh: ``data`` and/or ``model`` axes.
    init: start from this CLT (cross-layer ``Transcoders``) instead of a fresh one.

    Returns ``TrainedCLT(transcoders, log)``. Raises ValueError for an unknown architecture, a missing ``k``, a
    dataset without the sites, a batch larger than the dataset, or a checkpoint written by another call.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"train_clt: architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    if architecture == "topk" and not k:
        raise ValueError("train_clt: a topk CLT needs k= (active features per block and token)")
    probe = Transcoders(jnp.zeros((1, 1, 1)), jnp.zeros((1, 1)), (jnp.zeros((1, 1, 1)),), jnp.zeros((1, 1)), None,
                        None, cross_layer=True, input_hook=input_hook, output_hook=output_hook)
    rows = CLTRows(dataset, probe.input_site, probe.output_site)
    if sparsity is None:
        sparsity = 0.0 if architecture == "topk" else 1e-3
    settings = Settings(architecture, k, float(sparsity), float(c), float(preact), float(bandwidth), int(dead_after))
    init_key, data_key = jax.random.split(key)
    tc = init if init is not None else init_clt(init_key, rows.layers, rows.d_in, d_features, d_out=rows.d_out,
                                                architecture=architecture, threshold=threshold,
                                                input_hook=input_hook, output_hook=output_hook, scan=scan)
    if not tc.cross_layer or tc.num_layers != rows.layers or tc.d_in != rows.d_in or tc.d_out != rows.d_out:
        raise ValueError(f"train_clt: init is a {'cross-layer' if tc.cross_layer else 'per-layer'} set of "
                         f"{tc.num_layers} blocks {tc.d_in} -> {tc.d_out}; the data is {rows.layers} blocks "
                         f"{rows.d_in} -> {rows.d_out} (pass a cross-layer set that fits)")
    if (tc.threshold is None) != (architecture == "relu"):
        raise ValueError(f"train_clt: a {architecture} CLT {'has no' if architecture == 'relu' else 'needs a'} "
                         "threshold; init does not fit")
    optimizer = optimizer or default_optimizer(float(learning_rate))
    batch_sharding, tc = placement(mesh, tc)
    L, F = tc.num_layers, tc.d_features
    state = State(tc, optimizer.init(tc), jnp.zeros((L, F)), jnp.zeros(L), jnp.zeros(()), jnp.zeros(()))
    fingerprint = dict(kind="clt", architecture=architecture, d_features=F, layers=L, d_in=tc.d_in, d_out=tc.d_out,
                       rows=len(rows), batch_size=batch_size, k=k, sites=list(rows.sites))
    try:
        step_fn, measured_fn = _compiled(optimizer, settings)
    except TypeError:  # an optimizer that does not hash: compiled for this call alone
        step_fn, measured_fn = _compiled.__wrapped__(optimizer, settings)
    order = shuffled_batches(len(rows), batch_size, data_key)
    batch = lambda i: tuple(placed(a, batch_sharding) for a in rows.read(order(i)))
    describe = lambda last: (f"train clt (explained variance {last['explained_variance']:.3f}, L0 {last['l0']:.1f}, "
                             f"dead {last['dead']:.1%})")
    state, log = streamed(state, steps, batch, step_fn, measured_fn, log_every=log_every, checkpoint=checkpoint,
                          checkpoint_every=checkpoint_every, fingerprint=fingerprint, label="train clt",
                          describe=describe, progress=progress)
    tc = jax.tree.map(jnp.asarray, jax.device_get(state.tc))
    if architecture == "topk":
        theta = state.threshold_sum / jnp.maximum(state.threshold_count, 1)
        tc = eqx.tree_at(lambda t: t.threshold, tc, jnp.broadcast_to(jnp.asarray(theta)[:, None], (L, F)))
    if scan is not None and tc.scan != scan:
        tc = Transcoders(tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec, tc.threshold, tc.W_skip, cross_layer=True,
                         input_hook=tc.input_hook, output_hook=tc.output_hook, scan=scan)
    if out is not None:
        save_transcoders(tc, out, model_name=model_name)
    return TrainedCLT(tc, log)
