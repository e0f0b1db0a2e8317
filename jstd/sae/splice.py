"""Splicing a dictionary into the forward at a site: ``jstd.splice`` and the ``Splice`` edit.

A spliced dictionary runs at its site inside the forward and serves three values under it (``core/sites.py``,
``SAE_SITES``): ``X.sae.latents`` ``[batch, seq, d_sae]``, ``X.sae.reconstruction`` and ``X.sae.error``, each
read and edited like any block site (``"layers.X.sae.latents"`` stacked over the blocks that compute X, zeros at
blocks where nothing is spliced; ``"layers.3.X.sae.latents"`` block 3 alone). What the site passes on:

- nothing under it edited: the site's value ``x`` itself, so an unedited spliced run is bit-identical to the
  plain run (the dictionary only adds what is read);
- the latents edited (ablated, clamped, steered) and neither the reconstruction nor the error:
  ``x + (decode(latents edited) - decode(latents))``, which is ``reconstruction + error`` with the error of the
  unedited latents added back, computed so that wherever the edit leaves the latents as they were (other
  positions, blocks, rows) the value is ``x`` bit for bit, and downstream gets exactly the change in the
  reconstruction (computed in the wider of the dictionary's and the model's dtype, then cast to the model's);
- the reconstruction or the error edited: ``reconstruction + error`` as edited (``Zero`` at ``X.sae.error``:
  the model runs on the dictionary's reconstruction alone).

A transcoder reads one site (``source``, e.g. ``layers.mlp_norm_output``) and replaces another (``site``, e.g.
``layers.mlp.mlp_output``) the same way: its error is ``output - reconstruction``. Both sites lie in one block,
the source computed first.
"""

from __future__ import annotations

from typing import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.core.edits import Edit, check_index, selection_mask
from jstd.core.sites import SITES, SiteError, parse
from jstd.nn.model import Model
from jstd.run import check_sites
from jstd.sae.format import site_of
from jstd.sae.module import SAE, stack

_SOURCES = "_sae_sources"  # the Tap attribute holding transcoders' inputs while one block traces
_COLUMNS = "_sae_columns"  # the Tap attribute: latents site -> the features a Splice computed alone


class FeatureEdit(Edit):
    """Zero, set or add to a few features of a spliced dictionary's latents (``site``: ``X.sae.latents``).

    features: feature indices ``[n]`` (ints, traced allowed); amounts: ``[n]`` (``set``, ``add``; None for
    ``zero``); how: ``"zero"``, ``"set"`` or ``"add"``; layer, positions as every edit. A feature named twice gets
    the sum of its amounts (``add``) or its last amount (``set``). On the latents it is the plain edit with a mask
    over the ``sae`` axis; where nothing reads the latents, reconstruction or error, the splice computes only
    these features' latents (ReLU, JumpReLU) and decoder rows, so the dictionary costs ``O(n)`` per token, not
    ``O(d_sae)`` (``Splice``). Made by ``jstd.sae.ablate_features``, ``steer_feature``, ``clamp_features``.
    """

    features: Int[Array, "n"]
    amounts: Float[Array, "n"] | None
    how: str = eqx.field(static=True)

    def __init__(self, site: str, how: str, features, amounts=None, *, layer=None, positions=None):
        self._init_site(site, layer, None, positions)
        if not self.site.endswith(".sae.latents"):
            raise SiteError(f"FeatureEdit edits a dictionary's latents (X.sae.latents), not {site!r}")
        if how not in ("zero", "set", "add"):
            raise ValueError(f"FeatureEdit: how must be 'zero', 'set' or 'add', got {how!r}")
        if (amounts is None) != (how == "zero"):
            raise ValueError(f"FeatureEdit: {how!r} {'takes no' if how == 'zero' else 'needs'} amounts")
        features = jnp.asarray(features)
        if not jnp.issubdtype(features.dtype, jnp.integer):
            raise TypeError(f"FeatureEdit: features are integer indices, got dtype {features.dtype}")
        self.features = features.reshape(-1)
        self.amounts = None if amounts is None else jnp.broadcast_to(jnp.asarray(amounts, jnp.float32),
                                                                     self.features.shape)
        self.how = how

    def arrays(self) -> tuple[str, ...]:
        return ()  # its arrays index the sae axis: nothing broadcasts against the site's value

    def op(self, value):
        return self._edited(value, jnp.arange(value.shape[-1]), value.shape[-1])

    def within(self, value: Array, scope) -> Array:
        view = getattr(scope.tap, _COLUMNS, {}).get(self.site)  # (the features value holds, d_sae)
        if view is None:
            return self(value)
        return self._selected(self._edited(value, *view), value)

    def __call__(self, value: Array) -> Array:
        return self._selected(self.op(value), value)

    def _selected(self, new, value):
        mask = selection_mask(self.site, value.shape, self.positions, None, f"FeatureEdit at {self.site}")
        return new if mask is None else jnp.where(mask, new, value)

    def _edited(self, value, columns, d_sae: int):
        """``value`` (latents at the features ``columns`` of ``d_sae`` along its last axis) with this edit's
        features edited. Features outside ``-d_sae..d_sae-1``: SiteError (an equinox runtime error when traced)."""
        features = check_index(self.features, d_sae, f"FeatureEdit at {self.site}: features", "sae")
        features = jnp.where(features < 0, features + d_sae, features)
        match = features[:, None] == columns[None, :]  # [n, columns]
        hit = match.any(0)
        if self.how == "zero":
            new = jnp.zeros_like(value)
        elif self.how == "add":
            new = value + jnp.where(match, self.amounts[:, None], 0.0).sum(0).astype(value.dtype)
        else:
            last = jnp.max(jnp.where(match, jnp.arange(1, len(features) + 1)[:, None], 0), axis=0) - 1
            new = jnp.broadcast_to(self.amounts[jnp.maximum(last, 0)].astype(value.dtype), value.shape)
        return jnp.where(hit, new, value)


