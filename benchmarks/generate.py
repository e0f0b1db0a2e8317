"""Generation speed: jstd.generate against transformers' generate, the memory-bandwidth bound, flatness, sweeps.

The model: the Foundation benchmark's Llama (8 blocks, 512 wide, 8 heads over 4
kv heads, intermediate 1408, vocab 8192), random weights, in ``--dtype``
(float32, or bfloat16: jstd and transformers both load it so); greedy
decoding of ``--new`` tokens (default 128) after a ``--prompt``-token prompt
(default 16), batch 1. Prints a markdown table (paste into docs/benchmarks.md):

- tokens per second, jstd (one jitted ``generate``, compile excluded and
  reported) and transformers' ``generate`` (sdpa, its KV cache) in the same
  process, and whether their tokens agree;
- the per-token time against the memory-bandwidth bound: the weights' bytes
  (in ``--dtype``: bfloat16 is measured against its own, half, bound) read once
  per token at this machine's read bandwidth (``read_bandwidth``: a jitted sum
  over a 256 MiB array, whole or split in rows so that every core reads a
  share, best of 15 each), measured before and after the timed runs (both are
  printed: how far the measurement moved; the bound takes the faster);
- what remains between the two: the step's products alone (``products_alone``:
  one one-row product per weight the step reads, the loop's own weight arrays,
  nothing else) per token, against the bound and against the whole step;
- the compiled ``generate``'s temporary memory against the weights' bytes
  (bfloat16 on XLA:CPU: the float32 copies of the weights that XLA hoists out
  of the loop, see docs/benchmarks.md);
- what a decoding step moves besides the weights, read from the compiled loop
  (``step_writes``, not timed): the buffers it writes besides its products'
  outputs and its in-place cache and logits writes (written, then read: twice
  their bytes), copies included, plus the whole cache it attends (every
  position, masked), against the weights' bytes; batch 1 and the sweep;
- flatness: the best time of decode steps 1-32 and of the last 32 steps,
  each step run alone (``jstd.generate.stream``'s jitted step, the same
  forward over the same preallocated cache as ``generate``'s loop);
- a sweep: 8 steering strengths in one vmapped ``generate`` against 8 calls;
- what bounds the sweep: an 8-row product against a one-row product on
  weights read from memory (a chain through 72 distinct weights).

    python benchmarks/generate.py [--dtype float32|bfloat16] [--new 128] [--prompt 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import common
from common import checkpoint, print_table
from forward import llama_config


def read_bandwidth(mib: int = 256) -> float:
    """Bytes per second of reading a device array once: the faster of a jitted sum over ``mib`` MiB and of the
    same split in two rows (best of 5 each): what a decoding step does with the weights. (A copy ``x + 0`` into a
    fresh buffer measured page faults, not bandwidth: 4.0-4.4 GB/s here against 19-24 GB/s read.)"""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    best = float("inf")
    # one row, two, and one per core (so that every core reads its share, as a decoding step's products do); the
    # best of 15 each: a single best of 5 swung 40-79 GB/s from run to run on a 2-core machine
    for rows in sorted({1, 2, os.cpu_count() or 1}):
        read = jax.jit(lambda x, rows=rows: x.reshape(rows, -1).sum(1))
        read(x).block_until_ready()
        best = min(best, *(_timed(lambda: read(x).block_until_ready()) for _ in range(15)))
    return x.nbytes / best


def products_alone(stepper, steps: int):
    """``(run, bytes)``: ``run()`` runs ``steps`` decoding steps' products alone — one one-row product per weight a
    step reads (``stepper``'s weights as the loop holds them: every block's, each as a flat ``[rows, columns]``
    matrix of its own dtype with float32 accumulation, and the head; not the embedding table, of which a step
    reads one row), chained so that none can be skipped or hoisted — and blocks; ``bytes``: those weights' bytes.
    The per-token time of ``run`` is what the product kernel alone costs a step; the rest of the step's time is
    everything else (norms, rotary, attention over the cache, the cache writes, the sampling, dispatch)."""
    import jax
    import jax.numpy as jnp

    flat = []
    for path, w in jax.tree_util.tree_leaves_with_path(stepper):
        name = jax.tree_util.keystr(path)
        if not hasattr(w, "ndim") or w.ndim < 2 or "embed" in name and "lm_head" not in name:
            continue
        inner = w.shape[0] if name.endswith((".q", ".k", ".v", ".gate", ".up", ".down", "lm_head")) else \
            int(w.size // w.shape[-1])  # o: [heads, head_dim, embed] reads heads * head_dim rows
        flat.append(w.reshape(inner, -1))
    if getattr(stepper, "lm_head", None) is None and hasattr(stepper, "embed"):  # a tied head reads the table
        flat.append(stepper.embed.T)
    widest = max(max(w.shape) for w in flat)

    @jax.jit
    def chain(ws, x):
        def body(_, x):
            for w in ws:
                y = jnp.dot(x[:, : w.shape[0]].astype(w.dtype), w, preferred_element_type=jnp.float32)
                x = x + jnp.pad(jnp.tanh(y), ((0, 0), (0, widest - y.shape[1]))) * 1e-3
            return x
        return jax.lax.fori_loop(0, steps, body, x)

    x = jnp.ones((1, widest), jnp.float32)
    return (lambda: chain(flat, x).block_until_ready()), sum(w.nbytes for w in flat)


def compiled_generate(model, tokens, new: int):
    """The compiled program of ``jstd.generate(model, tokens, max_new_tokens=new, eos_token_id=())`` (which this
    runs once). Its ``memory_analysis`` temporaries: the cache, the logits, and whatever XLA keeps beside the
    weights (on bfloat16 weights on XLA:CPU, float32 copies of them hoisted out of the loop)."""
    import importlib

    import jstd

    loop = importlib.import_module("jstd.generate.loop")  # the module whose _jit_generate generate calls
    real, seen = loop._jit_generate, {}

    def spy(dynamic, structure, static):
        seen["compiled"] = real.lower(dynamic, structure, static).compile()
        return real(dynamic, structure, static)

    loop._jit_generate = spy
    try:
        jstd.generate(model, tokens, max_new_tokens=new, eos_token_id=()).tokens.block_until_ready()
    finally:
        loop._jit_generate = real
    return seen["compiled"]


def step_writes(hlo: str, logits_shape: str) -> tuple[int, int]:
    """``(made, copied)``: the bytes each step of a compiled generate's decoding loop (the ``while`` whose state
    holds the logits buffer of ``logits_shape``, e.g. ``[128,1,8192]``) writes into buffers of its own besides
    its products' outputs and its in-place writes of the cache and the logits (activations, concatenations,
    slices, conversions), and the bytes it copies (``copy`` instructions); from the optimized HLO, not timed."""
    from decoding_hlo import step_buffers

    buffers = step_buffers(hlo, logits_shape)
    return (sum(size for size, kind, _ in buffers if kind == "made"),
            sum(size for size, kind, _ in buffers if kind == "copy"))


def product_times(rows=(1, 8), count: int = 36, embed: int = 512, mlp: int = 1408) -> dict:
    """Milliseconds per ``[rows, embed] @ [embed, mlp]`` product (and back) on weights read from memory: a chain
    through ``count`` pairs of distinct weights (2 x 36 x 2.75 MiB, past the caches), five times, best of 3."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    ups = [jnp.asarray(rng.normal(size=(embed, mlp)).astype(np.float32) * 0.03) for _ in range(count)]
    downs = [jnp.asarray(rng.normal(size=(mlp, embed)).astype(np.float32) * 0.03) for _ in range(count)]

    @jax.jit
    def chain(ups, downs, x):
        def body(_, x):
            for up, down in zip(ups, downs):
                x = x + jnp.tanh(x @ up) @ down * 0.01
            return x
        return jax.lax.fori_loop(0, 5, body, x)

    out = {}
    for n in rows:
        x = jnp.ones((n, embed), jnp.float32)
        chain(ups, downs, x).block_until_ready()
        best = min(_timed(lambda: chain(ups, downs, x).block_until_ready()) for _ in range(3))
        out[n] = best / (5 * 2 * count) * 1e3
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", type=int, default=8)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import jstd
    from jstd.generate import stream
    from jstd.generate.cache import stepper

    folder = checkpoint(llama_config(8), Path(tempfile.gettempdir()) / "jstd-bench-forward-8")
    model = jstd.load(folder, dtype=getattr(jnp, args.dtype))
    bandwidth_before = read_bandwidth()  # again after the timed runs: the bound takes the faster
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, args.prompt))
    new = args.new

    # jstd: one jitted generate; the first call compiles
    t0 = time.perf_counter()
    gen = jstd.generate(model, tokens, max_new_tokens=new, eos_token_id=())  # every token, as torch's min_new_tokens
    gen.tokens.block_until_ready()
    first = time.perf_counter() - t0
    t_jstd = common.timeit(lambda: jstd.generate(model, tokens, max_new_tokens=new, eos_token_id=()).tokens.block_until_ready(),
                           args.repeats, 1)

    # transformers: generate with its cache, greedy, every token generated
    ref = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                               dtype=getattr(torch, args.dtype)).eval()
    ids = torch.as_tensor(tokens)

    def torch_generate():
        with torch.inference_mode():
            return ref.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    want = torch_generate().numpy()
    t_torch = common.timeit(torch_generate, args.repeats, 1)
    agree = int((np.asarray(gen.tokens) == want).all(0)[args.prompt:].cumprod().sum())

    # the bandwidth bound: every weight read once per token (in the model's dtype)
    weights = sum(x.nbytes for x in jax.tree.leaves(model) if hasattr(x, "nbytes"))
    if model.lm_head is not None:  # an untied head: a step reads one row of the embedding table, not all of it
        weights -= model.embed.nbytes
    per_token = t_jstd / new
    # what remains between the two: the step's products alone, timed interleaved with generate
    run_products, product_bytes = products_alone(stepper(model), new)
    both = common.time_interleaved({
        "generate": lambda: jstd.generate(model, tokens, max_new_tokens=new, eos_token_id=()).tokens.block_until_ready(),
        "products": run_products}, args.repeats)
    t_products = both["products"][0] / new
    t_step = both["generate"][0] / new
    compiled = compiled_generate(model, tokens, new)
    temp = compiled.memory_analysis().temp_size_in_bytes
    c, itemsize = model.config, jnp.dtype(args.dtype).itemsize
    cache = 2 * c.num_layers * c.num_kv_heads * (args.prompt + new) * c.head_dim * itemsize  # batch 1
    cache_and_logits = cache + gen.logits.nbytes
    made, copied = step_writes(compiled.as_text(), f"[{new},1,{c.vocab_size}]")

    # flatness: each decode step alone
    steps = []
    it = stream(model, tokens, max_new_tokens=new)
    next(it)  # the prefill (and the compile of both steps' functions on the first step)
    t = time.perf_counter()
    for _ in it:
        now = time.perf_counter()
        steps.append(now - t)
        t = now
    early, late = min(steps[1:33]), min(steps[-32:])  # the best of each: machine noise only adds time

    # a sweep of steering strengths: one vmapped generate against one call per strength
    v = jnp.asarray(np.random.default_rng(1).normal(size=model.config.hidden_size).astype(np.float32))
    strengths = jnp.linspace(0.0, 4.0, args.sweep)
    steer = lambda s: jstd.generate(model, tokens, [jstd.Add("layers.layer_output", s * v, layer=4)],
                                    max_new_tokens=new, eos_token_id=())
    swept = jax.jit(jax.vmap(steer))
    swept_made, swept_copied = step_writes(swept.lower(strengths).compile().as_text(),
                                           f"[{args.sweep},{new},1,{c.vocab_size}]")
    swept(strengths).tokens.block_until_ready()
    steer(strengths[0]).tokens.block_until_ready()
    t_swept = common.timeit(lambda: swept(strengths).tokens.block_until_ready(), args.repeats, 1)
    t_loop = common.timeit(lambda: [steer(s).tokens.block_until_ready() for s in strengths], args.repeats, 1)

    products = product_times((1, args.sweep))
    bandwidth_after = read_bandwidth()
    bandwidth = max(bandwidth_before, bandwidth_after)
    bound = weights / bandwidth

    print_table(f"## Generation ({jax.default_backend()}, {args.dtype}, batch 1, {args.prompt}-token prompt, "
                f"{new} new tokens)", [
        ("greedy decoding, tokens per second (jstd / transformers generate)", f"{t_torch / t_jstd:.2f}x",
         f"jstd {new / t_jstd:,.1f} tok/s, transformers {new / t_torch:,.1f} tok/s; first call (compile) "
         f"{first:.2f} s; tokens agree for the first {agree} of {new}"),
        ("per-token time / memory-bandwidth bound", f"{per_token / bound:.2f}x",
         f"{per_token * 1e3:.2f} ms per token; weights read {weights / 2**20:.1f} MiB ({args.dtype}) at a "
         f"bandwidth of {bandwidth / 1e9:.1f} GB/s (read; {bandwidth_before / 1e9:.1f} before the timed runs, "
         f"{bandwidth_after / 1e9:.1f} after) = {bound * 1e3:.2f} ms"),
        ("the step's products alone (one one-row product per weight) / the bound", f"{t_products / bound:.2f}x",
         f"{t_products * 1e3:.2f} ms per token over {product_bytes / 2**20:.1f} MiB "
         f"({product_bytes / t_products / 1e9:.1f} GB/s); interleaved with generate at {t_step * 1e3:.2f} ms per "
         f"token: the products are {t_products / t_step:.0%} of a step, the rest {1 - t_products / t_step:.0%}"),
        ("compiled generate's temporary memory / the weights' bytes", f"{temp / weights:.2f}x",
         f"{temp / 2**20:.1f} MiB vs {weights / 2**20:.1f} MiB (of which the cache and the logits: "
         f"{cache_and_logits / 2**20:.1f} MiB)"),
        ("a decoding step's memory traffic besides the weights / the weights' bytes (compiled loop, not timed)",
         f"{(2 * (made + copied) + cache) / weights:.3f}x",
         f"batch 1: writes {made / 2**20:.2f} MiB besides its products and its in-place cache and logits writes "
         f"(copies {copied / 2**20:.2f} MiB), each read again, and reads the whole cache, {cache / 2**20:.2f} MiB "
         f"(every position, masked); the {args.sweep}-strength sweep: writes {swept_made / 2**20:.2f} MiB (copies "
         f"{swept_copied / 2**20:.2f} MiB), reads its caches, {args.sweep * cache / 2**20:.2f} MiB, "
         f"{(2 * (swept_made + swept_copied) + args.sweep * cache) / weights:.3f}x the weights"),
        ("per-token decode cost, last 32 / first 32 steps", f"{late / early:.2f}x",
         f"{late * 1e3:.2f} ms vs {early * 1e3:.2f} ms (best of each 32; medians {statistics.median(steps[-32:]) * 1e3:.2f} "
         f"vs {statistics.median(steps[1:33]) * 1e3:.2f} ms; steps run one at a time)"),
        (f"{args.sweep} steering strengths: {args.sweep} calls / one vmapped call", f"{t_loop / t_swept:.2f}x",
         f"{t_loop:.2f} s vs {t_swept:.2f} s"),
        (f"a [{args.sweep}, 512] @ [512, 1408] product / a [1, 512] one, weights from memory",
         f"{products[args.sweep] / products[1]:.2f}x",
         f"{products[args.sweep]:.3f} ms vs {products[1]:.3f} ms: what bounds the sweep ({args.sweep} / this)"),
    ])


if __name__ == "__main__":
    main()
