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
from jstd.io.load import ConfigWarning, load
from jstd.io.convert import convert, export
from jstd.interventions.reading import token_strings
from jstd.io.safetensors import CheckpointError
from jstd.models.base import logical_axes
from jstd.sharding import shard  # also makes jstd.sharding (DP, FSDP, TP, FSDP_TP, mesh, ...) an attribute
from jstd.inputs import Inputs
from jstd.context import Context
from jstd.run import Outputs, project_on_vocab, run
from jstd.generate import Generation, Sampling, generate, generation_config
from jstd.sites import SITES, Site, SiteError
from jstd.collect import collect
from jstd.activations import ActivationDataset


def load_processor(path_or_repo_id):
    """The checkpoint's HuggingFace processor, tokenizer or (for a vision tower) image processor, the PIL
    backend where there is a choice (use ``return_tensors="np"``; ``jstd.Inputs.of`` converts the output).

    Tokenizers pad on the LEFT (``padding_side="left"``; a processor's tokenizer too): every family jstd loads is
    a causal LM, whose padded batch then ends each row at its last real token.

    Raises FileNotFoundError when the folder has no tokenizer vocabulary and no image processor (naming the files
    looked for), ValueError when the files are there but transformers cannot build any of them (with its reasons).
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from jstd.io.hub import resolve

    folder = resolve(path_or_repo_id)
    vocabulary = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tekken.json")
    image = ("preprocessor_config.json", "processor_config.json")
    has = lambda names: [n for n in names if (folder / n).exists()]
    reasons = []
    if has(vocabulary + image + ("tokenizer_config.json",)):
        builders = {"AutoProcessor": AutoProcessor.from_pretrained, "the processor without videos": _without_videos,
                    "AutoTokenizer": AutoTokenizer.from_pretrained,
                    "AutoImageProcessor": AutoImageProcessor.from_pretrained}
        for name, build in builders.items():
            try:
                processor = build(folder)
            except Exception as e:
                reasons.append(f"{name}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")
                continue
            if processor is not None:
                tokenizer = getattr(processor, "tokenizer", processor)
                if hasattr(tokenizer, "padding_side"):
                    tokenizer.padding_side = "left"
                return processor
    missing = []
    if not has(vocabulary):
        missing.append(f"no tokenizer vocabulary ({', '.join(vocabulary[:4])} or vocab.txt)")
    if not has(("tokenizer_config.json",)):
        missing.append("no tokenizer_config.json")
    if not has(image):
        missing.append("no preprocessor_config.json (an image processor's)")
    message = (f"jstd.load_processor: {folder} has {'; '.join(missing) or 'the files'}"
               + ("; transformers could not build a tokenizer or processor from it: " + " | ".join(reasons)
                  if reasons else "")
               + ". Copy the tokenizer (and processor) files from the model's original repo (the base model's, "
                 "for a fine-tune), or pass the folder or repo id that has them")
    raise (FileNotFoundError if not has(vocabulary) and not has(image) else ValueError)(message)


def _without_videos(folder):
    """The checkpoint's image-text processor built without its video processor (Qwen2-VL's needs torchvision, which
    jstd does not use), or None when the folder names no such processor."""
    import json

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    name = None
    for config in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = folder / config
        if path.exists():
            name = name or json.loads(path.read_text()).get("processor_class")
    cls = getattr(transformers, name or "", None)
    if cls is None or "video_processor" not in getattr(cls, "get_attributes", lambda: ())():
        return None

    class WithoutVideos(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    WithoutVideos.__name__ = cls.__name__
    try:
        return WithoutVideos(image_processor=AutoImageProcessor.from_pretrained(folder),
                             tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None)
    except Exception:
        return None


__all__ = [
    "ConfigWarning", "token_strings",
    "load", "load_processor", "run", "Inputs", "Outputs", "project_on_vocab", "Context",
    "convert", "export",
    "generate", "Generation", "Sampling", "generation_config",
    "collect", "ActivationDataset",
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
