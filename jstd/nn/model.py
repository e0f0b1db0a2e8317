"""The loaded-model protocol: a composition of stacks of blocks and the parts around them."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jstd.core.checks import block_ranges, check_kind, checked, is_traced, span
from jstd.core.config import ModelConfig
from jstd.core.sites import SITES, SiteError


class Model(eqx.Module):
    """A loaded model: a composition of stacks (``stacks``: prefix -> ``Stack``) and the parts around them.

    ``family`` names the family that built it; ``model_sites`` are the sites it
    computes outside its stacks; ``sites`` adds every stack's block sites. The
    forward takes a ``jstd.Inputs`` and a tap and returns ``(logits or None,
    reads)``.
    """

    config: ModelConfig = eqx.field(static=True)
    family: str = eqx.field(static=True)
    # the HuggingFace layout the model was loaded from (``jstd.io.source.Source``: config.json and the stored
    # tensors' names and shapes), for ``jstd.export``; metadata that compares equal to any other (and to None), so
    # it never splits a tree structure; None on a model built without a checkpoint
    source: object = eqx.field(static=True, default=None, kw_only=True)

    model_sites: ClassVar[frozenset[str]] = frozenset()

    @property
    def stacks(self) -> dict:
        """The model's stacks of blocks by prefix (``{"layers": Stack}``)."""
        raise NotImplementedError

    @property
    def sites(self) -> frozenset[str]:
        """Every site the model serves."""
        return self.model_sites.union(*(stack.sites() for stack in self.stacks.values()))

    @property
    def decoder(self) -> "Model | None":
        """The text model that decodes tokens (``jstd.generate`` steps it over the cache after the prefill): a
        ``CausalLM``, the model itself or a wrapper's text model; None where there is none (a vision tower alone)."""
        return None

    @property
    def position_limit(self) -> int | None:
        """How many positions the decoder's learned position table holds (GPT-2's ``n_positions``): every token's
        position must lie in ``0 .. position_limit - 1`` (a lookup past the table would clamp to its last row).
        None: no table (a rotary's positions are unbounded)."""
        decoder = self.decoder
        return None if decoder is None or decoder is self else decoder.position_limit

    def forward(self, inputs, tap, context=None):
        """``(logits or None, reads)``: the recorded sites by whole name (block sites stacked as ``Stack`` says)."""
        raise NotImplementedError

    def check_inputs(self, inputs) -> None:
        """Raise ValueError where ``inputs`` (a ``jstd.Inputs``) do not fit the model (static checks)."""

    def depth(self, stack: str = "layers") -> int:
        """The number of blocks of ``stack``."""
        return self.stacks[stack].depth

    def blocks_for(self, site: str) -> tuple[int, ...]:
        """The blocks that compute the block site ``site`` (whole name, no index), in order (a dictionary's site,
        ``X.sae.latents``: the blocks that compute X)."""
        site = SITES[site].parent or site
        stack = self.stacks.get(SITES[site].stack)
        return () if stack is None else stack.blocks_for(site)

    def check_block(self, site: str, layer, who: str) -> Int[Array, ""] | int:
        """``layer`` (an int or a traced int) checked as a block computing the block site ``site``.

        Valid: ``-L..L-1`` for the site's stack of ``L`` blocks (negatives count
        from the end, as ``"layers.-1.X"``), naming a block that has the site's
        host (``blocks_for(site)``; all blocks but on hybrids). A concrete bad
        layer raises SiteError now (``who`` names the caller); a traced one an
        equinox runtime error when the compiled call runs (under ``jit`` and
        ``vmap``). Returns the layer (the check attached when traced).
        """
        spec = SITES[site]
        L = self.depth(spec.stack)
        blocks = tuple(self.blocks_for(site))
        check_kind(layer, f"{who}: layer", L, masks=False)
        if np.ndim(layer) != 0:
            raise SiteError(f"{who}: layer must be one block index (a scalar), got shape {np.shape(layer)}; "
                            f"vmap over an array of layers for a sweep")
        some = blocks != tuple(range(L))
        host = spec.host[len(spec.stack) + 1:]
        fix = (f"pass a block with {host}: {block_ranges(blocks)} (negatives count from the end: -{L}..-1)" if some
               else f"pass a block index in {span(L)}")

        def concrete(index, _):
            index = int(index)
            if not -L <= index < L:
                return f"{who}: layer={index}: block {index} does not exist ({spec.stack} has {L} blocks); {fix}"
            return f"{who}: layer={index} is block {index % L}, which has no {host}; {fix}"

        return checked(layer, lambda xp, i: (i < -L) | (i >= L) | ~xp.isin(xp.where(i < 0, i + L, i), xp.asarray(blocks)),
                       f"{who}: layer is out of range" + (f" or names a block without {host}" if some else "")
                       + f" ({spec.stack} has {L} blocks); {fix}", concrete=concrete, error=SiteError)

    def row_of(self, site: str, layer, who: str | None = None) -> Int[Array, ""] | int:
        """The row of block ``layer`` (an int or a traced int; negatives count from the end) in the value of
        ``"layers.X"`` for the block site ``site``, which is stacked over ``blocks_for(site)`` only: ``layer``
        itself where every block has the site's host, its place among the blocks that have it on hybrids.

        A concrete block that does not exist or lacks the host raises SiteError (``who`` prefixes the message); a
        traced one is not checked here (``check_block`` checks it).
        """
        blocks = self.blocks_for(site)
        L = self.depth(SITES[site].stack)
        if not is_traced(layer):
            index = int(layer)
            if not -L <= index < L or index % L not in blocks:
                raise SiteError(f"{who + ': ' if who else ''}block {index} does not exist or has no "
                                f"{SITES[site].host}; blocks with it: {block_ranges(blocks)}")
            return blocks.index(index % L)
        layer = jnp.where(layer < 0, layer + L, layer)
        return layer if blocks == tuple(range(L)) else jnp.searchsorted(jnp.asarray(blocks), layer)

    def layers_with(self, host: str, stack: str = "layers") -> tuple[int, ...]:
        """The indices of ``stack``'s blocks that have ``host`` (``self_attn``, ``mlp``, ``linear_attn``)."""
        return self.stacks[stack].layers_with(host) if stack in self.stacks else ()

    def unavailable(self, site: str) -> str:
        """Why this model does not serve ``site`` (nnterp's 'Unavailable')."""
        spec = SITES[site]
        if spec.family and spec.family != self.family:
            return f"{site} is specific to the {spec.family} family"
        if spec.stack is not None and spec.stack not in self.stacks:
            what = "vision tower" if spec.stack.startswith("vision") else "text model"
            return f"this {self.family} model has no {what} (no {spec.stack} stack)"
        if spec.stack is not None and spec.host != spec.stack:
            host = spec.host[len(spec.stack) + 1:]
            if not self.layers_with(host, spec.stack):
                return f"{self.family} blocks have no {host}"
        if spec.stack in self.stacks:  # a block whose shape is the reason (a parallel residual's layer_mid)
            for slot in getattr(self.stacks[spec.stack], "slots", ()):
                why = getattr(slot, "unavailable", lambda rel: None)(spec.relative)
                if why:
                    return f"{self.family} {why}"
        root = site.split(".")[0]
        if root in ("vision", "projector") and "vision.layers" not in self.stacks:
            return f"{self.family} is a text model: it has no vision tower or projector"
        if root not in ("vision", "projector") and "layers" not in self.stacks:
            return f"a {self.family} model is a vision tower alone: it has no text model (read vision.* values)"
        return f"{self.family} does not compute {site}"

    def project_on_vocab(self, hidden: Float[Array, "... hidden"]) -> Float[Array, "... vocab"]:
        raise NotImplementedError(f"a {self.family} model has no head to project on")

    def readout(self):
        """``(final_norm, logits_from_norm)`` for direct logit attribution; raises where there is no head."""
        raise NotImplementedError(f"direct logit attribution needs a final norm and a head; a {self.family} "
                                  "model has none")
