"""Where a speculative round's time goes: each phase of a greedy round (propose-mtp, propose-drafter,
verify, accept, commit) timed as its own jitted function next to the fused round, the median of
`repeats` calls after `warmup`, on fresh copies of donated caches (docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.decode.round import accept, commit, merge_models, verify_forward
from dmtp_jax.decode.sampling import SamplingParams

PHASES = ("propose-mtp", "propose-drafter", "verify", "accept", "commit")


def _copy(tree):
    return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def _median_ms(fn, make_args, repeats: int, warmup: int) -> tuple[float, object]:
    """`(median ms of fn(*make_args()) over repeats calls after warmup, last output)`; `make_args` runs
    outside the timed region."""
    times, out = [], None
    for i in range(warmup + repeats):
        args = make_args()
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times)), out


def phase_breakdown(decoder, state=None, *, repeats: int = 10, warmup: int = 2, seed: int = 0) -> dict:
    """Milliseconds per phase of one greedy round of `decoder` from `state` (default: the state its last
    `generate` left), their sum, and the fused round on the same state; None for a phase not run:
    `{"batch", "max_len", "repeats", "phases_ms", "sum_ms", "round_ms"}`."""
    state = decoder.last_state if state is None else state
    if state is None:
        raise ValueError("no decoder state: run a request first (or pass state)")
    sp = SamplingParams.make()
    batch = int(state.lengths_b.shape[0])
    max_len = int(state.target_cache.kv.k_lbskd.shape[2])
    graphdefs, proposer, knobs = decoder.setup.graphdefs, decoder.proposer, decoder.knobs()
    states = decoder.model_states()
    models = lambda states: merge_models(graphdefs, states)  # noqa: E731
    active = np.ones(batch, bool)
    limits = np.full(batch, max_len, np.int32)
    base_key, round_index = jax.random.key(seed), np.int32(1)
    k_draft, _ = jax.random.split(jax.random.fold_in(base_key, round_index))      # as the round splits its key
    ms = dict.fromkeys(PHASES)
    time_it = lambda fn, make_args: _median_ms(fn, make_args, repeats, warmup)  # noqa: E731

    # ---- propose ----
    def propose(states, st, mtp_cache):     # a chained MTP writes speculative rows into its cache
        st = dataclasses.replace(st, mtp_cache=mtp_cache)
        return proposer.propose(models(states), st, sp, k_draft, True, limits, knobs)
    propose = jax.jit(propose, donate_argnames=("mtp_cache",))
    if proposer.needs["mtp"] and not proposer.needs["drafter"]:     # the MTP chain
        ms["propose-mtp"], proposal = time_it(propose, lambda: (states, state, _copy(state.mtp_cache)))
    else:
        first = None
        if proposer.needs["mtp"]:
            first_fn = jax.jit(lambda states, st: proposer.first(models(states), st, sp, k_draft, True))
            ms["propose-mtp"], first = time_it(first_fn, lambda: (states, state))
        draft_fn = jax.jit(lambda states, st, first: proposer.draft(models(states), st, first, sp, k_draft, True,
                                                                    limits, knobs))
        ms["propose-drafter"], proposal = time_it(draft_fn, lambda: (states, state, first))

    # ---- verify ----
    def verify(states, st, target_cache, drafts_bn):
        m = models(states)
        return verify_forward(m.target, dataclasses.replace(st, target_cache=target_cache), drafts_bn,
                              m.capture_layers)
    verify = jax.jit(verify, donate_argnames=("target_cache",))
    rest = dataclasses.replace(state, target_cache=None)
    ms["verify"], fwd = time_it(verify, lambda: (states, rest, _copy(state.target_cache), proposal.drafts_bn))

    # ---- accept ----
    accept_fn = jax.jit(lambda logits, drafts: accept(logits, drafts, None, sp, k_draft, True))
    ms["accept"], (acc, bonus) = time_it(accept_fn, lambda: (fwd.logits_bnv, proposal.drafts_bn))

    # ---- commit ----
    def commit_fn(states, st, ctx_cache, mtp_cache, verified_cache, proposal, fwd, acc, bonus, active_b):
        proposal = dataclasses.replace(proposal, mtp_cache=mtp_cache)
        fwd = dataclasses.replace(fwd, out=dataclasses.replace(fwd.out, cache=verified_cache))
        return commit(models(states), dataclasses.replace(st, ctx_cache=ctx_cache), proposal, fwd, acc, bonus,
                      active_b)
    commit_fn = jax.jit(commit_fn, donate_argnames=("ctx_cache", "mtp_cache", "verified_cache"))
    rest = dataclasses.replace(state, target_cache=None, ctx_cache=None, mtp_cache=None)
    bare_proposal = dataclasses.replace(proposal, mtp_cache=None)
    bare_fwd = dataclasses.replace(fwd, out=dataclasses.replace(fwd.out, cache=None))
    ms["commit"], _ = time_it(commit_fn, lambda: (states, rest, _copy(state.ctx_cache), _copy(proposal.mtp_cache),
                                                  _copy(fwd.out.cache), bare_proposal, bare_fwd, acc, bonus, active))

    # ---- the fused round, for comparison ----
    round_ms, _ = time_it(lambda st: decoder.round(states, st, active, limits, sp, base_key, round_index, knobs,
                                                   greedy=True),
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
    """The bench's per-phase table: ms per phase of a greedy round, their sum and the fused round."""
    head = "phases (greedy round, each phase jitted alone; median ms)"
    rows = {m: p for m, p in phases.items() if p}
    if not rows:
        return head + ": no speculative rounds ran"
    cell = lambda v: f"{v:.3f}" if v is not None else "-"  # noqa: E731
    width = max([len(m) for m in rows] + [6])     # the longest method name sets the column
    lines = [head + "; the sum of separate phases is not the fused round (dispatch per phase, no "
             "cross-phase fusion):",
             f"{'method':<{width}} {'shape':>9} " + " ".join(f"{p:>15}" for p in PHASES) + f" {'sum':>9} {'round':>9}"]
    for m, p in rows.items():
        lines.append(f"{m:<{width}} {str(p['batch']) + 'x' + str(p['max_len']):>9} "
                     + " ".join(f"{cell(p['phases_ms'][k]):>15}" for k in PHASES)
                     + f" {cell(p['sum_ms']):>9} {cell(p['round_ms']):>9}")
    return "\n".join(lines)
