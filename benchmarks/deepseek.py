"""DeepSeek-V2-Lite-shaped generation: the cache per token (the latent, not per-head keys) and decoding speed
against transformers. DeepSeek-V2-Lite's shapes (2048 wide, 16 heads, kv_lora_rank 512, 128 + 64 query/key dims,
128 value dims, YaRN factor 40; block 0 dense 10944 wide, block 1 64 experts 1408 wide top-6 and two shared;
vocab 102400) cut to 2 blocks, float32, random weights; batch 1, a 128-token prompt, 32 new tokens, greedy.
transformers runs ``DeepseekV2ForCausalLM.generate`` (eager attention, its default experts) in the same process.

Reported: the bytes jstd's cache holds per token (``generate.cache.prefill``'s cache: kv_latent and rope_keys per
block), what per-head keys and values would take, what transformers' ``DynamicCache`` holds after its generate
(its MLA cache keeps the latent too), and decoding throughput (new tokens per second, the prefill included in
both). The issue's figure: the cache per token is the latent's size.

Decoding steps attend in latent space (``LatentAttention.attend_latent``: ``kv_b`` absorbed into the queries and
after the probabilities); a generation that reads a per-head site (``attention_values`` here) keeps the expanded
path, which re-expands every cached latent at every step (what every step did before). Both are reported: the
FLOPs XLA counts in one compiled decoding step at 512 and 4096 cached positions (``cost_analysis``; compiled only,
no timing, so the figure holds on a loaded machine too) and the generate throughput of each, interleaved.

    python benchmarks/deepseek.py [--repeats 3] [--tiny]

The checkpoint (about 4.5 GB in float32) is written once under ``common.WORK``.
"""

from __future__ import annotations

import numpy as np

from common import WORK, checkpoint, print_table, repeats_parser, time_interleaved, versions

PROMPT, NEW = 128, 32
CACHED = (512, 4096)  # the cache lengths of the FLOPs rows
EXPANDED = ("layers.self_attn.attention_values",)  # a per-head read: the expanded path
SIZE = dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
            n_shared_experts=2, num_experts_per_tok=6, num_attention_heads=16, num_key_value_heads=16,
            kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            first_k_dense_replace=1, vocab_size=102400, max_position_embeddings=163840, eos_token_id=None,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0, beta_slow=1.0,
                                 mscale=0.707, mscale_all_dim=0.707, original_max_position_embeddings=4096))
TINY = dict(SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=512)  # --tiny: no figure


def v2_lite(layers: int = 2, size=SIZE):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(num_hidden_layers=layers, **size)


def torch_cache_bytes(cache) -> int:
    """The bytes of every tensor a transformers cache holds."""
    import torch

    total = 0
    for layer in cache.layers:
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def flops_rows(model) -> list[tuple[str, str, str]]:
    """The FLOPs of one compiled decoding step (batch 1) at each of ``CACHED`` positions, latent path vs expanded
    path, and what the step adds per cached position. ``model``: abstract arrays are enough (only compiled); its
    blocks must not repeat in a scan (XLA counts a loop's body once: 2 blocks, one dense and one MoE, do not)."""
    from deepseek_cases import decode_step_flops

    flops = {(c, path): decode_step_flops(model, c, reads) for c in CACHED
             for path, reads in (("latent", ()), ("expanded", EXPANDED))}
    rows = [(f"decoding step FLOPs at {c} cached positions, latent path vs expanded path",
             f"{flops[c, 'expanded'] / flops[c, 'latent']:.1f}x fewer",
             f"latent {flops[c, 'latent'] / 1e9:.3f} GFLOP, expanded {flops[c, 'expanded'] / 1e9:.3f} GFLOP "
             "(XLA cost_analysis of the compiled step)") for c in CACHED]
    lo, hi = CACHED
    slope = {path: (flops[hi, path] - flops[lo, path]) / (hi - lo) / model.config.num_layers
             for path in ("latent", "expanded")}
    rows.append(("decoding step FLOPs per cached position and block, latent vs expanded",
                 f"{slope['expanded'] / slope['latent']:.0f}x fewer",
                 f"latent {slope['latent'] / 1e3:.1f} kFLOP, expanded {slope['expanded'] / 1e3:.0f} kFLOP"))
    return rows


def main():
    args = repeats_parser(tiny="tiny sizes (a check that the script runs; no figure)").parse_args()
    size = TINY if args.tiny else SIZE
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    import jstd
    from jstd.families import family_for
    from jstd.generate.cache import prefill

    config = v2_lite(size=size)
    folder = checkpoint(config, WORK / ("deepseek_v2-tiny" if args.tiny else "deepseek_v2-lite-2blocks"))
    tokens = np.random.default_rng(0).integers(0, size["vocab_size"], (1, PROMPT))
    model = jstd.load(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.as_tensor(tokens)

    _, cache = jax.eval_shape(lambda m: prefill(m, jstd.Inputs(tokens, None), (), NEW), model)
    total = PROMPT + NEW
    per_token = (cache.keys.size * cache.keys.dtype.itemsize + cache.values.size * cache.values.dtype.itemsize) / total
    c = model.config
    per_head = c.num_layers * c.num_heads * (c.qk_head_dim + c.head_dim) * 4
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                           pad_token_id=0)
    cache_of = getattr(out, "cache", None) or out.past_key_values
    torch_per_token = torch_cache_bytes(cache_of) / (total - 1)  # the last token is never cached

    def run_jstd():
        return np.asarray(jstd.generate(model, tokens, max_new_tokens=NEW, eos_token_id=()).tokens)

    def run_expanded():
        return np.asarray(jstd.generate(model, tokens, max_new_tokens=NEW, eos_token_id=(), reads=EXPANDED).tokens)

    def run_torch():
        with torch.no_grad():
            return ref.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)

    same = np.array_equal(run_jstd(), run_torch().numpy()) and np.array_equal(run_jstd(), run_expanded())
    t = time_interleaved({"torch": run_torch, "jstd": run_jstd, "expanded": run_expanded}, args.repeats)
    (tm, tb), (jm, jb), (em, eb) = t["torch"], t["jstd"], t["expanded"]
    rows = [
        ("cache per token, jstd (kv_latent + rope_keys, every block)", f"{per_token:.0f} B",
         f"{c.num_layers} blocks x (512 + 64) x 4 B" if not args.tiny else "tiny"),
        ("per-head keys and values would take", f"{per_head:.0f} B", f"{per_head / per_token:.1f}x the latent"),
        ("transformers' DynamicCache after generate, per token", f"{torch_per_token:.0f} B", ""),
        ("generate throughput (median; best), new tokens/s", f"{tm / jm:.2f}x; {tb / jb:.2f}x",
         f"jstd {NEW / jm:.1f} / {NEW / jb:.1f}, torch {NEW / tm:.1f} / {NEW / tb:.1f}; same tokens: {same}"),
        ("generate throughput, latent path vs the expanded path (median; best)", f"{em / jm:.2f}x; {eb / jb:.2f}x",
         f"expanded (reads {EXPANDED[0]}) {NEW / em:.1f} / {NEW / eb:.1f} new tokens/s"),
    ] + flops_rows(family_for(config.model_type).skeleton(config, jnp.float32))
    shapes = "tiny sizes (no figure)" if args.tiny else "DeepSeek-V2-Lite shapes"
    print_table(f"{versions()}; {shapes}, 2 blocks, batch 1, {PROMPT}-token prompt + {NEW} new, float32", rows)


if __name__ == "__main__":
    main()
