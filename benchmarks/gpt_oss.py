"""gpt-oss forward speed against transformers: gpt-oss-20b's shapes (2880 wide, 64 query heads over 8 key/value
heads of 64, attention sinks, sliding (128) and full blocks alternating, YaRN; 32 experts 2880 wide, top-4, clamped
SwiGLU; vocab 201088) cut to 2 blocks, batch 4 x 128 tokens, float32, random weights; torch runs transformers'
``GptOssForCausalLM`` (eager attention: transformers has no sdpa path with sinks) in the same process, with its
default experts implementation and with its eager experts loop. The issue's figure: jstd >= 1.5x transformers.

    python benchmarks/gpt_oss.py [--repeats 7] [--tiny] [--check]

The checkpoint (about 11 GB in float32: the 2 blocks' experts and the untied 201088-row embedding and head) is
written once under ``common.WORK`` (``common.streamed_checkpoint``: a tensor at a time). Both frameworks run on one
copy of the weights where their layouts agree (``common.share_weights``: transformers reads jstd's buffers for the
embedding, the down experts, norms and biases; each keeps its own transposed projections and head, and transformers
its interleaved gate/up experts, which jstd splits), and one transformers model serves both experts
implementations (switched before each call): the process holds 16.75 GiB of weights instead of 31 (two
transformers models and jstd's), about 20 GiB in all with the runs: a quiet 24 GiB machine (docs/benchmarks.md).
``--check`` runs one forward of each (their logits compared) and prints the memory, without timing.
"""

from __future__ import annotations

import numpy as np

from common import WORK, compare, forward_rows, print_table, repeats_parser, rss_gib, \
    share_weights, streamed_checkpoint, time_interleaved, torch_call, versions

BATCH, SEQ = 4, 128
STATES = ("layers.layer_output", "layers.self_attn.sink_probability", "layers.mlp.expert_indices")


SIZE = dict(num_local_experts=32, num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880, head_dim=64,
            num_attention_heads=64, num_key_value_heads=8, sliding_window=128, vocab_size=201088,
            max_position_embeddings=131072)
TINY = dict(SIZE, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=512)  # --tiny: the same structure, to see the script run


def gpt_oss_20b(layers: int = 2, size=SIZE):
    from transformers import GptOssConfig

    return GptOssConfig(num_hidden_layers=layers, layer_types=["sliding_attention", "full_attention"][:layers],
                        **size)


def main():
    args = repeats_parser(tiny="tiny sizes (a check that the script runs; no figure)",
                          check="one forward of each, their logits compared and the process's memory; no timing"
                          ).parse_args()
    size = TINY if args.tiny else SIZE
    import torch
    from transformers import AutoModelForCausalLM

    import jstd
    from common import jstd_call

    name = "gpt_oss-tiny" if args.tiny else "gpt_oss-20b-2blocks"
    folder = streamed_checkpoint(gpt_oss_20b(size=size), WORK / name)
    tokens = np.random.default_rng(0).integers(0, size["vocab_size"], (BATCH, SEQ))
    ids = torch.as_tensor(tokens)
    model = jstd.load(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    default = ref.config._experts_implementation
    shared, own = share_weights(model, ref, folder)
    jstd_forward = jstd_call(model, tokens)
    if args.check:
        want = experts(ref, default, ids)().numpy()
        got = np.asarray(jstd_forward(()).logits)
        now, peak = rss_gib()
        print(f"logits max rel. diff {np.abs(got - want).max() / np.abs(want).max():.1e}; resident {now:.2f} GiB, "
              f"peak {peak:.2f} GiB; transformers' weights {(shared + own) / 2 ** 30:.2f} GiB, "
              f"{shared / 2 ** 30:.2f} of them jstd's buffers")
        return
    t = compare(experts(ref, default, ids), jstd_forward, STATES, args.repeats)
    both = time_interleaved({"eager": experts(ref, "eager", ids), "jstd": lambda: jstd_forward(())}, args.repeats)
    now, peak = rss_gib()
    rows = forward_rows(t["torch"], t["jstd"], t["reads"], BATCH * SEQ, "tok", f"logits max rel. diff {t['err']:.1e}",
                        "every block's layer_output, sink_probability and expert_indices", (1, 1.0, 1, 1.0))[:2]
    (em, eb), (jm, jb) = both["eager"], both["jstd"]
    rows.append(("forward throughput, interleaved runs, transformers' eager experts loop (median; best)",
                 f"{em / jm:.2f}x; {eb / jb:.2f}x",
                 f"jstd {jm * 1e3:.0f} / {jb * 1e3:.0f} ms, torch {em * 1e3:.0f} / {eb * 1e3:.0f} ms"))
    rows.append(("process memory (resident now; peak)", f"{now:.2f}; {peak:.2f} GiB",
                 f"transformers' weights {(shared + own) / 2 ** 30:.2f} GiB, {shared / 2 ** 30:.2f} of them jstd's "
                 f"buffers (common.share_weights); default experts: {default}"))
    shapes = "tiny sizes (no figure)" if args.tiny else "gpt-oss-20b shapes"
    print_table(f"{versions()}; {shapes}, 2 blocks, batch {BATCH} x {SEQ} tokens, float32", rows)


def experts(ref, implementation: str, ids):
    """``torch_call`` of ``ref``'s logits with its experts implementation set to ``implementation`` first (one
    model serves both: the setting is read at each call)."""
    call = torch_call(ref, "logits", input_ids=ids)

    def forward():
        ref.set_experts_implementation(implementation)
        return call()
    return forward


if __name__ == "__main__":
    main()
