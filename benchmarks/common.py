"""Shared benchmark helpers: the quiet-machine guard (``quiet.guard``, run when a benchmark starts), timing, tiny random checkpoints, peak memory in a subprocess, table headings, and
the text forward benchmark (olmo_hybrid.py, qwen3_5.py)."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import quiet

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
# a cold figure is one with an empty persistent compilation cache: a fresh folder per benchmark run (inherited by
# its subprocesses), unless JSTD_COMPILATION_CACHE says otherwise (jstd.core.compile_cache, read when jstd is
# imported)
if "JSTD_COMPILATION_CACHE" not in os.environ:
    os.environ["JSTD_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jstd-bench-cache-")
import jstd  # noqa: E402,F401  (before anything imports JAX: jstd.core.startup starts it quietly, without the
#              CUDA and libtpu plugins' lines on a machine that has neither)
_SCRIPT = Path(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else None  # not `python -c`, not a REPL
if _SCRIPT is not None and _SCRIPT.is_file() and _SCRIPT.resolve().parent == Path(__file__).resolve().parent \
        and not quiet.BUSY:  # a benchmark script's start (its subprocesses run `-c` code)
    quiet.guard()  # refuses a busy machine (or, with --allow-busy, marks every row "busy")
WORK = Path(tempfile.gettempdir()) / "jstd-bench"   # the random checkpoints, saved once
BATCH, SEQ = 4, 256                                 # the text forward benchmarks' random tokens


def timeit(fn, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds (``fn`` must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_interleaved(runs: dict, reps: int) -> dict:
    """Median and best wall time of each callable, runs interleaved so that machine noise hits all alike."""
    for f in runs.values():  # compile / warm up
        f()
        f()
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def jstd_steps(step, state, batch, steps: int):
    """A callable running ``steps`` updates of a compiled training step ``step(state, batch) -> (state, metrics)``
    (the state donated: each call continues from the last), blocked on the last loss."""
    import jax

    box = {"state": state}

    def run():
        st = box["state"]
        for _ in range(steps):
            st, metrics = step(st, batch)
        jax.block_until_ready(metrics["loss"])
        box["state"] = st

    return run


def torch_adam_steps(params, loss_fn, lr: float, steps: int):
    """A callable running ``steps`` updates of SAELens' update in torch (what ``jstd.sae.train`` and
    ``jstd.circuits.train_clt`` run by default): ``loss_fn()`` (the forward and any bookkeeping, returning the
    loss), backward, the gradient clipped to global norm 1 (``clip_grad_norm_``), ``torch.optim.Adam(lr)``."""
    import torch

    opt = torch.optim.Adam(params, lr=lr)

    def run():
        for _ in range(steps):
            loss = loss_fn()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
        return float(loss.detach())

    return run


def compare(torch_forward, jstd_forward, reads, repeats: int) -> dict:
    """The torch reference against jstd, both already built: ``torch_forward()`` returns the reference's output
    (a tensor), ``jstd_forward(reads)`` the blocked ``jax.jit(jstd.run)`` Outputs reading ``reads`` (``()``: the
    output only).

    Returns median seconds per forward: ``torch``; ``jstd`` (the output only) and ``reads`` (reading ``reads``
    too), those two interleaved over ``3 * repeats`` runs since the read overhead is a small difference of two
    noisy times; and ``err``, the outputs' max difference relative to their max.
    """
    import numpy as np

    t_torch = timeit(torch_forward, repeats)
    both = time_interleaved({"jstd": lambda: jstd_forward(()), "reads": lambda: jstd_forward(reads)}, 3 * repeats)
    want = torch_forward().numpy()
    out = jstd_forward(())
    got = np.asarray(out.logits if out.logits is not None else out["vision.tower_output"])
    err = float(np.abs(got - want).max() / np.abs(want).max())
    return dict(torch=t_torch, jstd=both["jstd"][0], reads=both["reads"][0], err=err)


def torch_call(ref, output: str, *args, **kwargs):
    """A callable running the torch module ``ref(*args, **kwargs)`` under ``torch.inference_mode``; it returns the
    result's ``output`` field (a tensor)."""
    import torch

    def forward():
        with torch.inference_mode():
            return getattr(ref(*args, **kwargs), output)
    return forward


def jstd_call(model, inputs, always: tuple = ()):
    """``jstd_forward(reads)``: the blocked ``jax.jit(jstd.run)`` Outputs of ``model`` on ``inputs`` reading
    ``always + reads`` (as ``compare`` takes it)."""
    import jax

    import jstd

    run = jax.jit(jstd.run, static_argnames="reads")
    return lambda reads: jax.block_until_ready(run(model, inputs, reads=always + reads))


