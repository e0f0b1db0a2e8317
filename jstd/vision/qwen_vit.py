"""The Qwen ViT vision encoder (Qwen2-VL, Qwen2.5-VL, HyperCLOVA X Vision V2, Qwen3-VL, Qwen3.5): every image of a
call packed in one row, attention once per image (or window), a 2-D rotary, and the patch merger.

    x      = pixel_values @ patch_embedding (+ bias)   # vision.patch_embeddings [1, patches, vision_hidden]
    x      = x + pos_embed resampled to each grid      # Qwen3-VL, Qwen3.5 only (bilinear, merge-block order)
    x      = x[window order]                           # Qwen2.5-VL only: merge blocks regrouped into windows
    h      = vision.layers(x)                          # attention within each image (frame), or each window
    out    = h                                         # vision.tower_output: the last block's stream
    merged = merger(h)                                 # norm, each 2 × 2 block concatenated, Linear-GELU-Linear
    taps   = [merger_k(h_k) for the DeepStack blocks]  # Qwen3-VL only: block k's stream through its own merger

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
- **Learned positions (Qwen3-VL, Qwen3.5).** A square table of ``side × side`` position embeddings is resampled to
  each image's ``h × w`` grid by bilinear interpolation with aligned corners (``position_taps``: four table rows and
  their float32 weights per patch, as transformers' ``get_vision_interpolation_indices_and_weights``) and added to
  the patch embeddings: ``vision.layers.0.layer_input`` is ``patch_embeddings`` plus the resampled table.
- **DeepStack (Qwen3-VL).** The outputs of the blocks in ``deepstack`` (the config's
  ``deepstack_visual_indexes``) each go through their own merger, whose norm comes after the 2 × 2 concatenation
  (``postshuffle``); the tower returns them in block order, one ``[tokens, hidden]`` array each, for the wrapper to
  add to the text model's stream.
"""

from __future__ import annotations

import functools
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from jstd.nn.namemap import Entry
from jstd.kernels import attention as attn_kernels
from jstd.kernels.rope import rotate_half
from jstd.kernels.rope_init import default_inv_freq
from jstd.kernels.rounding import rounded
from jstd.nn.params import param, shape
from jstd.nn.norms import LayerNorm, RMSNorm
from jstd.nn.stack import Stack
from jstd.vision.projector import MLPProjector

Grids = tuple[tuple[int, int, int], ...]
# the merger's module names: Qwen2-VL's line (ln_q, mlp.0, mlp.2) and Qwen3-VL's (norm, linear_fc1, linear_fc2)
QWEN2_MERGER_NAMES = {"norm": "ln_q", "fc1": "mlp.0", "fc2": "mlp.2"}
QWEN3_MERGER_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


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


