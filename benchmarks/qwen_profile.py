"""Where the Qwen2.5-VL tower's time goes (``python benchmarks/vision.py --parts qwen-tower --profile``): the
overhead of reading every block's layer_output, and one piece of each kind (patch embedding, a windowed block, a
full-attention block, each block's attention alone, the merger) timed alone against torch's. Prints markdown."""

from __future__ import annotations

import numpy as np
from common import time_interleaved
from qwen_tower import QWEN_MERGED, QWEN_TOWER


def torch_pieces(ref, x, thw) -> dict:
    """A callable per piece of the torch tower ``ref``, by name, each running the piece on the arguments ``ref``'s
    own forward on ``(x, thw)`` passes it (captured by hooks)."""
    import torch

    captured = {}

    def grab(name):
        def hook(module, a, kw):
            captured[name] = (module, a, kw)
        return hook

    full = QWEN_TOWER["fullatt_block_indexes"][0]
    modules = {"patch embedding": ref.patch_embed, "windowed block": ref.blocks[0],
               "full-attention block": ref.blocks[full], "windowed attention": ref.blocks[0].attn,
               "full attention": ref.blocks[full].attn, "merger": ref.merger}
    hooks = [m.register_forward_pre_hook(grab(name), with_kwargs=True) for name, m in modules.items()]
    with torch.inference_mode():
        ref(x, grid_thw=thw)
    for h in hooks:
        h.remove()

    def torch_piece(name):
        module, a, kw = captured[name]

        def piece():
            with torch.inference_mode():
                return module(*a, **kw)
        return piece

    return {name: torch_piece(name) for name in modules}


def jstd_pieces(model, inputs, x) -> dict:
    """The same pieces of jstd's tower (``torch_pieces``' names), each a blocked jit call on a random stream (the
    patch embedding on the pixels ``x``)."""
    import jax

    from jstd.core.tap import Tap
    from jstd.vision.qwen_vit import packing

    full = QWEN_TOWER["fullatt_block_indexes"][0]
    v = model.vision
    layout = packing(tuple(map(tuple, inputs.static("image_grid_thw"))), v.merge, v.window)
    args = (v.rotary(layout.positions), {"full": layout.full, "window": layout.window})
    s = Tap(frozenset(), (), {}, {}).scope()
    block = lambda i: jax.tree.map(lambda a: a[i // v.layers.period], v.layers.slots[i % v.layers.period])
    windowed, full_block = block(0), block(full)
    h = jax.numpy.asarray(np.random.default_rng(1).standard_normal((1, x.shape[0], v.patch_embedding.shape[1]),
                                                                   dtype=np.float32))
    pixels = jax.numpy.asarray(x.numpy())
    ready = lambda f, *a: (lambda g: lambda: jax.block_until_ready(g(*a)))(jax.jit(f))
    return {
        "patch embedding": ready(lambda w, p: p @ w, v.patch_embedding, pixels),
        "windowed block": ready(lambda b, h: b(h, args, s), windowed, h),
        "full-attention block": ready(lambda b, h: b(h, args, s), full_block, h),
        "windowed attention": ready(lambda b, h: b.attn(h, args, s), windowed, h),
        "full attention": ready(lambda b, h: b.attn(h, args, s), full_block, h),
        "merger": ready(lambda m, h: m(h[0]), v.merger, h),
    }


def qwen_profile(model, inputs, merged, ref, x, thw, reps: int):
    """The overhead of reading every block's layer_output, then one piece of each kind alone, jstd against torch
    (torch's pieces on the arguments its own forward passes them, captured by hooks; jstd's on a random stream)."""
    every_block = QWEN_MERGED + ("vision.layers.layer_output",)
    t = time_interleaved({"merged tokens": merged, "and every block's layer_output": lambda: merged(every_block)}, reps)
    (plain, _), (every, _) = t["merged tokens"], t["and every block's layer_output"]
    print(f"\nreading every block's layer_output: {(every / plain - 1) * 100:+.1f}% ({every:.2f} s vs {plain:.2f} s)\n")

    torch_side, jstd_side = torch_pieces(ref, x, thw), jstd_pieces(model, inputs, x)
    runs = {}
    for name in torch_side:
        runs[name, "torch"], runs[name, "jstd"] = torch_side[name], jstd_side[name]
    t = time_interleaved(runs, reps)
    print("| piece (one call, 4 images) | torch sdpa ms | jstd ms | jstd / torch time |\n| --- | --- | --- | --- |")
    for name in torch_side:
        tt, tj = t[name, "torch"][0], t[name, "jstd"][0]
        print(f"| {name} | {tt * 1e3:,.0f} | {tj * 1e3:,.0f} | {tj / tt:.2f} |")
