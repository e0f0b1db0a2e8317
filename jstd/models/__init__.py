"""Families and towers, by the ``model_type`` they serve."""

from jstd.models.hyperclovax import HyperCLOVAX
from jstd.models.llama import Llama
from jstd.models.olmo_hybrid import OlmoHybrid
from jstd.models.qwen2 import Qwen2VLText
from jstd.vision.deepseek_vl import DeepseekVL
from jstd.vision.idefics3 import Idefics3, SmolVLM
from jstd.vision.llava import Llava, VipLlava
from jstd.vision.llava_next import LlavaNext
from jstd.vision.qwen2_vl import HyperCLOVAXVisionV2, Qwen2VL, QwenVisionTower
from jstd.vision.towers import CLIPVision, SiglipVision

FAMILIES = {t: f for f in (Llama, HyperCLOVAX, OlmoHybrid, Qwen2VLText, CLIPVision, SiglipVision, Llava, VipLlava,
                           DeepseekVL, LlavaNext, Idefics3, SmolVLM, QwenVisionTower, Qwen2VL, HyperCLOVAXVisionV2)
            for t in f.model_types}


def served_sites() -> dict[str, tuple[str, ...]]:
    """Site -> the families and towers that serve it, from each family's model on transformers' default config
    for its first model_type (shapes only: no weights are made)."""
    import jax.numpy as jnp
    from transformers import AutoConfig

    served: dict[str, list[str]] = {}
    for family in dict.fromkeys(FAMILIES.values()):
        model = family.skeleton(AutoConfig.for_model(family.model_types[0]), jnp.float32)
        for site in model.sites:
            served.setdefault(site, []).append(family.family)
    return {site: tuple(names) for site, names in served.items()}
