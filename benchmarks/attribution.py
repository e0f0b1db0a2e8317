"""Attribution graphs: ``jstd.attribute`` against circuit-tracer 0.5.0 on issue 37's benchmark case.

The case (scripts/circuit_tracer/time_attribution.py writes it, in circuit-tracer's own venv, and times
circuit-tracer on it): a random 4-block, 256-wide Llama (4 heads of 64, 2 KV heads, MLP 1024, vocab 512), a ReLU
cross-layer transcoder with 1024 features per block (``mlp.hook_in`` -> ``mlp.hook_out``), a 24-token prompt with
about 2,900 active features, and 16 prompts of the same length. Reported for jstd, float32 on the CPU:

1. compile: the first ``attribute`` call (the prompt's forward, and per batch shape the batched backward and the
   on-device contraction with the sources), apart from the runs;
2. one prompt, warm, best of ``--repeats``, at each ``--batch-sizes``, with the graph checked against
   circuit-tracer's (every adjacency entry within 1e-5 of the largest);
3. 16 prompts in one ``attribute`` call (a list of prompts, padded on the right to one length: one forward for
   all, every program shared; the first call apart), and its ratio to 16 times the one-prompt figure.

circuit-tracer's figures are read from the case's ``case.json`` (``benchmark.timing``: its warm best over batch
sizes, and its 16 prompts one after another), measured by time_attribution.py on the same machine just before::

    make circuit-tracer                                              # .venv-ct, once
    .venv-ct/bin/python scripts/circuit_tracer/time_attribution.py /tmp/bench --n-prompts 16
    python benchmarks/attribution.py --case /tmp/bench/bench_llama4x256_clt1024

``--flops`` prints instead the work of the batched programs one graph runs, from XLA's cost analysis of each compiled
program times its calls (the backward's scan over blocks is counted once by the analysis, so its figure is
multiplied by the program's depth), beside the minimal count of the local replacement model's products: each row
backpropagated through the attention value/output maps of the blocks up to its own and the positions up to its
own, and contracted with the sources at those blocks and positions. Counts, not timings: run it anywhere.

Without ``--case`` it builds a case of the same shape itself (random weights; no circuit-tracer figure):
``python benchmarks/attribution.py [--tiny]`` (``--tiny``: 2 blocks, 64 wide, a smoke run).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

TARGET_ACTIVE = 2900


def build_case(folder: Path, tiny: bool, n_prompts: int) -> dict:
    """A Llama and a ReLU CLT of the benchmark's shape (random), ``b_enc`` shifted so ~2,900 features (tiny: 200)
    are active on the first prompt; returns a case.json-like dict."""
    import jax.numpy as jnp
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import jstd
    from jstd.circuits import Transcoders, save_transcoders

    L, d, F, vocab, n = (2, 64, 256, 128, 16) if tiny else (4, 256, 1024, 512, 24)
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(folder / "model")
    rng = np.random.default_rng(6)
    prompts = [[1] + rng.integers(4, vocab, n - 1).tolist() for _ in range(n_prompts)]
    model = jstd.load(folder / "model")
    x = np.asarray(jstd.run(model, jnp.asarray([prompts[0]]), reads=("layers.mlp_input",))["layers.mlp_input"][:, 0])
    W_enc = rng.normal(0, 1 / np.sqrt(d), (L, F, d)).astype(np.float32)
    pre = np.einsum("lpd,lfd->lpf", x[:, 1:], W_enc).reshape(-1)
    want = 200 if tiny else TARGET_ACTIVE
    shift = float(np.sort(pre)[::-1][want - 1: want + 1].mean())
    tc = Transcoders(jnp.asarray(W_enc), jnp.full((L, F), -shift, jnp.float32),
                     tuple(jnp.asarray(rng.normal(0, 0.05, (F, L - l, d)), jnp.float32) for l in range(L)),
                     jnp.zeros((L, d), jnp.float32), None, None, cross_layer=True, scan="local/bench")
    save_transcoders(tc, folder / "transcoders")
    return {"prompt_ids_given": prompts[0][1:], "benchmark": {"prompts_given": [p[1:] for p in prompts]}}


def flops(model, prompt, tc, batch_size: int) -> list[tuple[str, str, str]]:
    """The rows of ``--flops`` (module docstring): GFLOP of the batched programs of one graph, and the minimum."""
    import collections
    import sys

    import jax.numpy as jnp

    from jstd.circuits import attribute
    from jstd.circuits.replacement import prompt_values

    module = sys.modules["jstd.circuits.attribute"]  # the module (jstd.circuits.attribute: the function)
    calls, lowered = collections.Counter(), {}
    inner = {name: getattr(module, name) for name in ("target_gradients", "source_columns")}

    def spy(name, *args, **kw):
        key = (name, tuple(np.shape(a) for a in args[:6] if hasattr(a, "shape")), tuple(sorted(kw.items())))
        calls[key] += 1
        lowered.setdefault(key, lambda: inner[name].lower(*args, **kw))
        return inner[name](*args, **kw)

    for name in inner:
        setattr(module, name, lambda *a, _n=name, **kw: spy(_n, *a, **kw))
    try:
        graph = attribute(model, prompt, tc, batch_size=batch_size)
    finally:
        for name, fn in inner.items():
            setattr(module, name, fn)
    total = collections.Counter()
    for key, count in calls.items():
        cost = lowered[key]().compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        depth = dict(key[2]).get("depth") or tc.num_layers
        total[key[0]] += cost.get("flops", 0.0) * count * (depth if key[0] == "target_gradients" else 1)
    # the minimum: per row, per block up to its own and position up to its own, the value/output maps (and the
    # mixing by the held pattern); then the contraction with the sources written at those blocks and positions
    c = model.config
    ids = jnp.asarray(np.asarray(prompt)[None], jnp.int32)
    x = prompt_values(model, ids, tc.input_site, tc.output_site)["x"][:, 0].astype(jnp.float32)
    layer, pos, _ = np.nonzero(np.asarray(tc.encode(x))[:, 1:])
    pos = pos + 1
    heads, kv, hd, d = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    per_position = 2 * d * hd * (heads + kv)
    backward = sum((l + 1) * ((p + 1) * per_position + 2 * heads * hd * (p + 1) * (p + 2) / 2)
                   for l, p in zip(layer, pos))
    writers = [np.bincount(pos[layer <= m], minlength=len(prompt)) for m in range(tc.num_layers)]
    contraction = sum(2 * d * sum(writers[m][:p + 1].sum() for m in range(l)) for l, p in zip(layer, pos))
    g = lambda f: f"{f / 1e9:.2f}"
    return [("batched backward (target_gradients)", g(total["target_gradients"]), f"{graph.n_features} rows"),
            ("contraction with the sources (source_columns)", g(total["source_columns"]), ""),
            ("minimal backward", g(backward), "value/output maps to each row's block and position"),
            ("minimal contraction", g(contraction), "sources at each row's blocks and positions")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default=None, help="time_attribution.py's case folder (bench_llama4x256_clt1024)")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[64, 128, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="without --case: a 2-block, 64-wide smoke case")
    ap.add_argument("--flops", action="store_true", help="print the programs' GFLOP (cost analysis), no timing")
    args = ap.parse_args()

    import jax

    import jstd
    from jstd.circuits import attribute, load_transcoders

    tmp = None
    if args.case:
        case_dir = Path(args.case)
        case = json.loads((case_dir / "case.json").read_text())
    else:
        tmp = tempfile.TemporaryDirectory()
        case_dir = Path(tmp.name)
        case = build_case(case_dir, args.tiny, args.n_prompts)
    model = jstd.load(case_dir / "model")
    tc = load_transcoders(case_dir / "transcoders")
    bos = [1]
    prompt = np.asarray(bos + case["prompt_ids_given"])
    prompts = [np.asarray(bos + p) for p in case["benchmark"]["prompts_given"][:args.n_prompts]]

    if args.flops:
        print("| program | GFLOP | detail |\n| --- | --- | --- |")
        for r in flops(model, prompt, tc, args.batch_sizes[0]):
            print(f"| {r[0]} | {r[1]} | {r[2]} |")
        return

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    rows = []
    compile_s, graph = timed(lambda: attribute(model, prompt, tc, batch_size=args.batch_sizes[0]))
    rows.append(("first call (compiles)", f"{compile_s:.2f} s", ""))
    ref_file = case_dir / "graph.safetensors"
    if ref_file.exists():
        from jstd.io.safetensors import SafetensorsFiles

        want = np.array(SafetensorsFiles(ref_file).mapped("adjacency_matrix", lazy=True))
        err = float(np.abs(graph.adjacency - want).max() / np.abs(want).max())
        rows.append(("graph vs circuit-tracer's", f"{err:.1e}", "max |Δ| / max |A| (must be <= 1e-5)"))
    best, best_bs = None, None
    for bs in args.batch_sizes:
        attribute(model, prompt, tc, batch_size=bs)  # compiles this batch size
        s = min(timed(lambda: attribute(model, prompt, tc, batch_size=bs))[0] for _ in range(args.repeats))
        rows.append((f"one prompt, batch {bs}", f"{s:.3f} s", f"{graph.n_features} features, {graph.n_nodes} nodes"))
        best, best_bs = (s, bs) if best is None or s < best else (best, best_bs)
    first, _ = timed(lambda: attribute(model, prompts, tc, batch_size=best_bs))  # at the best batch size
    many, graphs = timed(lambda: attribute(model, prompts, tc, batch_size=best_bs))
    rows.append((f"{len(prompts)} prompts in one call (batch {best_bs}), first (compiles)", f"{first:.3f} s", ""))
    rows.append((f"{len(prompts)} prompts in one call", f"{many:.3f} s",
                 f"{sum(g.n_features for g in graphs)} features in all; "
                 f"{many / (len(prompts) * best):.2f} x {len(prompts)} one-prompt runs"))
    timing = case.get("benchmark", {}).get("timing")
    if timing:
        ct = timing["best_seconds"]
        rows.append(("circuit-tracer, one prompt (best batch)", f"{ct:.3f} s", f"jstd is {ct / best:.1f}x faster"))
        if "n_prompts_seconds_sequential" in timing:
            ct16 = timing["n_prompts_seconds_sequential"]
            rows.append((f"circuit-tracer, {timing['n_prompts']} prompts", f"{ct16:.3f} s",
                         f"jstd is {ct16 / many:.1f}x faster"))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print("| figure | seconds | detail |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
