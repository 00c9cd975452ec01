"""Block verification: how many drafts the target accepts, and the bonus token.

Every function takes the target's distributions at the `n+1` verify slots (slot i predicts the token
after verify token i) and `n` draft tokens, and returns `(accepted [B], bonus [B])`; the committed
tokens are `drafts[:accepted] + [bonus]`.

* `verify_greedy`: exact match against the target argmax (spec output == greedy output).
* `verify_target_only`: draw one target sample per slot and accept the matching prefix (lossless,
  needs no draft probabilities; greedy is its argmax special case).
* `verify_rejection`: speculative sampling with the drafter's probabilities `q`: accept draft i with
  probability `min(1, p_i(d) / q_i(d))`; at the first rejection the bonus is drawn from
  `norm(max(p - q, 0))` (falling back to `p`), after a full accept from the last slot's `p`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax.decode.sampling import sample_from_probs


def _prefix_len(match_bn: jax.Array) -> jax.Array:
    return jnp.sum(jnp.cumprod(match_bn.astype(jnp.int32), axis=1), axis=1)


def _at(x_bn_: jax.Array, index_b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x_bn_, index_b.reshape((-1,) + (1,) * (x_bn_.ndim - 1)), axis=1)[:, 0]


def verify_greedy(target_logits_bsv: jax.Array, drafts_bn: jax.Array):
    """Example: `acc, bonus = verify_greedy(logits[:, :8], drafts[:, :7])`."""
    pred = jnp.argmax(target_logits_bsv, axis=-1).astype(jnp.int32)
    acc = _prefix_len(drafts_bn == pred[:, :-1])
    return acc, _at(pred, acc)


def verify_target_only(target_probs_bsv: jax.Array, drafts_bn: jax.Array, key: jax.Array):
    """Example: `acc, bonus = verify_target_only(p, drafts, key)`."""
    samples = sample_from_probs(target_probs_bsv, key)
    acc = _prefix_len(drafts_bn == samples[:, :-1])
    return acc, _at(samples, acc)


def verify_rejection(target_probs_bsv: jax.Array, draft_probs_bnv: jax.Array, drafts_bn: jax.Array,
                     key: jax.Array):
    """Example: `acc, bonus = verify_rejection(p, q, drafts, key)`."""
    n = drafts_bn.shape[1]
    k_accept, k_bonus = jax.random.split(key)
    p_d = jnp.take_along_axis(target_probs_bsv[:, :n], drafts_bn[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs_bnv, drafts_bn[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_accept, drafts_bn.shape)
    acc = _prefix_len(u * q_d < p_d)
    p_at = _at(target_probs_bsv, acc)
    q_padded = jnp.concatenate([draft_probs_bnv, jnp.zeros_like(draft_probs_bnv[:, :1])], axis=1)
    residual = jnp.maximum(p_at - _at(q_padded, acc), 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    bonus_probs = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), p_at)
    return acc, sample_from_probs(bonus_probs, k_bonus)


def candidate_probs_to_dense(cand_bnk: jax.Array, probs_bnk: jax.Array, vocab: int) -> jax.Array:
    """Scatters probabilities over k candidate ids into `[B, n, V]` (DFlash2 selector)."""
    dense = jnp.zeros(cand_bnk.shape[:2] + (vocab,), jnp.float32)
    b, n, _ = cand_bnk.shape
    return dense.at[jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], cand_bnk].add(
        probs_bnk.astype(jnp.float32))
