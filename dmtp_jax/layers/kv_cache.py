"""Static KV cache: `[layers, batch, max_len, kv_heads, head_dim]`, slot index == absolute position.

Rows carry their own lengths outside the cache (the decode state). A forward writes its new K/V at
the slots named by the token positions; rejected or padded tokens simply leave stale rows beyond the
row's length, which causal masking never reads and later writes overwrite. Positions `>= max_len`
are dropped on write (used as a scratch target for finished rows and padding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k_lbskd: jax.Array
    v_lbskd: jax.Array

    @property
    def max_len(self) -> int:
        return self.k_lbskd.shape[2]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
              dtype) -> "KVCache":
        """An empty cache. Example: `KVCache.zeros(2, 4, 64, 2, 8, jnp.float32)`."""
        shape = (num_layers, batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def write_layer(cache_lbskd: jax.Array, layer: int, new_btkd: jax.Array,
                positions_bt: jax.Array) -> jax.Array:
    """Scatters `new [B, T, kv, D]` into layer `layer` at slots `positions [B, T]` (OOB dropped)."""
    rows_b1 = jnp.arange(new_btkd.shape[0])[:, None]
    return cache_lbskd.at[layer, rows_b1, positions_bt].set(new_btkd.astype(cache_lbskd.dtype),
                                                            mode="drop")
