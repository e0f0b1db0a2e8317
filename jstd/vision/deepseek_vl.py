"""DeepSeek-VL (``deepseek_vl``): a SigLIP tower, the aligner on ``vision.tower_output``, a Llama text model.

The aligner (linear1, GELU, linear2) is the projector and reads the patches
after the tower's ``post_layernorm``: ``projector.input == vision.tower_output``,
so an edit to the last block reaches the text model through the norm. One
token per patch; ``vision.image_features`` is ``projector.output`` flattened
over the images. The head is tied to the embeddings unless the config says
otherwise.
"""

from __future__ import annotations

from jstd.nn.namemap import Entry
from jstd.vision.projector import MLPProjector
from jstd.vision.wrapper import VisionLanguageModel, WrapperFamily


class DeepseekVL(WrapperFamily):
    family = "deepseek_vl"
    model_types = ("deepseek_vl",)
    model_class = VisionLanguageModel
    keys = {"tower": "model.vision_model.", "text": "model.language_model.", "projector": "model.aligner."}

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        # the SigLIP model inside keeps its vision_model. on the hub; transformers 5 holds it without
        return {"model.vision_model.": ("model.vision_model.vision_model.", "vision_model.vision_model.",
                                        "model.vision_model.", "vision_model."),
                "model.language_model.": ("model.language_model.", "language_model.model."),
                "model.aligner.": ("model.aligner.", "aligner."),
                "lm_head.": ("lm_head.", "language_model.lm_head.")}

    @classmethod
    def projector(cls, hf, dtype) -> MLPProjector:
        return MLPProjector.skeleton(hf.vision_config.hidden_size, hf.text_config.hidden_size, "gelu", True, dtype)

    @classmethod
    def projector_entries(cls, hf, projector) -> list[Entry]:
        names = {"fc1": "linear1", "fc2": "linear2"}
        return [e.under(cls.keys["projector"], "projector.") for e in projector.entries(names)]
