"""Grouped-query attention over explicit key positions, one mask rule for every caller:
`allowed = valid & (k_pos <= q_pos if causal) & (q_pos - k_pos < window if sliding)`.

`grouped_attention` is the one entry point: a materialised mask `[B, T, S]` runs the dense form; a
`MaskRule` lets `attention_kernel` pick "dense", "cache_blocks", "cudnn", "pallas" or "blockwise" by
the static shapes and the compile platform (docs/models-detail.md). Rows with no allowed key return zeros.
"cache_blocks" (decode steps and verify blocks over a cache of more than `CACHE_BLOCKS_FROM` slots, on
CPU and TPU) reads the cache by blocks of `CACHE_BLOCK` slots up to the longest live row, so a round
costs the rows' lengths, not the cache's (`blockwise_attention`); a smaller cache is read whole, since
its loop could skip one block at most and costs more than that block.

Example:
    >>> pos = jnp.arange(5)[None]
    >>> q = jnp.ones((1, 5, 4, 8)); k = v = jnp.ones((1, 5, 2, 8))
    >>> grouped_attention(q, k, v, MaskRule(pos, pos, causal=True)).shape
    (1, 5, 4, 8)
    >>> attention_kernel(1, 32768, jnp.bfloat16, MaskRule(pos, pos))
    'dense'
    >>> attention_kernel(1, 32768, jnp.bfloat16, MaskRule.over_slots(pos, 32768))
    'cache_blocks'
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax import platform
from dmtp_jax.layers.attention_mask import MaskRule, attention_mask
from dmtp_jax.layers.blockwise_attention import blockwise_attention, stops_at_live_rows
from dmtp_jax.layers.fused_attention import PALLAS_BLOCK, cudnn_attention, pallas_tpu_attention

__all__ = ["MaskRule", "attention_mask", "attention_kernel", "dense_attention", "grouped_attention"]

DENSE_MAX_QUERIES = 64          # decode steps and verify blocks: dense, or "cache_blocks" over a cache
DENSE_MAX_SCORES = 1 << 20      # T x S up to this stays dense (short prompts, tests)
CACHE_BLOCK = 128               # the slots per block of "cache_blocks"
CACHE_BLOCKS_FROM = 2 * CACHE_BLOCK     # "cache_blocks" over caches of more slots than this, else dense
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def attention_kernel(t: int, s: int, dtype, rule: MaskRule | None, head_dim: int = 128) -> str:
    """`"dense"`, `"cache_blocks"`, `"cudnn"`, `"pallas"` or `"blockwise"`: the form `grouped_attention`
    runs for `t` queries over `s` keys of `dtype` under `rule` (None: a materialised mask), on
    `compile_platform()`."""
    if rule is not None and t <= DENSE_MAX_QUERIES and s > CACHE_BLOCKS_FROM and stops_at_live_rows(rule):
        return "cache_blocks"
    if rule is None or t <= DENSE_MAX_QUERIES or t * s <= DENSE_MAX_SCORES:
        return "dense"
    fused = rule.self_keys and rule.causal is True
    target = platform.compile_platform()
    if (target == "gpu" and fused and jnp.dtype(dtype) in CUDNN_DTYPES and head_dim % 8 == 0
            and head_dim <= 256):
        return "cudnn"
    if (target == "tpu" and fused and not rule.window and t % PALLAS_BLOCK == 0
            and platform.compile_device_count() == 1):      # a Pallas call is not partitioned by GSPMD
        return "pallas"
    return "blockwise"


def dense_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, mask_bts: jax.Array) -> jax.Array:
    """Softmax attention with GQA (`heads = kv_heads * groups`) over a materialised mask; softmax in
    fp32. Returns `[B, T, heads, D]`; rows with no allowed key return zeros instead of NaN."""
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


def grouped_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                      mask: jax.Array | MaskRule) -> jax.Array:
    """Softmax attention with GQA; `mask` is a materialised `[B, T, S]` mask or a `MaskRule`.

    Returns `[B, T, heads, D]`. Rows with no allowed key return zeros instead of NaN."""
    if not isinstance(mask, MaskRule):
        return dense_attention(q_bthd, k_bskd, v_bskd, mask)
    kernel = attention_kernel(q_bthd.shape[1], k_bskd.shape[1], q_bthd.dtype, mask, q_bthd.shape[-1])
    if kernel == "dense":
        return dense_attention(q_bthd, k_bskd, v_bskd, mask.dense())
    if kernel == "cache_blocks":
        return blockwise_attention(q_bthd, k_bskd, v_bskd, mask, q_block=q_bthd.shape[1], k_block=CACHE_BLOCK)
    if kernel == "cudnn":
        out = cudnn_attention(q_bthd, k_bskd, v_bskd, mask)
        if out is not None:
            return out
    if kernel == "pallas":
        return pallas_tpu_attention(q_bthd, k_bskd, v_bskd, mask)
    return blockwise_attention(q_bthd, k_bskd, v_bskd, mask)
