"""Cross-layer transcoder training throughput: ``jstd.circuits.train_clt``'s update against a faithful torch loop of
the same update.

The update (jstd/circuits/train.py): a ReLU CLT of ``L`` blocks, ``d``-wide, ``F`` features per block; the loss
``Σ_l ‖ŷ_l - y_l‖² + λ Σ_l Σ_i tanh(c · ‖W_dec[l][i]‖ · a_{l,i})`` averaged over the batch (decoder norms over each
feature's decoders to every later block, concatenated), the gradient clipped to global norm 1, Adam; plus the
tokens-since-fired bookkeeping. jstd runs the compiled step ``train_clt`` runs between logged steps; torch runs the
same arithmetic written out (one encoder product for all blocks, one decoder product per source block, autograd,
``clip_grad_norm_``, ``torch.optim.Adam``) from the same initial arrays on the same batch, float32 on the CPU,
interleaved. The data are Gaussian inputs and a fixed linear map of them (the cost of an update does not depend on
the values).

    python benchmarks/clt_train.py [--repeats 5] [--tiny]

Default size: 8 blocks, 512 wide, 4096 features per block (32,768 in all), batch 1024. The update is bound by its
matrix products (about 530 GFLOP a step at the default size, printed with each side's rate): neither side can go
faster than the CPU's float32 matrix-product rate, so the ratio is at most the torch loop's overhead beyond them.
"""

from __future__ import annotations

import time

from common import jstd_steps, print_table, repeats_parser, time_interleaved, torch_adam_steps, versions

SIZES = {"default": dict(L=8, d=512, F=4096, B=1024), "tiny": dict(L=2, d=32, F=64, B=64)}
LAMBDA, C, LR = 1e-3, 1.0, 1e-3


def jstd_update(x, y, L, F, steps):
    import jax
    import jax.numpy as jnp

    from jstd.circuits.train import Settings, State, _compiled, init_clt
    from jstd.sae.train import default_optimizer

    tc = init_clt(jax.random.key(0), L, x.shape[-1], F)
    optimizer = default_optimizer(LR)  # train_clt's default: clip to global norm 1, then Adam
    settings = Settings("relu", None, LAMBDA, C, 0.0, 0.05, 10 ** 9)
    state = State(tc, optimizer.init(tc), jnp.zeros((L, F)), jnp.zeros(L), jnp.zeros(()), jnp.zeros(()))
    step = _compiled(optimizer, settings)[0]  # the update train_clt runs between logged steps
    return jstd_steps(step, state, (jnp.asarray(x), jnp.asarray(y)), steps), tc


def torch_update(tc, x, y, steps):
    """The same update in torch: parameters from ``tc``'s arrays."""
    import numpy as np
    import torch

    L, F = tc.num_layers, tc.d_features
    param = lambda a: torch.nn.Parameter(torch.from_numpy(np.array(a, np.float32)))
    W_enc, b_enc, b_dec = param(tc.W_enc), param(tc.b_enc), param(tc.b_dec)
    W_dec = [param(w) for w in tc.W_dec]  # [F, L - l, d]
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)  # [L, B, d]
    B, d = xt.shape[1], xt.shape[2]
    since = torch.zeros(L, F)

    def loss_fn():
        acts = torch.relu(torch.einsum("lbd,lfd->lbf", xt, W_enc) + b_enc[:, None, :])
        recon = [b_dec[lo].expand(B, d) for lo in range(L)]
        for l in range(L):
            part = (acts[l] @ W_dec[l].reshape(F, -1)).reshape(B, L - l, d)
            for k in range(L - l):
                recon[l + k] = recon[l + k] + part[:, k]
        mse = sum(((r - yt[lo]) ** 2).sum() for lo, r in enumerate(recon)) / B
        norms = torch.stack([w.pow(2).sum((1, 2)).sqrt() for w in W_dec])[:, None, :]
        with torch.no_grad():
            fired = acts.sum(1) > 0
            since.add_(B)
            since[fired] = 0
        return mse + LAMBDA * torch.tanh(C * norms * acts).sum() / B

    return torch_adam_steps([W_enc, b_enc, *W_dec, b_dec], loss_fn, LR, steps)


def main():
    args = repeats_parser(tiny="a tiny size that only checks the script runs").parse_args()
    import numpy as np

    s = SIZES["tiny" if args.tiny else "default"]
    L, d, F, B = s["L"], s["d"], s["F"], s["B"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(L, B, d)).astype(np.float32)
    y = np.einsum("lbd,lde->lbe", x, rng.normal(size=(L, d, d)).astype(np.float32) / np.sqrt(d)).astype(np.float32)
    t0 = time.time()
    steps = 3
    jstd_run, tc = jstd_update(x, y, L, F, steps)
    t = time_interleaved({"jstd": jstd_run, "torch": torch_update(tc, x, y, steps)}, args.repeats)
    per = {k: (v[0] / steps, v[1] / steps) for k, v in t.items()}
    # the products an update cannot skip: the encoder forward and its weight gradient, and each decoder's forward,
    # weight gradient and gradient to the activations (no gradient to the inputs); the rest is elementwise
    gflop = 2 * B * (2 * L * F * d + 3 * F * d * L * (L + 1) // 2) / 1e9
    rows = [(f"CLT training throughput, train_clt's update / a torch loop of the same update ({L} blocks, {d} wide, "
             f"{F} features a block, batch {B}, ReLU, tanh decoder-norm sparsity, clip + Adam)",
             f"{per['torch'][0] / per['jstd'][0]:.2f}x",
             f"jstd {B / per['jstd'][0]:,.0f} tokens/s, torch {B / per['torch'][0]:,.0f} tokens/s (median; best "
             f"{per['torch'][1] / per['jstd'][1]:.2f}x); {gflop:.3g} GFLOP of matrix products a step: jstd "
             f"{gflop / per['jstd'][0]:.3g} GFLOP/s, torch {gflop / per['torch'][0]:.3g} GFLOP/s")]
    print_table(versions() + f"; {time.time() - t0:.0f} s", rows)


if __name__ == "__main__":
    main()
