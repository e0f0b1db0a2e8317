"""The Qwen ViT vision encoder (Qwen2-VL, Qwen2.5-VL, HyperCLOVA X Vision V2): every image of a call packed in one
row, attention once per image (or window), a 2-D rotary, and the patch merger.

    x      = pixel_values @ patch_embedding            # vision.patch_embeddings [1, patches, vision_hidden]
    x      = x[window order]                           # Qwen2.5-VL only: merge blocks regrouped into windows
    h      = vision.layers(x)                          # attention within each image (frame), or each window
    out    = h                                         # vision.tower_output: the last block's stream
    merged = merger(h)                                 # ln_q, each 2 × 2 block concatenated, Linear-GELU-Linear

The processor cuts image k into its own ``t × h × w`` grid of patches (``image_grid_thw``), rows of
``channels · temporal_patch_size · patch · patch`` pixels, patches in *merge-block order* (the 2 × 2 block the
merger folds into one image token is four consecutive rows). The grids are static (``Inputs.layout``), so every
index below is a numpy constant and the computation jits with static shapes:

- **Packed attention with static shapes.** The row is cut into segments (an image's frame; on Qwen2.5-VL's
  windowed blocks, a window of ``window_size`` pixels): each segment attends within itself. The segments are
  gathered into ``[segments, longest, …]`` (a reshape when they are equal and contiguous), attended with their
  padding keys masked, and put back. Memory is per segment: no ``[patches, patches]`` mask or score matrix.
- **Values.** ``self_attn.attention_queries``/``keys`` (after the rotary) and ``attention_values`` are served
  whole ``[1, heads, patches, head_dim]``; ``attention_head_outputs`` / ``attention_premix`` ``[1, patches, heads,
  head_dim]``. There is no one pattern per block, so ``attention_scores`` / ``attention_probabilities`` are not
  served: a pattern per image is a softmax over each segment's slice of queries and keys.
- **The 2-D rotary.** Each patch turns with its row (first half of the frequencies) and column (second half),
  ``head_dim / 4`` frequencies each; computed and applied in float32, the result cast back, as transformers does.
- **Windows (Qwen2.5-VL).** At entry the merge blocks are permuted into windows (raster order of windows, raster
  order inside each), so every block value and ``vision.tower_output`` are in window order; blocks in
  ``fullatt_block_indexes`` attend over whole images, the others within windows. The merged tokens are put back
  into the images' raster order after the merger (``restore``).
"""

from __future__ import annotations

import functools
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jstd.io.namemap import Entry
from jstd.kernels import attention as attn_kernels
from jstd.kernels.rope import _default_inv_freq, _rotate_half
from jstd.models.base import param, shape
from jstd.models.layers import LayerNorm, RMSNorm
from jstd.models.stack import Stack
from jstd.vision.projector import MLPProjector

Grids = tuple[tuple[int, int, int], ...]


# ---------------------------------------------------------------------------
# the static layout of a packed row (numpy, from the grids)
# ---------------------------------------------------------------------------


class Segments(NamedTuple):
    """Contiguous segments of the packed row, as a static gather: ``index`` [segments, longest] (row positions;
    padding slots point at 0), ``valid`` [segments, longest], ``slot`` [patches] (each patch's flat slot). ``index``
    is None when every segment has the same length and they tile the row in order (a reshape does)."""

    count: int
    longest: int
    index: np.ndarray | None
    valid: np.ndarray | None
    slot: np.ndarray | None


def segments(lengths: tuple[int, ...]) -> Segments:
    lengths = tuple(int(n) for n in lengths if n > 0)
    longest = max(lengths)
    if all(n == longest for n in lengths):
        return Segments(len(lengths), longest, None, None, None)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    offsets = np.arange(longest)
    valid = offsets[None, :] < np.asarray(lengths)[:, None]
    index = np.where(valid, starts[:, None] + offsets[None, :], 0).astype(np.int32)
    slot = np.concatenate([g * longest + np.arange(n) for g, n in enumerate(lengths)]).astype(np.int32)
    return Segments(len(lengths), longest, index, valid, slot)


class Packing(NamedTuple):
    """What the grids fix: each patch's (row, column) in its image (merge-block order), the row's order into
    windows (``order``: position -> patch, None without windows), the merged tokens' way back (``restore``), and
    the segments of the full-attention and windowed blocks."""

    positions: np.ndarray
    order: np.ndarray | None
    restore: np.ndarray | None
    full: Segments
    window: Segments | None


