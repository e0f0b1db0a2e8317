"""The toolkit on a spliced dictionary's features: ablation, steering and clamping as edits, attribution to features,
a patching sweep over (block, feature) pairs, sparse latents.

Every edit here edits ``site + ".sae.latents"`` at the features named (a ``FeatureEdit``: the plain zero, add or
set with a mask over the ``sae`` axis, which lets an unread splice compute only those features; a bool mask of
features gives a plain ``jstd.Zero`` / ``Add`` / ``Set``), so it composes with any other edit, runs in ``jstd.generate`` (clamped features while decoding), and a
``vmap`` over its arrays (features, amounts, blocks) is one compile. Pass it after the ``jstd.splice`` edits.
``metric``: a function of the logits to a scalar (as ``jstd.logit_difference`` makes).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jstd.core.checks import checked, shown
from jstd.core.edits import Add, Set, Zero, check_index
from jstd.core.sites import parse
from jstd.run import run
from jstd.sae.splice import FeatureEdit, Splice, sae_site


def feature_mask(d_sae: int, features) -> Bool[Array, "d_sae"]:
    """True at ``features`` (an int, ints — traced allowed — in ``-d_sae..d_sae-1``, negatives counting from the
    end, or a bool mask ``[d_sae]``) among ``d_sae`` latents. SiteError for an index outside (an equinox runtime
    error when traced) or a mask of another shape: a mask built from it would silently select nothing."""
    features = check_index(features, d_sae, "features", "sae")
    if features.dtype == bool:
        return features
    features = features.reshape(-1)
    features = jnp.where(features < 0, features + d_sae, features)
    return (jnp.arange(d_sae)[:, None] == features[None, :]).any(-1)


def _is_mask(features) -> bool:
    return jnp.asarray(features).dtype == bool


def ablate_features(site: str, features, d_sae: int, *, layer=None, positions=None) -> FeatureEdit | Zero:
    """Zero ``features`` of the dictionary spliced at ``site`` (at ``layer`` and ``positions``; None: all).
    Indices give a ``FeatureEdit`` (only those features' latents are computed where nothing reads them); a bool
    mask ``[d_sae]`` a ``Zero`` with that mask."""
    if _is_mask(features):
        return Zero(sae_site(site, "latents"), layer=layer, positions=positions, where=feature_mask(d_sae, features))
    return FeatureEdit(sae_site(site, "latents"), "zero", features, layer=layer, positions=positions)


def steer_feature(site: str, feature, amount, d_sae: int, *, layer=None, positions=None) -> FeatureEdit | Add:
    """Add ``amount`` to ``feature``'s activation (what the site passes on moves by ``amount · W_dec[feature]``)."""
    if _is_mask(feature):
        return Add(sae_site(site, "latents"), jnp.asarray(amount) * feature_mask(d_sae, feature), layer=layer,
                   positions=positions)
    return FeatureEdit(sae_site(site, "latents"), "add", feature, amount, layer=layer, positions=positions)


def clamp_features(site: str, features, value, d_sae: int, *, layer=None, positions=None) -> FeatureEdit | Set:
    """Set ``features``' activations to ``value`` (a scalar, one per feature, or ``[d_sae]``)."""
    value = jnp.asarray(value, jnp.float32)
    if _is_mask(features):
        return Set(sae_site(site, "latents"), jnp.broadcast_to(value, (d_sae,)), layer=layer, positions=positions,
                   where=feature_mask(d_sae, features))
    features = jnp.asarray(features).reshape(-1)
    amounts = value[features] if value.shape == (d_sae,) and d_sae != features.shape[0] else value
    return FeatureEdit(sae_site(site, "latents"), "set", features, amounts, layer=layer, positions=positions)


def _d_sae(splices, site: str) -> int:
    base = parse(site)[0]
    found = [e for e in splices if isinstance(e, Splice) and e.site == base]
    if not found:
        raise ValueError(f"no dictionary is spliced at {base} among the edits; pass jstd.splice(model, sae, {base!r})")
    return found[0].sae.d_sae


def feature_attribution(model, inputs, splices: Sequence, metric: Callable, site: str
                        ) -> Float[Array, "blocks batch seq d_sae"]:
    """``∂ metric(logits) / ∂ latents`` at every block of ``site`` (zeros where nothing is spliced): one forward
    and one backward pass. Where a latent enters linearly downstream, gradient × activation is its direct effect."""
    spliced = sae_site(site, "latents")
    shape = run(model, inputs, splices, reads=(spliced,))[spliced].shape

    def f(delta):
        return metric(run(model, inputs, [*splices, Add(spliced, delta)]).logits)

    return jax.jit(jax.grad(f))(jnp.zeros(shape, jnp.float32))


def feature_attribution_patching(model, clean, corrupt, splices: Sequence, metric: Callable, site: str
                                 ) -> Float[Array, "blocks d_sae"]:
    """The linear estimate of ``feature_patch_sweep``: gradient on ``corrupt`` × (clean − corrupt latents), summed
    over the batch and the positions, per block and feature."""
    spliced = sae_site(site, "latents")
    lat_clean = run(model, clean, splices, reads=(spliced,))[spliced]
    lat_corrupt = run(model, corrupt, splices, reads=(spliced,))[spliced]
    grad = feature_attribution(model, corrupt, splices, metric, site)
    return (grad * (lat_clean - lat_corrupt)).sum((1, 2))


def feature_patch_sweep(model, clean, corrupt, splices: Sequence, metric: Callable, site: str,
                        layers: Sequence[int], features: Sequence[int] | Int[Array, "n"]
                        ) -> Float[Array, "layers features"]:
    """``metric`` of the corrupted run with one feature at one block set to its clean activation (every
    position), for every (block in ``layers``, feature in ``features``): one compiled ``vmap`` over the pairs.
    SiteError for a feature outside ``-d_sae..d_sae-1``, before compiling."""
    spliced = sae_site(site, "latents")
    d_sae = _d_sae(splices, site)
    lat_clean = run(model, clean, splices, reads=(spliced,))[spliced]
    layers = np.asarray(layers, np.int32)
    if not isinstance(features, jax.core.Tracer):  # before compiling: an index outside would patch nothing
        check_index(np.asarray(features), d_sae, "feature_patch_sweep: features", "sae")
    features = np.asarray(features, np.int32)
    rows = np.asarray([model.row_of(parse(site)[0], int(l)) for l in layers], np.int32)
    pair_layer, pair_feature = np.meshgrid(np.arange(len(layers)), features, indexing="ij")

    def one(i, f):
        edit = Set(spliced, lat_clean[jnp.asarray(rows)[i]], layer=jnp.asarray(layers)[i],
                   where=feature_mask(d_sae, f))
        return metric(run(model, corrupt, [*splices, edit]).logits)

    grid = jax.jit(jax.vmap(one))(jnp.asarray(pair_layer.reshape(-1)), jnp.asarray(pair_feature.reshape(-1)))
    return grid.reshape(len(layers), len(features))


def sparse_latents(latents: Float[Array, "... d_sae"], k: int) -> tuple[Int[Array, "... k"], Float[Array, "... k"]]:
    """``(indices, values)`` of each row's ``k`` largest latents (ties by lower index): the row exactly where it has
    at most ``k`` active latents (``dense_latents`` restores it); an inactive slot holds value 0."""
    values, indices = jax.lax.top_k(latents, k)
    return indices.astype(jnp.int32), values


def dense_latents(indices: Int[Array, "... k"], values: Float[Array, "... k"], d_sae: int) -> Float[Array, "... d_sae"]:
    """The rows ``sparse_latents`` stored, as ``[..., d_sae]``. ValueError for an index outside ``0..d_sae-1``
    (the compiled call fails when traced): a scatter there would drop its value."""
    indices = checked(indices, lambda xp, i: (i < 0) | (i >= d_sae),
                      f"dense_latents: indices must lie in 0..{d_sae - 1} (d_sae={d_sae}); pass the d_sae the "
                      "latents were stored with",
                      concrete=lambda i, bad: f"dense_latents: index {shown(i[bad])} is outside 0..{d_sae - 1} "
                                              f"(d_sae={d_sae}); pass the d_sae the latents were stored with")
    indices = jnp.asarray(indices)
    flat_i, flat_v = indices.reshape(-1, indices.shape[-1]), values.reshape(-1, values.shape[-1])
    out = jnp.zeros((flat_i.shape[0], d_sae), values.dtype).at[jnp.arange(flat_i.shape[0])[:, None], flat_i].add(flat_v)
    return out.reshape(*indices.shape[:-1], d_sae)
