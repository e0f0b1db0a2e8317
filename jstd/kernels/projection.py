"""A layer's projection by its stored weights: the product (``flat_product``) and the optional bias (``add_bias``)."""

from __future__ import annotations

import numpy as np
from jaxtyping import Array, Float


def add_bias(x: Float[Array, "..."], b: Float[Array, "..."] | None) -> Float[Array, "..."]:
    """``x + b``, or ``x`` where the layer has no bias (``b`` None)."""
    return x if b is None else x + b


def flat_product(x: Float[Array, "..."], w: Float[Array, "..."], contracted: int = 1) -> Float[Array, "..."]:
    """``x``'s last ``contracted`` axes times ``w``'s first ones as one flat product (rows times a matrix): the
    einsum's value, e.g. ``bte,ehd->bthd`` or ``bthd,hde->bte``.

    For a few positions per row (a decoding step) an einsum into or out of the heads lets XLA:CPU's layout
    assignment lay the product out head-major and transpose the *weight* to match: a copy of each such weight at
    every step, inside the decoding loop (layout assignment runs after loop-invariant code motion). The flat
    product reads each weight as stored (``test_the_decoding_loop_reads_every_weight_where_it_lies``).
    """
    inner = int(np.prod(w.shape[:contracted]))
    flat = x.reshape(-1, inner) @ w.reshape(inner, -1)
    return flat.reshape(*x.shape[: x.ndim - contracted], *w.shape[contracted:])
