"""A patching sweep over a Llava's tower blocks x patches against nnsight (``python benchmarks/vision.py --parts
sweep-tiny,sweep-small``, or ``sweep``: both): every block, every patch that feeds an image token, patched from a
clean image into a corrupted one; one jstd.patch_sweep call (one compile) against a loop of nnsight traces on the
torch model (sdpa), one per entry, the metric a logit difference at the last position. Prints a markdown table."""

from __future__ import annotations

import logging
import time

import numpy as np
from common import WORK

# the sweep's Llavas. small: a 4-block CLIP tower (256 wide, 4 heads, 112-pixel images in 14-pixel patches: 64
# patches and the class token), a 2-block Llama (256 wide), vocab 1024. tiny: a 4-block tower 64 wide on 56-pixel
# images (16 patches), a 2-block Llama 64 wide, vocab 1024
SWEEP_SIZES = {
    "small": (dict(hidden_size=256, intermediate_size=1024, image_size=112), dict(hidden_size=256, intermediate_size=704)),
    "tiny": (dict(hidden_size=64, intermediate_size=256, image_size=56), dict(hidden_size=64, intermediate_size=176)),
}
SWEEP_TOWER = dict(model_type="clip_vision_model", num_hidden_layers=4, num_attention_heads=4, patch_size=14,
                   hidden_act="quick_gelu")
SWEEP_TEXT = dict(model_type="llama", vocab_size=1024, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=512)
SWEEP_TARGET, SWEEP_OTHER = 11, 42
SWEEP_SITE = "vision.layers.layer_output"


def sweep_setup(size: str):
    """``(folder, tower_config, text_config, clean, corrupt, entries)`` for the ``size`` Llava (its random checkpoint
    saved once): one row of 4 text tokens, an image token per patch and 6 more text tokens, the clean and the
    corrupted batch differing in their standard normal pixels; ``entries`` every (block, patch position)."""
    from transformers import LlavaConfig

    from reference.wrapper import make_wrapper_checkpoint

    tower_size, text_size = SWEEP_SIZES[size]
    tower_config, text_config = {**SWEEP_TOWER, **tower_size}, {**SWEEP_TEXT, **text_size}
    folder = WORK / f"llava-sweep-{size}"
    if not (folder / "config.json").exists():
        make_wrapper_checkpoint(LlavaConfig(vision_config=tower_config, text_config=text_config,
                                            image_token_index=text_config["vocab_size"] - 1), folder)
    rng = np.random.default_rng(0)
    patches = (tower_config["image_size"] // tower_config["patch_size"]) ** 2
    ids = np.array([[*rng.integers(0, 1000, 4), *[SWEEP_TEXT["vocab_size"] - 1] * patches, *rng.integers(0, 1000, 6)]])
    pixels = tower_config["image_size"]
    clean = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "pixel_values": rng.normal(size=(1, 3, pixels, pixels)).astype(np.float32)}
    corrupt = {**clean, "pixel_values": rng.normal(size=(1, 3, pixels, pixels)).astype(np.float32)}
    positions = range(1, patches + 1)                        # the patches (position 0 is the class token)
    entries = [(l, p) for l in range(tower_config["num_hidden_layers"]) for p in positions]
    return folder, tower_config, text_config, clean, corrupt, entries


class CompiledNames(logging.Handler):
    """Collects into ``names`` the programs XLA compiles while it is attached to jax's logger (jax_log_compiles)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            self.names.append(msg.split()[1])


def jstd_sweep(folder, clean, corrupt, patches: int, repeats: int) -> dict:
    """The sweep as one jstd.patch_sweep call: ``grid`` [blocks, patches] of the metric, ``cold`` the first call's
    seconds (compile included) and ``compiled`` the programs it compiled, ``warm`` the median of ``repeats`` more."""
    import jax

    import jstd

    model = jstd.load(folder)
    metric = jstd.logit_difference(SWEEP_TARGET, SWEEP_OTHER)
    sweep = lambda: jstd.patch_sweep(model, jstd.Inputs.of(clean), jstd.Inputs.of(corrupt), SWEEP_SITE, metric,
                                     positions=list(range(1, patches + 1)), progress=False).block_until_ready()
    handler = CompiledNames()
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    t0 = time.perf_counter()
    grid = np.asarray(sweep())
    cold = time.perf_counter() - t0
    jax.config.update("jax_log_compiles", False)
    logging.getLogger("jax").removeHandler(handler)
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sweep()
        warm.append(time.perf_counter() - t0)
    return dict(grid=grid, cold=cold, compiled=handler.names, warm=float(np.median(warm)))


def nnsight_sweep(folder, clean, corrupt, entries, blocks: int) -> tuple[dict, float]:
    """The sweep as a loop of nnsight traces on the torch model: one trace saving every block's clean output, then
    one patched trace per entry; returns the metric by (block, position) and the loop's seconds."""
    import torch
    from nnsight import NNsight
    from transformers import AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    lm = NNsight(ref)
    tower = lambda: lm.model.vision_tower.encoder.layers
    tc, tb = ({k: torch.from_numpy(v) for k, v in b.items()} for b in (clean, corrupt))
    t0 = time.perf_counter()
    saved = []
    with torch.no_grad(), lm.trace(**tc):
        for l in range(blocks):
            saved.append(tower()[l].output.save())
    values = {}
    for l, p in entries:
        with torch.no_grad(), lm.trace(**tb):
            tower()[l].output[:, p] = saved[l][:, p]
            logits = lm.output.logits.save()
        last = logits[0, -1]
        values[l, p] = float(last[SWEEP_TARGET] - last[SWEEP_OTHER])
    return values, time.perf_counter() - t0


def sweep_benchmark(args, size: str):
    """Tower blocks x patches: jstd.patch_sweep (one call) against a loop of nnsight traces, one per entry."""
    import jax
    import nnsight
    import torch

    jax.config.update("jax_default_matmul_precision", "highest")
    folder, tower_config, text_config, clean, corrupt, entries = sweep_setup(size)
    blocks = tower_config["num_hidden_layers"]
    patches = len(entries) // blocks
    j = jstd_sweep(folder, clean, corrupt, patches, args.repeats)
    grid, cold, t_jstd = j["grid"], j["cold"], j["warm"]
    values, t_nnsight = nnsight_sweep(folder, clean, corrupt, entries, blocks)
    diff = max(abs(values[l, p] - grid[l, p - 1]) for l, p in entries)
    print(f"tower sweep ({size}: tower {tower_config['hidden_size']} wide, text {text_config['hidden_size']} wide): "
          f"{blocks} blocks x {patches} patches = {len(entries)} patched runs; jax {jax.__version__}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), nnsight {nnsight.__version__}")
    print("| figure | ratio | detail |\n| --- | --- | --- |")
    print(f"| tower patching sweep: nnsight loop / jstd.patch_sweep (warm) | {t_nnsight / t_jstd:.1f}x "
          f"| jstd {t_jstd:.2f} s, nnsight {t_nnsight:.1f} s |")
    print(f"| the same, jstd including its compile | {t_nnsight / cold:.1f}x | jstd {cold:.2f} s cold, "
          f"compiled: {', '.join(j['compiled'])} |")
    print(f"| max abs difference of the metric vs nnsight | {diff:.1e} | scale {np.abs(grid).max():.2f}; last block "
          f"(read by nothing) spread {np.ptp(grid[-1]):.1e} |")
