"""The mixture-of-experts Qwen wrappers: Qwen3-VL-MoE (``qwen3_vl_moe``: Qwen3-VL's tower and DeepStack with the
``qwen3_vl_moe_text`` model, ``jstd.models.qwen3_moe``) and Qwen3.5-MoE (``qwen3_5_moe``: Qwen3.5's tower with the
``qwen3_5_moe_text`` hybrid, ``jstd.models.qwen3_5_moe``). Everything but the text model's MLPs is the dense
wrappers' (``jstd.vision.qwen3_vl``); the text family comes from ``text_config.model_type``."""

from __future__ import annotations

from jstd.vision.qwen3_vl import Qwen3_5VL, Qwen3VL


class Qwen3VLMoe(Qwen3VL):
    family = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)


class Qwen3_5MoeVL(Qwen3_5VL):
    family = "qwen3_5_moe"
    model_types = ("qwen3_5_moe",)
