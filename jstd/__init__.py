"""jstd: HuggingFace transformers in JAX, with every interpretability value a named, standard site.

    model = jstd.load("path/or/org-repo")
    out = jax.jit(jstd.run, static_argnames="reads")(model, tokens, edits, reads=("layers.layer_output",))
"""

from jstd.core.startup import quiet_start

quiet_start()  # before anything imports JAX: on a machine without an accelerator, JAX starts on the CPU, quietly

from jstd.interventions import (  # noqa: E402 (every import after the quiet start)
    LogitAttribution, TokenizationError, TopK, attribution_patching, contrastive_vector,
    direct_logit_attribution, get_first_tokens, kl_divergence, logit_difference, logit_lens, mean_ablation,
    next_token_probs, optimize, patch, patch_sweep, resample_ablation, site_mean, steer, target_probability, top_k,
    zero_ablation,
)
from jstd.interventions.plots import logit_lens_table, plot_attention, plot_logit_lens, plot_patching
from jstd.core.edits import Add, Apply, Edit, Scale, Set, Zero
from jstd.io.hf import ConfigWarning, generation_config
from jstd.io.load import load
from jstd.io.processor import load_processor
from jstd.io.export import export
from jstd.io.stacked import convert
from jstd.interventions.reading import token_strings
from jstd.io.safetensors import CheckpointError
from jstd.nn.params import logical_axes
from jstd.sharding import shard  # also makes jstd.sharding (DP, FSDP, TP, FSDP_TP, mesh, ...) an attribute
from jstd.core.inputs import Inputs
from jstd.core.context import Context
from jstd.run import Outputs, project_on_vocab, run
from jstd.generate import Generation, Sampling, generate
from jstd.core.sites import SITES, Site, SiteError
from jstd.collect import ActivationDataset, SparseRows, collect
from jstd import sae  # noqa: F401 (jstd.sae: sparse autoencoders and transcoders)
from jstd.sae import splice
from jstd.circuits import view  # a Graph, or a graph JSON (jstd.viewer.view)
from jstd import circuits  # noqa: F401 (jstd.circuits: attribution graphs)
from jstd.circuits import attribute
__all__ = [
    "ConfigWarning", "token_strings",
    "load", "load_processor", "run", "Inputs", "Outputs", "project_on_vocab", "Context",
    "convert", "export",
    "generate", "Generation", "Sampling", "generation_config",
    "collect", "ActivationDataset", "SparseRows",
    "sae", "splice", "circuits", "attribute",
    "view",
    "Edit", "Set", "Add", "Scale", "Zero", "Apply",
    "SITES", "Site", "SiteError", "CheckpointError", "logical_axes", "shard",
    # interventions
    "zero_ablation", "mean_ablation", "resample_ablation", "site_mean",
    "patch", "patch_sweep", "logit_difference", "target_probability", "kl_divergence",
    "steer", "contrastive_vector", "optimize",
    "logit_lens", "get_first_tokens", "top_k", "TopK", "next_token_probs", "TokenizationError",
    "direct_logit_attribution", "LogitAttribution", "attribution_patching",
    "plot_attention", "plot_patching", "plot_logit_lens", "logit_lens_table",
]
