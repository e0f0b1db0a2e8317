"""The text families, by the ``model_type`` they serve (``jstd.families`` adds the towers and wrappers)."""

from jstd.models.hyperclovax import HyperCLOVAX
from jstd.models.llama import Llama
from jstd.models.olmo_hybrid import OlmoHybrid
from jstd.models.qwen2 import Qwen2VLText
from jstd.models.qwen3_vl import Qwen3VLText
from jstd.models.qwen3_5 import Qwen3_5Text

TEXT_FAMILIES = {t: f for f in (Llama, HyperCLOVAX, OlmoHybrid, Qwen2VLText, Qwen3_5Text, Qwen3VLText)
                 for t in f.model_types}