def sae_site(site: str, name: str) -> str:
    """The whole name of a spliced dictionary's value ``name`` (``latents``, ``reconstruction``, ``error``) at
    ``site`` (``layers.layer_output`` -> ``layers.layer_output.sae.latents``); a block index is kept
    (``layers.3.layer_output`` -> ``layers.3.layer_output.sae.latents``)."""
    full = f"{site}.sae.{name}"
    parse(full)  # SiteError for a site that has no dictionary values
    return full


class Source(Edit):
    """A transcoder's input: passes the value at ``site`` through unchanged and hands it to the ``Splice`` at
    ``target`` in the same block. Made by ``jstd.splice``."""

    target: str = eqx.field(static=True)

    def __init__(self, site: str, target: str):
        self._init_site(site, None, None)
        self.target = target

    def op(self, value):
        return value

    def within(self, value: Array, scope) -> Array:
        if not hasattr(scope.tap, _SOURCES):
            setattr(scope.tap, _SOURCES, {})
        getattr(scope.tap, _SOURCES)[self.target] = value
        return value


def source_value(scope, target: str):
    """The value a ``Source`` at this block handed to the edit at ``target`` (a whole site name), None if none
    (other edits that read a second site of their block use it too: ``jstd.circuits``' held MLPs)."""
    return getattr(scope.tap, _SOURCES, {}).get(target)


