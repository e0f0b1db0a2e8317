"""Family declarations: how a family builds its model from a transformers config — the standard sizes, a
skeleton whose leaves are the parameters' shapes, the name map from checkpoint keys to it, the config keys it
handles. ``Family`` is what every declaration is (text, tower, wrapper); ``TextFamily`` the one every causal-LM
family fills in (``llama.py`` is the smallest); ``HybridTextFamily`` adds gated DeltaNet blocks."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp

from jstd.core.config import ModelConfig
from jstd.kernels.rope import Rotary
from jstd.kernels.rope_config import rotary_from_config
from jstd.nn.block import LLAMA_NAMES
from jstd.nn.causal_lm import CausalLM
from jstd.nn.model import Model
from jstd.nn.namemap import Entry, linear
from jstd.nn.norms import RMSNorm
from jstd.nn.params import shape
from jstd.nn.stack import Stack


class Family:
    """A family's declaration: the ``model_types`` it serves and how to build its model from a transformers
    config — the standard sizes, a ``skeleton`` whose leaves are the parameters' shapes, the ``name_map``
    from HuggingFace keys to that tree, and the checkpoint tensors it knowingly ``ignored``."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    # the config attributes the family reads or knowingly ignores; the loader reports any other whose value is not
    # transformers' default (``jstd.io.hf.unhandled``)
    handled: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        raise NotImplementedError

    @classmethod
    def skeleton(cls, hf, dtype) -> Model:
        """The model with ``jax.ShapeDtypeStruct`` leaves (the shapes the loader fills)."""
        raise NotImplementedError

    @classmethod
    def name_map(cls, hf):
        """The ``io.namemap.Entry`` list from HuggingFace keys to the skeleton."""
        raise NotImplementedError

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        """Patterns (fnmatch) of checkpoint tensors the family knowingly does not use."""
        return ()

    @classmethod
    def stored_prefixes(cls, hf) -> dict[str, tuple[str, ...]]:
        """Where the name map's module prefixes may be stored: prefix -> the spellings checkpoints use, most
        specific first (hub checkpoints and what transformers saves differ). The loader takes, for each prefix,
        the first spelling some stored tensor starts with; none by default (keys are stored as mapped)."""
        return {}


