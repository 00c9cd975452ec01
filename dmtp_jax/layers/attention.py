"""Grouped-query attention over explicit key positions, one mask rule for every caller.

Every caller (target prefill / decode / verify, the DFlash block, training) describes its keys by
absolute positions and a validity flag; the mask is built here once:

    allowed = valid & (k_pos <= q_pos if causal) & (q_pos - k_pos < window if sliding)

A non-causal sliding layer uses the symmetric window `|q_pos - k_pos| < window`, as the DFlash
reference does.
"""

import jax
import jax.numpy as jnp


def attention_mask(q_pos_bt: jax.Array, k_pos_bs: jax.Array, k_valid_bs: jax.Array | None,
                   causal: bool | jax.Array, window: int | None) -> jax.Array:
    """Boolean mask `[B, T, S]`; `causal` may be a static bool or a `[B, T, S]` array."""
    q = q_pos_bt[:, :, None]
    k = k_pos_bs[:, None, :]
    mask = jnp.ones(q.shape[:2] + k.shape[2:], bool) if k_valid_bs is None else (
        jnp.broadcast_to(k_valid_bs[:, None, :], q.shape[:2] + k.shape[2:]))
    if causal is True:
        mask = mask & (k <= q)
    elif causal is not False:
        mask = mask & causal
    if window:
        mask = mask & ((q - k) < window)
        if causal is False:
            mask = mask & ((k - q) < window)
    return mask


def grouped_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                      mask_bts: jax.Array) -> jax.Array:
    """Softmax attention with GQA (`heads = kv_heads * groups`); softmax in fp32.

    Returns `[B, T, heads, D]`. Rows with no allowed key return zeros instead of NaN.
    """
    b, t, h, d = q_bthd.shape
    kv = k_bskd.shape[2]
    q = q_bthd.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bskd,
                        preferred_element_type=jnp.float32) * (d ** -0.5)
    scores = jnp.where(mask_bts[:, None, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v_bskd.dtype), v_bskd)
    return out.reshape(b, t, h, d)
