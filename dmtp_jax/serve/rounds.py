"""The rounds an engine runs on ONE running state: plain decoding and the speculative rounds its
models allow, switchable between any two steps.

A `RoundBank` carries the union of the models its rounds need, so its `round.SpecState` holds
every cache any round reads. Every round is `round.spec_round` with its own proposer (`ar`: the
one-slot `PlainProposer`; `mtp`: the MTP chain; the base method its block), and `round.commit`
keeps every cache current whatever the proposer (plain rounds buffer their rows and the next
speculative round catches up: `decode/drafting.py`), so switching needs no re-prefill. Greedy rows
commit the target's argmax in every round; each sampled round is lossless."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.auto import AutoDecoder
from dmtp_jax.decode.caches import TargetCaches
from dmtp_jax.decode.drafting import DEFER_WINDOW
from dmtp_jax.decode.multi_round import pad_stop_ids
from dmtp_jax.decode.proposers import RoundKnobs, round_proposer
from dmtp_jax.decode.spec import (RoundSetup, _used, catch_up_entry, multi_round_entry, new_spec_state, prefill_entry,
                                  round_entry, to_host)
from dmtp_jax.options import verify_slots

DEFAULT_MTP_STEPS = 4       # the MTP chain's drafts when the models allow `mtp` and no mtp decoder says otherwise


def base_decoder(candidates: dict):
    """The decoder whose models a bank carries for auto's `candidates`: the speculative one needing the
    most models (dmtp first among equals), else the plain one."""
    spec = {m: d for m, d in candidates.items() if not isinstance(d, ARDecoder)}
    if not spec:
        return next(iter(candidates.values()))
    return spec[max(spec, key=lambda m: (sum(spec[m].proposer.needs.values()), m == "dmtp"))]


class RoundBank:
    """Jitted prefill, rounds (`round[method]`) and K-round dispatches (`multi_round(method, K)`, built on
    first use) over one set of models, and the state they share. `models`: `(target, drafter, mtp,
    fusion, draft_head, draft_model)` `LoadedModel`s or None; `slots`: `{method: verify slots}`; `knobs`:
    `RoundKnobs`; `rounds_per_dispatch`: the engine's default K."""

    def __init__(self, models: tuple, slots: dict[str, int], *, verify_mode: str = "rejection",
                 context_window: int = 4096, rounds_per_dispatch: int = 1, prefill_chunk: int = 512,
                 knobs: RoundKnobs | None = None):
        self.models = models
        self.target = models[0]
        self.slots = dict(slots)
        self.rounds_per_dispatch = int(rounds_per_dispatch)
        self.prefill_chunk = int(prefill_chunk)
        self.knobs = knobs or RoundKnobs.make(None)
        self.caches = TargetCaches(self.target)
        graphdefs = tuple(None if m is None else m.graphdef for m in models)
        self._jit = functools.partial(counted_jit, donate_argnames=("state",), static_argnames=("greedy",))
        self.setups = {m: RoundSetup(graphdefs, self.target.mesh, round_proposer(m, n, context_window),
                                     verify_mode if m != "ar" else "rejection", 1, logprobs=True)
                       for m, n in self.slots.items()}
        self.round = {m: self._jit(functools.partial(round_entry, setup)) for m, setup in self.setups.items()}
        self._multi: dict[tuple[str, int], object] = {}
        self.prefill_step = counted_jit(functools.partial(prefill_entry, next(iter(self.setups.values()))),
                                        donate_argnames=("state",), static_argnames=("greedy", "defer"))
        drafting = any(m is not None for m in (models[1], models[2], models[5]))
        self.defer_window = DEFER_WINDOW if drafting and "ar" in self.slots and len(self.slots) > 1 else 0
        self.catch_up_step = counted_jit(functools.partial(catch_up_entry, next(iter(self.setups.values()))),
                                         donate_argnames=("state",))

    def dispatch(self, method: str, rounds: int, buffer: int | None = None):
        """The jitted program a dispatch of `rounds` rounds of `method` runs (`run`): the single round's
        when both are 1, else the `buffer`-round (default `rounds`) dispatch's."""
        if (buffer or rounds) == 1:
            return self.round[method]
        return self.multi_round(method, buffer or rounds)

    def multi_round(self, method: str, rounds: int):
        """The jitted dispatch of up to `rounds` rounds of `method` (`spec.multi_round_entry`)."""
        if (method, rounds) not in self._multi:
            setup = dataclasses.replace(self.setups[method], rounds_per_dispatch=rounds)
            self._multi[(method, rounds)] = self._jit(functools.partial(multi_round_entry, setup))
        return self._multi[(method, rounds)]

    @classmethod
    def for_decoder(cls, decoder, candidates: dict | None = None, switching: bool = False,
                    extra_methods: tuple[str, ...] = ("mtp", "lookup")) -> "RoundBank":
        """The bank of a decoder: an `ARDecoder` runs `ar`; a `SpecDecoder` its method, and with `switching`
        also `ar` and, of `extra_methods`, `mtp` (with an MTP head) and `lookup` (when a candidate)."""
        k = getattr(decoder, "rounds_per_dispatch", 1)
        if isinstance(decoder, ARDecoder):
            return cls((decoder.target, None, None, None, None, None), {"ar": 1}, prefill_chunk=decoder.prefill_chunk,
                       rounds_per_dispatch=k)
        models = _used(decoder.proposer, decoder.target, decoder.drafter, decoder.mtp, decoder.fusion,
                       decoder.draft_head, decoder.draft_model)
        slots = {decoder.method: decoder.slots}
        if switching:
            slots = {"ar": 1, **slots}
            if "mtp" in extra_methods and models[2] is not None and "mtp" not in slots:
                mtp = (candidates or {}).get("mtp")
                slots["mtp"] = (mtp.slots if mtp is not None else
                                verify_slots("mtp", mtp_steps=DEFAULT_MTP_STEPS, block_size=None,
                                             drafter_block_size=None))
            # lookup needs no model: the token buffer
            if "lookup" in extra_methods and "lookup" in (candidates or {}) and "lookup" not in slots:
                slots["lookup"] = candidates["lookup"].slots
        return cls(models, slots, verify_mode=decoder.verify_mode, context_window=decoder.context_window,
                   rounds_per_dispatch=k, prefill_chunk=decoder.prefill_chunk,
                   knobs=decoder.knobs())

    @property
    def methods(self) -> list[str]:
        return list(self.slots)

    @property
    def max_slots(self) -> int:
        return max(self.slots.values())

    def model_states(self) -> tuple:
        return tuple(None if m is None else m.state for m in self.models)

    def new_state(self, rows: int, max_len: int, defer_window: int | None = None, lean: bool = False):
        """A zero state of `rows` rows with every cache of the bank's models; when the bank also runs
        `ar` beside drafting models, its plain rounds (and lean prefills) defer the drafting caches'
        work for up to `defer_window` positions (default `self.defer_window`; `drafting.DeferredRows`).
        `lean`: a lean prefill's state, without the drafting caches (`new_spec_state`); its rows go into
        a running state with theirs zeroed (`rows.put_rows`). The token buffer only where a round of
        the bank reads it (`Proposer.READS_TOKENS`)."""
        window = self.defer_window if defer_window is None or not self.defer_window else defer_window
        reads_tokens = any(setup.proposer.READS_TOKENS for setup in self.setups.values())
        return new_spec_state(self.caches, self.models[1], self.models[2], rows, max_len, self.models[5], window,
                              drafting_caches=not lean, token_buffer=reads_tokens)

    def caught_up(self, state, method: str | None = None, rounds: int = 1):
        """`state` ready for `rounds` rounds of `method` (None: a prefill): its deferred rows caught up
        (`catch_up_step`) when a speculative round or a prefill would read the drafting caches, or a
        plain row's buffer would overflow; else `state` itself. Reads the lags (a small host sync)."""
        if state.deferred is None:
            return state
        lag = int(np.max(np.asarray(state.deferred.lag_b)))
        plain = method is not None and self.slots[method] == 1
        if lag == 0 or (plain and lag + rounds <= state.deferred.window):
            return state
        return self.catch_up_step(self.model_states(), state)

    def lean_prefill(self, width: int, chunks: int) -> bool:
        """Whether a prefill of `chunks` calls `width` tokens wide can be lean (`round.prefill_step`'s
        `defer`): one call no wider than the defer window."""
        return chunks == 1 and 0 < width <= self.defer_window

    def run(self, method: str, state, active_b, limits_b, sp, base_key, first_round: int, greedy: bool,
            rounds: int = 1, stop_ids=(), commit_cap: int | None = None, buffer: int | None = None,
            logprobs: bool = False):
        """One round of `method`, or up to `rounds` stopping on device, on `state` made ready by
        `caught_up`: `(state, tokens [B, k, n], accepted [B, k], ran [B, k], logprobs, rounds run, seconds
        from dispatch to host results, seconds of the catch-up before it)`; `logprobs`: the target's
        `TokenLogprobs` of `tokens` (`[B, k, n]`, `[B, k, n, W]`) on the host when asked for, else None (every
        round computes them: one program). A catch-up is waited for before
        the rounds' clock starts, so their seconds are theirs alone (a switch's cost is the catch-up's).
        `commit_cap`: a row commits `tokens[:min(accepted, commit_cap) + 1]` per round
        (`round.cap_accepted`); `accepted` stays what the target accepted. `buffer` (>= `rounds`): run
        the `buffer`-round dispatch's program (`dispatch`), so one program per method serves every
        dispatch size up to it."""
        knobs = self.knobs if commit_cap is None else dataclasses.replace(self.knobs, commit_cap=np.int32(commit_cap))
        t0, catch_up_s = time.perf_counter(), 0.0
        ready = self.caught_up(state, method, rounds)
        if ready is not state:
            state = jax.block_until_ready(ready)
            catch_up_s = time.perf_counter() - t0
        t0, entry = time.perf_counter(), self.dispatch(method, rounds, buffer)
        if entry is self.round[method]:
            state, *out = entry(self.model_states(), state, active_b, limits_b, sp, base_key, np.int32(first_round),
                                knobs, greedy=greedy)
            tokens_bn, acc_b, _, lp = to_host(tuple(out) if logprobs else tuple(out[:3]) + (None,))
            lp = None if lp is None else jax.tree.map(lambda x: x[:, None], lp)
            return state, tokens_bn[:, None], acc_b[:, None], np.asarray(active_b)[:, None], lp, 1, \
                time.perf_counter() - t0, catch_up_s
        state, *out = entry(self.model_states(), state, active_b, limits_b, sp, base_key, np.int32(first_round),
                            pad_stop_ids(stop_ids), knobs, greedy=greedy, max_rounds=np.int32(rounds))
        tokens_bkn, acc_bk, _, ran_bk, k, lp = to_host(tuple(out) if logprobs else tuple(out[:5]) + (None,))
        return state, tokens_bkn, acc_bk, ran_bk, lp, int(k), time.perf_counter() - t0, catch_up_s

    def compile_counts(self) -> dict[str, int]:
        counts = {"prefill": self.prefill_step.compiles, "catch_up": self.catch_up_step.compiles}
        counts.update({f"round/{m}": fn.compiles for m, fn in self.round.items()})
        counts.update({f"multi_round/{m}": fn.compiles for (m, _), fn in self._multi.items()})
        return counts


def engine_bank(decoder, extra_methods: tuple[str, ...] = ()):
    """`(bank, gate)` of a decoder (auto: `ar` and the `base_decoder` of its candidates, and of
    `extra_methods` those the models allow: `RoundBank.for_decoder`); a speculative bank passes the
    exactness probe first, else is served plainly. One bank per decoder and `extra_methods`, so
    engines share compiles."""
    banks = decoder.__dict__.setdefault("_engine_banks", {})
    if extra_methods not in banks:
        auto = decoder if isinstance(decoder, AutoDecoder) else None
        base = base_decoder(auto.candidates) if auto is not None else decoder
        gate = None
        if not isinstance(base, ARDecoder):
            gate = base.exactness.gate()
            if not gate.engaged:
                base = ARDecoder(base.target, prefill_chunk=base.prefill_chunk)
        banks[extra_methods] = (RoundBank.for_decoder(base, None if auto is None else auto.candidates,
                                                      switching=auto is not None, extra_methods=extra_methods), gate)
    return banks[extra_methods]