def merge_block_positions(grids: Grids, merge: int) -> np.ndarray:
    """``[patches, 2]``: each patch's row and column in its image, patches in merge-block order, frames repeated."""
    rows = []
    for t, h, w in grids:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = lambda a: a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
        rows.append(np.tile(np.stack([blocks(hh), blocks(ww)], axis=-1), (t, 1)))
    return np.concatenate(rows)


def window_index(grids: Grids, merge: int, side: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """``(order of the merge blocks into windows, each window's patch count)``: windows of ``side`` merge blocks
    per side in raster order per frame, raster order inside each, empty windows dropped (transformers'
    ``get_vision_window_index``)."""
    order, lengths, offset = [], [], 0
    for t, h, w in grids:
        hh, ww = h // merge, w // merge
        index = np.arange(t * hh * ww).reshape(t, hh, ww)
        ph, pw = -hh % side, -ww % side
        padded = np.pad(index, ((0, 0), (0, ph), (0, pw)), constant_values=-1)
        nh, nw = (hh + ph) // side, (ww + pw) // side
        windows = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
        for window in windows:
            kept = window[window >= 0]
            if len(kept):
                order.append(kept + offset)
                lengths.append(len(kept) * merge * merge)
        offset += t * hh * ww
    return np.concatenate(order), tuple(lengths)


@functools.lru_cache(maxsize=64)
def packing(grids: Grids, merge: int, window: int | None) -> Packing:
    """The ``Packing`` of images with ``grids`` (t, h, w in patches); ``window``: merge blocks per window side
    (None: no windows)."""
    for t, h, w in grids:
        if h % merge or w % merge or min(t, h, w) < 1:
            raise ValueError(f"image_grid_thw row {(t, h, w)}: the grid's height and width must be positive "
                             f"multiples of spatial_merge_size {merge} (as the image processor makes them)")
    positions = merge_block_positions(grids, merge)
    full = segments(tuple(h * w for t, h, w in grids for _ in range(t)))
    if window is None:
        return Packing(positions, None, None, full, None)
    blocks, lengths = window_index(grids, merge, window)
    unit = merge * merge
    order = (blocks[:, None] * unit + np.arange(unit)).reshape(-1)
    return Packing(positions[order], order, np.argsort(blocks), full, segments(lengths))


def _take(x, index, axis):
    return x if index is None else jnp.take(x, jnp.asarray(index), axis=axis)


# ---------------------------------------------------------------------------
# the layers
# ---------------------------------------------------------------------------


class PackedAttention(eqx.Module):
    """Attention of a packed row within its segments; one fused qkv projection (transformers' ``attn.qkv``) and
    ``attn.proj``, both biased. ``windowed``: this block attends within windows (else within images)."""

    qkv: Float[Array, "embed three heads head_dim"] = param("embed", "qkv", "heads", "head_dim")
    qkv_bias: Float[Array, "three heads head_dim"] = param("qkv", "heads", "head_dim")
    o: Float[Array, "heads head_dim embed"] = param("heads", "head_dim", "embed")
    o_bias: Float[Array, "embed"] = param("embed")
    scale: float = eqx.field(static=True)
    windowed: bool = eqx.field(static=True, default=False)

    host: ClassVar[str] = "self_attn"
    sites: ClassVar[tuple[str, ...]] = (
        "attention_queries", "attention_keys", "attention_values", "attention_head_outputs", "attention_premix",
    )

    def __call__(self, x: Float[Array, "1 patches embed"], args, s, past=None) -> Float[Array, "1 patches embed"]:
        (cos, sin), layout = args
        qkv = jnp.einsum("bte,ekhd->kbhtd", x, self.qkv) + self.qkv_bias[:, None, :, None, :]
        rotate = lambda y: (y.astype(jnp.float32) * cos + _rotate_half(y.astype(jnp.float32)) * sin).astype(y.dtype)
        q = s("self_attn.attention_queries", rotate(qkv[0]))
        k = s("self_attn.attention_keys", rotate(qkv[1]))
        v = s("self_attn.attention_values", qkv[2])
        heads = segment_attention(q, k, v, self.scale, layout["window" if self.windowed else "full"])
        heads = s("self_attn.attention_head_outputs", heads)
        heads = s("self_attn.attention_premix", heads)
        return jnp.einsum("bthd,hde->bte", heads, self.o) + self.o_bias

    def entries(self, names=None) -> list[Entry]:
        three, heads = self.qkv.shape[-3], self.qkv.shape[-2]
        return [
            Entry("qkv.weight", "qkv", lambda w: w.reshape(three, heads, -1, w.shape[-1]).transpose(3, 0, 1, 2)),
            Entry("qkv.bias", "qkv_bias", lambda b: b.reshape(three, heads, -1)),
            Entry("proj.weight", "o", lambda w: w.reshape(w.shape[0], heads, -1).transpose(1, 2, 0)),
            Entry("proj.bias", "o_bias"),
        ]

    @classmethod
    def skeleton(cls, embed: int, heads: int, windowed: bool, dtype) -> "PackedAttention":
        d = embed // heads
        return cls(shape(embed, 3, heads, d, dtype=dtype), shape(3, heads, d, dtype=dtype),
                   shape(heads, d, embed, dtype=dtype), shape(embed, dtype=dtype), d ** -0.5, windowed)


def segment_attention(q: Float[Array, "1 heads patches dim"], k, v, scale: float, seg: Segments
                      ) -> Float[Array, "1 patches heads dim"]:
    """Softmax attention of each segment of the row over itself (no mask across segments, none inside)."""
    def grouped(x):  # [1, heads, patches, dim] -> [segments, heads, longest, dim]
        x = _take(x[0], None if seg.index is None else seg.index.reshape(-1), axis=1)
        return x.reshape(x.shape[0], seg.count, seg.longest, x.shape[-1]).transpose(1, 0, 2, 3)

    mask = None if seg.valid is None else jnp.asarray(seg.valid)[:, None, None, :]
    out = attn_kernels.fused(grouped(q), grouped(k), grouped(v), scale, mask)  # [segments, longest, heads, dim]
    out = out.reshape(seg.count * seg.longest, *out.shape[2:])
    return _take(out, seg.slot, axis=0)[None]


class PatchMerger(eqx.Module):
    """transformers' ``PatchMerger``: ``ln_q`` on each patch, each ``merge²`` consecutive patches (a merge block)
    concatenated, then Linear, GELU, Linear (``mlp.0``, ``mlp.2``)."""

    norm: LayerNorm | RMSNorm
    mlp: MLPProjector
    unit: int = eqx.field(static=True)

    def __call__(self, x: Float[Array, "patches vision_hidden"]) -> Float[Array, "tokens hidden"]:
        return self.mlp(self.norm(x).reshape(-1, self.unit * x.shape[-1]))

    def entries(self) -> list[Entry]:
        return ([e.under("ln_q.", "norm.") for e in self.norm.entries()]
                + [e.under("", "mlp.") for e in self.mlp.entries({"fc1": "mlp.0", "fc2": "mlp.2"})])

    @classmethod
    def skeleton(cls, width: int, out: int, merge: int, rms: bool, dtype) -> "PatchMerger":
        unit = merge * merge
        norm = RMSNorm.skeleton(width, 1e-6, dtype) if rms else LayerNorm.skeleton(width, 1e-6, dtype)
        mlp = MLPProjector.skeleton(width * unit, width * unit, "gelu", True, dtype)
        mlp = eqx.tree_at(lambda m: m.fc2, mlp, shape(width * unit, out, dtype=dtype))
        mlp = eqx.tree_at(lambda m: m.fc2_bias, mlp, shape(out, dtype=dtype))
        return cls(norm, mlp, unit)


# ---------------------------------------------------------------------------
# the tower
# ---------------------------------------------------------------------------


class QwenViT(eqx.Module):
    """Arrays: ``patch_embedding`` [channels·temporal·patch·patch, embed] (the Conv3d as a matmul), ``layers`` (a
    Stack, prefix ``vision.layers``), ``merger`` (HyperCLOVA X Vision V2 serves it as ``vision.merger``; None
    where the wrapper's projector is the merger). Static: ``inv_freq`` of the 2-D rotary, ``merge`` (spatial
    merge size), ``window`` (merge blocks per window side; None: no windows)."""

    patch_embedding: Float[Array, "patch_in embed"] = param("patch_in", "embed")
    layers: Stack
    merger: PatchMerger | None
    inv_freq: tuple[float, ...] = eqx.field(static=True)
    merge: int = eqx.field(static=True)
    window: int | None = eqx.field(static=True, default=None)

    sites: ClassVar[frozenset[str]] = frozenset({"vision.patch_embeddings", "vision.tower_output"})

    def packing(self, grids: Grids) -> Packing:
        return packing(grids, self.merge, self.window)

    def rotary(self, positions: np.ndarray):
        """cos and sin ``[patches, head_dim]`` (float32) of the 2-D rotary at each patch's (row, column)."""
        inv = jnp.asarray(np.asarray(self.inv_freq, np.float32))
        freqs = jnp.asarray(positions, jnp.float32)[..., None] * inv  # [patches, 2, head_dim / 4]
        freqs = freqs.reshape(freqs.shape[0], -1)
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb), jnp.sin(emb)

    def __call__(self, pixel_values: Float[Array, "patches patch_in"], tap, streams: tuple[int, ...] = (),
                 grids: Grids = ()):
        """``(out, [], reads)``: ``out`` the merged tokens in the images' order ``[tokens, merged]`` with a merger,
        else the last block's stream ``[1, patches, vision_hidden]`` (in window order with windows). ``grids``:
        each image's (t, h, w), static."""
        if streams:
            raise ValueError("the Qwen ViT serves its last block's stream only")
        s = tap.scope("vision.")
        layout = self.packing(grids)
        dtype = self.patch_embedding.dtype
        x = s("patch_embeddings", (pixel_values.astype(dtype) @ self.patch_embedding)[None])
        x = _take(x, layout.order, axis=1)
        cos_sin = self.rotary(layout.positions)
        segs = {"full": layout.full, "window": layout.window}
        h, reads = self.layers(x, tap, {"self_attn": (cos_sin, segs)})
        s("tower_output", h)  # the merger reads the stream before this value: an edit here changes nothing
        out = h
        if self.merger is not None:
            out = _take(s("merger.output", self.merger(h[0])), layout.restore, axis=0)
        return out, [], {**s.records, **reads}

    def restore(self, merged: Float[Array, "tokens hidden"], grids: Grids) -> Float[Array, "tokens hidden"]:
        """Merged tokens from window order back to the images' raster order (the identity without windows)."""
        return _take(merged, self.packing(grids).restore, axis=0)

    def name_map(self, path: str, key: str, names: dict) -> list[Entry]:
        """The tower's entries under ``path`` in the model and ``key`` in the checkpoint (``blocks.{i}``)."""
        conv = lambda w: w.reshape(w.shape[0], -1).T  # [embed, C, T, p, p] -> [C·T·p·p, embed]
        entries = [Entry(key + "patch_embed.proj.weight", path + ".patch_embedding", conv)]
        if self.merger is not None:
            entries += [e.under(key + "merger.", path + ".merger.") for e in self.merger.entries()]
        return entries + self.layers.name_map(f"{path}.layers", f"{key}blocks.{{i}}.", lambda kind: names)


def check_grids(pixels, grids: Grids, unit: int, what: str) -> None:
    """Raise ValueError unless ``pixels`` is ``[sum of t·h·w, unit]`` floating point for ``grids``."""
    want = sum(t * h * w for t, h, w in grids)
    if np.ndim(pixels) != 2 or tuple(np.shape(pixels)) != (want, unit):
        raise ValueError(f"pixel_values has shape {tuple(np.shape(pixels))}; for image_grid_thw {list(grids)} "
                         f"{what} takes [{want}, {unit}] (every image's patches in one row, as its image processor "
                         "makes them)")
    dtype = pixels.dtype if hasattr(pixels, "dtype") else np.asarray(pixels).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"pixel_values must be floating point (the processor's normalized pixels), got {dtype}")


def vision_inv_freq(hf, head_dim: int) -> tuple[float, ...]:
    """The 2-D rotary's frequencies: the default rope over ``head_dim / 2`` (rows and columns share them)."""
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "axial")
    if rope_type != "axial":
        raise ValueError(f"the Qwen ViT's rotary is axial; this vision config has rope_type {rope_type!r}")
    theta = params.get("rope_theta", 10000.0)
    return tuple(float(v) for v in _default_inv_freq(theta, head_dim // 2))

