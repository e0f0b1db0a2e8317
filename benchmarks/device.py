"""jstd on one GPU, against torch on the same card: the figures a lent accelerator gives in one short run.

    python benchmarks/device.py SECTION [--smoke]

Sections (each prints a markdown table; ``benchmarks/device.sh`` runs them all, each under its own time limit):

* ``peak``: the card, the versions, and the matrix-product peaks measured here (8192³ bf16 in JAX and in torch;
  float32 at HIGHEST precision in JAX, as jstd's float32 parity runs use it).
* ``gated_delta``: the gated delta rule at Qwen3-Next's / Qwen3.5's sizes (32 value heads over 16 key heads,
  dk = dv = 128, batch 1, float32 state), the Pallas kernel (``jstd.kernels.pallas``, what ``jstd.kernels.select``
  picks on a GPU) against jstd's plain-JAX chunked form (XLA), jstd's recurrent scan, and transformers'
  ``torch_chunk_gated_delta_rule`` on the same card; the largest difference of each from the chunked form.
* ``forward``: Llama-3.1-8B's shape (4 of its 32 blocks, random weights, bf16), ``jax.jit(jstd.run)`` against
  transformers' model (sdpa) on the same card, interleaved medians, at 1 × 4096 and 8 × 1024 tokens; the
  achieved TFLOP/s beside the measured bf16 peak; the logits' difference.
* ``attribution``: ``jstd.attribute`` on issue 37's benchmark shape (4 × 256 Llama, a 1024-per-block CLT, 24
  tokens, ~2,900 active features; random weights made here): compile apart, one prompt warm, 16 prompts in one
  call. (circuit-tracer pins transformers <= 4.57.3 and has no place on the card's image: its figure is the CPU's.)

The patching sweeps run through ``benchmarks/patching.py --device cuda`` (``device.sh``). ``--smoke``: tiny sizes,
for checking the script on a CPU before a device run.
"""

from __future__ import annotations

import argparse
import sys
import time

from common import time_interleaved  # first: jstd quiets the accelerator plugins' start-up noise; the guard

import jax
import jax.numpy as jnp
import numpy as np

import jstd

SMOKE = False


def table(heading: str, rows) -> None:
    print(f"\n{heading}\n\n| figure | value | detail |\n| --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    sys.stdout.flush()


def interleaved(runs: dict, reps: int) -> dict:
    """Median seconds of each blocking callable (``common.time_interleaved``: two warm-up calls each, runs
    interleaved)."""
    return {k: median for k, (median, _) in time_interleaved(runs, reps).items()}


def torch_sync(fn):
    import torch

    def run():
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out
    return run


def card() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"no GPU ({jax.devices()[0].platform})"


def versions() -> str:
    import torch
    import transformers

    return (f"{card()}; jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------------------------- peak
def jax_peak(dtype, n: int, precision=None) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, precision=precision))
    t = interleaved({"dot": lambda: f(a, a).block_until_ready()}, 10)["dot"]
    return 2 * n ** 3 / t / 1e12


def torch_peak(n: int) -> float:
    import torch

    dev = torch_device()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dtype)
    t = interleaved({"mm": torch_sync(lambda: a @ a)}, 10)["mm"]
    return 2 * n ** 3 / t / 1e12


def section_peak():
    n = 1024 if SMOKE else 8192
    rows = [("bf16 dot, JAX", f"{jax_peak(jnp.bfloat16, n):.0f} TFLOP/s", f"{n}³"),
            ("bf16 dot, torch", f"{torch_peak(n):.0f} TFLOP/s", f"{n}³"),
            ("float32 dot, JAX, HIGHEST", f"{jax_peak(jnp.float32, n, jax.lax.Precision.HIGHEST):.1f} TFLOP/s",
             f"{n}³ (jstd's float32 parity setting)"),
            ("float32 dot, JAX, default", f"{jax_peak(jnp.float32, n):.1f} TFLOP/s", f"{n}³ (TF32 where allowed)")]
    table(versions(), rows)


