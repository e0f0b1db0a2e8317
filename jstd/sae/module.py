"""A sparse dictionary as an equinox module: sparse autoencoders (ReLU, TopK, JumpReLU) and transcoders.

The arrays and their meaning are SAELens' (``W_enc [d_in, d_sae]``, ``b_enc
[d_sae]``, ``W_dec [d_sae, d_out]``, ``b_dec [d_out]``, ``threshold [d_sae]``
for JumpReLU), and so are the formulas, so a dictionary trained or loaded
elsewhere gives the same latents here:

    x'      = norm_in(x) - b_dec           (b_dec only with apply_b_dec_to_input; never on a transcoder)
    pre     = x' @ W_enc + b_enc           (times ‖W_dec[i]‖ with rescale_acts_by_decoder_norm, TopK)
    latents = relu(pre)                    standard / transcoder
            = relu(pre) · (pre > θ)        jumprelu / jumprelu_transcoder
            = relu(top-k of pre), 0 else   topk
    recon   = norm_out(latents @ W_dec + b_dec)   (latents / ‖W_dec[i]‖ with rescale_acts_by_decoder_norm)

``norm_in``/``norm_out``: identity for ``normalize_activations`` ``"none"`` and
``"expected_average_only_in"`` (SAELens folds that scale into the weights when
it saves), ``x·√d_in/‖x‖`` and its inverse for ``"constant_norm_rescale"``,
SAELens' layer norm (mean, unbiased std, eps 1e-5) and its inverse for
``"layer_norm"``; ``decode`` then needs the input (``x=``). A transcoder
reads one site (``d_in``) and writes another (``d_out``); its decode never
undoes an input norm, as SAELens'.

Several dictionaries of one architecture, settings and shape stack into one
(``stack``): every array gains a leading axis, each keeps its own names
(``hook_name``), ``sae[i]`` is one again; ``jstd.splice`` takes a stacked one
for several blocks (its blocks from the names when no ``layer`` is given).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

ARCHITECTURES = ("standard", "topk", "jumprelu", "transcoder", "jumprelu_transcoder")
ALIASES = {"relu": "standard", "batchtopk": "jumprelu"}  # BatchTopK infers as JumpReLU with a learned threshold
NORMS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")


def architecture_name(architecture: str) -> str:
    """The SAELens architecture name for ``architecture`` (``relu`` is ``standard``); ValueError for others."""
    name = ALIASES.get(architecture, architecture)
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown dictionary architecture {architecture!r}; jstd.sae knows "
                         f"{', '.join(ARCHITECTURES + tuple(ALIASES))}")
    return name


class SAE(eqx.Module):
    """A sparse autoencoder or transcoder (see the module docstring for the formulas).

    W_enc ``[d_in, d_sae]``, b_enc ``[d_sae]``, W_dec ``[d_sae, d_out]`` (``d_out
    == d_in`` unless a transcoder), b_dec ``[d_out]``, threshold ``[d_sae]``
    (JumpReLU; None otherwise). Static: ``architecture`` (SAELens' name), ``k``
    (TopK), ``apply_b_dec_to_input``, ``normalize_activations``,
    ``rescale_acts_by_decoder_norm``, ``hook_name`` / ``hook_name_out`` (where
    it was trained: a TransformerLens hook or a jstd site) and ``extra`` (the
    rest of the SAELens ``cfg.json``, as JSON, kept for writing it back).
    """

    W_enc: Float[Array, "*stack d_in d_sae"]
    b_enc: Float[Array, "*stack d_sae"]
    W_dec: Float[Array, "*stack d_sae d_out"]
    b_dec: Float[Array, "*stack d_out"]
    threshold: Float[Array, "*stack d_sae"] | None
    architecture: str = eqx.field(static=True, default="standard")
    k: int | None = eqx.field(static=True, default=None)
    apply_b_dec_to_input: bool = eqx.field(static=True, default=True)
    normalize_activations: str = eqx.field(static=True, default="none")
    rescale_acts_by_decoder_norm: bool = eqx.field(static=True, default=False)
    # on a stack (``stack``) of differently named dictionaries: a tuple, one per row
    hook_name: str | tuple[str | None, ...] | None = eqx.field(static=True, default=None)
    hook_name_out: str | tuple[str | None, ...] | None = eqx.field(static=True, default=None)
    extra: str | tuple[str, ...] = eqx.field(static=True, default="{}")

    def __check_init__(self):
        architecture_name(self.architecture)
        if self.normalize_activations not in NORMS:
            raise ValueError(f"normalize_activations={self.normalize_activations!r} is not supported; jstd.sae "
                             f"knows {', '.join(NORMS)}")
        if self.activation == "topk" and (self.k is None or self.k < 1):
            raise ValueError(f"a topk dictionary needs k >= 1, got k={self.k!r}")
        if self.activation == "jumprelu" and self.threshold is None:
            raise ValueError(f"a {self.architecture} dictionary needs a threshold [d_sae]")
        if self.transcoder and self.apply_b_dec_to_input:
            raise ValueError("apply_b_dec_to_input is not supported for transcoders (b_dec lives in the output "
                             "space), as in SAELens; pass apply_b_dec_to_input=False")
        if self.transcoder and self.normalize_activations in ("constant_norm_rescale", "layer_norm"):
            raise ValueError(f"normalize_activations={self.normalize_activations!r} on a transcoder is not supported")

    # ---- what it is --------------------------------------------------------------
    @property
    def activation(self) -> str:
        """``relu``, ``topk`` or ``jumprelu``."""
        return {"standard": "relu", "transcoder": "relu", "topk": "topk", "jumprelu": "jumprelu",
                "jumprelu_transcoder": "jumprelu"}[self.architecture]

    @property
    def transcoder(self) -> bool:
        return self.architecture.endswith("transcoder")

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[-2]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[-1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[-1]

    @property
    def stacked(self) -> tuple[int, ...]:
        """The leading stack axes (``()`` for one dictionary, ``(n,)`` for ``stack`` of ``n``)."""
        return self.b_enc.shape[:-1]

    @property
    def dtype(self):
        return self.W_enc.dtype

    def __getitem__(self, i) -> "SAE":
        """Row ``i`` (an int or a traced int) of a stacked dictionary; with a concrete ``i``, with that row's names
        (``hook_name``, …) where the stack kept one per row."""
        if not self.stacked:
            raise IndexError("this dictionary is not stacked; index a jstd.sae.stack of several")
        row = jax.tree.map(lambda a: a[i], self)
        per_row = {f: getattr(self, f) for f in ("hook_name", "hook_name_out", "extra")
                   if isinstance(getattr(self, f), tuple)}
        if not per_row or isinstance(i, jax.core.Tracer):
            return row
        index = int(i)
        return dataclasses.replace(row, **{f: v[index] for f, v in per_row.items()})

    # ---- the forward -------------------------------------------------------------
    def _norm_in(self, x):
        if self.normalize_activations == "constant_norm_rescale":
            return x * (self.d_in ** 0.5 / jnp.linalg.norm(x, axis=-1, keepdims=True))
        if self.normalize_activations == "layer_norm":
            x = x - x.mean(-1, keepdims=True)
            return x / (x.std(-1, keepdims=True, ddof=1) + 1e-5)
        return x

    def _norm_out(self, y, x):
        if self.normalize_activations in ("constant_norm_rescale", "layer_norm"):
            if x is None:
                raise ValueError(f"decode of a dictionary with normalize_activations={self.normalize_activations!r} "
                                 "undoes the input's norm: pass the input it encoded (decode(latents, x=x))")
            x = x.astype(self.dtype)
            if self.normalize_activations == "constant_norm_rescale":
                return y / (self.d_in ** 0.5 / jnp.linalg.norm(x, axis=-1, keepdims=True))
            centred = x - x.mean(-1, keepdims=True)
            return y * centred.std(-1, keepdims=True, ddof=1) + x.mean(-1, keepdims=True)
        return y

    def pre_activations(self, x: Float[Array, "... d_in"]) -> Float[Array, "... d_sae"]:
        """``x' @ W_enc + b_enc`` (in the dictionary's dtype), before the activation."""
        x = self._norm_in(jnp.asarray(x).astype(self.dtype))
        if self.apply_b_dec_to_input and not self.transcoder:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.rescale_acts_by_decoder_norm:
            pre = pre * jnp.linalg.norm(self.W_dec, axis=-1)
        return pre

    def activate(self, pre: Float[Array, "... d_sae"]) -> Float[Array, "... d_sae"]:
        """The activation of pre-activations: ReLU, JumpReLU at ``threshold``, or ReLU of the top ``k``."""
        if self.activation == "relu":
            return jax.nn.relu(pre)
        if self.activation == "jumprelu":
            return jax.nn.relu(pre) * (pre > self.threshold).astype(pre.dtype)
        return topk(pre, self.k)

    def encode(self, x: Float[Array, "... d_in"]) -> Float[Array, "... d_sae"]:
        """The latents of ``x`` (any leading axes), in the dictionary's dtype."""
        return self.activate(self.pre_activations(x))

    def decode(self, latents: Float[Array, "... d_sae"], x: Float[Array, "... d_in"] | None = None
               ) -> Float[Array, "... d_out"]:
        """The reconstruction from ``latents``; ``x`` (the encoded input) where the input norm must be undone."""
        latents = jnp.asarray(latents).astype(self.dtype)
        if self.rescale_acts_by_decoder_norm:
            latents = latents / jnp.linalg.norm(self.W_dec, axis=-1)
        y = latents @ self.W_dec + self.b_dec
        return y if self.transcoder else self._norm_out(y, x)

    @property
    def linear_decoder(self) -> bool:
        """Whether the reconstruction is linear in the latents plus ``b_dec`` (no input norm to undo)."""
        return self.transcoder or self.normalize_activations in ("none", "expected_average_only_in")

    def columns(self, features: Int[Array, "n"]) -> "SAE":
        """The dictionary cut to ``features`` (ints, traced allowed; one dictionary, not a stack): their encoder
        columns, encoder biases, thresholds and decoder rows. For ReLU and JumpReLU (each latent computed alone)
        its latents are this dictionary's at ``features``; a TopK's are not (which k win needs every latent)."""
        if self.stacked:
            raise ValueError("columns cuts one dictionary; index the stack first (sae[i])")
        cut = lambda a, axis: jnp.take(a, features, axis=axis)
        threshold = None if self.threshold is None else cut(self.threshold, -1)
        return eqx.tree_at(lambda s: (s.W_enc, s.b_enc, s.W_dec, s.threshold), self,
                           (cut(self.W_enc, -1), cut(self.b_enc, -1), cut(self.W_dec, -2), threshold),
                           is_leaf=lambda a: a is None)

    def decode_change(self, new: Float[Array, "... d_sae"], old: Float[Array, "... d_sae"],
                      x: Float[Array, "... d_in"] | None = None) -> Float[Array, "... d_out"]:
        """``decode(new) - decode(old)``: one product with ``W_dec`` where the decoder is linear in the latents
        (no output norm to undo), so it is exactly zero wherever ``new == old``."""
        if self.linear_decoder:
            change = jnp.asarray(new).astype(self.dtype) - jnp.asarray(old).astype(self.dtype)
            if self.rescale_acts_by_decoder_norm:
                change = change / jnp.linalg.norm(self.W_dec, axis=-1)
            return change @ self.W_dec
        return self.decode(new, x) - self.decode(old, x)

    def __call__(self, x: Float[Array, "... d_in"]) -> Float[Array, "... d_out"]:
        """``decode(encode(x))``."""
        return self.decode(self.encode(x), x)

    # ---- transformations -----------------------------------------------------------
    def fold_decoder_norm(self) -> "SAE":
        """The same dictionary with unit-norm decoder rows: ``W_dec[i] / n_i`` and ``W_enc[:, i]``, ``b_enc[i]``
        (and ``threshold[i]``) times ``n_i`` (``n_i = max(‖W_dec[i]‖, 1e-8)``), as SAELens' ``fold_W_dec_norm``:
        the reconstruction is unchanged and latent ``i`` is scaled by ``n_i``. Refused on TopK (it can change which
        ``k`` latents win), as SAELens refuses it."""
        if self.activation == "topk" and not self.rescale_acts_by_decoder_norm:
            raise ValueError("folding the decoder norm into a TopK dictionary can change which k latents are "
                             "active (SAELens refuses it too); keep the decoder as it is")
        n = jnp.maximum(jnp.linalg.norm(self.W_dec, axis=-1), 1e-8)
        threshold = None if self.threshold is None else self.threshold * n
        return eqx.tree_at(lambda s: (s.W_dec, s.W_enc, s.b_enc, s.threshold), self,
                           (self.W_dec / n[..., None], self.W_enc * n[..., None, :], self.b_enc * n, threshold),
                           is_leaf=lambda a: a is None)

    def astype(self, dtype) -> "SAE":
        """Every array cast to ``dtype``."""
        return jax.tree.map(lambda a: a.astype(dtype), self)


