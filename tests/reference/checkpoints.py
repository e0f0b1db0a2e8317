"""Tiny random HuggingFace checkpoints, built locally from config classes (nothing is downloaded)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter O(1) values so that activations are neither tiny nor saturated.

    Matrices: normal with std 1/sqrt(fan_in); vectors named like norms: 1 + 0.1·normal;
    other vectors (biases): 0.1·normal; embeddings: normal.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.ndim >= 2:
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(noise * std)
            elif "norm" in name or "layernorm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def make_checkpoint(config, folder: str | Path, seed: int = 0,
                    adjust: Callable[[torch.nn.Module], None] | None = None) -> Path:
    """Build a random float32 model from a transformers config, ``randomize`` it, let ``adjust`` (if given) change
    its parameters in place, save it (safetensors) to ``folder``. Returns ``folder`` as a Path."""
    torch.manual_seed(seed)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def published_matches(raw: dict, folder: Path, hub_spelled: Callable[[str, str], str], rtol: float,
                      extra: dict | None = None):
    """A published config.json ``raw`` (cut to a few blocks) with random weights, saved in ``folder`` under the
    hub's tensor names (``hub_spelled(key, model_type)``; ``extra``: tensors the hub's files also hold), loads with
    every ``ConfigWarning`` an error and gives transformers' float32 logits within ``rtol``. Returns the jstd model.
    """
    import json
    import warnings

    import numpy as np
    from safetensors.numpy import save_file
    from transformers import AutoConfig

    import jstd
    from conftest import assert_close
    from jstd.io.hf import ConfigWarning
    from reference.cases import jit_run

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")})
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    tied = ref.config.tie_word_embeddings
    tensors = {hub_spelled(k, raw["model_type"]): v.numpy() for k, v in ref.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file({**tensors, **(extra or {})}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw))
    del tensors
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        model = jstd.load(folder)
    tokens = np.random.default_rng(0).integers(0, raw["vocab_size"], (2, 9))
    with torch.no_grad():
        want = ref(input_ids=torch.as_tensor(tokens)).logits.numpy()
    del ref
    assert_close(jit_run(model, tokens).logits, want, rtol, raw["model_type"])
    return model
