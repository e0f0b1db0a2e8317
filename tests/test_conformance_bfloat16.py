"""The conformance suite, bfloat16: on one case per family and tower (``families.MAIN``), every value near torch's
bf16 value and every norm bit-exact given torch's input (so one rounding in a different place fails).
``tests/test_conformance.py`` holds the rest."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jstd
from conftest import relative_rms
from families import MAIN
from reference.cases import final, jit_run

main_case = pytest.mark.parametrize("name", MAIN)


# ---- bfloat16 -----------------------------------------------------------------------------------------------------

# (input site, output site): the output is a norm (and multiplier) of the input alone, so given torch's bf16 input
# jstd's bf16 output is torch's bit for bit (RMSNorm), or but for a rare last-bit tie in a LayerNorm (torch's CPU
# kernel sums the moments in another order: about one element in 6000): a rounding moved anywhere in the norm
# changes a quarter of the elements and fails
NEAR_TIES = 1e-3
NORMED = [("layer_input", "attention_norm_output"), ("layer_mid", "mlp_norm_output"),
          ("self_attn.attention_raw_output", "self_attn.attention_output"), ("mlp.mlp_raw_output", "mlp.mlp_output")]


def assert_bf16_exact(actual, expected, label: str) -> None:
    """Bit-equal bfloat16 values, but for at most a NEAR_TIES fraction of elements up to two units in the last place
    off (a near-tie rounded the other way before the norm's weight, which rounds again)."""
    a, b = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    differ = a != b
    ulp = np.abs(b) * 2.0 ** -7 + 1e-30  # bfloat16 keeps 8 significant bits: one unit is at most |b|·2⁻⁷
    assert differ.mean() <= NEAR_TIES, f"{label}: {differ.mean():.2%} of the elements differ from torch's"
    assert (np.abs(a - b)[differ] <= 2 * ulp[differ]).all(), f"{label}: an element differs by more than two units"


def _normed_pairs(model):
    """(input site, output site) for every norm the model has (on every block of the output's)."""
    pairs = []
    for stack in model.stacks:
        for src, dst in NORMED:
            src, dst = f"{stack}.{src}", f"{stack}.{dst}"
            if src in model.sites and dst in model.sites and set(model.blocks_for(dst)) <= set(model.blocks_for(src)):
                pairs.append((src, dst))
    return pairs


@main_case
def test_bfloat16(zoo, name):
    """bf16: every value near torch's bf16 value, and every norm bit-exact when it reads torch's bf16 input (so
    applying a norm's weight before or after the cast, or rounding a multiplier early, fails)."""
    _, _, model, ref, spec = zoo(name, "bfloat16")
    inputs, ref_inputs = spec.inputs(model)
    want = ref.run(ref_inputs)
    reads = tuple(sorted(model.sites))
    out = jit_run(model, inputs, reads=reads)
    for site in reads + (("logits",) if out.logits is not None else ()):
        a, b = np.asarray(out[site], np.float32), want[site]
        assert ((a < -1e30) == (b < -1e30)).all(), f"{name}:{site} masks other entries than torch"
        a, b = np.where(b < -1e30, 0, a), np.where(b < -1e30, 0, b)
        rel = relative_rms(a, b) if b.any() else float(np.abs(a).max())  # zeros (a state_input) stay zeros
        assert rel < 5e-2, f"{name}:{site} bf16 relative RMS error {rel:.3g}"
    assert final(model, out).dtype == jnp.bfloat16
    # every norm's input set to torch's in one program (each norm's output reads its own input alone, so setting
    # them all at once changes none of them; one compile instead of one per norm)
    edits, exact = [], []
    for src, dst in _normed_pairs(model):
        edits.append(jstd.Set(src, jnp.asarray(want[src], jnp.bfloat16)))
        exact.append((dst, f"{name}: {dst} from torch's {src}"))
    last = {"layers": "final_norm_output", "vision.layers": "vision.tower_output"}
    for stack, dst in last.items():
        if stack in model.stacks and dst in model.sites:
            L = model.depth(stack) - 1
            edits.append(jstd.Set(f"{stack}.layer_output", jnp.asarray(want[f"{stack}.layer_output"][L], jnp.bfloat16),
                                  layer=L))
            exact.append((dst, f"{name}: {dst}"))
    assert exact, f"{name}: no norm checked"
    forced = jit_run(model, inputs, edits, reads=tuple(dst for dst, _ in exact))
    for dst, label in exact:
        assert_bf16_exact(forced[dst], want[dst], label)


# gemma-2b: head_dim 24, so the scale 24^-0.5 is no power of two and rounding it to bfloat16 before the product
# (0.2041 -> 0.2041015625) moves about one score in seventy by a unit (torch multiplies the bf16 product by the Python
# float in float32 and rounds once); bloom-560m: ALiBi through baddbmm, scale · q·kᵀ + bias in float32 rounded once
# (rounding the product, then the sum, moves one score in five)
@pytest.mark.parametrize("name", ["gemma-2b", "bloom-560m"])
def test_bfloat16_scores(zoo, name):
    """bf16 attention scores bit-exact given torch's bf16 queries and keys (scaled, and ALiBi's bias added, where
    torch rounds)."""
    _, _, model, ref, spec = zoo(name, "bfloat16")
    inputs, ref_inputs = spec.inputs(model)
    want = ref.run(ref_inputs)
    edits = [jstd.Set(f"layers.self_attn.attention_{x}", jnp.asarray(want[f"layers.self_attn.attention_{x}"],
                                                                    jnp.bfloat16)) for x in ("queries", "keys")]
    site = "layers.self_attn.attention_scores"
    a, b = np.asarray(jit_run(model, inputs, edits, reads=(site,))[site], np.float32), want[site]
    assert ((a < -1e30) == (b < -1e30)).all(), f"{name}: masks other entries than torch"
    assert_bf16_exact(np.where(b < -1e30, 0, a), np.where(b < -1e30, 0, b), f"{name}: {site}")


def test_bfloat16_scaled_queries_are_opts():
    """OPT's order (``ScoreOptions.scaled_queries``: its queries leave ``q_proj`` scaled) against torch's in bf16 at
    OPT-2.7B's head_dim 80 (the scale no power of two): the scores are ``matmul(q · s, kᵀ)`` bit for bit (not the
    product scaled after), and the fused path is torch's ``scaled_dot_product_attention`` of the scaled queries at
    scale 1 (as transformers' sdpa path calls it)."""
    import torch

    from jstd.kernels import attention as attn_kernels

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 9, 80)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.tensor(x).bfloat16() for x in (q, k, v))
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    scale, opt = 80 ** -0.5, attn_kernels.ScoreOptions(scaled_queries=True)
    want = torch.matmul(tq * scale, tk.transpose(2, 3)).float().numpy()
    assert_bf16_exact(attn_kernels.scores(jq, jk, scale, None, opt), want, "OPT's scores")
    causal = jnp.tril(jnp.ones((9, 9), bool))[None, None]
    want = torch.nn.functional.scaled_dot_product_attention(tq * scale, tk, tv, is_causal=True, scale=1.0)
    got = attn_kernels.fused(jq, jk, jv, scale, causal, opt)  # [batch, q, heads, dim]
    assert relative_rms(np.asarray(got, np.float32), want.transpose(1, 2).float().numpy()) < 1e-2
