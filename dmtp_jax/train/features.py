"""Frozen target features for the train step (computed inside the jitted step, no gradient)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax.models.dflash import context_features
from dmtp_jax.models.dflash_config import DFlashConfig


def target_features(target, tokens_bt: jax.Array, valid_bt: jax.Array, dcfg: DFlashConfig):
    """One causal target forward over whole sequences (no cache), under `stop_gradient`: the context
    features at `dcfg.target_layer_ids` `[B, L, n_ctx*H]` and the post-norm hidden `[B, L, H]`.
    `valid_bt` marks real tokens."""
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    out = target(tokens_bt, positions_bt, None, capture_layers=dcfg.target_layer_ids,
                 kv_valid_bt=valid_bt)
    feats = context_features(out, dcfg, target.cfg.num_hidden_layers)
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(out.hidden_bth)


def mtp_hidden(mtp, target, tokens_bt: jax.Array, hidden_bth: jax.Array) -> jax.Array:
    """`[B, L, H]`: at position a, the frozen MTP's pre-norm hidden of row (h_{a-1}, x_a), the state that
    predicts x_{a+1} (0 at position 0); one causal MTP pass, as inference builds it."""
    b, length = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(1, length), (b, length - 1))
    h, _ = mtp(target.embed(tokens_bt[:, 1:]), hidden_bth[:, :-1].astype(target.dtype), positions)
    return jax.lax.stop_gradient(jnp.pad(h, ((0, 0), (1, 0), (0, 0))))
