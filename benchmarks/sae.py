"""Sparse autoencoders: the spliced forward against the plain one, and training throughput against torch.

1. The Foundation model (benchmarks/forward.py: 8 blocks, 512 wide, batch 4 x 256, float32 on the CPU) with one
   16x-wide ReLU dictionary (8192 latents) spliced at ``layers.layer_output`` of every block (a stack of 8), run
   by ``jax.jit(jstd.run)``: unedited with nothing under the site read; with one feature ablated at every block,
   by index (a ``FeatureEdit``: only that latent and decoder row are computed) and by mask (each block encodes and
   decodes the whole dictionary); with the latents of every block read. All interleaved with the plain forward.
   The FLOP floor is what the dictionary's products add to the forward's (encoder, and decoder where it runs).
2. Training throughput: ``jstd.sae.train``'s update (standard ReLU dictionary, 512 -> 8192, l1 5, batch 4096,
   float32, its default optimizer: SAELens' clip to global norm 1 then Adam 4e-4) against SAELens' own trainer
   (``SAETrainer.step`` on a ``StandardTrainingSAE``: the bench extra installs sae-lens) on the same activations
   (block 4's layer_output of the Foundation model on random tokens), runs interleaved. Without sae-lens, a torch
   loop of the same update (its loss, its trainer's dead-latent bookkeeping, clipping, Adam) stands in.

    python benchmarks/sae.py [--repeats 5]
"""

from __future__ import annotations

import time

import common
from common import (jstd_steps, print_table, repeats_parser, text_checkpoint, time_interleaved, torch_adam_steps,
                    versions)
from forward import SIZE, llama_config

D_SAE = 16 * SIZE["hidden_size"]
SITE = "layers.layer_output"


