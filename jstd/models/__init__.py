"""Families and towers, by the ``model_type`` they serve."""

from jstd.models.hyperclovax import HyperCLOVAX
from jstd.models.llama import Llama
from jstd.models.olmo_hybrid import OlmoHybrid
from jstd.models.qwen2 import Qwen2VLText
from jstd.models.qwen3_vl import Qwen3VLText
from jstd.models.qwen3_5 import Qwen3_5Text
from jstd.vision.deepseek_vl import DeepseekVL
from jstd.vision.idefics3 import Idefics3, SmolVLM
from jstd.vision.llava import Llava, VipLlava
from jstd.vision.llava_next import LlavaNext
from jstd.vision.qwen2_vl import HyperCLOVAXVisionV2, Qwen2VL, QwenVisionTower
from jstd.vision.qwen3_vl import Qwen3_5VL, Qwen3VisionTower, Qwen3VL
from jstd.vision.towers import CLIPVision, SiglipVision

FAMILIES = {t: f for f in (Llama, HyperCLOVAX, OlmoHybrid, Qwen2VLText, Qwen3_5Text, CLIPVision, SiglipVision, Llava,
                           VipLlava, DeepseekVL, LlavaNext, Idefics3, SmolVLM, QwenVisionTower, Qwen2VL,
                           HyperCLOVAXVisionV2, Qwen3VLText, Qwen3VL, Qwen3VisionTower, Qwen3_5VL)
            for t in f.model_types}

# model_types jstd knowingly does not serve, with the reason the loader gives
REFUSED = {
    t: f"{t} is Qwen3-VL's mixture-of-experts line, which jstd does not serve (no MoE blocks); the dense Qwen3-VL "
       "checkpoints (model_type qwen3_vl) are supported"
    for t in ("qwen3_vl_moe", "qwen3_vl_moe_text")
} | {
    t: f"{t} is Qwen3.5's mixture-of-experts line, which jstd does not serve (no MoE blocks); the dense Qwen3.5 "
       "checkpoints (model_type qwen3_5, and its text model qwen3_5_text) are supported"
    for t in ("qwen3_5_moe", "qwen3_5_moe_text")
}


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
