"""Prompt lookup (n-gram) drafting: a row's drafts continue the most recent, longest earlier match
(n = `ngram_max` .. 1) of its last tokens in its own token buffer, repeated periodically so a block
of `k` is always full; a row without a match drafts its pending token. No model; on device.

Example:
    >>> lookup_drafts(jnp.array([[7, 8, 9, 7, 8, 0, 0, 0]]), jnp.array([4]), 3).tolist()
    [[9, 7, 8]]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NGRAM_MAX = 4       # the longest suffix matched


def match_lengths(tokens_bs: jax.Array, lengths_b: jax.Array, ngram_max: int = NGRAM_MAX) -> jax.Array:
    """`[B, S]`: how many of the row's last `ngram_max` tokens (ending at its length `L`) match the
    tokens ending at each position `p` (0 where `p >= L`).

    Example:
        >>> match_lengths(jnp.array([[1, 2, 1, 2]]), jnp.array([3]), 3).tolist()
        [[0, 2, 0, 0]]
    """
    b, s = tokens_bs.shape
    pos_s = jnp.arange(s)
    run_bs = (pos_s[None] < lengths_b[:, None])
    count_bs = jnp.zeros((b, s), jnp.int32)
    for i in range(ngram_max):
        q_b = lengths_b - i
        suffix_b = jnp.take_along_axis(tokens_bs, jnp.clip(q_b, 0, s - 1)[:, None], axis=1)[:, 0]
        shifted_bs = jnp.pad(tokens_bs, ((0, 0), (i, 0)), constant_values=-1)[:, :s]     # x[p - i]
        run_bs = run_bs & (shifted_bs == suffix_b[:, None]) & (q_b >= 0)[:, None]
        count_bs = count_bs + run_bs
    return count_bs


def lookup_drafts(tokens_bs: jax.Array, lengths_b: jax.Array, k: int, ngram_max: int = NGRAM_MAX) -> jax.Array:
    """`[B, k]` int32 drafts of every row (see the module docstring).

    Example: see the module docstring.
    """
    s = tokens_bs.shape[1]
    count_bs = match_lengths(tokens_bs, lengths_b, ngram_max)
    score_bs = jnp.where(count_bs > 0, count_bs * s + jnp.arange(s)[None], -1)
    end_b = jnp.argmax(score_bs, axis=1)
    found_b = jnp.max(score_bs, axis=1) >= 0
    period_b = jnp.maximum(lengths_b - end_b, 1)
    j = jnp.arange(k)[None]
    src_bk = jnp.clip(end_b[:, None] + 1 + j % period_b[:, None], 0, s - 1)
    drafts = jnp.take_along_axis(tokens_bs, src_bk, axis=1)
    pending_b = jnp.take_along_axis(tokens_bs, jnp.clip(lengths_b, 0, s - 1)[:, None], axis=1)
    return jnp.where(found_b[:, None], drafts, pending_b).astype(jnp.int32)
