"""Frozen target features for the train step (computed inside the jitted step, no gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax.decode.caches import target_cache_spec, zero_target_cache
from dmtp_jax.models.dflash import context_features
from dmtp_jax.models.dflash_config import DFlashConfig


def target_features(target, tokens_bt: jax.Array, valid_bt: jax.Array, dcfg: DFlashConfig, *,
                    keep_kv: bool = False):
    """One causal target forward over whole sequences, under `stop_gradient`: the context features at
    `dcfg.target_layer_ids` `[B, L, n_ctx*H]`, the post-norm hidden `[B, L, H]` and, with `keep_kv`
    (an MTP head that reads the target's K/V: `reads_target_kv`), the K/V of every position (the
    forward runs through a zero cache of the sequence's length; else no cache, and None).
    `valid_bt` marks real tokens (padding trails: no real token reads it)."""
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    cache = zero_target_cache(target_cache_spec(target.cfg, *tokens_bt.shape, target.dtype)) if keep_kv else None
    out = target(tokens_bt, positions_bt, cache, capture_layers=dcfg.target_layer_ids,
                 kv_valid_bt=valid_bt)
    feats = context_features(out, dcfg, target.cfg.num_hidden_layers)
    kv = jax.lax.stop_gradient(out.cache.kv) if keep_kv else None
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(out.hidden_bth), kv


def reads_target_kv(mtp) -> bool:
    """Whether an MTP head's steps read the target's K/V (`target_kv=`: Gemma 4's assistant)."""
    return bool(getattr(mtp, "reads_target_kv", False))


def mtp_hidden(mtp, target, tokens_bt: jax.Array, hidden_bth: jax.Array, target_kv=None) -> jax.Array:
    """`[B, L, Hs]`: at position a, the frozen MTP's state of row (h_{a-1}, x_a) (Qwen's / DeepSeek's: the
    pre-norm hidden), the state that predicts x_{a+1} (0 at position 0); one causal MTP pass, as
    inference builds it. `target_kv`: the target's K/V of the sequence, for a head that reads it."""
    b, length = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(1, length), (b, length - 1))
    h, _ = mtp(target.embed(tokens_bt[:, 1:]), hidden_bth[:, :-1].astype(target.dtype), positions,
               target_kv=target_kv)
    return jax.lax.stop_gradient(jnp.pad(h, ((0, 0), (1, 0), (0, 0))))