class Splice(Edit):
    """A dictionary run at ``site`` inside the forward (see the module docstring for what it passes on).

    sae: one dictionary, or a stack (``jstd.sae.stack``) with one per block of ``layers`` (or, with
        ``layers=None``, one per block that computes the site).
    layers: the blocks it runs at (non-negative ints, static); None: every block that computes the site.
    source: a transcoder's input site (whole name); None for an autoencoder, which reads the site itself.
    Build it with ``jstd.splice``, which checks it against the model.
    """

    sae: SAE
    layers: tuple[int, ...] | None = eqx.field(static=True)
    source: str | None = eqx.field(static=True)

    def __init__(self, site: str, sae: SAE, *, layers: Sequence[int] | None = None, source: str | None = None):
        self._init_site(site, None, None)
        if f"{self.site}.sae.latents" not in SITES:
            raise SiteError(f"a dictionary cannot be spliced at {site!r}: jstd splices at text block sites of one "
                            "row per position (layers.layer_output, layers.mlp.mlp_output, …)")
        if not isinstance(sae, SAE):
            raise TypeError(f"Splice: sae must be a jstd.sae.SAE, got {type(sae).__name__}")
        self.sae = sae
        self.layers = None if layers is None else tuple(int(i) for i in layers)
        self.source = source

    def op(self, value):
        raise SiteError("a Splice runs inside the forward, at its site: pass it among jstd.run's edits")

    def _sub(self, name: str) -> str:
        return f"{SITES[self.site].relative}.sae.{name}"

    def within(self, x: Array, scope) -> Array:
        spliced = [e for e in scope.tap.edits.get(self.site, ()) if isinstance(e, Splice)]
        if len(spliced) > 1:
            raise SiteError(f"{len(spliced)} dictionaries are spliced at {self.site}: splice one there, stacked "
                            "over its blocks (jstd.sae.stack, jstd.splice(model, stacked, site, layer=(…)))")
        sae, active = self.sae, None
        if self.layers is None:
            if sae.stacked:
                sae = sae[scope.stack_index]
        else:
            match = jnp.asarray(self.layers) == scope.layer
            active = match.any()
            if sae.stacked:
                sae = sae[jnp.argmax(match)]
        if self.source is None:
            x_in = x
        else:
            x_in = source_value(scope, self.site)
            if x_in is None:
                raise SiteError(f"the transcoder at {self.site} reads {self.source}, which this block did not "
                                "compute before it")
        edited = scope.tap.edits
        whole = lambda name: scope.prefix + self._sub(name)
        wide = jnp.promote_types(x.dtype, sae.dtype)
        on_latents = edited.get(whole("latents"), ())
        if (on_latents and all(isinstance(e, FeatureEdit) for e in on_latents) and sae.linear_decoder
                and whole("latents") not in scope.tap.reads
                and not scope.touches(self._sub("reconstruction"), self._sub("error"))):
            out = self._features_only(sae, x, x_in, active, on_latents, scope, wide)
            return out if active is None else jnp.where(active, out, x)
        latents = sae.encode(x_in)
        if active is not None:
            latents = jnp.where(active, latents, jnp.zeros_like(latents))
        new_latents = scope(self._sub("latents"), latents)
        if whole("latents") in edited and not (whole("reconstruction") in edited or whole("error") in edited):
            # x plus the change in the reconstruction: x itself, bit for bit, wherever the latents are unedited
            out = (x.astype(wide) + sae.decode_change(new_latents, latents, x_in).astype(wide)).astype(x.dtype)
        else:
            out = x
        if scope.touches(self._sub("reconstruction"), self._sub("error")):  # computed only when read or edited
            recon = sae.decode(latents, x_in)
            new_recon = sae.decode(new_latents, x_in) if whole("latents") in edited else recon
            read_recon = scope(self._sub("reconstruction"), new_recon.astype(x.dtype))
            read_error = scope(self._sub("error"), x - recon.astype(x.dtype))
            if whole("reconstruction") in edited or whole("error") in edited:
                out = read_recon + read_error
        return out if active is None else jnp.where(active, out, x)

    def _features_only(self, sae: SAE, x, x_in, active, on_latents, scope, wide):
        """``x`` plus the change the feature edits make to the reconstruction, computing only the edited features'
        latents (ReLU, JumpReLU: each alone; TopK: every latent, then these) and decoder rows: the latents there
        equal the whole dictionary's up to float32 rounding (a dot product over ``d_in`` summed in another
        order), and the site's value is ``x`` bit for bit wherever they are unedited."""
        columns = jnp.concatenate([e.features for e in on_latents]).astype(jnp.int32)
        columns = jnp.where(columns < 0, columns + sae.d_sae, columns)
        cut = sae.columns(columns)
        old = jnp.take(sae.encode(x_in), columns, axis=-1) if sae.activation == "topk" else cut.encode(x_in)
        if active is not None:
            old = jnp.where(active, old, jnp.zeros_like(old))
        latents = scope.prefix + self._sub("latents")
        views = getattr(scope.tap, _COLUMNS, {})
        setattr(scope.tap, _COLUMNS, {**views, latents: (columns, sae.d_sae)})
        try:
            new = scope(self._sub("latents"), old)
        finally:
            setattr(scope.tap, _COLUMNS, views)
        n = columns.shape[0]
        earlier = (columns[:, None] == columns[None, :]) & (jnp.arange(n)[None, :] < jnp.arange(n)[:, None])
        new = jnp.where(earlier.any(1), old, new)  # a feature named twice: its change counted once
        return (x.astype(wide) + cut.decode_change(new, old, x_in).astype(wide)).astype(x.dtype)


