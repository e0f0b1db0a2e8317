"""The one ``Block`` of every family and tower: a mixer and an MLP, with optional pre-norms, post-norms and a
residual multiplier; and ``LLAMA_NAMES``, the HuggingFace module names of Llama's block parts.

Every value a block computes passes a tap (``s(site, value)``) under its name
*relative to the block* (``self_attn.attention_queries``); the stack the block
runs in supplies the prefix (``layers.``, ``vision.layers.``). Each part owns
its fragment of the name map (``entries(names)``) and the block places the
fragments under the family's module names (``Entry.under``).
"""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Float

from jstd.core.tap import Taps
from jstd.kernels.rounding import rounded, times
from jstd.nn.mlp import MLP, GatedMLP
from jstd.nn.moe import MoEMLP
from jstd.nn.namemap import Entry
from jstd.nn.norms import LayerNorm, RMSNorm


RAW_OUTPUT = {"self_attn": "self_attn.attention_raw_output", "mlp": "mlp.mlp_raw_output"}
# the block's own modules, in the order of the names a family gives them (Block.entries)
BLOCK_PARTS = ("attention_norm", "attn", "attention_post_norm", "mlp_norm", "mlp", "mlp_post_norm")
LLAMA_NAMES = {"attention_norm": "input_layernorm", "attn": "self_attn", "mlp_norm": "post_attention_layernorm",
               "mlp": "mlp"}