def spliced_forward(folder, tokens, repeats):
    import jax
    import jax.numpy as jnp

    import jstd

    model = jstd.load(folder)
    L, H = model.config.num_layers, model.config.hidden_size
    saes = jstd.sae.stack([jstd.sae.init(jax.random.key(i), H, D_SAE) for i in range(L)])
    splices = jstd.splice(model, saes, SITE)
    ablate = jstd.sae.ablate_features(SITE, 17, D_SAE)  # by index: only feature 17's latent and row computed
    ablate_mask = jstd.sae.ablate_features(SITE, jnp.arange(D_SAE) == 17, D_SAE)  # by mask: the whole dictionary
    run = jax.jit(jstd.run, static_argnames="reads")
    calls = {
        "plain": lambda: jax.block_until_ready(run(model, tokens).logits),
        "spliced": lambda: jax.block_until_ready(run(model, tokens, splices).logits),
        "ablated": lambda: jax.block_until_ready(run(model, tokens, [*splices, ablate]).logits),
        "ablated_mask": lambda: jax.block_until_ready(run(model, tokens, [*splices, ablate_mask]).logits),
        "read": lambda: jax.block_until_ready(run(model, tokens, splices, reads=(f"{SITE}.sae.latents",))),
    }
    t = time_interleaved(calls, repeats)
    same = bool(jnp.array_equal(run(model, tokens, splices).logits, run(model, tokens).logits))
    gap = float(jnp.abs(run(model, tokens, [*splices, ablate]).logits
                        - run(model, tokens, [*splices, ablate_mask]).logits).max())
    n = tokens.size
    block = 2 * n * (H * (H + 2 * SIZE["num_key_value_heads"] * H // SIZE["num_attention_heads"] + H)
                     + 3 * H * SIZE["intermediate_size"])
    forward_flops = L * block + 2 * n * H * SIZE["vocab_size"]
    encode = 2 * n * H * D_SAE * L
    return t, same, gap, (forward_flops + encode) / forward_flops, (forward_flops + 2 * encode) / forward_flops


def training(folder, tokens, repeats, steps=3):
    """Seconds per update (median, best) of jstd and of SAELens' trainer (or, without sae-lens, the faithful torch
    loop), the batch size, and which torch side ran."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import jstd
    from jstd.sae.train import Settings, State, _compiled, default_optimizer

    model = jstd.load(folder)
    rows = []
    for seed in range(4):
        toks = np.random.default_rng(seed).integers(0, SIZE["vocab_size"], tokens.shape)
        rows.append(np.asarray(jstd.run(model, toks, reads=("layers.4.layer_output",))["layers.4.layer_output"]))
    x = np.concatenate(rows).reshape(-1, SIZE["hidden_size"]).astype(np.float32)[:4096]
    H = x.shape[1]

    sae = jstd.sae.init(jax.random.key(0), H, D_SAE)
    optimizer = default_optimizer(4e-4)  # train's default: SAELens' update (clip to global norm 1, then Adam)
    settings = Settings("standard", None, 5.0, 0.0, 0.05, H // 2, 0.0, 10**9)
    state = State(sae, optimizer.init(sae), jnp.zeros(D_SAE), jnp.zeros(()), jnp.zeros(()), jnp.zeros(()))
    step = _compiled(optimizer, settings)[0]  # the update train runs between logged steps
    jstd_run = jstd_steps(step, state, jnp.asarray(x), steps)

    xt = torch.from_numpy(x)
    try:
        torch_steps, side = saelens_steps(xt, steps), f"SAELens {__import__('sae_lens').__version__}'s SAETrainer.step"
    except ImportError:
        torch_steps, side = faithful_steps(sae, xt, steps), "a torch loop of SAELens' update (sae-lens not installed)"
    t = time_interleaved({"jstd": jstd_run, "torch": torch_steps}, repeats)
    return {k: (v[0] / steps, v[1] / steps) for k, v in t.items()}, len(x), side


def saelens_steps(xt, steps):
    """SAELens' own trainer on the batch: ``SAETrainer.step`` (its forward, dead-latent bookkeeping, backward,
    gradient clipping, Adam, schedulers), as its ``fit`` calls it."""
    from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    H = xt.shape[1]
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=H, d_sae=D_SAE, l1_coefficient=5.0, dtype="float32",
                                                        device="cpu"))
    trainer = SAETrainer(SAETrainerConfig(total_training_samples=10**12, train_batch_size_samples=len(xt), lr=4e-4,
                                          lr_end=4e-4), sae, iter(()))

    def run():
        for _ in range(steps):
            out = trainer.step(xt)
            trainer.n_training_steps += 1
        return float(out.loss.detach())
    return run


def faithful_steps(sae, xt, steps):
    """SAELens 6's update written out in torch: ``StandardTrainingSAE``'s loss, its trainer's dead-latent
    bookkeeping, ``clip_grad_norm_(…, 1.0)`` and Adam."""
    import numpy as np
    import torch

    H = xt.shape[1]
    W_dec = torch.nn.Parameter(torch.from_numpy(np.array(sae.W_dec)))
    W_enc = torch.nn.Parameter(torch.from_numpy(np.array(sae.W_enc)))
    b_enc = torch.nn.Parameter(torch.zeros(D_SAE))
    b_dec = torch.nn.Parameter(torch.zeros(H))
    since, freq = torch.zeros(D_SAE), torch.zeros(D_SAE)

    def loss_fn():
        acts = torch.relu((xt - b_dec) @ W_enc + b_enc)
        out = acts @ W_dec + b_dec
        with torch.no_grad():
            firing = acts.bool().float()
            since.add_(1)
            since[firing.sum(-2).bool()] = 0
            freq.add_(firing.sum(0))
        return (out - xt).pow(2).sum(-1).mean() + 5.0 * (acts * W_dec.norm(dim=1)).norm(p=1, dim=-1).mean()

    return torch_adam_steps([W_enc, b_enc, W_dec, b_dec], loss_fn, 4e-4, steps)


def main():
    args = repeats_parser().parse_args()
    folder, tokens = text_checkpoint(llama_config, "llama-8x512", SIZE["vocab_size"])
    t0 = time.time()
    t, same, gap, floor_encode, floor_both = spliced_forward(folder, tokens, args.repeats)
    tt, batch, side = training(folder, tokens, args.repeats)
    plain = t["plain"][0]
    ms = lambda s: f"{s * 1e3:.0f} ms"
    rows = [
        ("spliced forward, unedited, nothing under the site read / plain (logits bit-identical: "
         f"{same})", f"{t['spliced'][0] / plain:.2f}x", f"{ms(t['spliced'][0])} vs {ms(plain)} (median)"),
        ("spliced forward, one feature ablated at every block, by index (FeatureEdit) / plain",
         f"{t['ablated'][0] / plain:.2f}x", f"{ms(t['ablated'][0])}; one latent and one decoder row a block; logits "
         f"within {gap:.1e} of the mask's"),
        ("spliced forward, one feature ablated at every block, by mask (whole dictionary) / plain",
         f"{t['ablated_mask'][0] / plain:.2f}x",
         f"{ms(t['ablated_mask'][0])}; FLOP floor {floor_both:.2f}x (encoder + decoder of 8 x 512x8192)"),
        ("spliced forward, latents of every block read ([8, 4, 256, 8192] float32) / plain",
         f"{t['read'][0] / plain:.2f}x", f"{ms(t['read'][0])}; FLOP floor {floor_encode:.2f}x (encoder)"),
        (f"training throughput, jstd.sae.train's update / {side} (batch {batch}, 512 -> {D_SAE})",
         f"{tt['torch'][0] / tt['jstd'][0]:.2f}x",
         f"jstd {batch / tt['jstd'][0]:,.0f} rows/s, torch {batch / tt['torch'][0]:,.0f} rows/s (median; best "
         f"{tt['torch'][1] / tt['jstd'][1]:.2f}x)"),
    ]
    print_table(versions() + f"; {time.time() - t0:.0f} s", rows)


if __name__ == "__main__":
    main()
