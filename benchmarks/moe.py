"""Mixture-of-experts forward speed against transformers, and the expert product's memory.

The model: an 8-block, 512-wide Qwen3-MoE text model (8 query heads over 4 key/value heads of 64, per-head q/k
norms; 16 experts of 256, top-2, no renormalisation; vocab 8192), batch 4 x 256 tokens, float32 on the CPU;
torch runs transformers' ``Qwen3MoeForCausalLM`` (sdpa attention) with random weights in the same process, with
its default experts implementation and with its eager experts loop. The compute budget: 38.8 GFLOP of matrix
products a forward (``common.forward_flops``: the LM head 8.6, each block's projections 1.6, scores and mix 0.5,
chosen experts and router 1.6), printed as a share of the dot peak measured at the run's start (at 200 GFLOP/s,
50% is 388 ms a forward, 100% is 194 ms: a ratio to torch is its share of the peak over torch's). Memory: the compiled forward's working
memory (XLA's own figure) with 16 and with 128 experts at the same shapes — the grouped product keeps it
O(tokens · top_k), where every expert for every token would add tokens · experts · 2 · 256 floats.

    python benchmarks/moe.py [--repeats 7]

``--kernel``: one block's expert product alone at these sizes (1024 tokens, top-2 of 16 experts, 512 -> 256 ->
512), interleaved in one process: the values' loop over the chosen experts (``kernels.moe.segments``, what the
forward runs), the tile scan (``kernels.moe.grouped``, what the derivatives run), and one plain product of the same
FLOPs (the 2048 rows through one expert: the machine's ceiling for this work); then the same under ``vmap`` over 16
rows of 64 tokens (a patching sweep's shape) against the tile scan vmapped.

    python benchmarks/moe.py --kernel [--repeats 20]
"""

from __future__ import annotations

from common import BATCH, SEQ, compare, forward_flops, forward_rows, peak_row, print_table, repeats_parser, \
    text_checkpoint, time_interleaved, torch_call, versions

SIZE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=2,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=1024,
            rms_norm_eps=1e-6, norm_topk_prob=False)
STATES = ("layers.layer_output", "layers.mlp.router_logits", "layers.mlp.expert_indices")


def qwen3_moe_config(layers, **over):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(num_hidden_layers=layers, **{**SIZE, **over})


def working_memory(experts: int) -> int:
    """XLA's temp bytes of the compiled forward on a skeleton with ``experts`` experts (no weights made)."""
    import jax
    import jax.numpy as jnp

    import jstd
    from jstd.models.qwen3_moe import Qwen3Moe

    skeleton = Qwen3Moe.skeleton(qwen3_moe_config(8, num_experts=experts), jnp.float32)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    return jax.jit(jstd.run).lower(skeleton, tokens).compile().memory_analysis().temp_size_in_bytes


