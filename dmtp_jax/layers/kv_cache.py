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


def repeat_kv_heads(x_btkd: jax.Array, heads: int) -> jax.Array:
    """`x [B, T, kv, D]` with each KV head repeated to `heads` (a multiple of kv): the cache layout
    of a `tensor` axis wider than the KV heads (`sharding.cache_kv_heads`). Query head `i` of a GQA
    group of `h / kv` keeps its key: virtual head `i // (h / heads)` is a copy of head `i // (h / kv)`.

    Example:
        >>> repeat_kv_heads(jnp.arange(2.0).reshape(1, 1, 2, 1), 4)[0, 0, :, 0].tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    kv = x_btkd.shape[2]
    return x_btkd if heads == kv else jnp.repeat(x_btkd, heads // kv, axis=2)


def write_layer(cache_lbskd: jax.Array, layer: int, new_btkd: jax.Array,
                positions_bt: jax.Array) -> jax.Array:
    """Scatters `new [B, T, kv, D]` into layer `layer` at slots `positions [B, T]` (OOB dropped);
    KV heads are repeated to the cache's head count (`repeat_kv_heads`)."""
    rows_b1 = jnp.arange(new_btkd.shape[0])[:, None]
    new_btkd = repeat_kv_heads(new_btkd, cache_lbskd.shape[3])
    return cache_lbskd.at[layer, rows_b1, positions_bt].set(new_btkd.astype(cache_lbskd.dtype),
                                                            mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetCache:
    """Everything a target carries between calls, one protocol for every family.

    `kv` holds the attention layers only (`[La, B, S, kv, D]`, in `cfg.attention_layers` order);
    Gated DeltaNet layers (`cfg.linear_layers` order) keep the last `K-1` pre-conv inputs
    `conv_lbwc [Ll, B, K-1, C]` and the recurrent state `ssm_lbhkv [Ll, B, nv, dk, dv]` (fp32).
    A pure-attention target has `conv_lbwc = ssm_lbhkv = None`.
    """
    kv: KVCache
    conv_lbwc: jax.Array | None = None
    ssm_lbhkv: jax.Array | None = None

    @property
    def max_len(self) -> int:
        return self.kv.max_len


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PendingBlock:
    """What a speculative (`speculative=True`) target call leaves for `commit`: per DeltaNet layer,
    the block's pre-conv inputs and the per-token delta-rule inputs, so that the state can be
    advanced over exactly the accepted prefix of the block (`[Ll, B, T, ...]`, fp32 but conv_in)."""
    conv_in_lbtc: jax.Array
    k_lbthk: jax.Array
    v_lbthv: jax.Array
    g_lbth: jax.Array
    beta_lbth: jax.Array
