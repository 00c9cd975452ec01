"""Several speculative rounds per dispatch: a `lax.while_loop` around `round.spec_round`
(`run_rounds`) that stops rows on device by `batch.StopTracker`'s rule and leaves each round's
tokens in `[B, K, n]` buffers, replayed on the host (`feed_rounds`). Results equal K = 1."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.decode.batch import StopTracker, next_pow2
from dmtp_jax.decode.round import NO_CAP

STOP_IDS_FLOOR = 8      # the stop-id array is padded to a power of two >= this: one compile for all
NO_STOP = -1            # padding of the stop-id array (never a token)


def pad_stop_ids(stop_ids) -> np.ndarray:
    """Stop ids as an int32 array padded with `NO_STOP` to a power of two >= 8 (one compile for up to 8
    stop ids).

    Example:
        >>> pad_stop_ids([127, 3]).tolist()
        [3, 127, -1, -1, -1, -1, -1, -1]
    """
    ids = sorted(set(int(s) for s in stop_ids))
    out = np.full(next_pow2(len(ids), STOP_IDS_FLOOR), NO_STOP, np.int32)
    out[:len(ids)] = ids
    return out


def rows_still_running(tokens_bn: jax.Array, accepted_b: jax.Array, lengths_b: jax.Array,
                       limits_b: jax.Array, stop_ids_s: jax.Array, active_b: jax.Array) -> jax.Array:
    """`[B]` bool: rows active in a round and not done after it: no stop id among the committed
    `tokens_bn[:accepted + 1]` and the committed length `lengths_b` below `limits_b - 1`.

    Example:
        >>> run = rows_still_running(jnp.array([[5, 7, 9], [5, 7, 9]]), jnp.array([0, 2]),
        ...                          jnp.array([4, 6]), jnp.array([20, 20]), jnp.array([9, -1]),
        ...                          jnp.array([True, True]))
        >>> run.tolist()          # row 1 committed the stop id 9
        [True, False]
    """
    committed_bn = jnp.arange(tokens_bn.shape[1])[None] <= accepted_b[:, None]
    hit_stop_b = (committed_bn & (tokens_bn[..., None] == stop_ids_s).any(-1)).any(-1)
    budget_spent_b = lengths_b + 1 >= limits_b
    return active_b & ~hit_stop_b & ~budget_spent_b


def run_rounds(round_fn: Callable, state, active_b, limits_b, sp, base_key, first_round, stop_ids_s, *,
               rounds: int, slots: int, greedy: bool, commit_cap=NO_CAP, max_rounds=None, extras: bool = False):
    """Up to `rounds` calls of `round_fn(state, active_b, limits_b, sp, key, greedy)` in one
    `lax.while_loop`, stopping when no row runs; loop round `i` uses key
    `fold_in(base_key, first_round + i)`. `max_rounds` (traced int32, at most `rounds`; None: `rounds`)
    stops the loop sooner, so one program of `rounds`-wide buffers runs any dispatch of 1..`rounds`.

    Returns `(state, tokens_bkn, accepted_bk, from_mtp_bk, ran_bk, rounds_run, *extra)`: slot `k` holds
    round `k` per row (row b committed `tokens_bkn[b, k, :min(accepted_bk[b, k], commit_cap) + 1]`, the
    rounds' `commit_cap`; `ran_bk`: was it active). `extras`: `round_fn` returns more than its four
    outputs (pytrees of `[B, ...]` arrays, as `logprobs.TokenLogprobs`): `extra`, each leaf buffered
    `[B, K, ...]` (their shapes from an abstract trace of the round)."""
    b = active_b.shape[0]
    tokens_bkn = jnp.zeros((b, rounds, slots), jnp.int32)
    accepted_bk = jnp.zeros((b, rounds), jnp.int32)
    from_mtp_bk = jnp.zeros((b, rounds), bool)
    ran_bk = jnp.zeros((b, rounds), bool)
    extra = ()
    if extras:
        shapes = jax.eval_shape(lambda *a: round_fn(*a, greedy)[4:], state, active_b, limits_b, sp, base_key)
        extra = jax.tree.map(lambda x: jnp.zeros((b, rounds) + x.shape[1:], x.dtype), shapes)

    def running(carry):
        i, _, active, *_ = carry
        return (i < (rounds if max_rounds is None else jnp.minimum(rounds, max_rounds))) & active.any()

    def one_round(carry):
        i, st, active, tokens, accepted, from_mtp, ran, extra = carry
        key = jax.random.fold_in(base_key, first_round + i)
        st, tokens_bn, accepted_b, from_mtp_b, *more = round_fn(st, active, limits_b, sp, key, greedy)

        def put(buf, x):
            return jax.lax.dynamic_update_slice_in_dim(buf, x[:, None].astype(buf.dtype), i, axis=1)
        tokens, accepted, from_mtp, ran = (put(tokens, tokens_bn), put(accepted, accepted_b),
                                           put(from_mtp, from_mtp_b), put(ran, active))
        extra = jax.tree.map(put, extra, tuple(more))
        active = rows_still_running(tokens_bn, jnp.minimum(accepted_b, commit_cap), st.lengths_b, limits_b,
                                    stop_ids_s, active)
        return i + 1, st, active, tokens, accepted, from_mtp, ran, extra

    carry = (jnp.int32(0), state, jnp.asarray(active_b), tokens_bkn, accepted_bk, from_mtp_bk, ran_bk, extra)
    i, state, _, tokens_bkn, accepted_bk, from_mtp_bk, ran_bk, extra = jax.lax.while_loop(running, one_round, carry)
    return (state, tokens_bkn, accepted_bk, from_mtp_bk, ran_bk, i, *extra)


def feed_rounds(tracker: StopTracker, acceptance: list[list[int]], first_source: list[list[bool]],
                tokens_bkn: np.ndarray, accepted_bk: np.ndarray, from_mtp_bk: np.ndarray, ran_bk: np.ndarray,
                rounds_run: int, on_tokens: Callable[[int, list[int]], None] | None = None,
                commit_cap: int = NO_CAP) -> None:
    """Replays a dispatch's rounds (run with `commit_cap`) into the host's `tracker`, `acceptance`
    (tokens committed per round) and `first_source` lists in round order, then streams each row's kept
    tokens in one `on_tokens` call. Raises `RuntimeError` if the device and the tracker disagree on
    which rows ran.

    Example:
        >>> tracker, acc, src = StopTracker(1, 4, [9]), [[]], [[]]
        >>> feed_rounds(tracker, acc, src, np.array([[[5, 6], [9, 1]]]), np.array([[1, 0]]),
        ...             np.array([[True, False]]), np.array([[True, True]]), 2, lambda row, toks: print(row, toks))
        0 [5, 6, 9]
        >>> tracker.outputs, acc, src, bool(tracker.done[0])
        ([[5, 6, 9]], [[2, 1]], [[True, False]], True)
    """
    kept_rows: list[list[int]] = [[] for _ in range(len(acceptance))]
    for k in range(rounds_run):
        for row in range(len(acceptance)):
            if bool(ran_bk[row, k]) != (not tracker.done[row]):
                raise RuntimeError(f"on-device stopping disagrees with the host's StopTracker at row {row}, "
                                   f"round {k} of the dispatch")
            if not ran_bk[row, k]:
                continue
            got = min(int(accepted_bk[row, k]), commit_cap) + 1
            acceptance[row].append(got)
            first_source[row].append(bool(from_mtp_bk[row, k]))
            kept_rows[row] += tracker.add(row, tokens_bkn[row, k, :got])
    if on_tokens:
        for row, kept in enumerate(kept_rows):
            if kept:
                on_tokens(row, kept)
