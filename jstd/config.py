"""The standard sizes every model carries as ``model.config``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Standard sizes of a loaded model (hashable: it is static pytree data).

    layer_types: one entry per block, the block's kind (``"full_attention"`` on
    every Llama block); hybrids mix kinds.
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_head_dim: int
    vocab_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]

    def __str__(self):
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self) if f.name != "layer_types")
