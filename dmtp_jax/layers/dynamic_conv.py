"""DFlash2's grouped dynamic causal conv as a pure function (`models/dflash.py` holds the module)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_dynamic_conv(x_bth: jax.Array, dyn_btkg: jax.Array, base_kh: jax.Array,
                         group_size: int, block_len: int | None = None) -> jax.Array:
    """`out[t, c] = sum_o (base[o, c] + dyn[t, o, g(c)]) * x[t - o, c]`, zero before each block start
    (blocks of `block_len` rows; the whole sequence when None).

    Example:
        >>> grouped_dynamic_conv(jnp.ones((1, 4, 8)), jnp.zeros((1, 4, 2, 2)), jnp.ones((2, 8)), 4)[0, :, 0]
        Array([1., 2., 2., 2.], dtype=float32)
    """
    b, t, h = x_bth.shape
    groups = h // group_size
    x = x_bth.reshape(b, t, groups, group_size)
    in_block = jnp.arange(t) % (block_len or t)
    out = jnp.zeros_like(x)
    for o in range(base_kh.shape[0]):
        shifted = x if o == 0 else jnp.pad(x[:, :-o], ((0, 0), (o, 0), (0, 0), (0, 0)))
        if o and block_len:
            shifted = jnp.where((in_block >= o)[None, :, None, None], shifted, 0)
        out = out + base_kh[o].reshape(groups, group_size).astype(x.dtype) * shifted
        out = out + dyn_btkg[:, :, o, :, None] * shifted
    return out.reshape(b, t, h)
