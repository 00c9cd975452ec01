"""Where a speculative round's time goes: each phase of a greedy `SpecDecoder` round timed as its
own jitted function of the inputs the round gives it, next to the fused round itself.

Phases (the decoder's own methods, called inside one `jax.jit` each):

  propose-mtp      `_mtp_first` (the MTP head's T1); for method `mtp` the whole `_propose` (the chain)
  propose-drafter  the rest of `_propose`: the drafter block and its draft logits (DFlash2: selector),
                   given T1 from propose-mtp
  verify           the target forward over `[pending, drafts]` (`speculative=True`) and its logits
  accept           `verify_greedy`
  commit           `target.commit`, `_mtp_advance` and `_write_context` (the drafter's context K/V)

Each time is the median of `repeats` calls after `warmup` calls, with `jax.block_until_ready`.
Arguments the round updates in place (the caches) are donated fresh copies, made outside the timed
region, so the decoder's own state is never touched. The phases' sum is not the fused round's time:
each separate call pays its own dispatch and writes its intermediates out, and XLA cannot fuse across
phases; the table shows both.

Example:
    >>> res = decoder.generate(prompts, 64)                       # doctest: +SKIP
    >>> print(format_phases({"dmtp": phase_breakdown(decoder)}))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

PHASES = ("propose-mtp", "propose-drafter", "verify", "accept", "commit")


class _GivenFirst:
    """The decoder, except that `_mtp_first` returns a T1 computed beforehand (so `_propose` times
    only its drafter part)."""

    def __init__(self, decoder, first):
        self._decoder, self._first = decoder, first

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def _mtp_first(self, *args, **kwargs):
        return self._first


def _copy(tree):
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def _median_ms(fn, make_args, repeats: int, warmup: int) -> tuple[float, object]:
    """Median wall time (ms) of `fn(*make_args())` over `repeats` calls after `warmup`; `make_args`
    runs outside the timed region (fresh copies of donated arguments). Also returns the last output."""
    times, out = [], None
    for i in range(warmup + repeats):
        args = make_args()
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times)), out


def phase_breakdown(decoder, state=None, *, repeats: int = 10, warmup: int = 2, seed: int = 0) -> dict:
    """Milliseconds per phase of one greedy round of `decoder` (a `SpecDecoder`) from `state`
    (default: `decoder.last_state`, the state its last `generate` left), their sum, and the fused
    round (`decoder.round`) on the same state. A phase the method does not run is None.

    Returns `{"batch", "max_len", "repeats", "phases_ms": {phase: ms | None}, "sum_ms", "round_ms"}`.
    """
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.decode.verify import verify_greedy

    state = decoder.last_state if state is None else state
    if state is None:
        raise ValueError("no decoder state: run a request first (or pass state)")
    sp = SamplingParams.make()
    batch = int(state.lengths_b.shape[0])
    max_len = int(state.target_cache.kv.k_lbskd.shape[2])
    states = decoder._states()
    active = np.ones(batch, bool)
    limits = np.full(batch, max_len, np.int32)
    key = jax.random.key(seed)
    k_draft, _ = jax.random.split(key)      # as the round splits its key
    n = decoder.slots
    capture = decoder._capture(decoder.drafter)
    ms = dict.fromkeys(PHASES)
    time_it = lambda fn, make_args: _median_ms(fn, make_args, repeats, warmup)  # noqa: E731

    # ---- propose ----
    first, mtp_cache = None, state.mtp_cache
    if decoder.method == "mtp":             # the whole chain; it writes speculative rows into the MTP cache
        def propose_chain(states, st, mtp_cache):
            st = dataclasses.replace(st, mtp_cache=mtp_cache)
            drafts, _, mtp_cache, _ = decoder._propose(decoder._models(states), st, sp, k_draft, True, limits)
            return drafts, mtp_cache
        propose_chain = jax.jit(propose_chain, donate_argnames=("mtp_cache",))
        ms["propose-mtp"], (drafts, mtp_cache) = time_it(propose_chain,
                                                         lambda: (states, state, _copy(state.mtp_cache)))
    else:
        if decoder.uses_mtp:
            @jax.jit
            def mtp_first(states, st):
                target, _, mtp, _ = decoder._models(states)
                t1, _, y, top_p = decoder._mtp_first(target, mtp, st, sp, jax.random.split(k_draft, n)[0], True)
                return t1, y, top_p
            ms["propose-mtp"], (t1, y, top_p) = time_it(mtp_first, lambda: (states, state))
            first = (t1, None, y, top_p)

        @jax.jit
        def propose_drafter(states, st, first):
            proposer = decoder if first is None else _GivenFirst(decoder, first)
            return type(decoder)._propose(proposer, decoder._models(states), st, sp, k_draft, True, limits)[0]
        ms["propose-drafter"], drafts = time_it(propose_drafter, lambda: (states, state, first))

    # ---- verify ----
    def verify(states, target_cache, lengths_b, pending_b, drafts):
        target = decoder._models(states)[0]
        positions = lengths_b[:, None] + jnp.arange(n)
        tokens = jnp.concatenate([pending_b[:, None], drafts], axis=1)
        out = target(tokens, positions, target_cache, capture_layers=capture, speculative=True)
        return out, target.logits(out.hidden_bth)
    verify = jax.jit(verify, donate_argnames=("target_cache",))
    ms["verify"], (out, logits) = time_it(
        verify, lambda: (states, _copy(state.target_cache), state.lengths_b, state.pending_b, drafts))

    # ---- accept ----
    ms["accept"], (acc, bonus) = time_it(jax.jit(verify_greedy), lambda: (logits, drafts))

    # ---- commit ----
    def commit(states, target_cache, ctx_cache, mtp_cache, st, out, drafts, acc, bonus, active_b):
        target, drafter, mtp, fusion = decoder._models(states)
        positions = st.lengths_b[:, None] + jnp.arange(n)
        verify_tokens = jnp.concatenate([st.pending_b[:, None], drafts], axis=1)
        mtp_h = mtp_rows = None
        if mtp is not None:
            mtp_cache, mtp_h, mtp_rows = decoder._mtp_advance(target, mtp, fusion, st, mtp_cache, verify_tokens,
                                                              out.hidden_bth, acc, bonus, active_b)
        if drafter is not None:
            ctx_cache = decoder._write_context(drafter, fusion, ctx_cache, out.captured, positions, mtp_rows)
        target_cache = target.commit(target_cache, out.pending, jnp.where(active_b, acc + 1, 0))
        return target_cache, ctx_cache, mtp_cache, mtp_h
    commit = jax.jit(commit, donate_argnames=("target_cache", "ctx_cache", "mtp_cache"))
    rest = dataclasses.replace(state, target_cache=None, ctx_cache=None, mtp_cache=None)
    spec_out = dataclasses.replace(out, cache=None)
    ms["commit"], _ = time_it(commit, lambda: (states, _copy(out.cache), _copy(state.ctx_cache), _copy(mtp_cache),
                                               rest, spec_out, drafts, acc, bonus, active))

    # ---- the fused round, for comparison ----
    round_ms, _ = time_it(lambda st: decoder.round(states, st, active, limits, sp, key, greedy=True),
                          lambda: (_copy(state),))
    ran = [v for v in ms.values() if v is not None]
    return {"batch": batch, "max_len": max_len, "repeats": repeats, "phases_ms": ms,
            "sum_ms": float(sum(ran)), "round_ms": round_ms}


def bench_phases(decoders: dict, repeats: int = 10) -> dict:
    """`phase_breakdown` of every speculative decoder of a bench (those a request ran on)."""
    out = {}
    for name, decoder in decoders.items():
        if hasattr(decoder, "round") and getattr(decoder, "last_state", None) is not None:
            out[name] = phase_breakdown(decoder, repeats=repeats)
    return out


def format_phases(phases: dict) -> str:
    """The bench's per-phase table: ms per phase of a greedy round, their sum and the fused round.

    Example:
        >>> print(format_phases({}))
        phases (greedy round, each phase jitted alone; median ms): no speculative rounds ran
    """
    head = "phases (greedy round, each phase jitted alone; median ms)"
    rows = {m: p for m, p in phases.items() if p}
    if not rows:
        return head + ": no speculative rounds ran"
    cell = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
    lines = [head + "; the sum of separate phases is not the fused round (dispatch per phase, no "
             "cross-phase fusion):",
             f"{'method':<8} {'shape':>9} " + " ".join(f"{p:>15}" for p in PHASES) + f" {'sum':>9} {'round':>9}"]
    for m, p in rows.items():
        lines.append(f"{m:<8} {str(p['batch']) + 'x' + str(p['max_len']):>9} "
                     + " ".join(f"{cell(p['phases_ms'][k]):>15}" for k in PHASES)
                     + f" {cell(p['sum_ms']):>9} {cell(p['round_ms']):>9}")
    return "\n".join(lines)
