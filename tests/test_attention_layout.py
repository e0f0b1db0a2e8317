"""The CPU's layout of softmax attention (``kernels.attention.grouped``, what ``fused`` runs on the CPU) against
``jax.nn.dot_product_attention`` (what it runs elsewhere): the same function — grouped-query heads, a boolean
mask (rows fully masked included), ALiBi's bias, float32 and bfloat16 — to float rounding. The families' values
against transformers are test_conformance's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from jstd.kernels import attention as attn_kernels


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_attention_equals_jax_dot_product_attention(dtype):
    rng = np.random.default_rng(0)
    swap = lambda a: jnp.swapaxes(a, 1, 2)
    for batch, heads, kv, queries, keys, dim in ((2, 8, 4, 6, 6, 8), (1, 4, 4, 5, 9, 8), (2, 6, 2, 7, 7, 4)):
        q = jnp.asarray(rng.standard_normal((batch, heads, queries, dim)), dtype)
        k, v = (jnp.asarray(rng.standard_normal((batch, kv, keys, dim)), dtype) for _ in range(2))
        mask = jnp.asarray(rng.random((batch, 1, queries, keys)) > 0.3).at[0, 0, 1].set(False)  # a row masked whole
        bias = jnp.asarray(rng.standard_normal((batch, heads, queries, keys)), dtype)
        for m, b in ((None, None), (mask, None), (mask, bias), (mask[:1], None)):
            want = jax.nn.dot_product_attention(swap(q), swap(k), swap(v), bias=b, mask=m, scale=0.3)
            got = jax.jit(attn_kernels.grouped, static_argnums=3)(q, k, v, 0.3, m, b)
            assert got.shape == want.shape and got.dtype == want.dtype
            tol = 1e-5 if dtype == jnp.float32 else 1e-2
            assert_close(got.astype(jnp.float32), want.astype(jnp.float32), tol,
                         f"{dtype.__name__}, {batch}x{heads}/{kv} heads, mask {m is not None}, bias {b is not None}")
