"""The text families, by the ``model_type`` they serve (``jstd.families`` adds the towers and wrappers)."""

from jstd.models.gemma import Gemma
from jstd.models.gpt2 import GPT2
from jstd.models.gpt_neox import GPTNeoX
from jstd.models.hyperclovax import HyperCLOVAX
from jstd.models.llama import Llama
from jstd.models.gemma2 import Gemma2
from jstd.models.gemma3 import Gemma3Text
from jstd.models.mistral import Mistral
from jstd.models.olmo3 import Olmo3
from jstd.models.qwen2 import Qwen2
from jstd.models.mixtral import Mixtral
from jstd.models.olmo2 import Olmo2
from jstd.models.olmo_hybrid import OlmoHybrid
from jstd.models.olmoe import Olmoe
from jstd.models.phi3 import Phi3
from jstd.models.qwen2 import Qwen2VLText
from jstd.models.qwen3 import Qwen3
from jstd.models.qwen3_vl import Qwen3VLText
from jstd.models.qwen3_5 import Qwen3_5Text
from jstd.models.qwen3_5_moe import Qwen3_5MoeText
from jstd.models.qwen3_moe import Qwen3Moe, Qwen3VLMoeText
from jstd.models.smollm3 import SmolLM3

TEXT_FAMILIES = {t: f for f in (Llama, HyperCLOVAX, OlmoHybrid, Qwen2VLText, Qwen3_5Text, Qwen3VLText,
                                     Gemma, Olmo2, Qwen3, Phi3, SmolLM3, GPT2, GPTNeoX,
                                     Mistral, Qwen2, Gemma2, Gemma3Text, Olmo3,
                                     Qwen3Moe, Qwen3VLMoeText, Olmoe, Mixtral, Qwen3_5MoeText)
                 for t in f.model_types}
