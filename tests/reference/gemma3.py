"""The torch reference for Gemma 3's image-text model: the wrapper reference with Gemma 2's text plan (the MLP reads
``pre_feedforward_layernorm``'s output; the block adds the post-norms' outputs). The batch carries the processor's
``token_type_ids``, which is what turns on transformers' bidirectional image blocks."""

from __future__ import annotations

import torch

from reference.wrapper import WrapperReference

GEMMA3_PATHS = dict(tower="model.vision_tower", text="model.language_model", projector="model.multi_modal_projector")


class Gemma3Reference(WrapperReference):
    """``Gemma3ForConditionalGeneration`` from ``folder`` (eager attention) in ``dtype``."""

    def __init__(self, folder, dtype=torch.float32):
        from sliding_cases import GEMMA2_PLAN

        super().__init__(folder, dtype, GEMMA3_PATHS)
        text = self.paths["text"]
        self.plan = {**self.plan, **{site: (path.replace("model.", text + ".", 1) if path.startswith("model.") else path,
                                            *rest) for site, (path, *rest) in GEMMA2_PLAN.items()}}
