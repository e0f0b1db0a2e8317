"""The projectors of the wrappers: an MLP (Llava, VipLlava, LLaVA-NeXT, DeepSeek-VL; the Qwen ViT's merger ends in
one), one linear (HyperCLOVA X Vision V2) and the pixel shuffle with a bias-free linear (Idefics 3, SmolVLM). ``projector.input`` is what one is called with,
``projector.output`` what it returns; the wrapper taps both.

Their logical axes are their own: ``projector_in`` (the tower's width, split over ``data`` by FSDP) and
``projector_hidden`` (a linear's output columns, split over ``model`` by tensor parallelism); an MLP's second linear
reads ``projector_hidden`` rows and writes ``embed`` (Megatron's column then row split), so under ``FSDP_TP`` no
projector weight is gathered whole."""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Float

from jstd.nn.namemap import Entry, linear, present
from jstd.nn.params import param, shape
from jstd.kernels.activations import activation
from jstd.nn.norms import LayerNorm


class MLPProjector(eqx.Module):
    """fc2(act(fc1(norm(x)))): ``norm`` (VipLlava's ``projector_layernorm``) and the biases are None where a
    family has none."""

    norm: LayerNorm | None
    fc1: Float[Array, "projector_in hidden"] = param("projector_in", "projector_hidden")
    fc1_bias: Float[Array, "hidden"] | None = param("projector_hidden")
    fc2: Float[Array, "hidden hidden"] = param("projector_hidden", "embed")
    fc2_bias: Float[Array, "hidden"] | None = param("embed")
    act: str = eqx.field(static=True)

    def __call__(self, x: Float[Array, "images patches projector_in"]) -> Float[Array, "images patches hidden"]:
        if self.norm is not None:
            x = self.norm(x)
        y = activation(self.act)(x @ self.fc1 + (0 if self.fc1_bias is None else self.fc1_bias))
        return y @ self.fc2 + (0 if self.fc2_bias is None else self.fc2_bias)

    def entries(self, names: dict) -> list[Entry]:
        """``names``: the checkpoint's ``fc1``, ``fc2`` and (with a norm) ``norm`` module names."""
        entries = [Entry(f"{names['fc1']}.weight", "fc1", linear), Entry(f"{names['fc1']}.bias", "fc1_bias"),
                   Entry(f"{names['fc2']}.weight", "fc2", linear), Entry(f"{names['fc2']}.bias", "fc2_bias")]
        if self.norm is not None:
            entries += [e.under(names["norm"] + ".", "norm.") for e in self.norm.entries()]
        return present(self, entries)

    @classmethod
    def skeleton(cls, width_in: int, hidden: int, act: str, bias: bool, dtype, norm_eps: float | None = None):
        b = lambda: shape(hidden, dtype=dtype) if bias else None
        return cls(None if norm_eps is None else LayerNorm.skeleton(width_in, norm_eps, dtype),
                   shape(width_in, hidden, dtype=dtype), b(), shape(hidden, hidden, dtype=dtype), b(), act)


class LinearProjector(eqx.Module):
    """One biased linear (HyperCLOVA X Vision V2's projector)."""

    weight: Float[Array, "projector_in hidden"] = param("projector_in", "projector_hidden")
    bias: Float[Array, "hidden"] = param("projector_hidden")

    def __call__(self, x: Float[Array, "... projector_in"]) -> Float[Array, "... hidden"]:
        return x @ self.weight + self.bias

    def entries(self, names=None) -> list[Entry]:
        return [Entry("weight", "weight", linear), Entry("bias", "bias")]

    @classmethod
    def skeleton(cls, width_in: int, hidden: int, dtype):
        return cls(shape(width_in, hidden, dtype=dtype), shape(hidden, dtype=dtype))


class PixelShuffleProjector(eqx.Module):
    """Each ``scale`` × ``scale`` block of neighbouring patches folded into one token (their widths concatenated,
    as transformers' ``pixel_shuffle`` orders them), then a linear without bias."""

    proj: Float[Array, "shuffled hidden"] = param("projector_in", "projector_hidden")
    scale: int = eqx.field(static=True)

    def shuffle(self, x: Float[Array, "images patches width"]) -> Float[Array, "images tokens shuffled"]:
        n, seq, width = x.shape
        side, s = int(round(seq ** 0.5)), self.scale
        # [n, rows, cols/s, s·w] -> swap -> [n, cols/s, rows/s, s²·w] -> swap back: row blocks outer, column blocks inner
        x = x.reshape(n, side, side // s, width * s).transpose(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, width * s * s).transpose(0, 2, 1, 3)
        return x.reshape(n, seq // (s * s), width * s * s)

    def __call__(self, x: Float[Array, "images patches width"]) -> Float[Array, "images tokens hidden"]:
        return self.shuffle(x) @ self.proj

    def entries(self, names: dict) -> list[Entry]:
        return [Entry(f"{names['proj']}.weight", "proj", linear)]

    @classmethod
    def skeleton(cls, width: int, hidden: int, scale: int, dtype):
        return cls(shape(width * scale * scale, hidden, dtype=dtype), scale)