def torch_causal_lm(folder):
    """transformers' causal LM in ``folder`` in float32 with sdpa attention, or with eager attention where the
    family refuses sdpa (Gemma 2: sdpa has no soft-capping of the scores). Its ``config._attn_implementation``
    says which."""
    import torch
    from transformers import AutoModelForCausalLM

    load = lambda attention: AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention,
                                                                  dtype=torch.float32).eval()
    try:
        return load("sdpa")
    except ValueError as error:  # "... does not support an attention implementation through ...sdpa... yet"
        if "scaled_dot_product_attention" not in str(error):
            raise
        return load("eager")


def forward_callables(folder, tokens):
    """``(torch_forward, jstd_forward, attention)`` for the causal LM in ``folder`` on ``tokens`` (the callables as
    ``compare`` takes them): transformers' model in float32 (``torch_causal_lm``: sdpa attention, or eager where
    the family refuses sdpa; ``attention`` names which), and the blocked ``jax.jit(jstd.run)``."""
    import torch

    import jstd

    ref = torch_causal_lm(folder)
    torch_forward = torch_call(ref, "logits", input_ids=torch.as_tensor(tokens))
    return torch_forward, jstd_call(jstd.load(folder), tokens), ref.config._attn_implementation


def forward_timings(folder, tokens, reads, repeats: int) -> dict:
    """``compare`` for the causal LM in ``folder`` (torch in float32, ``torch_causal_lm``) on ``tokens``, and
    ``attention``: the torch model's attention implementation (``sdpa``, or ``eager`` where sdpa is refused)."""
    torch_forward, jstd_forward, attention = forward_callables(folder, tokens)
    return {**compare(torch_forward, jstd_forward, reads, repeats), "attention": attention}


def forward_rows(t_torch: float, t_jstd: float, t_reads: float, per_call: int, unit: str, detail: str, read_what: str,
                 compiled: tuple[int, float, int, float]) -> list[tuple[str, str, str]]:
    """The three rows every forward benchmark reports: throughput against torch (``per_call`` ``unit`` per call,
    ``detail`` appended), the overhead of reading ``read_what``, and compile time at two depths
    ``(small, seconds, large, seconds)``."""
    rate = lambda t: f"{per_call / t:,.1f} {unit}/s"
    small, t_small, large, t_large = compiled
    return [
        ("forward throughput (jstd / torch)", f"{t_torch / t_jstd:.2f}x",
         f"jstd {rate(t_jstd)}, torch {rate(t_torch)}; {detail}"),
        (f"reading {read_what} (overhead over the output only)", f"{(t_reads / t_jstd - 1) * 100:+.1f}%",
         f"{t_reads * 1e3:.1f} ms vs {t_jstd * 1e3:.1f} ms"),
        (f"compile time, {large} blocks / {small} blocks", f"{t_large / t_small:.2f}x",
         f"{t_large:.2f} s vs {t_small:.2f} s"),
    ]


def versions() -> str:
    """``torch <version> threads <n>, jax <version>, <n> cores``: the start of every table's heading."""
    import jax
    import torch

    return f"torch {torch.__version__} threads {torch.get_num_threads()}, jax {jax.__version__}, {os.cpu_count()} cores"