class TextFamily(Family):
    """The declaration of a causal-LM family: override ``block`` (and, where they differ, ``names``,
    ``layer_types``, ``rotary``, ``extra``, ``norm``, ``ignored``; ``model_class``: a ``CausalLM`` subclass)."""

    model_class: ClassVar[type] = CausalLM
    head_bias: ClassVar[bool] = False  # the head has a bias (GPT-J, Phi: CausalLM.lm_head_bias)
    # the checkpoint's top-level module names (``name_map``): the token embedding, the final norm (its ``entries``:
    # a weight, and a bias where it is a LayerNorm), the blocks (``{i}``: a block's index); ``block_names``: every
    # block's module names (``names``)
    embed_name: ClassVar[str] = "model.embed_tokens"
    final_norm_name: ClassVar[str] = "model.norm"
    blocks_name: ClassVar[str] = "model.layers.{i}"
    block_names: ClassVar[dict] = LLAMA_NAMES
    SLIDING = "sliding_attention"  # the block kind whose attention has config.sliding_window

    handled = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
                         "rope_parameters", "rope_theta", "partial_rotary_factor", "max_position_embeddings",
                         "original_max_position_embeddings"})

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        """The standard sizes from a transformers config with the usual attribute names."""
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return ModelConfig(
            model_type=hf.model_type, num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim, qk_head_dim=head_dim, vocab_size=hf.vocab_size,
            intermediate_size=hf.intermediate_size, layer_types=cls.layer_types(hf),
        )

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        """Each block's kind; every block is ``full_attention`` unless the family says otherwise."""
        return ("full_attention",) * hf.num_hidden_layers

    @classmethod
    def window(cls, hf, kind: str) -> int | None:
        """The sliding window of blocks of ``kind``: ``config.sliding_window`` on ``sliding_attention`` blocks,
        None (full attention) on every other kind. ValueError when the blocks have one that is not a positive
        int (a window of 0 or fewer keys would let every query see every key, later ones included)."""
        return cls.sliding_window(hf) if kind == cls.SLIDING else None

    @classmethod
    def sliding_window(cls, hf) -> int | None:
        """``config.sliding_window`` (None: none); ValueError unless it is None or a positive int."""
        window = getattr(hf, "sliding_window", None)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"{hf.model_type}: config.json's sliding_window={window!r} is not a window: its "
                             f"sliding_attention blocks need a positive number of keys; set sliding_window to the "
                             "window the checkpoint was trained with (or null, where the family allows it, for "
                             "full attention)")
        return window

    @classmethod
    def block(cls, hf, c: ModelConfig, kind: str, dtype):
        """The skeleton of one block of ``kind`` (a ``block.Block``)."""
        raise NotImplementedError

    @classmethod
    def names(cls, hf, kind: str) -> dict:
        """A block's HuggingFace module names (``Block.entries``): ``block_names`` for every kind."""
        return cls.block_names

    @classmethod
    def norm(cls, hf, c: ModelConfig, dtype) -> RMSNorm:
        """The final norm (and, by default, every block norm's shape)."""
        return RMSNorm.skeleton(c.hidden_size, hf.rms_norm_eps, dtype)

    @classmethod
    def rotary(cls, hf, c: ModelConfig) -> Rotary | None:
        return rotary_from_config(hf, c.head_dim)

    @classmethod
    def extra(cls, hf) -> dict:
        """CausalLM's static numbers that differ from their defaults (multipliers)."""
        return {}

    @classmethod
    def skeleton(cls, hf, dtype) -> CausalLM:
        c = cls.standard_config(hf)
        return cls.model_class(
            config=c, family=cls.family,
            embed=shape(c.vocab_size, c.hidden_size, dtype=dtype),
            layers=Stack.skeleton("layers", c.layer_types, lambda kind: cls.block(hf, c, kind, dtype)),
            final_norm=cls.norm(hf, c, dtype),
            lm_head=None if tied(hf) else shape(c.hidden_size, c.vocab_size, dtype=dtype),
            rotary=cls.rotary(hf, c),
            **({"lm_head_bias": shape(c.vocab_size, dtype=dtype)} if cls.head_bias else {}),
            **cls.extra(hf),
        )

    @classmethod
    def name_map(cls, hf, skeleton=None) -> list[Entry]:
        """The embedding, the final norm (none where the skeleton has none), the head (untied) and its bias
        (``head_bias``), and every block, under the top-level names ``embed_name``, ``final_norm_name`` and
        ``blocks_name``."""
        skeleton = skeleton if skeleton is not None else cls.skeleton(hf, jnp.float32)
        norm = skeleton.final_norm
        return [
            Entry(f"{cls.embed_name}.weight", "embed"),
            *([] if norm is None else [e.under(f"{cls.final_norm_name}.", "final_norm.") for e in norm.entries()]),
            *([] if skeleton.lm_head is None else [Entry("lm_head.weight", "lm_head", linear)]),
            *([Entry("lm_head.bias", "lm_head_bias")] if cls.head_bias else []),
            *skeleton.layers.name_map("layers", f"{cls.blocks_name}.", lambda kind: cls.names(hf, kind)),
        ]

    @classmethod
    def ignored(cls, hf) -> tuple[str, ...]:
        # rotary buffers are recomputed; a tied head stored anyway is the embedding itself
        return ("*rotary_emb.inv_freq",) + (("lm_head.weight",) if tied(hf) else ())


class HybridTextFamily(TextFamily):
    """A text family whose blocks are gated DeltaNet (``linear_attention``) or softmax attention
    (``full_attention``) blocks as ``config.layer_types`` says (OLMo-Hybrid, Qwen3.5)."""

    LINEAR, FULL = "linear_attention", "full_attention"
    handled = TextFamily.handled | {"layer_types", "linear_num_key_heads", "linear_num_value_heads",
                                    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"}

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        """``config.layer_types``; ValueError naming any kind but the two."""
        kinds = tuple(hf.layer_types)
        unknown = set(kinds) - {cls.LINEAR, cls.FULL}
        if unknown:
            raise ValueError(f"{cls.family} layer_types holds {sorted(unknown)}; supported: {cls.LINEAR}, {cls.FULL}")
        return kinds


def refuse_quantized(hf, family: str, stored: str, fix: str) -> None:
    """ValueError naming a quantised checkpoint (``quantization_config``; ``stored``: how its weights are stored)
    and the ``fix``; nothing for a floating-point one."""
    quantization = getattr(hf, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
            quantization, "quant_method", quantization)
        raise ValueError(f"{family}: the checkpoint is quantised (quantization_config quant_method={method!r}: "
                         f"{stored}); jstd loads floating-point weights: {fix}")


def tied(hf) -> bool:
    return bool(getattr(hf, "tie_word_embeddings", False))


def rotaries(hf, head_dim: int, kinds, main: str = "full_attention") -> tuple[Rotary | None, tuple]:
    """``(rotary, kind_rotary)`` for ``CausalLM`` where ``rope_parameters`` is nested by layer type (Gemma 3's
    local and global blocks, OLMo-3's sliding and full ones): the ``main`` kind's rotary, and ``(kind, rotary)`` for
    every other kind in ``kinds`` (each from its entry of the nested ``rope_parameters``)."""
    others = tuple((k, rotary_from_config(hf, head_dim, layer_type=k)) for k in dict.fromkeys(kinds) if k != main)
    return rotary_from_config(hf, head_dim, layer_type=main), others
