"""The text families: one declaration a file (``llama.py`` … ``qwen3_5_moe.py``) over the layers of ``jstd.nn``,
what a declaration is in ``family.py``, and ``TEXT_FAMILIES`` by the ``model_type`` they serve (``jstd.families``
adds the towers and wrappers).

The layers lived here until they moved to ``jstd.nn``: their old module names (``jstd.models.attention``,
``jstd.models.base``, …) still import, as the modules they moved to (``MOVED_MODULES``)."""

import importlib
import sys
import types

from jstd.models.gemma import Gemma
from jstd.models.gpt2 import GPT2
from jstd.models.gpt_neo import GPTNeo
from jstd.models.gptj import GPTJ
from jstd.models.phi import Phi
from jstd.models.opt import OPT
from jstd.models.bloom import Bloom
from jstd.models.gpt_neox import GPTNeoX
from jstd.models.gpt_oss import GptOss
from jstd.models.hyperclovax import HyperCLOVAX
from jstd.models.llama import Llama
from jstd.models.llama4 import Llama4Text
from jstd.models.gemma2 import Gemma2
from jstd.models.gemma3 import Gemma3Text
from jstd.models.mistral import Mistral
from jstd.models.olmo3 import Olmo3
from jstd.models.qwen2 import Qwen2
from jstd.models.mixtral import Mixtral
from jstd.models.olmo2 import Olmo2
from jstd.models.olmo_hybrid import OlmoHybrid
from jstd.models.olmoe import Olmoe
from jstd.models.phimoe import Phimoe
from jstd.models.phi3 import Phi3
from jstd.models.qwen2 import Qwen2VLText
from jstd.models.qwen2_moe import Qwen2Moe
from jstd.models.deepseek_v2 import DeepseekV2, DeepseekV3
from jstd.models.qwen3 import Qwen3
from jstd.models.qwen3_vl import Qwen3VLText
from jstd.models.qwen3_5 import Qwen3_5Text
from jstd.models.qwen3_5_moe import Qwen3_5MoeText
from jstd.models.qwen3_moe import Qwen3Moe, Qwen3VLMoeText
from jstd.models.smollm3 import SmolLM3

TEXT_FAMILIES = {t: f for f in (Llama, HyperCLOVAX, OlmoHybrid, Qwen2VLText, Qwen3_5Text, Qwen3VLText,
                                     Gemma, Olmo2, Qwen3, Phi3, SmolLM3, GPT2, GPTNeoX, GPTNeo, GPTJ, Phi, OPT, Bloom,
                                     Mistral, Qwen2, Gemma2, Gemma3Text, Olmo3,
                                     Qwen3Moe, Qwen3VLMoeText, Olmoe, Mixtral, Qwen3_5MoeText, GptOss, Qwen2Moe,
                                     Phimoe, Llama4Text, DeepseekV2, DeepseekV3)
                 for t in f.model_types}

# module -> the module(s) its names moved to; a module split in several is served as one module holding their names
MOVED_MODULES = {
    **{f"jstd.models.{m}": (f"jstd.nn.{m}",) for m in ("attention", "gated_attention", "deltanet", "moe", "mlp",
                                                       "norms", "block", "stack", "namemap")},
    "jstd.models.base": ("jstd.nn.params", "jstd.nn.model", "jstd.models.family"),
    "jstd.models.causal_lm": ("jstd.nn.causal_lm", "jstd.nn.attention_inputs", "jstd.models.family"),
    "jstd.models.layer_rotary": ("jstd.models.family",),
}


def _serve_moved(old: str, new: tuple[str, ...]) -> None:
    modules = [importlib.import_module(m) for m in new]
    if len(modules) == 1:
        module = modules[0]
    else:
        module = types.ModuleType(old, f"Moved to {', '.join(new)}; their names, served under the old one.")
        for m in modules:
            module.__dict__.update({k: v for k, v in vars(m).items() if not k.startswith("__")})
    sys.modules[old] = module
    setattr(sys.modules[__name__], old.rpartition(".")[2], module)


for _old, _new in MOVED_MODULES.items():
    _serve_moved(_old, _new)
