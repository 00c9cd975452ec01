"""A full-model drafter (`--method draft-model`): a smaller target of the same vocabulary with its own
`TargetCache` in the state's `draft_cache`, over the same committed positions as the target's:
prefilled with the prompt, `draft_chain` drafts k greedy / sampled tokens on a copy, and
`commit_draft_cache` keeps the accepted prefix exactly as the target's commit does."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dmtp_jax.layers.kv_cache import TargetCache


def draft_chain(model, cache: TargetCache, pending_b: jax.Array, lengths_b: jax.Array, steps: int,
                choose: Callable[[jax.Array, int], tuple]):
    """`(drafts [B, steps], q [B, steps, V] or None, cache)`: the draft model chained `steps` tokens
    from `pending_b` at positions `lengths_b..`; `choose(logits_bv, j)` -> `(token_b, q_bv or None)`
    picks draft j. The returned cache holds the chain's K/V and the states it started from."""
    kv_cache, token_b, drafts, qs = cache, pending_b, [], []
    for j in range(steps):
        out = model(token_b[:, None], (lengths_b + j)[:, None], kv_cache)
        kv_cache = out.cache
        token_b, q = choose(model.logits(out.hidden_bth[:, 0]), j)
        drafts.append(token_b)
        qs.append(q)
    q_all = None if qs[0] is None else jnp.stack(qs, axis=1)
    return jnp.stack(drafts, axis=1), q_all, TargetCache(kv_cache.kv, cache.conv_lbwc, cache.ssm_lbhkv)


def commit_draft_cache(model, cache: TargetCache, tokens_bn: jax.Array, positions_bn: jax.Array,
                       keep_b: jax.Array) -> TargetCache:
    """The draft model's cache after the round: the verify block `tokens_bn` at `positions_bn` run
    speculatively from `cache` (the pre-round states), the first `keep_b` tokens of each row kept."""
    out = model(tokens_bn, positions_bn, cache, speculative=True)
    return model.commit(out.cache, out.pending, keep_b)


def prefill_draft_cache(model, cache: TargetCache, tokens_bt: jax.Array, positions_bt: jax.Array,
                        lengths_b: jax.Array) -> TargetCache:
    """The draft model's cache after one prefill chunk (tokens real where `positions < lengths_b`)."""
    return model(tokens_bt, positions_bt, cache, kv_valid_bt=positions_bt < lengths_b[:, None]).cache
