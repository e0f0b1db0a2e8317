"""Sparse dictionaries: sparse autoencoders and transcoders as equinox modules (``SAE``), SAELens' folder format
both ways (``load_sae``, ``save_sae``), splicing into the forward at any text block site (``splice``: the error
term added back, so an unedited spliced run is the plain run bit for bit), the feature toolkit (``features``)
and training in JAX on activation datasets (``train``)."""

from jstd.sae.features import (
    ablate_features, clamp_features, dense_latents, feature_attribution, feature_attribution_patching, feature_mask,
    feature_patch_sweep, sparse_latents, steer_feature,
)
from jstd.sae.format import hook_name_of, load_sae, save_sae, site_of
from jstd.sae.module import SAE, init, stack, topk
from jstd.sae.splice import FeatureEdit, Splice, sae_site, splice
from jstd.sae.train import Trained, train

__all__ = ["SAE", "init", "stack", "topk", "load_sae", "save_sae", "site_of", "hook_name_of", "Splice", "FeatureEdit", "splice",
           "sae_site", "train", "Trained", "feature_mask", "ablate_features", "steer_feature", "clamp_features",
           "feature_attribution", "feature_attribution_patching", "feature_patch_sweep", "sparse_latents",
           "dense_latents"]