# -------------------------------------------------------------------------------------------------------- gated delta
def section_gated_delta():
    import torch

    from jstd.kernels.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
    from jstd.kernels.pallas.gated_delta import pallas_chunk_gated_delta_rule

    Hk, H, D = (2, 4, 32) if SMOKE else (16, 32, 128)
    lengths = (256,) if SMOKE else (4096, 16384)
    interpret = jax.default_backend() == "cpu"
    rows = []
    for T in lengths:
        rng = np.random.default_rng(0)
        q, k = (rng.standard_normal((1, T, Hk, D)).astype(np.float32) for _ in range(2))
        v = rng.standard_normal((1, T, H, D)).astype(np.float32)
        g = (-np.exp(rng.uniform(-1.5, 0.5, (1, 1, H))) * np.log1p(np.exp(rng.standard_normal((1, T, H)) - 1.0))).astype(np.float32)
        beta = (1 / (1 + np.exp(-rng.standard_normal((1, T, H))))).astype(np.float32)
        args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(g), jnp.asarray(beta)]
        forms = {
            "pallas": jax.jit(lambda *a: pallas_chunk_gated_delta_rule(*a, use_qk_l2norm=True, interpret=interpret)),
            "chunked (XLA)": jax.jit(lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm=True)),
            "recurrent scan": jax.jit(lambda *a: recurrent_gated_delta_rule(*a, use_qk_l2norm=True)),
        }
        runs = {name: (lambda f=f: jax.block_until_ready(f(*args))) for name, f in forms.items()}
        outs = {name: np.asarray(f(*args)[0], np.float32) for name, f in forms.items()}
        try:
            from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

            dev = torch_device()
            tq, tk, tv = (torch.as_tensor(x, device=dev).to(torch.bfloat16) for x in (q, k, v))
            tk_rep = tk.repeat_interleave(H // Hk, dim=2)
            tq_rep = tq.repeat_interleave(H // Hk, dim=2)
            tg, tb = torch.as_tensor(g, device=dev), torch.as_tensor(beta, device=dev)
            call = lambda: torch_chunk_gated_delta_rule(tq_rep, tk_rep, tv, tg, tb, use_qk_l2norm_in_kernel=True)[0]
            with torch.inference_mode():
                runs["transformers torch_chunk (torch)"] = torch_sync(call)
                outs["transformers torch_chunk (torch)"] = call().float().cpu().numpy()
        except Exception as e:  # noqa: BLE001  (the reference's absence is reported, not fatal)
            rows.append((f"T={T}: torch reference", "not run", repr(e)[:120]))
        t = interleaved(runs, 3 if SMOKE else 7)
        ref = outs["chunked (XLA)"]
        scale = float(np.abs(ref).max())
        for name in runs:
            tokens_s = T / t[name]
            rows.append((f"T={T}: {name}", f"{t[name] * 1e3:.2f} ms",
                         f"{tokens_s / 1e6:.2f} M tokens/s; {t[name] / t['pallas']:.2f}× the Pallas kernel's time; "
                         f"max |Δ| vs chunked {np.abs(outs[name] - ref).max() / scale:.1e} of max"))
    table(f"{versions()}; gated delta rule, batch 1, {H} value heads over {Hk} key heads, dk = dv = {D}, bf16 "
          "inputs, float32 state", rows)


# ------------------------------------------------------------------------------------------------------------ forward
def llama_folder(name, dtype="bfloat16", **shape):
    """A random Llama checkpoint (``dtype``; float32 with ``--smoke``) built on the torch device and saved under
    /tmp; returns (folder, the torch model, sdpa attention)."""
    import tempfile
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(tempfile.gettempdir()) / "jstd-device" / name
    config = LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(torch_device()):
        ref = LlamaForCausalLM(config).to(torch.float32 if SMOKE else getattr(torch, dtype)).eval()
    ref.config._attn_implementation = "sdpa"
    if not (folder / "config.json").exists():
        ref.save_pretrained(folder)
    return folder, ref


LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
SMOKE_LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=512, max_position_embeddings=512)


def section_forward():
    import torch

    shape = SMOKE_LLAMA if SMOKE else LLAMA_8B
    blocks = 2 if SMOKE else 4
    folder, ref = llama_folder(f"llama8b-{blocks}" if not SMOKE else "smoke", num_hidden_layers=blocks, **shape)
    dtype = jnp.float32 if SMOKE else jnp.bfloat16
    model = jstd.load(folder, dtype=dtype)
    run = jax.jit(jstd.run)
    peak = jax_peak(jnp.bfloat16, 1024 if SMOKE else 8192)
    d, f, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = d // shape["num_attention_heads"] * shape["num_key_value_heads"]
    rows = []
    for B, S in ((1, 128), (2, 64)) if SMOKE else ((1, 4096), (8, 1024)):
        tokens = np.random.default_rng(1).integers(0, V, (B, S))
        t_ids = torch.as_tensor(tokens, device=torch_device())

        def torch_forward():
            with torch.inference_mode():
                return ref(input_ids=t_ids).logits
        t = interleaved({"jstd": lambda: run(model, jnp.asarray(tokens)).logits.block_until_ready(),
                         "torch": torch_sync(torch_forward)}, 3 if SMOKE else 10)
        want = torch_forward().float().cpu().numpy()
        got = np.asarray(run(model, jnp.asarray(tokens)).logits, np.float32)
        err = float(np.abs(got - want).max() / np.abs(want).max())
        per_token = 2 * (blocks * (d * d * 2 + d * kv * 2 + 3 * d * f) + d * V)
        attention = 2 * blocks * 2 * S * S / 2 * d  # scores and mix, causal half
        flops = B * (S * per_token + attention)
        rows.append((f"{B} × {S} tokens: jstd / torch time", f"{t['jstd'] / t['torch']:.2f}",
                     f"jstd {t['jstd'] * 1e3:.1f} ms ({flops / t['jstd'] / 1e12:.0f} TFLOP/s, "
                     f"{flops / t['jstd'] / 1e12 / peak:.0%} of the bf16 peak {peak:.0f}); torch "
                     f"{t['torch'] * 1e3:.1f} ms ({flops / t['torch'] / 1e12:.0f} TFLOP/s); logits' max |Δ| "
                     f"{err:.1e} of max (bf16)"))
    table(f"{versions()}; Llama-3.1-8B's shape, {blocks} blocks, random weights, bf16, jax.jit(jstd.run) vs "
          "transformers (sdpa), interleaved medians", rows)


# -------------------------------------------------------------------------------------------------------- attribution
def attribution_case(L, d, F, vocab, n, heads, kv, d_mlp, n_prompts, active):
    """A random Llama (torch, float32, on the torch device, saved) and a random ReLU CLT whose encoder biases are
    shifted so that about ``active`` features fire on the first prompt; returns (model, transcoders, prompts)."""
    from jstd.circuits import Transcoders

    folder, _ = llama_folder(f"attr-{L}x{d}", "float32", hidden_size=d, intermediate_size=d_mlp, num_hidden_layers=L,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             max_position_embeddings=512)
    model = jstd.load(folder, dtype=jnp.float32)
    rng = np.random.default_rng(6)
    prompts = [np.asarray([1] + rng.integers(4, vocab, n - 1).tolist()) for _ in range(n_prompts)]
    x = np.asarray(jstd.run(model, jnp.asarray(prompts[:1]), reads=("layers.mlp_input",))["layers.mlp_input"][:, 0])
    W_enc = rng.normal(0, 1 / np.sqrt(d), (L, F, d)).astype(np.float32)
    pre = np.einsum("lpd,lfd->lpf", x[:, 1:], W_enc).reshape(-1)
    shift = float(np.sort(pre)[::-1][active - 1: active + 1].mean())
    tc = Transcoders(jnp.asarray(W_enc), jnp.full((L, F), -shift, jnp.float32),
                     tuple(jnp.asarray(rng.normal(0, 0.05, (F, L - l, d)), jnp.float32) for l in range(L)),
                     jnp.zeros((L, d), jnp.float32), None, None, cross_layer=True, scan="local/device")
    return model, tc, prompts


def section_attribution():
    import torch

    from jstd.circuits import attribute

    # jstd's float32 attribution matches circuit-tracer at full float32: no TF32 products
    jax.config.update("jax_default_matmul_precision", "highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = {"issue 37's benchmark shape: 4 × 256 Llama, CLT 1024/block, 24 tokens": (4, 256, 1024, 512, 24, 4, 2, 1024, 16, 2900)}
    if SMOKE:
        cases = {"smoke: 2 × 64, CLT 256": (2, 64, 256, 128, 16, 4, 2, 256, 4, 200)}
    rows = []
    for name, spec in cases.items():
        model, tc, prompts = attribution_case(*spec)
        bs = 256 if SMOKE else 1024
        t0 = time.perf_counter()
        graph = attribute(model, prompts[0], tc, batch_size=bs)
        first = time.perf_counter() - t0
        one = []
        for _ in range(3):
            t0 = time.perf_counter()
            attribute(model, prompts[0], tc, batch_size=bs)
            one.append(time.perf_counter() - t0)
        attribute(model, prompts, tc, batch_size=bs)
        t0 = time.perf_counter()
        graphs = attribute(model, prompts, tc, batch_size=bs)
        many = time.perf_counter() - t0
        rows.append((f"{name}: first call (compiles)", f"{first:.2f} s", f"{graph.n_features} features, "
                     f"{graph.n_nodes} nodes"))
        rows.append((f"{name}: one prompt, warm (best of 3)", f"{min(one):.3f} s", f"batch {bs}"))
        rows.append((f"{name}: {len(prompts)} prompts in one call", f"{many:.3f} s",
                     f"{sum(g.n_features for g in graphs)} features in all"))
    table(f"{versions()}; jstd.attribute, float32 (HIGHEST precision)", rows)


SECTIONS = {"peak": section_peak, "gated_delta": section_gated_delta, "forward": section_forward,
            "attribution": section_attribution}


def main():
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("section", choices=sorted(SECTIONS))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: check the script on a CPU")
    args = ap.parse_args()
    SMOKE = args.smoke
    SECTIONS[args.section]()


if __name__ == "__main__":
    main()
