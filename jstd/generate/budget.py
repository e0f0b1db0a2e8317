"""What a generation may ask for, checked before anything compiles: ``max_new_tokens`` a positive int, every
position it runs inside a learned position table (GPT-2's ``n_positions``), and the buffers preallocated for the whole sequence (the cache's keys and values, each step's logits; on the CPU, the float32 copies of lower-precision
weights) within the free memory of the devices that hold the model."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np


def check_max_new_tokens(max_new_tokens) -> int:
    """``max_new_tokens`` as an int; ValueError unless it is a positive int (static under jit)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int (static under jit), got {max_new_tokens!r}")
    return int(max_new_tokens)


def check_positions(model, prompt: int, new: int) -> None:
    """ValueError when the generation would run a token past the decoder's learned position table
    (``model.position_limit``; a lookup there would read the table's last row): the prompt's tokens and every new
    token but the last run, at positions ``0 .. prompt + new - 2`` (as transformers runs them)."""
    limit = model.position_limit
    if limit is None or prompt + new - 2 < limit:
        return
    most = limit + 1 - prompt
    fix = (f"pass max_new_tokens={most} or fewer" if most >= 1
           else f"shorten the prompt to at most {limit} tokens")
    raise ValueError(f"generate: a prompt of {prompt} tokens and max_new_tokens={new} run positions up to "
                     f"{prompt + new - 2}, past this {model.family} model's {limit} learned positions (n_positions: "
                     f"positions 0..{limit - 1}); {fix}")


def preallocated_bytes(model, batch: int, prompt: int, new: int) -> int:
    """The bytes a generation of ``new`` tokens after a ``[batch, prompt]`` prompt preallocates: the softmax
    blocks' keys and values over ``prompt + new`` positions, the step logits (kept, then returned), the token
    ids, and on the CPU two float32 copies of every lower-precision (bfloat16, float16) weight a product reads
    (``float32_copies``), and multi-head latent attention's head-major copies of ``kv_b`` (``absorbed_copies``)."""
    c = model.config
    leaves = [x for x in jax.tree.leaves(model.decoder) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]
    itemsize = np.dtype(leaves[0].dtype).itemsize if leaves else 4
    total = prompt + new
    layout = getattr(model, "attention_cache", None)
    if layout is not None:  # multi-head latent attention: its latent and shared rotary key
        width = sum(heads * dim for _, (heads, dim) in layout)
    else:
        heads = c.num_kv_heads or c.num_heads or 0
        width = heads * ((c.qk_head_dim or c.head_dim or 0) + (c.head_dim or 0))  # a key and a value
    per_position = len(model.layers_with("self_attn")) * width
    cache = per_position * batch * total * itemsize
    logits = 2 * new * batch * (c.vocab_size or 0) * max(itemsize, 4)
    return int(cache + logits + batch * total * 4 + float32_copies(model) + absorbed_copies(model))


def float32_copies(model) -> int:
    """The bytes of the float32 copies XLA:CPU keeps of ``model``'s lower-precision weights during a
    ``generate`` call: it has no bfloat16 (or float16) one-row product, so it converts each weight to float32 and
    multiplies that; in the decoding loop the conversion does not change from step to step, so XLA hoists it out
    of the loop and the copy lives for the whole call, beside the prefill's own converted copy. Two float32 copies
    of every floating array of two or more axes of the decoder below float32, the embedding table included (the
    loop's token lookup converts the whole table): the compiled program's temporary memory grows by 2.2 times
    the float32 bytes on the benchmark model and on tiny-llama. 0 off the CPU (accelerators multiply bfloat16 as
    it is stored) and for float32 weights."""
    decoder = model.decoder
    arrays = [x for x in jax.tree.leaves(decoder) if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
    if not arrays or any(d.platform != "cpu" for x in arrays for d in x.devices()):
        return 0
    low = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4 and x.ndim >= 2
    return int(sum(2 * x.size * 4 for x in arrays if low(x)))


def absorbed_copies(model) -> int:
    """The bytes of the head-major copies of every multi-head latent attention block's ``kv_b`` that a ``generate``
    call keeps for its decoding steps (``LatentAttention.head_major``: made once a call, outside the loop, as large
    as ``kv_b`` itself); 0 for a model without such blocks."""
    from jstd.nn.latent_attention import LatentAttention

    blocks = jax.tree.leaves(model.decoder, is_leaf=lambda x: isinstance(x, LatentAttention))
    return int(sum(m.kv_b.size * m.kv_b.dtype.itemsize for m in blocks if isinstance(m, LatentAttention)))


def free_bytes(model) -> tuple[int, str] | None:
    """The free memory of the devices holding ``model``'s arrays and their name; None when no device reports it
    or the model holds no concrete array (traced under an outer jit, abstract for a deviceless compile: the
    devices it will run on are not known here). A CPU device's is the host's available memory (counted once)."""
    devices = {d for x in jax.tree.leaves(model) if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               for d in x.devices()}
    if not devices:
        return None
    free, host, known = 0, False, False
    for d in devices:
        stats = _stats(d)
        if stats and "bytes_limit" in stats:
            free += int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
            known = True
        elif d.platform == "cpu" and not host:
            available = _host_available()
            if available is not None:
                free, host, known = free + available, True, True
    platform = sorted({d.platform for d in devices})
    return (free, f"{len(devices)} {'/'.join(platform)} device{'s' if len(devices) > 1 else ''}") if known else None


def check_fits(model, batch: int, prompt: int, new: int) -> None:
    """ValueError, before compiling, when the buffers of a generation of ``new`` tokens after a ``[batch,
    prompt]`` prompt (``preallocated_bytes``) exceed the free memory of the model's devices (not checked where
    ``free_bytes`` does not know it)."""
    need = preallocated_bytes(model, batch, prompt, new)
    free = free_bytes(model)
    if free is None or need <= free[0]:
        return
    raise ValueError(f"generate: max_new_tokens={new} preallocates {_gib(need)} ({batch} rows x {prompt + new} "
                     f"positions of cache, and each step's logits), more than the {_gib(free[0])} free on "
                     f"{free[1]}; generate fewer new tokens (or fewer rows) per call")


def _stats(device) -> dict | None:
    try:
        return device.memory_stats()
    except Exception:  # backends without memory statistics
        return None


def _host_available() -> int | None:
    """The host's available memory (``MemAvailable``; else free pages), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB ({n} bytes)"