class Block(eqx.Module):
    """Every family's block: a mixer and an MLP, each with an optional norm before it, an optional norm
    after it and the family's residual multiplier::

        h   = x + mult · attention_post_norm(attn(attention_norm(x)))
        out = h + mult · mlp_post_norm(mlp(mlp_norm(h)))

    Llama and the towers have the pre-norms only, OLMo's attention blocks the
    post-norms only, HyperCLOVA X both and a multiplier. ``attn`` is softmax
    attention or a DeltaNet mixer (its ``host``: ``self_attn``, ``linear_attn``).

    Values (relative names): ``layer_input``; ``attention_norm_normalized`` and
    ``attention_norm_output`` (with an input norm: its ``x / rms(x)`` before the
    weight, and its output; without, the mixer reads ``layer_input``); the mixer's values;
    ``{host}.attention_output`` (what the block adds: after the post-norm and
    multiplier); ``layer_mid``; ``mlp_norm_normalized`` and ``mlp_norm_output`` (with an MLP norm);
    ``mlp_input``; the MLP's values; ``mlp.mlp_output``; ``layer_output``. So
    ``layer_input + attention_output + mlp_output == layer_output`` exactly on
    every block: a post-normed or multiplied contribution is ``rounded`` before
    the add (without it XLA fuses the last multiply into the add, an FMA).
    ``raw_outputs`` serves the sublayers' own outputs before post-norm and
    multiplier (HyperCLOVA X's ``attention_raw_output`` / ``mlp_raw_output``).
    An edit at ``mlp_input`` reaches the MLP only; edit ``layer_mid`` to change
    the stream too.

    ``parallel`` (GPT-NeoX / Pythia's ``use_parallel_residual``): the attention
    and the MLP both read the block input, ``mlp_norm_output`` is the MLP's norm
    of ``layer_input``, and ``out = (mlp_output + attention_output) + x`` (torch's
    order); there is no stream between the two adds, so no ``layer_mid``
    (``unavailable`` says why) and an edit at ``attention_output`` does not reach
    the block's own MLP. A parallel block without an MLP norm (GPT-J, Phi: one
    LayerNorm for both) gives the MLP the attention norm's output
    (``mlp_input`` is ``attention_norm_output``, and an edit at
    ``attention_norm_output`` reaches both sublayers).

    ``norm_after_add`` (OPT-350M's ``do_layer_norm_before=False``: the original
    transformer's post-norm): the post-norms norm the *sums*, not the sublayers'
    outputs, and there are no pre-norms::

        mid = attention_post_norm(x + attn(x))              # layer_mid: the stream the MLP reads
        out = mlp_post_norm(mid + mlp(mid))                 # layer_output

    ``attention_output`` / ``mlp_output`` are the sublayers' outputs, what each
    adds before its norm, so ``layer_input + attention_output`` is the norm's
    input, not ``layer_mid``: the stream is not a sum of contributions here.
    """

    attention_norm: RMSNorm | LayerNorm | None
    attn: eqx.Module
    attention_post_norm: RMSNorm | None
    mlp_norm: RMSNorm | LayerNorm | None
    mlp: GatedMLP | MLP | MoEMLP
    mlp_post_norm: RMSNorm | None
    residual_multiplier: float = eqx.field(static=True, default=1.0)
    raw_outputs: bool = eqx.field(static=True, default=False)
    parallel: bool = eqx.field(static=True, default=False)
    norm_after_add: bool = eqx.field(static=True, default=False)

    def has(self, host: str) -> bool:
        """Whether the block has ``host`` (``self_attn``, ``linear_attn``, ``mlp``; ``""``: the block itself)."""
        return host in ("", "mlp", self.attn.host)

    def sites(self) -> frozenset[str]:
        """The values the block computes, by relative name."""
        host = self.attn.host
        rel = {"layer_input", "layer_mid", "mlp_input", "layer_output", f"{host}.attention_output", "mlp.mlp_output"}
        rel |= {"attention_norm_output", "attention_norm_normalized"} if self.attention_norm is not None else set()
        rel |= {"mlp_norm_output", "mlp_norm_normalized"} if self.mlp_norm is not None else set()
        rel |= {f"{host}.{x}" for x in self.attn.sites} | {f"mlp.{x}" for x in self.mlp.sites}
        rel |= {RAW_OUTPUT[host], RAW_OUTPUT["mlp"]} if self.raw_outputs else set()
        return frozenset(rel - {"layer_mid"} if self.parallel else rel)

    def unavailable(self, rel: str) -> str | None:
        """Why the block does not compute the relative site ``rel``, where its shape is the reason (None
        otherwise)."""
        if self.parallel and rel == "layer_mid":
            return ("blocks are parallel residual blocks (use_parallel_residual): attention and MLP both read "
                    "layer_input and layer_output = layer_input + attention_output + mlp_output, so no stream lies "
                    "between the two adds; read layer_input, or layer_input + attention_output yourself")
        return None

    def contribution(self, host: str, y, norm, s: Taps):
        """What the block adds from a sublayer's own output ``y``: post-norm, multiplier, rounded."""
        if self.raw_outputs:
            y = s(RAW_OUTPUT[host], y)
        if self.norm_after_add:
            norm = None  # the post-norm norms the sum (__call__)
        if norm is None and self.residual_multiplier == 1.0:
            return y  # Llama's block: the sublayer's output is what the block adds
        if norm is not None:
            y = norm(y)
        if self.residual_multiplier != 1.0:
            # the norm's output is rounded to the dtype before the multiplier, as in torch (XLA would otherwise
            # keep it in float32 through the fused multiply: excess precision)
            y = times(rounded(y) if norm is not None else y, self.residual_multiplier)
        return rounded(y)

    def __call__(self, h: Float[Array, "batch seq embed"], args, s: Taps, past=None) -> Float[Array, "batch seq embed"]:
        """One block over the stream ``h``; ``args``: what the mixer takes besides its input (``(cos_sin, mask)``)."""
        host = self.attn.host
        x = s("layer_input", h)
        normed = x if self.attention_norm is None else s("attention_norm_output",
                                                                  self.attention_norm(x, s, "attention_norm_normalized"))
        a = self.attn(normed, args, s, past)
        a = s(f"{host}.attention_output", self.contribution(host, a, self.attention_post_norm, s))
        after = self.attention_post_norm if self.norm_after_add else (lambda y: y)
        mid = x if self.parallel else s("layer_mid", after(x + a))  # parallel: the MLP reads the block input too
        if self.parallel and self.mlp_norm is None:  # one norm for both sublayers (GPT-J, Phi)
            m_in = normed
        else:
            m_in = mid if self.mlp_norm is None else s("mlp_norm_output", self.mlp_norm(mid, s, "mlp_norm_normalized"))
        m_in = s("mlp_input", m_in)
        m = s("mlp.mlp_output", self.contribution("mlp", self.mlp(m_in, s), self.mlp_post_norm, s))
        if self.norm_after_add:
            return s("layer_output", self.mlp_post_norm(mid + m))
        return s("layer_output", (m + a) + x if self.parallel else mid + m)

    def entries(self, names: dict) -> list[Entry]:
        """The block's name map: each part's fragment under the family's module name for it (``names``:
        part -> HuggingFace name, e.g. ``LLAMA_NAMES``; extra keys reach the parts, e.g. ``out``)."""
        entries = []
        for part in BLOCK_PARTS:
            module = getattr(self, part)
            if module is not None:
                if part not in names:
                    raise ValueError(f"the block has {part} but the family's names do not say where it is stored")
                prefix = names[part] + "." if names[part] else ""  # "": the part's tensors sit in the block (OPT's fc1)
                entries += [e.under(prefix, part + ".") for e in module.entries(names)]
        return entries
