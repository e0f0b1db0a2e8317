"""Transcoder sets as equinox modules: one transcoder per block (per-layer, PLT) or a cross-layer transcoder (CLT).

Both read ``x_l`` at every block ``l`` (the value at ``input_hook``, a TransformerLens hook name such as
``mlp.hook_in``) and write ``y_l`` (``output_hook``: ``mlp.hook_out``, ``hook_mlp_out``), what the block's MLP adds
to the stream. Arrays (``L`` blocks, ``F`` features per block):

- ``W_enc [L, F, d_in]``, ``b_enc [L, F]``: pre-activation ``x @ W_enc[l].T + b_enc[l]`` (circuit-tracer's layout);
- ``threshold [L, F]`` or None: JumpReLU ``a = pre · (pre > θ)`` (strictly greater), else ReLU ``max(pre, 0)``;
- per-layer: ``W_dec [L, F, d_out]`` (feature ``f`` of block ``l`` writes ``a · W_dec[l, f]`` at block ``l``);
  cross-layer: ``W_dec`` a tuple, ``W_dec[l] [F, L - l, d_out]`` (it writes ``a · W_dec[l][f, k]`` at block
  ``l + k`` for every ``k``);
- ``b_dec [L, d_out]``; ``W_skip [L, d_in, d_out]`` or None: the skip path ``skip_l(x) = x @ W_skip[l]`` (a
  per-layer file stores its transpose, circuit-tracer's ``x @ W_skip.T``; the reader and writer turn it).

The reconstruction of ``y_l`` is ``Σ active a · decoder + b_dec[l] + skip_l(x_l)``.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jstd.core.sites import SiteError
from jstd.nn.params import param
from jstd.sae.format import site_of


class Transcoders(eqx.Module):
    """A transcoder set (see the module docstring). ``cross_layer`` (static) says which decoder layout
    ``W_dec`` has; ``input_hook`` / ``output_hook`` the TransformerLens names the set reads and writes; ``scan``
    circuit-tracer's identifier of the set (kept in graphs and their JSON).

    Logical axes (``jstd.logical_axes``, for ``jstd.sharding``'s layouts): the feature axis is ``mlp`` (a
    transcoder stands in for the MLP, so every layout splits its features as it splits the MLP's hidden units: over
    ``model`` under TP and FSDP_TP), the widths are ``embed`` (over ``data`` under FSDP), the blocks ``layers``
    (never split); a cross-layer decoder ``W_dec[l] [F, L - l, d_out]`` is ``(mlp, layers, embed)``, the skip
    ``W_skip`` ``(layers, embed, embed_out)`` (its output width whole: an axis name once per array).
    ``jstd.shard(transcoders, mesh, rules)`` places a set as it places a model."""

    W_enc: Float[Array, "layers features d_in"] = param("layers", "mlp", "embed")
    b_enc: Float[Array, "layers features"] = param("layers", "mlp")
    W_dec: Float[Array, "layers features d_out"] | tuple = param("layers", "mlp", "embed",
                                                                 items=("mlp", "layers", "embed"))
    b_dec: Float[Array, "layers d_out"] = param("layers", "embed")
    threshold: Float[Array, "layers features"] | None = param("layers", "mlp")
    W_skip: Float[Array, "layers d_in d_out"] | None = param("layers", "embed", "embed_out")
    cross_layer: bool = eqx.field(static=True)
    input_hook: str = eqx.field(static=True, default="mlp.hook_in")
    output_hook: str = eqx.field(static=True, default="mlp.hook_out")
    scan: str | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        L, F, d_in = self.W_enc.shape
        d_out = self.b_dec.shape[-1]
        want = {"b_enc": (L, F), "b_dec": (L, d_out), "threshold": (L, F), "W_skip": (L, d_in, d_out)}
        for name, shape in want.items():
            a = getattr(self, name)
            if a is not None and tuple(a.shape) != shape:
                raise ValueError(f"Transcoders: {name} has shape {tuple(a.shape)}; W_enc {self.W_enc.shape} and "
                                 f"b_dec {self.b_dec.shape} need {shape}")
        if self.cross_layer:
            if len(self.W_dec) != L:
                raise ValueError(f"Transcoders: a cross-layer W_dec holds one decoder per block ({L}), got "
                                 f"{len(self.W_dec)}")
            for l, w in enumerate(self.W_dec):
                if tuple(w.shape) != (F, L - l, d_out):
                    raise ValueError(f"Transcoders: W_dec[{l}] has shape {tuple(w.shape)}; block {l} of {L} needs "
                                     f"{(F, L - l, d_out)} (a decoder to each block from {l} on)")
        elif tuple(self.W_dec.shape) != (L, F, d_out):
            raise ValueError(f"Transcoders: W_dec has shape {tuple(self.W_dec.shape)}, needs {(L, F, d_out)}")

    # ---- sizes and sites ---------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_features(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[2]

    @property
    def d_out(self) -> int:
        return self.b_dec.shape[-1]

    @property
    def activation(self) -> str:
        return "relu" if self.threshold is None else "jump_relu"

    @property
    def input_site(self) -> str:
        """The jstd block site ``input_hook`` names (``mlp.hook_in`` -> ``layers.mlp_input``)."""
        return _site(self.input_hook)

    @property
    def output_site(self) -> str:
        """The jstd block site ``output_hook`` names (``mlp.hook_out`` -> ``layers.mlp.mlp_output``)."""
        return _site(self.output_hook)

    # ---- the arithmetic ----------------------------------------------------------------------------------------
    def pre(self, x: Float[Array, "layers *rest d_in"]) -> Float[Array, "layers *rest features"]:
        """Each block's pre-activations from its input ``x[l]``."""
        x = x.astype(self.W_enc.dtype)
        return jnp.einsum("l...d,lfd->l...f", x, self.W_enc) + self.b_enc.reshape(
            (self.num_layers,) + (1,) * (x.ndim - 2) + (self.d_features,))

    def activate(self, pre: Float[Array, "layers *rest features"]) -> Float[Array, "layers *rest features"]:
        """ReLU, or JumpReLU ``pre · (pre > θ)`` (strict) with a threshold."""
        if self.threshold is None:
            return jnp.maximum(pre, 0)
        theta = self.threshold.reshape((self.num_layers,) + (1,) * (pre.ndim - 2) + (self.d_features,))
        return pre * (pre > theta).astype(pre.dtype)

    def encode(self, x: Float[Array, "layers *rest d_in"]) -> Float[Array, "layers *rest features"]:
        return self.activate(self.pre(x))

    def skip(self, x: Float[Array, "layers *rest d_in"]) -> Float[Array, "layers *rest d_out"]:
        """Each block's skip path ``x[l] @ W_skip[l]`` (zeros without a skip)."""
        if self.W_skip is None:
            return jnp.zeros(x.shape[:-1] + (self.d_out,), self.b_dec.dtype)
        return jnp.einsum("l...d,lde->l...e", x.astype(self.W_skip.dtype), self.W_skip)

    def decode(self, acts: Float[Array, "layers *rest features"]) -> Float[Array, "layers *rest d_out"]:
        """Σ decoder outputs of ``acts`` at each block, plus ``b_dec`` (no skip)."""
        shape = (self.num_layers,) + (1,) * (acts.ndim - 2) + (self.d_out,)
        if not self.cross_layer:
            return jnp.einsum("l...f,lfd->l...d", acts, self.W_dec) + self.b_dec.reshape(shape)
        L = self.num_layers
        out = [jnp.zeros(acts.shape[1:-1] + (self.d_out,), self.b_dec.dtype) for _ in range(L)]
        for l, w in enumerate(self.W_dec):
            part = jnp.einsum("...f,fkd->k...d", acts[l], w)
            for k in range(L - l):
                out[l + k] = out[l + k] + part[k]
        return jnp.stack(out) + self.b_dec.reshape(shape)

    def decoder_vectors(self, layers: np.ndarray, features: np.ndarray) -> np.ndarray:
        """``[n, L, d_out]``: what feature ``features[i]`` of block ``layers[i]`` writes per unit activation at
        every block (zeros at blocks it does not write). Only those rows reach the host (gathered where the
        decoders live: on a mesh, from their shards)."""
        layers, features = np.asarray(layers), np.asarray(features)
        out = np.zeros((len(layers), self.num_layers, self.d_out), np.dtype(self.b_dec.dtype))
        if not self.cross_layer:
            out[np.arange(len(layers)), layers] = np.asarray(self.W_dec[layers, features])
            return out
        for l, w in enumerate(self.W_dec):
            at = np.nonzero(layers == l)[0]
            if len(at):
                out[at, l:] = np.asarray(w[features[at]])
        return out


def _site(hook: str) -> str:
    try:
        site, _ = site_of(f"blocks.0.{hook}")
    except SiteError as e:
        raise SiteError(f"transcoders read and write TransformerLens hooks inside a block: {e}") from None
    return site
