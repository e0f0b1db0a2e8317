"""The registry: every family, tower and wrapper jstd serves, by the ``model_type`` it serves; the ones it knowingly
refuses; which sites each serves (``docs/values.md``). The only module that knows every family."""

from __future__ import annotations

from jstd.core.sites import SITES, Site
from jstd.models.family import TextFamily
from jstd.models.gemma import Gemma
from jstd.models.gpt2 import GPT2
from jstd.models.gpt_neo import GPTNeo
from jstd.models.gptj import GPTJ
from jstd.models.phi import Phi
from jstd.models.opt import OPT
from jstd.models.bloom import Bloom
from jstd.models.gpt_neox import GPTNeoX
from jstd.models.hyperclovax import HyperCLOVAX
from jstd.models.llama import Llama
from jstd.models.llama4 import Llama4, Llama4Text
from jstd.models.gemma2 import Gemma2
from jstd.models.gemma3 import Gemma3Text
from jstd.models.mistral import Mistral
from jstd.models.olmo3 import Olmo3
from jstd.models.qwen2 import Qwen2
from jstd.models.olmo2 import Olmo2
from jstd.models.olmo_hybrid import OlmoHybrid
from jstd.models.phi3 import Phi3
from jstd.models.qwen2 import Qwen2VLText
from jstd.models.qwen3 import Qwen3
from jstd.models.qwen3_vl import Qwen3VLText
from jstd.models.qwen3_5 import Qwen3_5Text
from jstd.models.smollm3 import SmolLM3
from jstd.models.mixtral import Mixtral
from jstd.models.olmoe import Olmoe
from jstd.models.qwen3_5_moe import Qwen3_5MoeText
from jstd.models.qwen3_moe import Qwen3Moe, Qwen3VLMoeText
from jstd.models.gpt_oss import GptOss
from jstd.models.phimoe import Phimoe
from jstd.models.qwen2_moe import Qwen2Moe
from jstd.models.deepseek_v2 import DeepseekV2, DeepseekV3
from jstd.vision.deepseek_vl import DeepseekVL
from jstd.vision.gemma3 import Gemma3
from jstd.vision.idefics3 import Idefics3, SmolVLM
from jstd.vision.llava import Llava, VipLlava
from jstd.vision.llava_next import LlavaNext
from jstd.vision.qwen2_vl import HyperCLOVAXVisionV2, Qwen2VL, QwenVisionTower
from jstd.vision.qwen3_vl import Qwen3_5VL, Qwen3VisionTower, Qwen3VL
from jstd.vision.towers import CLIPVision, SiglipVision
from jstd.vision.wrapper import WrapperFamily
from jstd.vision.qwen3_vl_moe import Qwen3_5MoeVL, Qwen3VLMoe

FAMILIES = {t: f for f in (Llama, HyperCLOVAX, OlmoHybrid, Qwen2VLText, Qwen3_5Text, Gemma, Olmo2, Qwen3, Phi3, SmolLM3,
                           GPT2, GPTNeoX, GPTNeo, GPTJ, Phi, OPT, Bloom,
                           Mistral, Qwen2, Gemma2, Gemma3Text, Olmo3,
                           CLIPVision, SiglipVision, Llava,
                           VipLlava, DeepseekVL, LlavaNext, Idefics3, SmolVLM, QwenVisionTower, Qwen2VL,
                           HyperCLOVAXVisionV2, Qwen3VLText, Qwen3VL, Qwen3VisionTower, Qwen3_5VL, Gemma3)
            for t in f.model_types}

# the mixture-of-experts families (jstd.nn.moe)
FAMILIES |= {t: f for f in (Qwen3Moe, Qwen3VLMoeText, Olmoe, Mixtral, Qwen3_5MoeText, Qwen3VLMoe, Qwen3_5MoeVL)
             for t in f.model_types}

# families with new attention and routing (issue 38): attention sinks, sparsemixer, a shared expert
FAMILIES |= {t: f for f in (GptOss, Qwen2Moe, Phimoe) for t in f.model_types}
# Llama 4: chunked attention, NoPE blocks with temperature tuning, input-weighted top-1 experts (jstd.models.llama4)
FAMILIES |= {t: f for f in (Llama4Text, Llama4) for t in f.model_types}
# multi-head latent attention and DeepSeek's routers (issue 38)
FAMILIES |= {t: f for f in (DeepseekV2, DeepseekV3) for t in f.model_types}

# model_types jstd knowingly does not serve, with the reason the loader gives
REFUSED: dict[str, str] = {}