@functools.lru_cache(maxsize=64)
def position_taps(grids: Grids, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """``(indices [patches, 4], weights [patches, 4] float32)``: the rows of a ``side × side`` position table
    (row-major) and their weights that resample it bilinearly, corners aligned, to each patch of ``grids``
    (merge-block order, frames repeated). Transformers' float32 steps: ``src = index · (side - 1) / (size - 1)``,
    taps ``floor(src)`` and ``floor(src) + 1`` clamped to the table, weights ``1 - |src - floor - offset|``, and
    the row weight times the column weight."""
    positions = merge_block_positions(grids, merge)
    sizes = np.concatenate([np.tile([[h, w]], (t * h * w, 1)) for t, h, w in grids])
    f32 = np.float32
    src = (positions.astype(f32) * f32(side - 1)).astype(f32) / np.maximum(sizes - 1, 1).astype(f32)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[..., None] + offsets, 0, side - 1)          # [patches, 2 axes, 2]
    weights = np.maximum(f32(1) - np.abs((src - floor)[..., None] - offsets.astype(f32)), f32(0)).astype(f32)
    indices = taps[:, 0, :, None] * side + taps[:, 1, None, :]
    weights = (weights[:, 0, :, None] * weights[:, 1, None, :]).astype(f32)
    return indices.reshape(-1, 4).astype(np.int32), weights.reshape(-1, 4)


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
        rotate = lambda y: (y.astype(jnp.float32) * cos + rotate_half(y.astype(jnp.float32)) * sin).astype(y.dtype)
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
    """transformers' ``PatchMerger``: a norm on each patch (``postshuffle``: on each concatenation instead, Qwen3-VL's
    DeepStack mergers), each ``merge²`` consecutive patches (a merge block) concatenated, then Linear, GELU
    (exact), Linear."""

    norm: LayerNorm | RMSNorm
    mlp: MLPProjector
    unit: int = eqx.field(static=True)
    postshuffle: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Float[Array, "patches vision_hidden"]) -> Float[Array, "tokens hidden"]:
        if self.postshuffle:
            return self.mlp(self.norm(x.reshape(-1, self.unit * x.shape[-1])))
        return self.mlp(self.norm(x).reshape(-1, self.unit * x.shape[-1]))

    def entries(self, names: dict = QWEN2_MERGER_NAMES) -> list[Entry]:
        """``names``: the checkpoint's ``norm``, ``fc1`` and ``fc2`` module names (``QWEN2_MERGER_NAMES``,
        ``QWEN3_MERGER_NAMES``)."""
        return ([e.under(names["norm"] + ".", "norm.") for e in self.norm.entries()]
                + [e.under("", "mlp.") for e in self.mlp.entries({"fc1": names["fc1"], "fc2": names["fc2"]})])

    @classmethod
    def skeleton(cls, width: int, out: int, merge: int, rms: bool, dtype, postshuffle: bool = False) -> "PatchMerger":
        unit = merge * merge
        normed = width * unit if postshuffle else width
        norm = RMSNorm.skeleton(normed, 1e-6, dtype) if rms else LayerNorm.skeleton(normed, 1e-6, dtype)
        mlp = MLPProjector.skeleton(width * unit, width * unit, "gelu", True, dtype)
        mlp = eqx.tree_at(lambda m: m.fc2, mlp, shape(width * unit, out, dtype=dtype))
        mlp = eqx.tree_at(lambda m: m.fc2_bias, mlp, shape(out, dtype=dtype))
        return cls(norm, mlp, unit, postshuffle)


# ---------------------------------------------------------------------------
# the tower
# ---------------------------------------------------------------------------