def kernel(repeats: int) -> None:
    """The ``--kernel`` table."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from common import time_interleaved
    from jstd.kernels import moe as K

    tokens, hidden, mlp, experts, k = BATCH * SEQ, SIZE["hidden_size"], SIZE["moe_intermediate_size"], \
        SIZE["num_experts"], SIZE["num_experts_per_tok"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32))
    gate_up = jnp.asarray(rng.standard_normal((experts, hidden, 2 * mlp), np.float32) / hidden ** 0.5)
    down = jnp.asarray(rng.standard_normal((experts, mlp, hidden), np.float32) / mlp ** 0.5)
    indices = jax.lax.top_k(jnp.asarray(rng.standard_normal((tokens, experts), np.float32)), k)[1]
    swiglu = lambda g, u: jax.nn.silu(g) * u
    one = lambda g, d, e: lambda xs: K._expert(xs, g[e], d[e], swiglu)
    seg = lambda x, i, g, d: K.segments(x, i, lambda e: one(g, d, e), experts)
    tiles = lambda x, i, g, d: K.grouped(x, i, lambda xs, e: one(g, d, e)(xs), experts)
    plain = lambda x, i, g, d: K._expert(jnp.concatenate([x] * k), g[0], d[0], swiglu)
    flops = 2 * tokens * k * 3 * hidden * mlp
    block = lambda f, *a: (lambda: jax.block_until_ready(f(*a)))
    args = (x, indices, gate_up, down)
    t = time_interleaved({n: block(jax.jit(f), *args) for n, f in
                          (("segments", seg), ("tiles", tiles), ("plain", plain))}, repeats)
    rows = [(f"one block's expert product: {n} (median; best)", f"{t[n][0] * 1e3:.1f}; {t[n][1] * 1e3:.1f} ms",
             f"{flops / t[n][0] / 1e9:.0f} GFLOP/s") for n in ("segments", "tiles", "plain")]
    bx, bi = x.reshape(16, -1, hidden), indices.reshape(16, -1, k)
    vmapped = lambda f: jax.jit(jax.vmap(f, (0, 0, None, None)))
    out = lambda x, i, g, d: K.expert_outputs(x, i, g, d, "silu", dense=False)
    t = time_interleaved({"expert_outputs": block(vmapped(out), bx, bi, gate_up, down),
                          "tiles": block(vmapped(tiles), bx, bi, gate_up, down)}, repeats)
    rows += [(f"the same under vmap over 16 x 64 tokens: {n} (median; best)",
              f"{t[n][0] * 1e3:.1f}; {t[n][1] * 1e3:.1f} ms", f"{flops / t[n][0] / 1e9:.0f} GFLOP/s")
             for n in ("expert_outputs", "tiles")]
    print_table(f"{versions()}; one block's experts, {tokens} tokens, top-{k} of {experts}, float32", rows)


def main():
    args = repeats_parser(kernel="one block's expert product alone (see the module's docstring)").parse_args()
    if args.kernel:
        return kernel(args.repeats)
    import torch
    from transformers import AutoModelForCausalLM

    import jstd
    from common import jstd_call

    folder, tokens = text_checkpoint(qwen3_moe_config, "qwen3_moe-8x512x16", SIZE["vocab_size"])
    ids = torch.as_tensor(tokens)
    default = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    jstd_forward = jstd_call(jstd.load(folder), tokens)
    t = compare(torch_call(default, "logits", input_ids=ids), jstd_forward, STATES, args.repeats)
    both = time_interleaved({"default": torch_call(default, "logits", input_ids=ids),
                             "eager": torch_call(eager, "logits", input_ids=ids),
                             "jstd": lambda: jstd_forward(())}, args.repeats)
    rows = forward_rows(t["torch"], t["jstd"], t["reads"], BATCH * SEQ, "tok", f"logits max rel. diff {t['err']:.1e}",
                        "every block's layer_output, router_logits and expert_indices", (1, 1.0, 1, 1.0))[:2]
    (dm, db), (em, eb), (jm, jb) = both["default"], both["eager"], both["jstd"]
    rows.append(("forward throughput, interleaved runs, transformers' default experts "
                 f"({default.config._experts_implementation}) (median; best)", f"{dm / jm:.2f}x; {db / jb:.2f}x",
                 f"jstd {jm * 1e3:.0f} / {jb * 1e3:.0f} ms, torch {dm * 1e3:.0f} / {db * 1e3:.0f} ms"))
    rows.append(("forward throughput, interleaved runs, transformers' eager experts loop (median; best)",
                 f"{em / jm:.2f}x; {eb / jb:.2f}x",
                 f"jstd {jm * 1e3:.0f} / {jb * 1e3:.0f} ms, torch {em * 1e3:.0f} / {eb * 1e3:.0f} ms"))
    flops = forward_flops(qwen3_moe_config(8))
    rows += [peak_row(flops, jm, "jstd forward, interleaved median"), peak_row(flops, dm, "torch forward (default experts), interleaved median")]
    # the scan over blocks slices one block's parameters (its experts: O(experts) by definition); the rest is the
    # activations'
    block = lambda e: e * 3 * SIZE["hidden_size"] * SIZE["moe_intermediate_size"] * 4
    m16, m128 = working_memory(16) - block(16), working_memory(128) - block(128)
    dense = BATCH * SEQ * 128 * 2 * SIZE["moe_intermediate_size"] * 4  # one block's every expert for every token
    rows.append(("working memory but one block's expert weights, 128 experts / 16 experts (compiled forward)",
                 f"{m128 / m16:.2f}x", f"{m128 / 2**20:.1f} MiB vs {m16 / 2**20:.1f} MiB; every expert for every "
                 f"token would need {dense / 2**20:.0f} MiB a block"))
    print_table(f"{versions()}; batch {BATCH} x {SEQ} tokens, float32", rows)


if __name__ == "__main__":
    main()