def topk(pre: Float[Array, "... d_sae"], k: int) -> Float[Array, "... d_sae"]:
    """``relu`` of the ``k`` largest entries of each row of ``pre`` at their places, zero elsewhere (SAELens'
    ``TopK``: ``torch.topk`` then ``relu`` then ``scatter``)."""
    flat = pre.reshape(-1, pre.shape[-1])
    values, indices = jax.lax.top_k(flat, k)
    rows = jnp.arange(flat.shape[0])[:, None]
    return jnp.zeros_like(flat).at[rows, indices].set(jax.nn.relu(values)).reshape(pre.shape)


def init(key: jax.Array, d_in: int, d_sae: int, *, architecture: str = "standard", k: int | None = None,
         d_out: int | None = None, threshold: float = 0.001, apply_b_dec_to_input: bool | None = None,
         dtype=jnp.float32, hook_name: str | None = None, hook_name_out: str | None = None) -> SAE:
    """A fresh dictionary, initialized as SAELens does: ``W_dec`` rows drawn Kaiming-uniform then scaled to norm
    0.1 (unit for TopK), ``W_enc = W_dec.T``, zero biases, ``threshold`` filled with ``threshold`` (JumpReLU).
    ``apply_b_dec_to_input`` defaults to True for autoencoders, False for transcoders."""
    architecture = architecture_name(architecture)
    d_out = d_in if d_out is None else d_out
    transcoder = architecture.endswith("transcoder")
    if not transcoder and d_out != d_in:
        raise ValueError(f"an autoencoder reconstructs its input: d_out={d_out} must equal d_in={d_in} "
                         "(a transcoder: architecture='transcoder')")
    bound = (6.0 / d_out) ** 0.5  # kaiming_uniform_ on [d_sae, d_out]: fan_in = d_out
    W_dec = jax.random.uniform(key, (d_sae, d_out), jnp.float32, -bound, bound)
    W_dec = W_dec / jnp.linalg.norm(W_dec, axis=-1, keepdims=True) * (1.0 if architecture == "topk" else 0.1)
    W_enc = W_dec.T if d_out == d_in else jax.random.uniform(jax.random.fold_in(key, 1), (d_in, d_sae),
                                                               jnp.float32, -bound, bound)
    jump = architecture.startswith("jumprelu")
    return SAE(W_enc.astype(dtype), jnp.zeros(d_sae, dtype), W_dec.astype(dtype), jnp.zeros(d_out, dtype),
               jnp.full(d_sae, threshold, dtype) if jump else None, architecture=architecture,
               k=k if architecture == "topk" else None,
               apply_b_dec_to_input=(not transcoder) if apply_b_dec_to_input is None else apply_b_dec_to_input,
               hook_name=hook_name, hook_name_out=hook_name_out)


