"""Interventions: edits, and the tools built on them.

- ``edits``: Set, Add, Scale, Zero, Apply (the core ops, at chosen blocks, positions, heads).
- ``reading``: a cached jitted read, one block's entry of a stacked value.
- ``ablation``: zero, mean and resample ablations.
- ``patching``: activation patching, one patch or a chunked, vmapped sweep.
- ``metrics``: logit difference, target probability, KL, as functions of the logits.
- ``steering``: steer, contrastive vectors, optimizing edit arrays with optax.
- ``lens``: logit lens, first tokens of words, top-k readouts, next-token probabilities.
- ``attribution``: direct logit attribution (blocks and heads), attribution patching.
- ``plots``: PNG figures of attention patterns, patching heatmaps, logit-lens tables (``pip install jstd[plots]``).
"""

from jstd.interventions.ablation import mean_ablation, resample_ablation, site_mean, zero_ablation
from jstd.interventions.attribution import LogitAttribution, attribution_patching, direct_logit_attribution
from jstd.interventions.lens import TokenizationError, TopK, get_first_tokens, logit_lens, next_token_probs, top_k
from jstd.interventions.metrics import kl_divergence, logit_difference, target_probability
from jstd.interventions.patching import patch, patch_sweep
from jstd.interventions.plots import logit_lens_table, plot_attention, plot_logit_lens, plot_patching
from jstd.interventions.steering import contrastive_vector, optimize, steer

__all__ = [
    "zero_ablation", "mean_ablation", "resample_ablation", "site_mean",
    "patch", "patch_sweep",
    "logit_difference", "target_probability", "kl_divergence",
    "steer", "contrastive_vector", "optimize",
    "logit_lens", "get_first_tokens", "top_k", "TopK", "next_token_probs", "TokenizationError",
    "direct_logit_attribution", "LogitAttribution", "attribution_patching",
    "plot_attention", "plot_patching", "plot_logit_lens", "logit_lens_table",
]
