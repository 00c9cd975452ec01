"""Continuous batching over rounds that follow the load: the serving core, no HTTP.

An `Engine` owns one `RoundBank` and one running state whose row count is a compiled bucket. Each
`step()` frees cancelled rows, admits waiting requests in prefill groups, runs the round the
policy picks over the active rows and compacts finished rows (docs/serving-design.md). A request's greedy
output is `generate`'s on the same prompt whatever else is in the batch; a decoder that fails its
exactness probe is served with plain decoding."""

from __future__ import annotations

import collections
import logging
import time

import jax
import numpy as np

from dmtp_jax.decode.auto import AUTO, AutoDecoder
from dmtp_jax.decode.batch import PROMPT_BUCKET_FLOOR, RequestError, StopTracker, round_up
from dmtp_jax.options import check_max_model_len, check_positive_int
from dmtp_jax.serve.admission import PrefillGroup, form_group, row_bucket, row_buckets
from dmtp_jax.serve.logprobs import keep_logprobs, slot_logprobs
from dmtp_jax.serve.policy import LoadPolicy
from dmtp_jax.serve.prefix_cache import PrefixCache, prefix_cache_bytes
from dmtp_jax.serve.request import Event, Request, check_request, merge_events, row_sampling
from dmtp_jax.serve.rounds import engine_bank
from dmtp_jax.serve.rows import RowMoves, compaction_moves, insert_row, same_shardings
from dmtp_jax.serve.stats import RecentMedians
from dmtp_jax.serve.warmup import warm_up_engine

__all__ = ["Engine", "Event", "Request", "insert_row"]

log = logging.getLogger(__name__)
PREFILL_BUDGET_CHUNKS = 4       # default prefill tokens per step: this many prefill chunks' worth
BURST_PROMPT_TOKENS = 2 * PROMPT_BUCKET_FLOOR    # an idle engine prefills this many tokens per free row at once
SERVE_ROUNDS_PER_DISPATCH = 4   # `serve`'s most rounds per dispatch while nobody waits (`LoadPolicy.rounds`)


