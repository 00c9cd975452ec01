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
* `verify_block`: block verification (Sun et al., "Block Verification Accelerates Speculative
  Decoding", 2024, arXiv 2403.10444): the same inputs as `verify_rejection`, but the block is
  accepted jointly; lossless, and its expected accepted length is never below `verify_rejection`'s
  for the same drafts (see its docstring for the algorithm).
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


def block_weights(target_probs_bsv: jax.Array, draft_probs_bnv: jax.Array, drafts_bn: jax.Array):
    """The block verifier's weights: `(w [B, n+1], h [B, n], residual_mass [B, n+1])`.

    `w[:, k]` is the acceptance weight of the first k drafts, `h[:, k-1]` the probability of
    accepting (at least) k drafts given that no longer prefix was accepted, `residual_mass[:, k]`
    the mass of the bonus residual after k drafts (see `verify_block`).

    Example: `w, h, mass = block_weights(p, q, drafts)`.
    """
    n = drafts_bn.shape[1]
    p_d = jnp.take_along_axis(target_probs_bsv[:, :n], drafts_bn[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs_bnv, drafts_bn[..., None], axis=-1)[..., 0]
    ws = [jnp.ones(drafts_bn.shape[:1], jnp.float32)]
    for k in range(n):                      # static loop over the static block length
        ws.append(jnp.minimum(1.0, ws[-1] * p_d[:, k] / jnp.maximum(q_d[:, k], 1e-30)))
    w = jnp.stack(ws, axis=1)
    q_padded = jnp.concatenate([draft_probs_bnv, jnp.zeros_like(draft_probs_bnv[:, :1])], axis=1)
    mass = jnp.sum(jnp.maximum(w[..., None] * target_probs_bsv - q_padded, 0.0), axis=-1)
    # w == 1: always keep going (0/0 when p_k == q_k as well); h_n == w_n since q_n == 0
    h = jnp.where(w[:, 1:] >= 1.0, 1.0, mass[:, 1:] / jnp.maximum(mass[:, 1:] + 1.0 - w[:, 1:], 1e-30))
    return w, h, mass


def verify_block(target_probs_bsv: jax.Array, draft_probs_bnv: jax.Array, drafts_bn: jax.Array,
                 key: jax.Array, *, _token_level_last: bool = False):
    """Block verification. Example: `acc, bonus = verify_block(p, q, drafts, key)`.

    Notation: drafts `d_1..d_n` were sampled from `q_0..q_{n-1}` (`q_{k}` = `draft_probs[:, k]`, the
    proposer's distribution for `d_{k+1}`: MTP's for T1, DFlash's / the DFlash2 selector's / the
    chained MTP's for the rest); `p_k` = `target_probs[:, k]` is the target at verify slot k (it
    predicts the token after `d_k`; `p_n` follows a fully accepted block). Put `q_n := 0`.

        w_0 = 1,  w_k = min(1, w_{k-1} p_{k-1}(d_k) / q_{k-1}(d_k))          k = 1..n
        r_k(x) = max(w_k p_k(x) - q_k(x), 0),  R_k = sum_x r_k(x)              k = 0..n
        h_k = R_k / (R_k + 1 - w_k)   (h_k = 1 when w_k = 1; so h_n = w_n)    k = 1..n
        draw eta_1..eta_n ~ U(0, 1) independently
        accepted = max {k >= 1 : eta_k < h_k}, or 0 when there is none
        bonus ~ r_accepted / R_accepted   (p_accepted when R_accepted == 0; after a full accept
                                           this is p_n, and after none r_0 = max(p_0 - q_0, 0))

    Unlike token-level rejection (accept the longest prefix whose every `eta_k < p/q`), a weak
    draft does not end the block: a later position can still accept through it, because `w_k`
    carries the likelihood ratio of the whole prefix and the residual `r_k` pays back the mass
    that token-level verification would have rejected. The output has the target's distribution
    (Sun et al., Theorem 1) and E[accepted] is maximal among valid verifiers that see only these
    conditionals, hence >= `verify_rejection`'s (tests/test_block_verify.py checks both exactly on
    small vocabularies). All shapes are fixed: one weight recursion over the static block length,
    one masked max for `accepted`, one categorical draw per row.

    `_token_level_last` (tests only) is a deliberately wrong variant: the last position's weight
    `h_n` is replaced by the token-level `min(1, p_{n-1}(d_n) / q_{n-1}(d_n))`; it is not lossless.
    """
    n = drafts_bn.shape[1]
    k_accept, k_bonus = jax.random.split(key)
    w, h, mass = block_weights(target_probs_bsv, draft_probs_bnv, drafts_bn)
    if _token_level_last:
        p_d = jnp.take_along_axis(target_probs_bsv[:, n - 1], drafts_bn[:, -1:], axis=-1)[:, 0]
        q_d = jnp.take_along_axis(draft_probs_bnv[:, n - 1], drafts_bn[:, -1:], axis=-1)[:, 0]
        h = h.at[:, -1].set(jnp.minimum(1.0, p_d / jnp.maximum(q_d, 1e-30)))
    eta = jax.random.uniform(k_accept, drafts_bn.shape)
    acc = jnp.max(jnp.where(eta < h, jnp.arange(1, n + 1, dtype=jnp.int32)[None], 0), axis=1)
    p_at = _at(target_probs_bsv, acc)
    q_padded = jnp.concatenate([draft_probs_bnv, jnp.zeros_like(draft_probs_bnv[:, :1])], axis=1)
    residual = jnp.maximum(_at(w, acc)[:, None] * p_at - _at(q_padded, acc), 0.0)
    r_mass = _at(mass, acc)[:, None]
    bonus_probs = jnp.where(r_mass > 0, residual / jnp.maximum(r_mass, 1e-30), p_at)
    return acc, sample_from_probs(bonus_probs, k_bonus)


def candidate_probs_to_dense(cand_bnk: jax.Array, probs_bnk: jax.Array, vocab: int) -> jax.Array:
    """Scatters probabilities over k candidate ids into `[B, n, V]` (DFlash2 selector)."""
    dense = jnp.zeros(cand_bnk.shape[:2] + (vocab,), jnp.float32)
    b, n, _ = cand_bnk.shape
    return dense.at[jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None], cand_bnk].add(
        probs_bnk.astype(jnp.float32))
