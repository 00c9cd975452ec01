"""Blockwise (flash-style) grouped-query attention in plain XLA: memory linear in T and S.

Query blocks, each an online softmax over key blocks (fp32 `m`, `l`, `acc`; docs/models-detail.md); key
blocks no query may see are skipped; inputs are never padded. A row with no allowed key gives 0.
Over a cache (a `slot_keys` rule), a query block's loop ends at the block holding its highest
position below `S` (a trip count known on device; not when compiling for GPU, where a data-dependent
loop waits on the host), so reading a cache costs its longest live row, not its length. Queries at
positions `>= S` (parked rows, whose writes are dropped) then see an unspecified part of the cache.

Example:
    >>> q = jnp.ones((1, 100, 4, 8)); k = v = jnp.ones((1, 100, 2, 8))
    >>> pos = jnp.arange(100)[None]
    >>> blockwise_attention(q, k, v, MaskRule(pos, pos), q_block=32, k_block=32).shape
    (1, 100, 4, 8)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax import platform
from dmtp_jax.layers.attention_mask import MaskRule

Q_BLOCK = 256
K_BLOCK = 512


def _online_step(carry, q_bkgtd, k_bskd, v_bskd, mask_bts, scale):
    """One key block of the online softmax (see the module docstring)."""
    m, l, acc = carry
    scores = jnp.einsum("bkgtd,bskd->bkgts", q_bkgtd, k_bskd, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask_bts[:, None, None], scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(scores - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_bskd.dtype), v_bskd, preferred_element_type=jnp.float32)
    return m_new, l, alpha[..., None] * acc + pv


def stops_at_live_rows(rule: MaskRule) -> bool:
    """Whether a key loop under `rule` ends at the queries' highest position: keys are a cache's slots
    (causal `slot_keys`) and the programs are not compiled for GPU."""
    return rule.slot_keys and rule.causal is True and platform.compile_platform() != "gpu"


def blockwise_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, rule: MaskRule, *,
                        q_block: int = Q_BLOCK, k_block: int = K_BLOCK) -> jax.Array:
    """`grouped_attention` by blocks: `[B, T, heads, D]` in `v`'s dtype, fp32 softmax and sums."""
    b, t, h, d = q_bthd.shape
    s, kv = k_bskd.shape[1], k_bskd.shape[2]
    g = h // kv
    tq, sk = min(q_block, t), min(k_block, s)
    n_q, n_k = -(-t // tq), -(-s // sk)
    scale = d ** -0.5
    q_all = q_bthd.reshape(b, t, kv, g, d)
    up_to_live_rows = stops_at_live_rows(rule)

    def key_blocks(q_at):
        """The key blocks a query block's loop runs: all, or over a cache up to its highest position."""
        if not up_to_live_rows:
            return n_k
        q_pos = jax.lax.dynamic_slice_in_dim(rule.q_pos_bt, q_at, tq, axis=1)
        top = jnp.max(jnp.where(q_pos < s, q_pos, -1))
        return (top + sk) // sk            # blocks holding slots 0 .. top

    def query_block(i, out_bthd):
        q_at = jnp.minimum(i * tq, t - tq)
        q_blk = jnp.moveaxis(jax.lax.dynamic_slice_in_dim(q_all, q_at, tq, axis=1), 1, 3)   # [B, kv, g, Tq, D]

        def key_block(j, carry):
            k_from = j * sk
            k_at = jnp.minimum(k_from, s - sk)
            mask = rule.block(q_at, tq, k_at, sk, k_from)
            k_blk = jax.lax.dynamic_slice_in_dim(k_bskd, k_at, sk, axis=1)
            v_blk = jax.lax.dynamic_slice_in_dim(v_bskd, k_at, sk, axis=1)
            return jax.lax.cond(jnp.any(mask), lambda c: _online_step(c, q_blk, k_blk, v_blk, mask, scale),
                                lambda c: c, carry)

        init = (jnp.full((b, kv, g, tq), -jnp.inf, jnp.float32), jnp.zeros((b, kv, g, tq), jnp.float32),
                jnp.zeros((b, kv, g, tq, d), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, key_blocks(q_at), key_block, init)
        o = acc / jnp.maximum(l, 1e-30)[..., None]                       # rows with no key: 0 / 1e-30
        o = jnp.moveaxis(o, 3, 1).reshape(b, tq, h, d).astype(out_bthd.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out_bthd, o, q_at, axis=1)

    return jax.lax.fori_loop(0, n_q, query_block, jnp.zeros((b, t, h, d), v_bskd.dtype))