def family_for(model_type: str | None, where: str = "the config"):
    """The family serving ``model_type``; ValueError listing jstd's families when there is none (``where``: the
    file named in the message)."""
    if model_type in REFUSED:
        raise ValueError(f"{REFUSED[model_type]} (in {where})")
    if model_type not in FAMILIES:
        what = "no model_type" if model_type is None else f"unsupported model_type {model_type!r}"
        raise ValueError(f"{what}; jstd supports: {', '.join(sorted(FAMILIES))} (in {where}; to add a family see "
                         "docs/architecture.md, 'Adding a family')")
    return FAMILIES[model_type]


# where transformers' default config is not one its model runs, the changes that make it one (the sites are the
# same): Gemma 3's default SigLIP has a 14 × 14 patch grid, which 256 image tokens cannot pool
WORKING_DEFAULTS = {"gemma3": {"mm_tokens_per_image": 196},
                    "deepseek_v2": {"num_experts_per_tok": 6}}  # its default leaves the top-k unset (V2-Lite's 6)


def served_sites() -> dict[str, tuple[str, ...]]:
    """Site -> the families and towers that serve it, from each family's model on transformers' default config
    for its first model_type (shapes only: no weights are made)."""
    import jax.numpy as jnp
    from transformers import AutoConfig

    served: dict[str, list[str]] = {}
    for family in dict.fromkeys(FAMILIES.values()):
        model_type = family.model_types[0]
        model = family.skeleton(AutoConfig.for_model(model_type, **WORKING_DEFAULTS.get(model_type, {})), jnp.float32)
        for site in model.sites:
            served.setdefault(site, []).append(family.family)
    return {site: tuple(names) for site, names in served.items()}


def values_markdown(served: dict[str, tuple[str, ...]] | None = None) -> str:
    """docs/values.md: every site some family or tower serves, with the ones that serve it (``served``: site ->
    family names; by default ``served_sites()``). Tests check the file is current."""
    served = served_sites() if served is None else served
    lines = [
        "# Standard values",
        "",
        "Generated from `jstd/core/sites.py` and the families' declarations by `make docs`; do not edit by hand.",
        "",
        '`"layers.X"` reads site X stacked over the blocks that have its host (block axis first);',
        '`"layers.5.X"` reads or edits block 5 alone; `"vision.layers.X"` and `"vision.layers.5.X"` do the same',
        "on a vision tower's blocks. Layouts are per host (per block). *Served by* lists the families and towers",
        "that compute the value; names in the vocabulary that nothing serves yet are left out.",
        "",
    ]
    by_host: dict[str, list[Site]] = {}
    for s in SITES.values():
        if served.get(s.name):
            by_host.setdefault(s.host, []).append(s)
    for host, sites in by_host.items():
        lines += [f"## `{host}`", "", "| site | layout | editable | served by | meaning |", "| --- | --- | --- | --- | --- |"]
        for s in sites:
            lines.append(f"| `{s.name}` | [{', '.join(s.layout)}] | {'yes' if s.editable else 'read-only'} | "
                         f"{', '.join(served[s.name])} | {s.meaning} |")
        lines.append("")
    return "\n".join(lines)




def families_markdown() -> str:
    """docs/families.md: every ``model_type`` ``jstd.load`` serves, by kind (text model, image-text model, vision
    tower alone), and the ones it refuses with the reason. Generated from ``FAMILIES`` and ``REFUSED``, so it cannot
    drift; tests check the file is current and that no doc calls a served ``model_type`` refused."""
    kinds = {"Text models": [], "Image-text models": [], "Vision towers, loaded alone": []}
    for model_type, family in sorted(FAMILIES.items()):
        kind = ("Text models" if issubclass(family, TextFamily) else
                "Image-text models" if issubclass(family, WrapperFamily) else "Vision towers, loaded alone")
        kinds[kind].append(f"| `{model_type}` | {family.__name__} (`{family.__module__}`) |")
    lines = ["# Families", "", "Generated from `jstd/families.py` (`FAMILIES`, `REFUSED`) by `make docs`; do not edit by "
             "hand. Every `model_type` below loads with `jstd.load` and its values match transformers (the tests "
             "under `tests/` check each). What each serves: docs/values.md.", ""]
    for kind, rows in kinds.items():
        lines += [f"## {kind}", "", "| model_type | declaration |", "| --- | --- |", *rows, ""]
    lines += ["## Refused", ""]
    if REFUSED:
        lines += ["| model_type | why |", "| --- | --- |",
                  *(f"| `{t}` | {why} |" for t, why in sorted(REFUSED.items())), ""]
    else:
        lines += ["None: a `model_type` not listed above is not supported yet (the loader lists these).", ""]
    return "\n".join(lines)