# what the arithmetic reads: dictionaries stack only when these agree (the names and the kept config need not)
SETTINGS = ("architecture", "k", "apply_b_dec_to_input", "normalize_activations", "rescale_acts_by_decoder_norm")
NAMES = ("hook_name", "hook_name_out", "extra")


def stack(saes: Sequence[SAE]) -> SAE:
    """Dictionaries of one architecture, settings (``SETTINGS``) and array shapes and dtypes stacked into one (a
    leading axis on every array). Their names may differ — one dictionary per block is named after its block
    (``blocks.3.hook_resid_post``): ``hook_name``, ``hook_name_out`` and ``extra`` are kept per dictionary (a tuple
    of one per row where they differ; ``sae[i]`` gives row ``i`` its own). ValueError naming the first field that
    differs and both values."""
    saes = list(saes)
    if not saes:
        raise ValueError("stack needs at least one dictionary")
    if any(not isinstance(s, SAE) for s in saes):
        raise TypeError("stack takes jstd.sae.SAE dictionaries")
    if any(s.stacked for s in saes):
        raise ValueError("stack takes single dictionaries; index a stacked one first (sae[i])")
    base = saes[0]
    arrays = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")
    for i, s in enumerate(saes[1:], 1):
        for field in SETTINGS:
            if getattr(s, field) != getattr(base, field):
                raise ValueError(f"dictionary {i} differs from dictionary 0 in {field}: {getattr(s, field)!r} vs "
                                 f"{getattr(base, field)!r}; only dictionaries of one architecture, settings and "
                                 "shape stack")
        for field in arrays:
            a, b = getattr(s, field), getattr(base, field)
            got = None if a is None else (a.shape, str(a.dtype))
            want = None if b is None else (b.shape, str(b.dtype))
            if got != want:
                raise ValueError(f"dictionary {i} differs from dictionary 0 in {field}: "
                                 f"{'none' if got is None else f'shape {got[0]} {got[1]}'} vs "
                                 f"{'none' if want is None else f'shape {want[0]} {want[1]}'}; only dictionaries of "
                                 "one architecture, settings and shape stack")
    names = {}
    for field in NAMES:
        values = tuple(getattr(s, field) for s in saes)
        names[field] = values[0] if len(set(values)) == 1 else values
    same = [dataclasses.replace(s, **{f: getattr(base, f) for f in NAMES}) for s in saes]
    return dataclasses.replace(jax.tree.map(lambda *a: jnp.stack(a), *same), **names)


def extra_of(sae: SAE) -> dict | list[dict]:
    """The SAELens ``cfg.json`` fields the module does not model (kept when read, written back); on a stack whose
    rows kept their own, one dict per row."""
    return [json.loads(e) for e in sae.extra] if isinstance(sae.extra, tuple) else json.loads(sae.extra)
