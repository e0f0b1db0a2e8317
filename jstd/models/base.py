"""What every family shares: the model protocol, parameter fields with logical axes."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int

from jstd.config import ModelConfig


def param(*axes: str):
    """A parameter field whose array carries logical axis names (for sharding rules).

    The names are the array's axes in order; blocks stacked for the scan get a
    leading ``layers`` axis (see ``logical_axes``).
    """
    return eqx.field(metadata={"axes": tuple(axes)})


def stacked():
    """A field holding blocks stacked on a leading ``layers`` axis."""
    return eqx.field(metadata={"stacked": True})


def logical_axes(module: eqx.Module):
    """A pytree shaped like ``module`` whose leaves are ``PartitionSpec``s of logical axis names.

    ``("layers", "embed", "heads", "head_dim")`` for a stacked query projection,
    and so on. A sharding rule maps these names to mesh axes, so families never
    change when sharding is added.
    """
    import dataclasses

    from jax.sharding import PartitionSpec

    def spec(path, leaf):
        node, prefix, axes = module, (), None
        for key in path:
            name = key.name
            field = {f.name: f for f in dataclasses.fields(node)}[name]
            if field.metadata.get("stacked"):
                prefix += ("layers",)
            axes = field.metadata.get("axes")
            node = getattr(node, name)
        if axes is None:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)} declares no logical axes")
        return PartitionSpec(*(prefix + axes))

    return jax.tree_util.tree_map_with_path(spec, module)


class Family(eqx.Module):
    """A loaded model. Subclasses are families: data (arrays) plus a forward.

    A family declares the ``model_types`` it serves, the ``sites`` it computes
    (with reasons for the standard sites it does not), a ``skeleton`` whose
    leaves are the parameters' shapes, a ``name_map`` from HuggingFace keys to
    that tree, and a ``forward`` that passes every standard value through taps.
    """

    config: ModelConfig = eqx.field(static=True)

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    sites: ClassVar[frozenset[str]]

    def forward(self, tokens: Int[Array, "batch seq"], tap, attention_mask, context=None):
        """``(logits, reads)``: logits ``[batch, seq, vocab]`` and the recorded base sites.

        ``context``: a ``jstd.Context`` the tokens continue (None: they start at position 0)."""
        raise NotImplementedError

    def project_on_vocab(self, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """Final norm, head and whatever follows the head: the logit lens (exact at the last block)."""
        return self.logits_from_norm(self.final_norm(hidden))

    def logits_from_norm(self, normed: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        """The logits from ``final_norm_output``: the head and whatever the family does after it."""
        raise NotImplementedError

    def layers_with(self, host: str) -> tuple[int, ...]:
        """The indices of the blocks that have ``host`` (``self_attn``, ``mlp``, ``linear_attn``)."""
        raise NotImplementedError

    def blocks_for(self, site: str) -> tuple[int, ...]:
        """The blocks that compute the block site ``site`` (its host's blocks), in order."""
        from jstd.sites import SITES

        host = SITES[site].host
        if host == "layers":
            return tuple(range(self.config.num_layers))
        return tuple(self.layers_with(host.split(".", 1)[1])) if host.startswith("layers.") else ()

    def unavailable(self, site: str) -> str:
        """Why this family does not serve ``site`` (nnterp's 'Unavailable')."""
        from jstd.sites import SITES

        host = SITES[site].host
        if SITES[site].family and SITES[site].family != self.family:
            return f"{site} is specific to the {SITES[site].family} family"
        if host.startswith("layers.") and not self.layers_with(host.split(".", 1)[1]):
            return f"{self.family} blocks have no {host.split('.', 1)[1]}"
        if host.split(".")[0] in ("vision", "projector"):
            return f"{self.family} is a text model: it has no vision tower or projector"
        return f"{self.family} does not compute {site}"

    @classmethod
    def standard_config(cls, hf) -> ModelConfig:
        """The standard sizes from a transformers config with the usual attribute names."""
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return ModelConfig(
            model_type=hf.model_type,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            qk_head_dim=head_dim,
            vocab_size=hf.vocab_size,
            intermediate_size=hf.intermediate_size,
            layer_types=cls.layer_types(hf),
        )

    @classmethod
    def layer_types(cls, hf) -> tuple[str, ...]:
        """Each block's kind; every block is ``full_attention`` unless the family says otherwise."""
        return ("full_attention",) * hf.num_hidden_layers

    @classmethod
    def skeleton(cls, hf, dtype) -> "Family":
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


def shape(*dims, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(dims), dtype)
