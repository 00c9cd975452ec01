"""Anchor sampling (SpecForge's rule, static shapes): per sequence, up to `num_anchors` distinct
valid anchors drawn uniformly without replacement, sorted by position; missing ones are anchor 0
with `keep` False. Blocks may overlap."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def valid_anchor_mask(loss_mask_bt: jax.Array, block_size: int, first_label: int = 1,
                      min_anchor: int = 0) -> jax.Array:
    """`[B, L]` bool: positions that may start a block: the anchor and the tokens up to the first
    predicted one (`anchor + first_label`) are in the loss mask, the block fits, and the anchor is at
    least `min_anchor` (1 for the DMTP methods).

    Example:
        >>> valid_anchor_mask(jnp.array([[0, 1, 1, 1, 1]]), 3).tolist()
        [[False, True, True, False, False]]
    """
    lm = loss_mask_bt.astype(bool)
    length = lm.shape[1]
    ok = lm
    for d in range(1, first_label + 1):
        ok = ok & jnp.pad(lm[:, d:], ((0, 0), (0, d)))
    pos = jnp.arange(length)
    fits = (pos <= length - block_size) & (pos >= min_anchor)
    return ok & fits[None]


def sample_anchors(key: jax.Array, loss_mask_bt: jax.Array, num_anchors: int, block_size: int,
                   first_label: int = 1, min_anchor: int = 0):
    """`(anchors_bn int32, keep_bn bool)`: up to `num_anchors` sorted anchors per row.

    Example:
        >>> a, keep = sample_anchors(jax.random.key(1), jnp.array([[1, 1, 1, 0, 0, 0]]), 3, 2)
        >>> a.tolist(), keep.tolist()
        ([[0, 1, 0]], [[True, True, False]])
    """
    valid_bl = valid_anchor_mask(loss_mask_bt, block_size, first_label, min_anchor)
    length = loss_mask_bt.shape[1]
    n = min(num_anchors, length)
    noise_bl = jax.random.uniform(key, valid_bl.shape)
    order_bl = jnp.argsort(jnp.where(valid_bl, noise_bl, 2.0), axis=1)[:, :n]
    keep_bn = jnp.take_along_axis(valid_bl, order_bl, axis=1)
    # sort kept anchors by position, padding last
    sort_key = jnp.where(keep_bn, order_bl, length + jnp.arange(n))
    perm = jnp.argsort(sort_key, axis=1)
    anchors_bn = jnp.take_along_axis(jnp.where(keep_bn, order_bl, 0), perm, axis=1)
    keep_bn = jnp.take_along_axis(keep_bn, perm, axis=1)
    if n < num_anchors:
        pad = ((0, 0), (0, num_anchors - n))
        anchors_bn, keep_bn = jnp.pad(anchors_bn, pad), jnp.pad(keep_bn, pad)
    return anchors_bn.astype(jnp.int32), keep_bn