class QwenViT(eqx.Module):
    """Arrays: ``patch_embedding`` [channels·temporal·patch·patch, embed] (the Conv3d as a matmul) and its
    ``patch_bias`` (Qwen3-VL, Qwen3.5; else None), ``pos_embed`` [side², embed] (the learned position table of
    Qwen3-VL and Qwen3.5; else None), ``layers`` (a Stack, prefix ``vision.layers``), ``merger`` (HyperCLOVA X
    Vision V2 serves it as ``vision.merger``; None where the wrapper's projector is the merger),
    ``deepstack_mergers`` (one per entry of ``deepstack``; empty without DeepStack). Static: ``deepstack`` (the
    blocks whose outputs feed DeepStack, in the config's order: merger ``i`` reads block ``deepstack[i]``),
    ``inv_freq`` of the 2-D rotary, ``merge`` (spatial merge size), ``window`` (merge blocks per window side;
    None: no windows)."""

    patch_embedding: Float[Array, "patch_in embed"] = param("patch_in", "embed")
    patch_bias: Float[Array, "embed"] | None = param("embed")
    pos_embed: Float[Array, "positions embed"] | None = param("positions", "embed")
    layers: Stack
    merger: PatchMerger | None
    deepstack_mergers: tuple[PatchMerger, ...]
    deepstack: tuple[int, ...] = eqx.field(static=True)
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

    def positions(self, grids: Grids, dtype) -> Float[Array, "patches embed"]:
        """The position table resampled to every patch of ``grids`` (``position_taps``), summed in float32 and
        cast to ``dtype``, as transformers adds it."""
        side = int(self.pos_embed.shape[0] ** 0.5)  # transformers: int(num_position_embeddings ** 0.5)
        indices, weights = position_taps(grids, self.merge, side)
        rows = self.pos_embed[jnp.asarray(indices)].astype(jnp.float32)  # [patches, 4, embed]
        # each product rounded before the sum, and the sum before the add, as torch does (no fused multiply-adds)
        return rounded(rounded(rows * jnp.asarray(weights)[..., None]).sum(1).astype(dtype))

    def __call__(self, pixel_values: Float[Array, "patches patch_in"], tap, streams: tuple[int, ...] = (),
                 grids: Grids = ()):
        """``(out, deepstack, reads)``: ``out`` the merged tokens in the images' order ``[tokens, merged]`` with a
        merger, else the last block's stream ``[1, patches, vision_hidden]`` (in window order with windows);
        ``deepstack`` the DeepStack blocks' outputs through their mergers, in block order, each ``[tokens,
        merged]`` (empty without DeepStack). ``grids``: each image's (t, h, w), static."""
        if streams:
            raise ValueError("the Qwen ViT serves its last block's stream only")
        s = tap.scope("vision.")
        layout = self.packing(grids)
        dtype = self.patch_embedding.dtype
        x = pixel_values.astype(dtype) @ self.patch_embedding
        x = s("patch_embeddings", (x if self.patch_bias is None else x + self.patch_bias)[None])
        if self.pos_embed is not None:
            x = x + self.positions(grids, dtype)
        x = _take(x, layout.order, axis=1)
        cos_sin = self.rotary(layout.positions)
        segs = {"full": layout.full, "window": layout.window}
        args = {"self_attn": (cos_sin, segs)}
        # transformers taps the blocks in block order, each through the merger the config lists it with
        blocks = tuple(sorted(set(self.deepstack)))
        if blocks:
            h, reads, kept = self.layers(x, tap, args, keep=blocks)
        else:
            (h, reads), kept = self.layers(x, tap, args), []
        deepstack = [self.deepstack_mergers[self.deepstack.index(b)](stream[0]) for b, stream in zip(blocks, kept)]
        s("tower_output", h)  # the merger reads the stream before this value: an edit here changes nothing
        out = h
        if self.merger is not None:
            out = _take(s("merger.output", self.merger(h[0])), layout.restore, axis=0)
        return out, deepstack, {**s.records, **reads}

    def restore(self, merged: Float[Array, "tokens hidden"], grids: Grids) -> Float[Array, "tokens hidden"]:
        """Merged tokens from window order back to the images' raster order (the identity without windows)."""
        return _take(merged, self.packing(grids).restore, axis=0)

    def name_map(self, path: str, key: str, names: dict) -> list[Entry]:
        """The tower's entries under ``path`` in the model and ``key`` in the checkpoint (``blocks.{i}``);
        ``names``: the blocks' module names, and the mergers' under ``"merger"`` (default ``QWEN2_MERGER_NAMES``)."""
        conv = lambda w: w.reshape(w.shape[0], -1).T  # [embed, C, T, p, p] -> [C·T·p·p, embed]
        entries = [Entry(key + "patch_embed.proj.weight", path + ".patch_embedding", conv)]
        if self.patch_bias is not None:
            entries.append(Entry(key + "patch_embed.proj.bias", path + ".patch_bias"))
        if self.pos_embed is not None:
            entries.append(Entry(key + "pos_embed.weight", path + ".pos_embed"))
        merger = names.get("merger", QWEN2_MERGER_NAMES)
        if self.merger is not None:
            entries += [e.under(key + "merger.", path + ".merger.") for e in self.merger.entries(merger)]
        for i, m in enumerate(self.deepstack_mergers):
            entries += [e.under(f"{key}deepstack_merger_list.{i}.", f"{path}.deepstack_mergers.{i}.")
                        for e in m.entries(merger)]
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
    return tuple(float(v) for v in default_inv_freq(theta, head_dim // 2))