def print_table(heading: str, rows) -> None:
    """``heading``, then ``rows`` of (figure, ratio, detail) as a markdown table."""
    print(heading)
    print("| figure | ratio | detail |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


def checkpoint(config, folder, seed=0):
    from reference.checkpoints import make_checkpoint

    if not (Path(folder) / "config.json").exists():
        make_checkpoint(config, folder, seed=seed)
    return Path(folder)


def share_weights(model, torch_model, folder) -> tuple[int, int]:
    """Make ``torch_model`` (transformers' model of the checkpoint ``folder``) use ``model``'s (``jstd.load`` of
    it, on the CPU) memory wherever jstd's slot holds the stored tensor in the stored order (the name map's
    transform a C-ordered view of the whole tensor: embeddings, fused experts, norms, biases; a one-block stack of
    them): each such torch parameter becomes a view of the jstd buffer, and transformers' own copy of it (a
    private map of the safetensors file) is dropped. The other tensors (transposed projections, a head stored
    [vocab, hidden]) stay each framework's own. Both then run the same weights without holding two copies of the
    large ones, so a float32 benchmark at published sizes fits the machine; what each framework computes is
    unchanged. ``model`` must outlive ``torch_model``'s use (torch reads its buffers; neither writes them).
    Returns ``(shared_bytes, own_bytes)``: the bytes torch now reads from jstd's buffers, and those it keeps."""
    import warnings

    import numpy as np
    import torch

    from jstd.io.hf import plan
    from jstd.nn.namemap import at_path

    _, _, _, _, _, entries = plan(Path(folder), "float32")
    params = dict(torch_model.named_parameters())
    shared = 0
    for e in entries:
        single = not e.stacked or len(e.blocks) == 1
        keys = [k.format(i=e.blocks[0]) if e.stacked else k for k in e.keys]
        param = params.get(keys[0]) if single and len(keys) == 1 else None
        if param is None or not param.is_contiguous():
            continue
        stored = param.detach().numpy()
        mapped = e.transform(stored)
        host = np.asarray(at_path(model, e.path))  # the CPU buffer itself, read-only
        if mapped.size == host.size and mapped.dtype == host.dtype and mapped.flags.c_contiguous \
                and mapped.ctypes.data == stored.ctypes.data:
            with warnings.catch_warnings():  # torch warns that the array is read-only: neither framework writes it
                warnings.simplefilter("ignore", UserWarning)
                param.data = torch.from_numpy(host).view(param.shape)
            shared += host.nbytes
    total = sum(p.nbytes for p in torch_model.parameters())
    return shared, total - shared


def rss_gib() -> tuple[float, float]:
    """This process's resident memory now and at its peak (``VmHWM``), GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 2 ** 20 for k in ("VmRSS", "VmHWM"))


def streamed_checkpoint(config, folder, seed=0):
    """``checkpoint`` for models near the machine's memory: the same file ``reference.checkpoints.make_checkpoint``
    writes (the same tensors, names and values: ``randomize``'s generator drawn in the same order), written tensor
    by tensor from a model built on the meta device, so the process holds one tensor at a time (2 GiB for
    gpt-oss-20b's fused experts) instead of the model and ``randomize``'s copies of its largest tensor. Written
    once: a folder holding a config.json is returned as it is. Only for families whose ``save_pretrained`` writes
    the parameters under their own names (gpt-oss: checked equal at tiny sizes); transformers saves DeepSeek's and
    other fused experts per expert, the hub's spelling, which this does not."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    params = [(name, tuple(p.shape)) for name, p in model.named_parameters() if name not in tied]
    buffers = set(model.state_dict()) - {name for name, _ in params} - tied
    if buffers:  # their values are the model's own init, which a meta model has not
        raise ValueError(f"streamed_checkpoint writes parameters only; {sorted(buffers)} are persistent buffers: "
                         "use checkpoint()")
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in params:
        size = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "model.safetensors.partial"
    g = torch.Generator().manual_seed(seed)
    with open(partial, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, shape in params:  # randomize's values, in its order
            noise = torch.randn(shape, generator=g, dtype=torch.float32)
            if len(shape) >= 2:
                noise.mul_(1.0 if "embed" in name else 1.0 / math.sqrt(shape[-1]))
            elif "norm" in name or "layernorm" in name:
                noise.mul_(0.1).add_(1.0)
            else:
                noise.mul_(0.1)
            f.write(memoryview(noise.numpy()).cast("B"))
            del noise
    partial.rename(folder / "model.safetensors")
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it
    GenerationConfig.from_model_config(model.config).save_pretrained(folder)
    model.config.save_pretrained(folder)  # last: its config.json marks the folder complete
    return folder


def compile_time(skeleton, inputs) -> float:
    """Trace + compile time of jit(run) on ``skeleton`` (shapes only, no weights) and ``inputs`` (made of
    ``jax.ShapeDtypeStruct``)."""
    import jax

    import jstd

    t = time.perf_counter()
    jax.jit(jstd.run).lower(skeleton, inputs).compile()
    return time.perf_counter() - t


def compile_seconds(family, hf_config, batch: int = BATCH, seq: int = SEQ) -> float:
    """Trace + compile time of jit(run) on ``family``'s skeleton for ``hf_config`` on ``[batch, seq]`` tokens."""
    import jax
    import jax.numpy as jnp

    return compile_time(family.skeleton(hf_config, jnp.float32), jax.ShapeDtypeStruct((batch, seq), jnp.int32))


def text_checkpoint(make_config, name: str, vocab: int):
    """``(folder, tokens)``: the random checkpoint of ``make_config(8)`` (8 blocks) saved once as ``WORK / name``,
    and ``[BATCH, SEQ]`` random tokens below ``vocab`` (seed 0)."""
    import numpy as np

    folder = checkpoint(make_config(8), WORK / name)
    return folder, np.random.default_rng(0).integers(0, vocab, (BATCH, SEQ))


def repeats_parser(**more: str) -> argparse.ArgumentParser:
    """The text benchmarks' parser: ``--repeats N`` (default 7) and a store-true flag per ``more`` (name: help)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    for flag, help in more.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", action="store_true", help=help)
    return parser


def text_benchmark(family, make_config, name: str, vocab: int, states, read_what: str, repeats: int,
                   interleaved: bool = False, no_compile: bool = False) -> None:
    """Print the forward benchmark of a causal LM against transformers (sdpa, float32) as a markdown table: the
    ``forward_rows`` of ``text_checkpoint(make_config, name, vocab)`` reading ``states`` (``read_what`` names them),
    compile time of ``family`` at 16 and 64 blocks (NaN with ``no_compile``); with ``interleaved`` a second row,
    torch and jstd timed run for run (median; best)."""
    folder, tokens = text_checkpoint(make_config, name, vocab)
    torch_forward, jstd_forward = forward_callables(folder, tokens)
    t = compare(torch_forward, jstd_forward, states, repeats)
    # the two interleaved too, run for run, so that load from other processes hits both alike: median and best
    both = time_interleaved({"torch": torch_forward, "jstd": lambda: jstd_forward(())}, repeats) if interleaved else {}
    # depths not compiled above (no cache hit)
    seconds = lambda layers: float("nan") if no_compile else compile_seconds(family, make_config(layers))
    rows = forward_rows(t["torch"], t["jstd"], t["reads"], BATCH * SEQ, "tok", f"logits max rel. diff {t['err']:.1e}",
                        read_what, (16, seconds(16), 64, seconds(64)))
    if interleaved:
        (tm, tb), (jm, jb) = both["torch"], both["jstd"]
        rows.insert(1, ("forward throughput, interleaved runs (median; best)", f"{tm / jm:.2f}x; {tb / jb:.2f}x",
                        f"jstd {jm * 1e3:.0f} / {jb * 1e3:.0f} ms, torch {tm * 1e3:.0f} / {tb * 1e3:.0f} ms"))
    print_table(f"{versions()}; batch {BATCH} x {SEQ} tokens, float32", rows)


def forward_flops(config, batch: int = BATCH, seq: int = SEQ) -> float:
    """The matrix products' FLOPs of one causal-LM forward of ``config`` (a transformers text config: Llama-like
    attention, a gated MLP or a mixture of experts) on ``[batch, seq]`` tokens, as the program computes them:
    ``2 · m · n · k`` for each product — q, k, v, o projections; the scores and the mix over the whole
    ``seq × seq`` square (the kernels compute the masked half too); the gated MLP's three products, or for a
    mixture of experts each token's ``top_k`` experts (three products each) and the router; the LM head. Norms,
    softmax, rotary and the routing's sort are not counted: they are the overhead the share of the peak measures."""
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    tokens = batch * seq
    attention = 2 * tokens * hidden * dim * (2 * heads + 2 * kv) + 2 * 2 * batch * heads * seq * seq * dim
    experts = getattr(config, "num_experts", None)
    if experts:
        mlp = 2 * tokens * (3 * hidden * config.moe_intermediate_size * config.num_experts_per_tok + hidden * experts)
    else:
        mlp = 2 * tokens * 3 * hidden * config.intermediate_size
    return layers * (attention + mlp) + 2 * tokens * hidden * vocab


def peak_row(flops: float, seconds: float, what: str) -> tuple[str, str, str]:
    """The table row of a program's share of the dot peak measured at this run's start (``quiet.measured_peak``):
    ``flops`` (``forward_flops``) in ``seconds``."""
    peak = quiet.measured_peak()
    return (f"{what}: share of XLA's float32 dot peak (measured at this run's start)", f"{flops / seconds / peak:.0%}",
            f"{flops / 1e9:.1f} GFLOP of matrix products in {seconds * 1e3:.0f} ms = {flops / seconds / 1e9:.0f} "
            f"GFLOP/s; dot peak {peak / 1e9:.0f} GFLOP/s")


def run_json(code: str) -> dict:
    """Run ``code`` in a fresh python process; return the JSON object its last output line prints."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"benchmark process failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
