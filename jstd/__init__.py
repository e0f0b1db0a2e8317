"""jstd: HuggingFace transformers in JAX, with every interpretability value a named, standard site.

    model = jstd.load("path/or/org-repo")
    out = jax.jit(jstd.run, static_argnames="reads")(model, tokens, edits, reads=("layers.layer_output",))
"""

from jstd.interventions import (
    LogitAttribution, TokenizationError, TopK, attribution_patching, contrastive_vector,
    direct_logit_attribution, get_first_tokens, kl_divergence, logit_difference, logit_lens, mean_ablation,
    next_token_probs, optimize, patch, patch_sweep, resample_ablation, site_mean, steer, target_probability, top_k,
    zero_ablation,
)
from jstd.interventions.plots import logit_lens_table, plot_attention, plot_logit_lens, plot_patching
from jstd.edits import Add, Apply, Edit, Scale, Set, Zero
from jstd.io.load import load
from jstd.io.safetensors import CheckpointError
from jstd.models.base import logical_axes
from jstd.inputs import Inputs
from jstd.context import Context
from jstd.run import Outputs, project_on_vocab, run
from jstd.sites import SITES, Site, SiteError


def load_processor(path_or_repo_id):
    """The checkpoint's HuggingFace processor, tokenizer or (for a vision tower) image processor, the PIL
    backend where there is a choice (use ``return_tensors="np"``; ``jstd.Inputs.of`` converts the output)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from jstd.io.hub import resolve

    folder = resolve(path_or_repo_id)
    for auto in (AutoProcessor, AutoTokenizer):
        try:
            return auto.from_pretrained(folder)
        except Exception:
            pass
    return AutoImageProcessor.from_pretrained(folder)


__all__ = [
    "load", "load_processor", "run", "Inputs", "Outputs", "project_on_vocab", "Context",
    "Edit", "Set", "Add", "Scale", "Zero", "Apply",
    "SITES", "Site", "SiteError", "CheckpointError", "logical_axes",
    # interventions
    "zero_ablation", "mean_ablation", "resample_ablation", "site_mean",
    "patch", "patch_sweep", "logit_difference", "target_probability", "kl_divergence",
    "steer", "contrastive_vector", "optimize",
    "logit_lens", "get_first_tokens", "top_k", "TopK", "next_token_probs", "TokenizationError",
    "direct_logit_attribution", "LogitAttribution", "attribution_patching",
    "plot_attention", "plot_patching", "plot_logit_lens", "logit_lens_table",
]
