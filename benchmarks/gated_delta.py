"""Benchmark the gated delta rule kernels on the CPU (float32, B=1, H=8, dk=dv=128).

    .venv/bin/python benchmarks/gated_delta.py [--reps 7] [--lengths 2048 8192] [--peak-only]

Times (median, and best, of ``--reps`` interleaved runs after a compile / warm-up run):

* the plain float32 matmul peak (``jax.jit(lambda a, b: a @ b)``, 2048 x 2048) and the
  chunked form at each T, interleaved (3 x ``--reps`` runs), with the chunked form's
  GFLOP/s on its own multiply-adds and its ratio to that peak (all this machine allows
  on a busy machine: other processes slow both alike); ``--peak-only`` stops there;
* jstd's chunked form vs jstd's recurrent scan at T=2048 (the two interleaved);
* jstd's chunked form vs transformers' ``torch_chunk_gated_delta_rule`` (torch with its
  default threads) at T=2048 and T=8192, in the same process, runs interleaved;

* the chunked form at chunk sizes 16 / 32 / 64 / 128 (T=2048);

a measured roofline for the chunked form (its exact multiply-add count, see
:func:`chunk_macs`, against this machine's measured float32 matmul throughput in XLA,
see :func:`matmul_throughput`), giving the best chunked time possible here and so an
upper bound on the chunked / recurrent ratio; and the chunked form's compiled memory
(``memory_analysis``) at several T, without and with per-token states, to show linear
growth. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import inspect
import os
import time

from common import time_interleaved  # (first: it imports jstd, which starts JAX quietly)

import jax
import jax.numpy as jnp
import numpy as np

from jstd.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule

B, H, D = 1, 8, 128


def inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(3))
    g = (-np.exp(rng.uniform(-1.5, 0.5, (1, 1, H))) * np.log1p(np.exp(rng.standard_normal((B, T, H)) - 1.0))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, T, H))))).astype(np.float32)
    return q, k, v, g, beta


def jax_fn(form, **kw):
    fn = {"chunk": chunk_gated_delta_rule, "recurrent": recurrent_gated_delta_rule}[form]
    f = jax.jit(lambda q, k, v, g, b: fn(q, k, v, g, b, use_qk_l2norm=True, **kw))
    return lambda *a: jax.block_until_ready(f(*a))


def unit_lower_inverse_macs(C: int) -> int:
    """Multiply-adds of :func:`jstd.kernels.gated_delta.unit_lower_inverse` on one C x C matrix.

    Merging two inverted diagonal s-blocks costs ``Z = -(Y M21) X``: 2 s^3 multiply-adds
    (none for s = 1, where X = Y = 1); a level has C / (2s) merges, so it costs C s^2, and
    the levels are s = 2, 4, ..., C/2.
    """
    total, s = 0, 2
    while s < C:
        total += C * s * s
        s *= 2
    return total


def chunk_macs(T: int, H: int = H, Dk: int = D, Dv: int = D, C: int = 64) -> dict:
    """Exact multiply-add count of ``chunk_gated_delta_rule`` (as implemented), by term.

    ``N = ceil(T / C)`` chunks, each for ``H`` heads; per chunk and head:

    * ``k k^T``: C^2 Dk (the full C x C product; only its strict lower triangle is used),
    * ``q k^T``: C^2 Dk (full product; lower triangle used) -- one product with ``k k^T``,
    * pairwise decay differences ``gamma_i - gamma_j`` as a K=2 product: 2 C^2,
    * the unit-triangular inverse ``T = (I + A)^{-1}``: :func:`unit_lower_inverse_macs`,
    * ``w S`` / ``q S`` (``k S`` and ``q S`` with the incoming state, one product): 2 C Dk Dv,
    * ``w / u`` (``T (beta v - beta e^gamma k S)``: T applied once, to a [C, Dv] right
      side, i.e. ``u - w S`` without forming w and u): C^2 Dv,
    * intra-chunk mix ``(q k^T * decay) delta``: C^2 Dv,
    * state update ``(k e^(gamma_C - gamma))^T delta``: C Dk Dv.

    Element-wise work (decays, masks, l2norm, the state decay) is not counted. The
    recurrence, for comparison, does 3 Dk Dv per token and head (``S^T [k, q]`` and
    ``k delta^T``): the chunked form's ``2 C Dk Dv + C Dk Dv`` is the same amount, and
    every other term is extra.
    """
    N = -(-T // C)
    per_chunk = {
        "k k^T + q k^T": 2 * C * C * Dk,
        "decay differences": 2 * C * C,
        "triangular inverse": unit_lower_inverse_macs(C),
        "k S + q S": 2 * C * Dk * Dv,
        "T (beta v - w S)": C * C * Dv,
        "intra-chunk mix": C * C * Dv,
        "state update": C * Dk * Dv,
    }
    return {name: N * H * m for name, m in per_chunk.items()}


def recurrent_macs(T: int, H: int = H, Dk: int = D, Dv: int = D) -> int:
    """Multiply-adds of the recurrent scan: 3 Dk Dv per token and head."""
    return 3 * T * H * Dk * Dv


def product_shapes(C: int) -> dict:
    """The chunked form's batched products at chunk size C (8 heads, D = 128), keyed by
    the :func:`chunk_macs` terms they compute: (lhs shape, rhs shape, einsum)."""
    return {
        "k k^T + q k^T": ((H, 2 * C, D), (H, C, D), "hik,hjk->hij"),
        "k S + q S": ((H, 2 * C, D), (H, D, D), "hij,hjk->hik"),
        "T (beta v - w S)": ((H, C, C), (H, C, D), "hij,hjk->hik"),
        "intra-chunk mix": ((H, C, C), (H, C, D), "hij,hjk->hik"),
        "state update": ((H, D, C), (H, C, D), "hkc,hcv->hkv"),
    }


def matmul_throughput(chunk_sizes=(16, 64), reps: int = 5) -> dict:
    """Best measured float32 matmul throughput (GFLOP/s, 2 flops per multiply-add) of a
    jitted XLA dot (HIGHEST precision, as in the kernel) for a large square matmul, a
    [8] 64x128 @ 128x128 batch, and the batched shapes of the chunked form's products at
    the given chunk sizes (:func:`product_shapes`), each the best of ``reps`` timed calls,
    with the number of cores it kept busy (process CPU time / wall time, over all calls).
    Returns ``{name: (GFLOP/s, busy)}``; the products' names are ``"C=<size>: <term>"``."""
    rng = np.random.default_rng(0)
    shapes = {  # name: (lhs shape, rhs shape, einsum)
        "2048x2048 @ 2048x2048": ((2048, 2048), (2048, 2048), "ij,jk->ik"),
        "[8] 64x128 @ 128x128": ((8, 64, 128), (8, 128, 128), "hij,hjk->hik"),
    }
    for C in chunk_sizes:
        shapes |= {f"C={C}: {term}": shape for term, shape in product_shapes(C).items() if term != "intra-chunk mix"}
    out = {}
    for name, (sa, sb, spec) in shapes.items():
        a = jnp.asarray(rng.standard_normal(sa), jnp.float32)
        b = jnp.asarray(rng.standard_normal(sb), jnp.float32)
        f = jax.jit(lambda a, b, spec=spec: jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST))
        ins = spec.split("->")[0]
        dims = dict(zip(ins.split(",")[0], sa)) | dict(zip(ins.split(",")[1], sb))
        macs = int(np.prod([dims[c] for c in set(ins) - {","}]))
        n = max(1, int(1e9 // macs))  # ~1 G multiply-adds per timed call, in one loop
        # each product depends on the previous one's result, which the loop carries whole,
        # so that none is hoisted out of the loop, skipped or shrunk; the extra element-wise
        # work is ~1% of the product's
        run = jax.jit(lambda a, b, f=f, n=n: jax.lax.fori_loop(0, n, lambda i, out: f(a * (1.0 + 0.0 * out.ravel()[0]), b), f(a, b)))
        jax.block_until_ready(run(a, b))
        walls, cpus = [], []
        for _ in range(reps):
            w, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(run(a, b))
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        out[name] = (2 * macs * n / min(walls) / 1e9, sum(cpus) / sum(walls))
    for C in chunk_sizes:  # the same shape as the T product
        out[f"C={C}: intra-chunk mix"] = out[f"C={C}: T (beta v - w S)"]
    return out


def cpu_description() -> str:
    """The CPU model and its widest vector extension, from /proc/cpuinfo ("" where unreadable)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return ""
    field = lambda key: next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith(key)), "?")
    flags = field("flags").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2 + FMA (no AVX-512)" if "fma" in flags else "no FMA"
    return f"{field('model name')} (family {field('cpu family')}, model {field('model')}), {isa}"


def _interleaved_wall_and_cpu(runs: dict, reps: int) -> dict:
    """Like ``common.time_interleaved`` (two warm-up calls each, then ``reps`` rounds of one
    call each), also recording process CPU time: ``{name: (best wall, median wall, best CPU)}``
    in seconds. CPU time per call is steadier than wall time on a busy machine."""
    for f in runs.values():
        f()
        f()
    walls, cpus = {name: [] for name in runs}, {name: [] for name in runs}
    for _ in range(reps):
        for name, f in runs.items():
            w, c = time.perf_counter(), time.process_time()
            f()
            walls[name].append(time.perf_counter() - w)
            cpus[name].append(time.process_time() - c)
    return {name: (min(walls[name]), float(np.median(walls[name])), min(cpus[name])) for name in runs}


def plain_dot_vs_kernel(lengths, reps: int, C: int) -> None:
    """Prints the plain float32 matmul peak (``jax.jit(lambda a, b: a @ b)`` on 2048 x 2048,
    default precision, which is full float32 on the CPU) and the chunked form's throughput on
    its own multiply-adds (:func:`chunk_macs` at chunk size ``C``), at each T, the two timed
    in the same process, runs interleaved, so that a busy machine slows both alike: best and
    median wall time of ``reps`` runs each, and the best process CPU time (GFLOP per
    CPU-second), with the ratio of the kernel's figure to the dot's for each."""
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal((2048, 2048)), jnp.float32) for _ in range(2))
    dot = jax.jit(lambda a, b: a @ b)
    dot_flops = 2 * 2048**3
    chunk = jax_fn("chunk", chunk_size=C)
    print(f"\nPlain-dot peak and the chunked form (chunk {C}), interleaved runs, {reps} each "
          f"(load average before: {os.getloadavg()[0]:.1f}); GFLOP/s as best / median wall, and per CPU-second:\n")
    print("| T | plain dot 2048^3, GFLOP/s | chunked form (ms, best / median) | chunked form, GFLOP/s on its "
          "multiply-adds | chunked / peak (best / median / CPU) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for T in lengths:
        jx = [jnp.asarray(x) for x in inputs(T)]
        t = _interleaved_wall_and_cpu({"dot": lambda: jax.block_until_ready(dot(a, b)), "chunk": lambda: chunk(*jx)}, reps)
        flops = 2 * sum(chunk_macs(T, C=C).values())
        peak = [dot_flops / x / 1e9 for x in t["dot"]]
        ours = [flops / x / 1e9 for x in t["chunk"]]
        fmt = lambda xs: " / ".join(f"{x:.0f}" for x in xs)
        print(f"| {T} | {fmt(peak)} | {t['chunk'][0] * 1e3:.1f} / {t['chunk'][1] * 1e3:.1f} | {fmt(ours)} "
              f"| {' / '.join(f'{o / p:.0%}' for o, p in zip(ours, peak))} |")
    print(f"\n(load average after: {os.getloadavg()[0]:.1f}; {flops / 2 / 1e9:.3f} G multiply-adds at T={T})")


def torch_fn():
    import torch
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import torch_chunk_gated_delta_rule

    def run(*a):
        with torch.no_grad():
            return torch_chunk_gated_delta_rule(*a, output_final_state=True, use_qk_l2norm_in_kernel=True)

    return run, torch


def memory(T, return_states=False):
    sd = jax.ShapeDtypeStruct
    args = (sd((B, T, H, D), jnp.float32),) * 3 + (sd((B, T, H), jnp.float32),) * 2
    f = jax.jit(lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm=True, return_states=return_states))
    m = f.lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes, m.output_size_in_bytes


def roofline(T: int, t_rec: tuple, C: int) -> None:
    """Prints the measured roofline at chunk size C: the chunked form's multiply-adds at T
    against the measured matmul throughput, the best chunked time that allows, and the
    resulting upper bound on recurrent / chunked (``t_rec``: the recurrent scan's
    (median, best) seconds)."""
    tput = matmul_throughput(chunk_sizes=sorted({C, 64}))
    print("\nMeasured float32 matmul throughput in XLA (jitted dot, HIGHEST precision, best run):\n")
    print("| product | GFLOP/s | cores busy |")
    print("| --- | ---: | ---: |")
    for name, (gflops, busy) in tput.items():
        print(f"| {name} | {gflops:.0f} | {busy:.2f} |")
    peak, busy = max(tput.values())
    macs = chunk_macs(T, C=C)
    total = sum(macs.values())
    # each product at its own shape's measured throughput; the small terms at the peak
    at_shape = sum(2 * m / (tput.get(f"C={C}: {term}", (peak,))[0] * 1e9) for term, m in macs.items())
    print(f"\nChunked form's multiply-adds at T={T} (chunk {C}, H={H}, dk=dv={D}; formula in chunk_macs):\n")
    print("| term | multiply-adds (M) |")
    print("| --- | ---: |")
    for name, m in macs.items():
        print(f"| {name} | {m / 1e6:.1f} |")
    print(f"| total | {total / 1e6:.1f} |")
    print(f"| (recurrent scan, for comparison) | {recurrent_macs(T) / 1e6:.1f} |")
    best = 2 * total / (peak * 1e9)  # seconds at the measured peak
    floor = 2 * recurrent_macs(T) / (peak * 1e9)  # any chunked form does at least the recurrence's products
    rec = t_rec[0]
    n = os.cpu_count()
    per_core = max(g / max(b, 1.0) for g, b in tput.values())  # GFLOP/s per busy core
    floor_all = 2 * recurrent_macs(T) / (n * per_core * 1e9)  # hypothetical: every core at that rate
    print(f"\nRoofline at T={T}: recurrent scan {rec * 1e3:.1f} ms (median; {2 * recurrent_macs(T) / rec / 1e9:.0f} GFLOP/s); "
          f"measured peak {peak:.0f} GFLOP/s, keeping {busy:.2f} cores busy\n")
    print("| bound | chunked time at least (ms) | recurrent / chunked at most | target |")
    print("| --- | ---: | ---: | ---: |")
    for name, t in (
        (f"chunked form's {total / 1e9:.3f} G multiply-adds, each product at its shape's measured throughput", at_shape),
        (f"chunked form's {total / 1e9:.3f} G multiply-adds at the measured peak", best),
        (f"any chunked form (only the recurrence's {recurrent_macs(T) / 1e9:.3f} G) at the measured peak", floor),
        (f"same, if all {n} cores ran at the best per-core rate, {per_core:.0f} GFLOP/s (XLA does not)", floor_all),
    ):
        ok = "reachable" if rec / t >= 10 else "unreachable"
        print(f"| {name} | {t * 1e3:.1f} | {rec / t:.1f}x | >= 10x ({ok}) |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--torch-one-thread", action="store_true", help="also time torch on one thread")
    ap.add_argument("--peak-only", action="store_true", help="only the plain-dot peak against the chunked form")
    args = ap.parse_args()

    tfn, torch = torch_fn()
    nthreads = torch.get_num_threads()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}), "
          f"torch {torch.__version__} with {nthreads} threads")
    print(f"CPU: {cpu_description()}")
    print(f"float32, B={B}, H={H}, dk=dv={D}, use_qk_l2norm=True; median of {args.reps} interleaved runs (ms)")
    default_chunk = inspect.signature(chunk_gated_delta_rule).parameters["chunk_size"].default
    plain_dot_vs_kernel(args.lengths, 3 * args.reps, default_chunk)
    if args.peak_only:
        return
    print()

    rows, t_rec = [], None
    chunk, rec = jax_fn("chunk"), jax_fn("recurrent")
    for T in args.lengths:
        x = inputs(T)
        tx = [torch.from_numpy(a) for a in x]
        jx = [jnp.asarray(a) for a in x]
        if T == 2048:  # without torch in the set: its idle threads spin, slowing the next run
            t = time_interleaved({"chunk": lambda: chunk(*jx), "recurrent": lambda: rec(*jx)}, args.reps)
            rows.append((f"jstd recurrent scan / jstd chunked, T={T}", t["recurrent"], t["chunk"], 10.0))
            t_rec = t["recurrent"]
        t = time_interleaved({"chunk": lambda: chunk(*jx), "torch": lambda: tfn(*tx)}, args.reps)
        rows.append((f"torch chunked ({nthreads} threads) / jstd chunked, T={T}", t["torch"], t["chunk"], 1.5))
        if args.torch_one_thread:  # informational: torch's threads suffer most on a busy machine
            torch.set_num_threads(1)
            t1 = time_interleaved({"chunk": lambda: chunk(*jx), "torch": lambda: tfn(*tx)}, args.reps)
            torch.set_num_threads(nthreads)
            rows.append((f"torch chunked (1 thread) / jstd chunked, T={T}", t1["torch"], t1["chunk"], None))

    print("| comparison | other (ms) | jstd chunked (ms) | speed-up (median) | speed-up (best runs) | target |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (other, other_min), (ours, ours_min), target in rows:
        goal = "-" if target is None else f">= {target:g}x ({'met' if other / ours >= target else 'NOT met'})"
        print(f"| {name} | {other * 1e3:.1f} | {ours * 1e3:.1f} | {other / ours:.2f}x | {other_min / ours_min:.2f}x | {goal} |")
    print(f"\n(load average after timing: {os.getloadavg()[0]:.1f})")

    T = 2048
    jx = [jnp.asarray(a) for a in inputs(T)]
    sizes = {C: jax_fn("chunk", chunk_size=C) for C in (16, 32, 64, 128)}
    tc = time_interleaved({C: (lambda f=f: f(*jx)) for C, f in sizes.items()}, args.reps)
    print(f"\nChunked form by chunk size, T={T} (ms, median / best of {args.reps} interleaved runs):\n")
    print("| chunk size | " + " | ".join(str(C) for C in tc) + " |")
    print("| --- |" + " ---: |" * len(tc))
    print("| time | " + " | ".join(f"{m * 1e3:.1f} / {b * 1e3:.1f}" for m, b in tc.values()) + " |")
    print("| multiply-adds (G) | " + " | ".join(f"{sum(chunk_macs(T, C=C).values()) / 1e9:.3f}" for C in tc) + " |")

    if t_rec is not None:
        roofline(T, t_rec, default_chunk)

    print("\nCompiled memory of the chunked form (memory_analysis, MiB):\n")
    print("| T | temp | output (out + final state) | total | total / T (KiB per token) | temp with states | output with states |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for T in (1024, 2048, 4096, 8192, 16384, 32768):
        tmp, out = memory(T)
        row = f"| {T} | {tmp / 2**20:.2f} | {out / 2**20:.2f} | {(tmp + out) / 2**20:.2f} | {(tmp + out) / T / 1024:.2f} |"
        if T <= 4096:
            tmp_s, out_s = memory(T, True)
            row += f" {tmp_s / 2**20:.1f} | {out_s / 2**20:.1f} |"
        else:
            row += " - | - |"
        print(row)
    print("\n(per-token states alone are T x 8 heads x 128 x 128 x 4 B = 512 KiB per token)")


if __name__ == "__main__":
    main()
