"""The one mask rule of every attention call, and `MaskRule`: the rule's inputs, unmaterialised.

Keys are described by absolute positions and a validity flag:

    allowed = valid & (k_pos <= q_pos if causal) & (q_pos - k_pos < window if sliding)

(a non-causal sliding layer: `|q_pos - k_pos| < window`, as DFlash). `attention_mask` builds the
`[B, T, S]` mask; a `MaskRule` lets long attention build it block by block or hand it to a fused
kernel.

Example:
    >>> pos = jnp.arange(4)[None]
    >>> attention_mask(pos, pos, None, True, 2).astype(int)[0].tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    >>> rule = MaskRule(pos, pos, None, causal=True, window=2, self_keys=True)
    >>> bool((rule.dense() == attention_mask(pos, pos, None, True, 2)).all())
    True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def attention_mask(q_pos_bt: jax.Array, k_pos_bs: jax.Array, k_valid_bs: jax.Array | None,
                   causal: bool | jax.Array, window: int | None) -> jax.Array:
    """Boolean mask `[B, T, S]`; `causal` may be a static bool or a `[B, T, S]` array."""
    q = q_pos_bt[:, :, None]
    k = k_pos_bs[:, None, :]
    shape = (max(q.shape[0], k.shape[0]),) + q.shape[1:2] + k.shape[2:]
    mask = jnp.ones(shape, bool) if k_valid_bs is None else (
        jnp.broadcast_to(k_valid_bs[:, None, :], shape))
    if causal is True:
        mask = mask & (k <= q)
    elif causal is not False:
        mask = mask & causal
    if window:
        mask = mask & ((q - k) < window)
        if causal is False:
            mask = mask & ((k - q) < window)
    return mask


@dataclasses.dataclass(frozen=True, eq=False)
class MaskRule:
    """The inputs of `attention_mask`: `q_pos_bt [B, T]`, `k_pos_bs [B, S]`, `k_valid_bs [B, S]` (None:
    all valid), static `causal` and `window`. `self_keys=True` promises that the keys are the queries'
    own tokens at consecutive positions with a valid prefix per row (what fused kernels need);
    `slot_keys=True` that they are a cache's slots, `k_pos_bs[b] == arange(S)` (`over_slots`), so a
    query at position `p < S` reads no key past slot `p`."""
    q_pos_bt: jax.Array
    k_pos_bs: jax.Array
    k_valid_bs: jax.Array | None = None
    causal: bool = True
    window: int | None = None
    self_keys: bool = False
    slot_keys: bool = False

    @classmethod
    def over_slots(cls, q_pos_bt: jax.Array, slots: int, first_key_slot: int = 0,
                   window: int | None = None) -> "MaskRule":
        """Causal queries at `q_pos_bt` over a cache of `slots` slots (slot == position), never a
        slot below `first_key_slot`."""
        k_pos = jnp.broadcast_to(jnp.arange(slots), (q_pos_bt.shape[0], slots))
        valid = k_pos >= first_key_slot if first_key_slot else None
        return cls(q_pos_bt, k_pos, valid, causal=True, window=window, slot_keys=True)

    def dense(self) -> jax.Array:
        """The whole mask `[B, T, S]` (`attention_mask` of these inputs)."""
        return attention_mask(self.q_pos_bt, self.k_pos_bs, self.k_valid_bs, self.causal, self.window)

    def block(self, q_start, q_len: int, k_start, k_len: int, k_from=None) -> jax.Array:
        """The mask `[B, q_len, k_len]` of queries `[q_start, +q_len)` over keys `[k_start, +k_len)`; keys
        before `k_from` (default `k_start`) are off."""
        sl = lambda x, start, n: jax.lax.dynamic_slice_in_dim(x, start, n, axis=1)  # noqa: E731
        valid = None if self.k_valid_bs is None else sl(self.k_valid_bs, k_start, k_len)
        if k_from is not None:
            fresh = (k_start + jnp.arange(k_len) >= k_from)[None]
            valid = fresh if valid is None else valid & fresh
        return attention_mask(sl(self.q_pos_bt, q_start, q_len), sl(self.k_pos_bs, k_start, k_len), valid,
                              self.causal, self.window)

    def valid_counts(self) -> jax.Array:
        """Valid keys per row `[B]` int32 (the prefix length under `self_keys`)."""
        b, s = self.k_pos_bs.shape
        if self.k_valid_bs is None:
            return jnp.full((b,), s, jnp.int32)
        return jnp.sum(self.k_valid_bs, axis=1).astype(jnp.int32)

    def rows_with_keys(self) -> jax.Array:
        """`[B, T]`: queries with at least one allowed key, under `self_keys` (no mask built)."""
        n_b1 = self.valid_counts()[:, None]
        i = jnp.arange(self.q_pos_bt.shape[1])[None]
        ok = n_b1 > 0
        if self.window:
            ok = ok & (i - jnp.minimum(i, n_b1 - 1) < self.window)
        return jnp.broadcast_to(ok, (n_b1.shape[0], i.shape[1]))
