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