def splice(model: Model, sae: SAE | Sequence[SAE], site: str | None = None, layer=None, *,
           source: str | None = None) -> tuple[Edit, ...]:
    """The edits that splice ``sae`` into ``model``'s forward at ``site``: pass them among ``jstd.run``'s (or
    ``jstd.generate``'s, a sweep's) edits, with edits of ``site + ".sae.latents"`` and reads of the values under
    the site.

    sae: one dictionary (``jstd.sae.SAE``), a stack of them (``jstd.sae.stack``) or a sequence (stacked here),
        one per block of ``layer``.
    site: a text block site (``layers.layer_output``, ``layers.3.layer_output``); None: the dictionary's
        ``hook_name`` (a TransformerLens hook or a jstd site), ``hook_name_out`` for a transcoder.
    layer: a block, a sequence of blocks, or None (every block that computes the site; a stack then has one
        dictionary per such block; one dictionary runs at each).
    source: a transcoder's input site (None: its ``hook_name``); it must lie in the same block, before ``site``.

    Several sites: concatenate the edits of several ``splice`` calls (one dictionary, or one stack, per site).
    Raises SiteError for a site the model does not serve or that takes no dictionary, blocks that do not compute
    it, a width that does not match the site's, or a stack whose length differs from the blocks'.
    """
    if not isinstance(sae, SAE):
        sae = stack(list(sae))
    if site is None:
        hook = sae.hook_name_out if sae.transcoder else sae.hook_name
        if hook is None:
            raise SiteError("splice: the dictionary names no site (no hook_name); pass site=")
        site, at = site_of(hook)
        layer = at if layer is None else layer
    base, index = parse(site)
    if index is not None:
        if layer is not None:
            raise SiteError(f"splice: {site!r} already names block {index}; drop layer={layer!r}")
        layer = index
    check_sites(model, [base], "splice at")
    if f"{base}.sae.latents" not in SITES:
        raise SiteError(f"splice: a dictionary cannot be spliced at {base!r}: jstd splices at text block sites of one "
                        "row per position (layers.layer_output, layers.mlp.mlp_output, …)")
    blocks = model.blocks_for(base)
    L = model.depth(SITES[base].stack)
    if layer is None:
        layers = None
        n = len(blocks)
    else:
        wanted = [layer] if np.ndim(layer) == 0 else list(np.asarray(layer).reshape(-1))
        layers = tuple(int(model.check_block(base, int(i), "splice")) % L for i in wanted)
        if len(set(layers)) != len(layers):
            raise SiteError(f"splice: layer={layer!r} names a block twice")
        n = len(layers)
    if sae.stacked and sae.stacked != (n,):
        raise SiteError(f"splice: the stacked dictionary holds {sae.stacked[0] if sae.stacked else 1} dictionaries "
                        f"for {n} blocks of {base}; pass one per block")
    width = _width(model, base)
    want_out = sae.d_out
    if want_out != width:
        raise SiteError(f"splice: the dictionary writes {want_out} features wide, but {base} is {width} wide "
                        f"[{', '.join(SITES[base].layout)}]; splice it where it was trained")
    if sae.transcoder:
        source = source or (site_of(sae.hook_name)[0] if sae.hook_name else None)
        if source is None:
            raise SiteError("splice: a transcoder reads a source site; pass source= (e.g. 'layers.mlp_norm_output')")
        source = parse(source)[0]
        check_sites(model, [source], "splice: source")
        if not SITES[source].per_block or SITES[source].stack != SITES[base].stack:
            raise SiteError(f"splice: the transcoder's source {source} must be a block site of {SITES[base].stack}")
        if _width(model, source) != sae.d_in:
            raise SiteError(f"splice: the transcoder reads {sae.d_in} features, but {source} is "
                            f"{_width(model, source)} wide")
        return Source(source, base), Splice(base, sae, layers=layers, source=source)
    if source is not None:
        raise SiteError("splice: source= is for transcoders; an autoencoder reads the site it is spliced at")
    if sae.d_in != width:
        raise SiteError(f"splice: the dictionary reads {sae.d_in} features, but {base} is {width} wide")
    return (Splice(base, sae, layers=layers),)


def _width(model: Model, site: str) -> int:
    axis = SITES[site].layout[-1]
    return {"hidden": model.config.hidden_size, "mlp": model.config.intermediate_size}[axis]
