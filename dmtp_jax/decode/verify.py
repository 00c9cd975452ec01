"""Block verification: how many drafts the target accepts, and the bonus token. Every verifier takes
the target's distributions at the `n+1` verify slots and `n` drafts and returns
`(accepted [B], bonus [B])`: `verify_greedy` (exact match), and the lossless `verify_target_only`,
`verify_rejection` and `verify_block` (docs/numerics.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax.decode.sampling import sample_from_probs


def _prefix_len(match_bn: jax.Array) -> jax.Array:
    return jnp.sum(jnp.cumprod(match_bn.astype(jnp.int32), axis=1), axis=1)


def _at(x_bn_: jax.Array, index_b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x_bn_, index_b.reshape((-1,) + (1,) * (x_bn_.ndim - 1)), axis=1)[:, 0]


def verify_greedy(target_logits_bsv: jax.Array, drafts_bn: jax.Array):
    """`(accepted [B], bonus [B])` from target logits `[B, n+1, V]` and drafts `[B, n]`."""
    pred = jnp.argmax(target_logits_bsv, axis=-1).astype(jnp.int32)
    acc = _prefix_len(drafts_bn == pred[:, :-1])
    return acc, _at(pred, acc)


def verify_target_only(target_probs_bsv: jax.Array, drafts_bn: jax.Array, key: jax.Array):
    """`(accepted [B], bonus [B])`: target samples from `p [B, n+1, V]` matched against drafts `[B, n]`."""
    samples = sample_from_probs(target_probs_bsv, key)
    acc = _prefix_len(drafts_bn == samples[:, :-1])
    return acc, _at(samples, acc)


def verify_rejection(target_probs_bsv: jax.Array, draft_probs_bnv: jax.Array, drafts_bn: jax.Array,
                     key: jax.Array):
    """`(accepted [B], bonus [B])`: token-level speculative sampling, `p [B, n+1, V]`, `q [B, n, V]`."""
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
    """The block verifier's weights `(w [B, n+1], h [B, n], residual_mass [B, n+1])` (`verify_block`'s
    `w_k`, `h_k`, `R_k`)."""
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
    """Block verification: `(accepted [B], bonus [B])` from `p [B, n+1, V]`, `q [B, n, V]`, drafts.

    Drafts `d_1..d_n` were sampled from `q_0..q_{n-1}`; `p_k` is the target at verify slot k; `q_n := 0`.

        w_0 = 1,  w_k = min(1, w_{k-1} p_{k-1}(d_k) / q_{k-1}(d_k))          k = 1..n
        r_k(x) = max(w_k p_k(x) - q_k(x), 0),  R_k = sum_x r_k(x)              k = 0..n
        h_k = R_k / (R_k + 1 - w_k)   (h_k = 1 when w_k = 1; so h_n = w_n)    k = 1..n
        draw eta_1..eta_n ~ U(0, 1) independently
        accepted = max {k >= 1 : eta_k < h_k}, or 0 when there is none
        bonus ~ r_accepted / R_accepted   (p_accepted when R_accepted == 0)

    The output has the target's distribution (Sun et al., Theorem 1). `_token_level_last` (tests
    only) is a deliberately wrong, lossy variant."""
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