class Engine:
    """Continuous batching of `Request`s over one decoder (see the module docstring).

    `max_model_len`: the most tokens (prompt + max_tokens) a request may use (default: the model's
    `max_position_embeddings`). `stop_ids`: the default stop tokens (default: the model's EOS ids).
    `buckets`: the running state's row counts (default `row_buckets(max_batch_size)`).
    `prefill_budget`: prefill tokens per step while rows decode (default: `PREFILL_BUDGET_CHUNKS` x the
    decoder's `prefill_chunk`); an idle engine's first group may take `burst_budget` (default: the larger
    of that and `max_batch_size` x `BURST_PROMPT_TOKENS`), so a burst of short prompts is one prefill.
    `rounds_per_dispatch`: the most rounds per dispatch, run while nobody waits and the policy's round time
    says K rounds take at most `policy.DISPATCH_S` (default: the decoder's).
    `prefix_cache_gb`: the prefix cache's budget in GiB (0: no cache; `serve/prefix_cache.py`).
    `extra_methods`: auto's rounds beside `ar` and its strongest speculative method, of `mtp` and
    `lookup` (each a set of programs to compile: `rounds.engine_bank`).
    Not thread-safe: one thread calls `add`, `cancel` and `step` (or `admit` and `decode`: the scheduler).
    """

    def __init__(self, decoder, *, max_batch_size: int = 8, max_model_len: int | None = None, stop_ids=None,
                 seed: int = 0, buckets: tuple[int, ...] | None = None, prefill_budget: int | None = None,
                 rounds_per_dispatch: int | None = None, max_top_k: int = 256, prefix_cache_gb: float = 0.0,
                 burst_budget: int | None = None, extra_methods: tuple[str, ...] = ()):
        cfg = decoder.target.cfg
        self.max_top_k = int(max_top_k)              # top-k's search width in sampled rounds (static)
        check_positive_int("--max-batch-size", max_batch_size, RequestError)
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        check_max_model_len(self.max_model_len, cfg.max_position_embeddings, RequestError)
        self.decoder, self.cfg, self.seed = decoder, cfg, seed
        self.stop_ids = tuple(cfg.eos_token_ids if stop_ids is None else stop_ids)
        self.max_batch_size = int(max_batch_size)
        self.buckets = tuple(sorted(set(buckets or row_buckets(self.max_batch_size))))
        if self.buckets[-1] != self.max_batch_size or self.buckets[0] < 1:
            raise RequestError(f"row buckets {self.buckets} must be >= 1 and end at {self.max_batch_size}")
        self.running: list[Request] = []            # row i of the state runs running[i]
        self.waiting: collections.deque[Request] = collections.deque()
        self._group: PrefillGroup | None = None      # the prefill in progress
        self._solo: set[int] = set()                 # requests to prefill alone (their group failed)
        self._index = 0                              # rounds run (the round key's index)
        self._last_dispatch = None                   # (bucket, rounds, results back s) of a dispatch just run
        self._busy_since: float | None = None        # when the busy time the next dispatch is charged began
        self._admitting_s = 0.0                      # of which spent admitting (prefill is modelled apart)
        self.counters = collections.Counter()        # requests, prompt / generated tokens, rounds, accepted
        self.auto = decoder if isinstance(decoder, AutoDecoder) else None
        self.verdict = None if self.auto is None else self.auto.cached(self.max_batch_size, greedy=True)
        self.bank, self.gate = engine_bank(decoder, tuple(extra_methods))
        self.rounds_per_dispatch = int(rounds_per_dispatch or self.bank.rounds_per_dispatch)
        self.method = AUTO if self.auto is not None else self.bank.methods[0]
        prior = {m: x.get("tau_per_verify") for m, x in (self.verdict.measured if self.verdict else {}).items()}
        self.policy = LoadPolicy(self.bank.slots, {m: t for m, t in prior.items() if t})
        self.prefill_times = RecentMedians()        # one-call prefill seconds by (row bucket, chunk width, lean)
        self.warm_prefills: set[tuple] = set()      # its keys warm-up timed (live calls leave them: `_admit`)
        self.max_len = round_up(self.max_model_len + self.bank.max_slots, 128)
        self.prefill_budget = int(prefill_budget or PREFILL_BUDGET_CHUNKS * self.bank.prefill_chunk)
        self.burst_budget = int(burst_budget or max(self.prefill_budget, self.max_batch_size * BURST_PROMPT_TOKENS))
        self.base_key = jax.random.key(seed)
        one = self.bank.new_state(1, self.max_len)
        self.moves = RowMoves(one, self.bank.new_state(2, self.max_len))    # the running state's row moves
        self.prefix_cache = PrefixCache.for_rows(prefix_cache_bytes(prefix_cache_gb), self.moves, one)
        self.state = self.bank.new_state(self.buckets[0], self.max_len)

    @property
    def rows(self) -> int:
        """Rows of the running state (a bucket)."""
        return int(self.state.lengths_b.shape[0])

    @property
    def choice(self) -> dict:
        """The policy's last choice: method, why, rows, bucket, tau and estimated tok/s per method."""
        return self.policy.describe()
    # ---- requests ------------------------------------------------------------------------------
    def check(self, req: Request) -> Request:
        """Validates a request against this engine's limits (`request.check_request`); returns it."""
        return check_request(req, vocab_size=self.cfg.vocab_size, max_model_len=self.max_model_len,
                             max_top_k=self.max_top_k)

    def add(self, req: Request) -> Request:
        """Queues a (checked) request; a later `step` admits it."""
        self.check(req)
        req.tracker = StopTracker(1, req.max_tokens, self.stop_ids if req.stop_ids is None else req.stop_ids)
        self.waiting.append(req)
        self.counters.update(requests=1, prompt_tokens=len(req.prompt_ids))
        return req

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Ends a request at the next step (its row is freed then); `reason` is its finish reason."""
        if not req.finished:
            req.cancelled, req.cancel_reason = True, reason

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self._group is not None or bool(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running) + (0 if self._group is None else len(self._group.reqs))

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """`admit()` then `decode()`: the events of both."""
        return self.admit() + self.decode()

    def admit(self) -> list[Event]:
        """Frees cancelled rows and runs at most the prefill budget's worth of admissions; returns the
        events (admitted requests' first tokens), which a server can send before the next round."""
        events: list[Event] = []
        start = time.perf_counter()
        if self._busy_since is None and self.busy:  # the engine's busy time runs from here (`_round`)
            self._busy_since, self._admitting_s = start, 0.0
        self._drop_cancelled(events)
        if self._admit(events) or events:
            self._last_dispatch = None      # the time to the next dispatch is not the host's round work
        self._admitting_s += time.perf_counter() - start
        return events

    def decode(self) -> list[Event]:
        """One dispatch of rounds over the running rows; returns the events (what each request committed)."""
        events: list[Event] = []
        if self.running:
            try:
                self._round(events)
            except Exception:       # not attributable to a row: the running rows end, the waiting stay
                log.exception("engine round failed; ending the running requests")
                self._end_running("error", events)
        return events

    def _finish(self, req: Request, reason: str, events: list[Event], tokens=()) -> None:
        req.finish_reason, req.finished_s = reason, time.perf_counter()
        events.append(Event(req, list(tokens), True))

    def _drop_cancelled(self, events):
        for req in [r for r in self.running if r.cancelled]:
            self._finish(req, req.cancel_reason, events)
        self._compact()
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self._finish(req, req.cancel_reason, events)
        if self._group is not None and all(r.cancelled for r in self._group.reqs):
            for req in self._group.reqs:
                self._finish(req, req.cancel_reason, events)
            self._group = None

    def _end_running(self, reason: str, events) -> None:
        for req in self.running:
            self._finish(req, reason, events)
        self.running = []
        self._last_dispatch = None
        self.state = self.bank.new_state(self.buckets[0], self.max_len)

    def abort_all(self, reason: str = "error") -> list[Event]:
        """Ends every request at once and frees every row; the running state is rebuilt so the next
        request starts clean."""
        events: list[Event] = []
        reqs = list(self.waiting) + ([] if self._group is None else self._group.reqs)
        self.waiting.clear()
        self._group = None
        for req in reqs:
            self._finish(req, reason, events)
        self._end_running(reason, events)
        return events

    # ---- admission -----------------------------------------------------------------------------
    def _next_group(self, events) -> PrefillGroup | None:
        """Starts the prefill of the next group (`admission.form_group`), None when none can start."""
        while self.waiting and len(self.running) < self.max_batch_size:
            budget = self.prefill_budget if self.running else self.burst_budget    # nobody decodes: no stall
            # lean while plain rounds will serve the rows once the waiting requests are in too (in the
            # dispatches run while nobody waits)
            need = self._rows_to_come(0)
            lean = self.policy.best(need, row_bucket(need, self.buckets), self.rounds_per_dispatch) == "ar"
            reqs = form_group(self.waiting, self.max_batch_size - len(self.running), self.buckets, budget,
                              self.bank.prefill_chunk, self._solo, self.prefix_cache, self.prefill_times, lean)
            if not reqs:
                return None
            for req in reqs:
                self.waiting.remove(req)
            try:
                return PrefillGroup.start(self.bank, reqs, row_bucket(len(reqs), self.buckets), self.max_len,
                                          self.cfg.vocab_size, self.max_top_k, self.prefix_cache, lean)
            except Exception:
                self._group_failed(reqs, events)
        return None

    def _rows_to_come(self, group: int) -> int:
        """The rows running once a group of `group` requests and the waiting ones are in (at most
        `max_batch_size`)."""
        return min(self.max_batch_size, len(self.running) + group + len(self.waiting))

    def _group_failed(self, reqs, events) -> None:
        log.exception("admitting requests %s failed", [r.id for r in reqs])
        if len(reqs) == 1:
            self._solo.discard(reqs[0].id)
            self._finish(reqs[0], "error", events)
            return
        self._solo.update(r.id for r in reqs)
        self.waiting.extendleft(reversed(reqs))

    def _admit(self, events) -> int:
        """Runs prefill groups within the budget; returns the prefill tokens run."""
        spent = 0                       # prefill tokens run this step: at most the budget (or one call)
        while True:
            if self._group is None:
                self._group = self._next_group(events)
                if self._group is None:
                    return spent
            group = self._group
            cost = group.rows * group.width
            if spent and spent + cost > self.prefill_budget:
                return spent            # the running rows wait no longer than the budget's prefill
            spent += cost
            try:
                start, compiles = time.perf_counter(), self.bank.prefill_step.compiles
                if not group.step(self.bank):
                    continue
                if group.calls == 1 and self.bank.prefill_step.compiles == compiles:    # its results are back
                    seconds, key = time.perf_counter() - start, (group.rows, group.width, group.lean)
                    if key not in self.warm_prefills:   # group sizes rest on times taken alike (docs/serving-design.md)
                        self.prefill_times.add(key, seconds)
                    self.policy.observe_prefill(group.lean, group.rows, len(group.reqs), seconds,
                                                row_bucket(self._rows_to_come(len(group.reqs)), self.buckets))
                self._group = None
                self._insert(group, events)
            except Exception:
                self._group = None
                self._group_failed(group.reqs, events)

    def _insert(self, group: PrefillGroup, events) -> None:
        """The group's rows into the running state (grown to a bucket that holds them, never shrunk
        here: `_fit_rows`), first tokens committed; cancelled requests' rows are dropped. On an empty
        engine whose state is no larger, a group none of whose requests was cancelled becomes the
        running state (no copy) when its row bucket is the one its requests need: its padding rows
        idle as a finished request's row does."""
        keep = [i for i, r in enumerate(group.reqs) if not r.cancelled]
        need = len(self.running) + len(keep)
        fits = len(keep) == len(group.reqs) and group.rows == row_bucket(need, self.buckets)
        if not self.running and fits and group.rows >= self.rows and group.owned and same_shardings(
                group.state, self.state):
            self.state = group.state
        else:
            self._resize_to(max(self.rows, row_bucket(need, self.buckets)))
            dst = np.full(group.rows, self.rows, np.int32)          # past the rows: dropped
            dst[keep] = np.arange(len(self.running), need, dtype=np.int32)
            self.state = self.moves.put(self.state, group.state, dst)
        now = time.perf_counter()
        self.counters["lean_prefills"] += group.lean
        for i, req in enumerate(group.reqs):
            self._solo.discard(req.id)
            if req.cancelled:
                self._finish(req, req.cancel_reason, events)
                continue
            self.running.append(req)
            req.first_token_s = now
            if self.prefix_cache is not None:      # the prompt consumed, its first token pending
                self.prefix_cache.offer_row(self.state, len(self.running) - 1, req.prompt_ids + [group.first[i]],
                                            req.greedy)
            self._commit(req, [group.first[i]], events, logprobs=group.logprobs and group.logprobs[i])
        self._compact()

    def _commit(self, req: Request, tokens, events, exact: bool = True, logprobs=None):
        """Commits a request's new tokens (and their `logprobs`: `serve/logprobs.py`) and returns how many it
        kept (its stop and `max_tokens` cut the rest); `exact`: its row's state holds no token past them (no
        later round of the dispatch ran it), so a finished row that kept them all is offered to the prefix cache."""
        kept = req.tracker.add(0, tokens)
        keep_logprobs(req, logprobs, len(kept))
        req.output_ids.extend(kept)
        self.counters["generated_tokens"] += len(kept)
        if req.tracker.done[0]:
            if self.prefix_cache is not None and exact and len(kept) == len(tokens):
                self.prefix_cache.offer_row(self.state, self.running.index(req), req.prompt_ids + req.output_ids,
                                            req.greedy)
            reason = "stop" if kept and kept[-1] in req.tracker.stop_ids else "length"
            self.policy.observe_output(len(req.output_ids))
            self._finish(req, reason, events, kept)
        elif kept:
            events.append(Event(req, kept, False))
        return len(kept)

    # ---- rows ----------------------------------------------------------------------------------
    def _resize_to(self, rows: int) -> None:
        if rows != self.rows:
            self.state = self.moves.resize(self.state, rows)

    def _compact(self) -> None:
        """Drops finished rows: the last running rows fill their places (`rows.compaction_moves`; the
        state keeps its rows: `_fit_rows`)."""
        moves, order = compaction_moves([r.finished for r in self.running])
        for src, hole in moves:
            self.state = self.moves.move(self.state, np.int32(src), np.int32(hole))
        self.running = [self.running[i] for i in order]

    def _fit_rows(self) -> None:
        """Before a dispatch, while nobody waits: the state shrinks to the smallest bucket holding the
        running rows and the most requests held at once over the last choices (`policy.recent_load`),
        so the next wave of a closed loop's clients finds its rows (docs/serving-design.md)."""
        if not self.waiting and self._group is None:
            load = min(self.rows, max(len(self.running), self.policy.recent_load))
            self._resize_to(row_bucket(load, self.buckets))

    # ---- rounds --------------------------------------------------------------------------------
    def _round(self, events):
        self._fit_rows()
        n, rows = len(self.running), self.rows
        active = np.arange(rows) < n
        limits = np.zeros(rows, np.int32)
        limits[:n] = [len(r.prompt_ids) + r.max_tokens for r in self.running]
        sp, greedy = row_sampling(self.running, rows, self.max_top_k)
        idle = not self.waiting and self._group is None
        method = self.policy.choose(n, rows, self.rounds_per_dispatch, idle=idle,
                                    held=self._rows_to_come(0 if self._group is None else len(self._group.reqs)))
        choice = self.policy.describe()
        k, cap = choice["rounds"], 0 if choice["in_step"] else None
        stop_ids = sorted({s for r in self.running for s in r.tracker.stop_ids}) if k > 1 else ()
        entry = self.bank.dispatch(method, k, self.rounds_per_dispatch)
        compiles = entry.compiles
        if self.prefix_cache is not None and self.bank.slots[method] > 1:   # rows the dispatch may end: once
            self.prefix_cache.before_round(self.state, self.running, self.bank.slots[method] * k)
        start = time.perf_counter()
        if self._last_dispatch is not None:     # (bucket, rounds, when its results were back)
            bucket, rounds, back = self._last_dispatch
            self.policy.observe_host(bucket, (start - back) / rounds)
        self.state, tokens_bkn, acc_bk, ran_bk, lp, k, seconds, catch_up_s = self.bank.run(
            method, self.state, active, limits, sp, self.base_key, self._index + 1, greedy, k, stop_ids, cap,
            self.rounds_per_dispatch, any(r.logprobs is not None for r in self.running))
        self._last_dispatch = (rows, k, start + catch_up_s + seconds)
        events_before = len(events)
        self._index += k
        self.counters["rounds"] += k
        self.counters[f"rounds/{method}"] += k
        row_rounds = committed = kept = cut = 0
        for j in range(k):
            for i, req in enumerate(self.running):
                if req.finished or not ran_bk[i, j]:
                    continue
                accepted = int(acc_bk[i, j]) + 1
                got = accepted if cap is None else min(accepted, cap + 1)
                req.acceptance.append(got)
                row_rounds, committed, cut = row_rounds + 1, committed + got, cut + accepted - got
                self.counters["first_accepted"] += accepted > 1
                kept += self._commit(req, tokens_bkn[i, j, :got].tolist(), events, not ran_bk[i, j + 1:].any(), slot_logprobs(lp, i, j, got))
        if k > 1:                       # one event per request per dispatch: one message to its client
            events[events_before:] = merge_events(events[events_before:])
        self.counters.update(row_rounds=row_rounds, committed=committed)
        compiled = entry.compiles != compiles
        self.policy.observe(method, rows, rounds=k, seconds=seconds, row_rounds=row_rounds, committed=kept + cut,
                            compiled=compiled, catch_up_s=catch_up_s)
        self._compact()
        now = time.perf_counter()
        if self._busy_since is not None and not compiled:   # busy since the last dispatch, admissions aside
            self.policy.observe_served(method, rows, kept, now - self._busy_since - self._admitting_s)
        self._busy_since, self._admitting_s = (now if self.busy else None), 0.0

    # ---- compiles ------------------------------------------------------------------------------
    def warm_up(self, every_bucket: bool = True, sampled: bool = True, progress: bool = False) -> None:
        """Compiles, before the first request, every program a request may run
        (`serve/warmup.py:warm_up_engine`; a bar on stderr when `progress`), so no request waits for a
        compile and the policy's first timings are clean (`compile_counts` counts them). Raises
        `InputError` when they would not fit the host's memory maps."""
        warm_up_engine(self, every_bucket, sampled, progress)

    def compile_counts(self) -> dict[str, int]:
        """The bank's compile counts plus the row moves' (`put_rows`, `move_row`, `resize_rows`) and
        the prefix cache's (`extract_row`, `copy_row`)."""
        cache = {} if self.prefix_cache is None else self.prefix_cache.compile_counts()
        return {**self.bank.compile_counts(), **self.moves.compile_counts(), **cache}
