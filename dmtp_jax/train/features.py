"""Frozen target features for the train step (computed inside the jitted step, no gradient).

Example:
    >>> feats_btf, hidden_bth = target_features(target, tokens_bt, valid_bt, dcfg)  # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax.models.dflash import DFlashConfig, context_features


def target_features(target, tokens_bt: jax.Array, valid_bt: jax.Array, dcfg: DFlashConfig):
    """One causal target forward over whole sequences (no cache): the concatenated context
    features at `dcfg.target_layer_ids` `[B, L, n_ctx*H]` (as `dflash` builds them) and the
    post-norm hidden `[B, L, H]` (the MTP input), both under `stop_gradient`.

    `valid_bt` marks real tokens; right padding never influences earlier rows (causal), it is only
    passed so that padding rows do not attend to garbage.

    Example:
        >>> f, h = target_features(target, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool), dcfg)  # doctest: +SKIP
    """
    positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    out = target(tokens_bt, positions_bt, None, capture_layers=dcfg.target_layer_ids,
                 kv_valid_bt=valid_bt)
    feats = context_features(out, dcfg, target.cfg.num_hidden_layers)
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(out.hidden_bth)
