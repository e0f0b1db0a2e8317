"""Vision-language wrappers against transformers (``python benchmarks/vision.py --parts llava,idefics3``), float32,
logits only, runs interleaved; torch runs AutoModelForImageTextToText with sdpa attention.

llava: a Llava 1.5 wrapper with a CLIP ViT-L/14-336-shaped tower (24 blocks, 1024 wide, 16 heads, MLP 4096,
    quick_gelu; 577 positions), the Llava MLP projector, and a 4-block Llama text model (2048 wide, 16 heads over
    16 kv heads, MLP 5632, vocab 8192); batch 2, one 336-pixel image per row (576 image tokens) in a 588-token
    prompt.
idefics3: an Idefics 3 wrapper with a SigLIP-shaped tower (27 blocks, 1152 wide, 16 heads, MLP 4304, 364-pixel
    tiles in 14-pixel patches: 676 per tile), scale_factor 2 (169 image tokens per tile), the same text model;
    batch 2, one tile per row.
"""

from __future__ import annotations

import numpy as np
from common import WORK, print_table, time_interleaved, torch_call, versions

TEXT = dict(model_type="llama", vocab_size=8192, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096)
IMAGE_TOKEN = TEXT["vocab_size"] - 1
WRAPPER_BATCH = 2


def llava_config():
    """The llava part's LlavaConfig (see the module's docstring)."""
    from transformers import LlavaConfig

    tower = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                 num_attention_heads=16, image_size=336, patch_size=14, hidden_act="quick_gelu",
                 projection_dim=768)
    return LlavaConfig(vision_config=tower, text_config=dict(TEXT), image_token_index=IMAGE_TOKEN)


def idefics3_config():
    """The idefics3 part's Idefics3Config (see the module's docstring)."""
    from transformers import Idefics3Config

    tower = dict(model_type="idefics3_vision", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                 num_attention_heads=16, image_size=364, patch_size=14)
    return Idefics3Config(vision_config=tower, text_config=dict(TEXT), image_token_id=IMAGE_TOKEN, scale_factor=2)


def wrapper_batch(image_tokens: int, image_size: int, tiles: bool, rng) -> dict:
    """``WRAPPER_BATCH`` rows of 4 text tokens, one image's ``image_tokens`` and 8 more text tokens."""
    row = lambda: [*rng.integers(0, IMAGE_TOKEN, 4), *[IMAGE_TOKEN] * image_tokens, *rng.integers(0, IMAGE_TOKEN, 8)]
    ids = np.array([row() for _ in range(WRAPPER_BATCH)], np.int64)
    shape = (WRAPPER_BATCH, 1, 3, image_size, image_size) if tiles else (WRAPPER_BATCH, 3, image_size, image_size)
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "pixel_values": rng.normal(size=shape).astype(np.float32)}
    if tiles:
        batch["pixel_attention_mask"] = np.ones((WRAPPER_BATCH, 1, image_size, image_size), np.int64)
    return batch


def wrapper_benchmark(name: str, config, image_tokens: int, image_size: int, tiles: bool, args):
    """jstd (jit) against transformers (sdpa) on one wrapper forward, logits only, interleaved; returns jstd's
    ``(model, inputs, forward)`` for ``profile_pieces``."""
    import jax
    import torch
    from transformers import AutoModelForImageTextToText

    import jstd
    from reference.wrapper import make_wrapper_checkpoint

    folder = WORK / name
    if not (folder / "config.json").exists():
        make_wrapper_checkpoint(config, folder)
    batch = wrapper_batch(image_tokens, image_size, tiles, np.random.default_rng(0))
    ref = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    torch_forward = torch_call(ref, "logits", **{k: torch.from_numpy(v) for k, v in batch.items()})

    model = jstd.load(folder)
    inputs = jstd.Inputs.of(batch)
    forward = jax.jit(jstd.run)
    jstd_forward = lambda: jax.block_until_ready(forward(model, inputs).logits)
    t = time_interleaved({"torch": torch_forward, "jstd": jstd_forward}, args.repeats)
    want, got = torch_forward().numpy(), np.asarray(jstd_forward())
    err = float(np.abs(got - want).max() / np.abs(want).max())
    (tt, tt_best), (tj, tj_best) = t["torch"], t["jstd"]
    seq = batch["input_ids"].shape[1]
    print_table(f"{name}: batch {WRAPPER_BATCH} x {seq} tokens ({image_tokens} image tokens a row), {versions()}", [
        ("wrapper forward, logits only (jstd / torch), median", f"{tt / tj:.2f}x",
         f"jstd {tj * 1e3:,.0f} ms, torch {tt * 1e3:,.0f} ms; max |diff| {err:.1e} of the max"),
        ("the same, best run", f"{tt_best / tj_best:.2f}x", f"jstd {tj_best * 1e3:,.0f} ms, torch {tt_best * 1e3:,.0f} ms"),
    ])
    return model, inputs, forward


def profile_pieces(model, inputs, forward, repeats: int):
    """Where a wrapper forward's time goes: the whole forward against its text model alone on the same tokens
    (the rest is the tower, the projector and the scatter), interleaved."""
    import jax

    import jstd

    text_only = jax.jit(lambda m, x: jstd.run(m.text, x).logits)
    text_inputs = jstd.Inputs(inputs.tokens, inputs.attention_mask)
    t = time_interleaved({"forward": lambda: jax.block_until_ready(forward(model, inputs).logits),
                          "text model alone": lambda: jax.block_until_ready(text_only(model, text_inputs))}, repeats)
    print("| piece | median ms |\n| --- | --- |")
    for k, (med, _) in t.items():
        print(f"| {k} | {med * 1e3:,.0f} |")
