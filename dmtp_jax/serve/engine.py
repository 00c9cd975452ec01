"""Continuous batching over the speculative round (or plain decoding): the serving core, no HTTP.

An `Engine` owns one decoder and one running state of `max_batch_size` rows x `max_len` slots, so
the round compiles once per greedy flag. Each `step()`:

    cancel     rows whose request was cancelled (client gone, stop string) are freed at once
    admit      waiting requests that fit free rows, oldest first, are prefilled each ALONE (a 1-row
               state of the same `max_len`, chunk by chunk with the decoder's `prefill_chunk`), as
               many chunks per step as fit one chunk's worth of tokens (`prefill_chunk`): short
               prompts arriving together are admitted in one step, and the running rows wait at
               most one chunk; a finished row goes into the running state by `insert_row` (one
               jitted, generic pytree scatter)
    round      one speculative round (`SpecDecoder.round`) or one plain step (`ARDecoder.decode_step`)
               over every row, the active ones committing; each request's own `StopTracker`
               cuts at its stop tokens / `max_tokens`, and a finished row is free for the next step

A request's greedy output is the decoder's `generate` output on the same prompt, whatever else is
in the batch: rows never read each other, and greedy verification is exact match. Sampled rows
carry their own temperature / top-p / top-k (`SamplingParams.rows`: traced values; top-k searches a
fixed `max_top_k`, so no k compiles anything; the round compiles once per greedy flag and top-p form,
`SamplingParams`' static flags). Sampled requests'
`seed` seeds their prefill (first token); later draws come from the engine's round keys (lossless,
not reproducible per request).

With `--method auto` (an `AutoDecoder`) the engine serves the method of the cached verdict for its
`max_batch_size` rows; without one, its first step measures the candidates on the waiting requests'
prompts (`AutoDecoder.choose`) and serves the fastest from then on. The round always runs over
`max_batch_size` rows, so the batch, and the verdict, never change while it serves.

Speculative decoders pass the exactness probe first (`decode/probe.py:exactness_gate`); on a
decline the engine serves plain decoding with the same target.

Example:
    >>> engine = Engine(make_decoder("dmtp", target, drafter=d, mtp=m, fusion=f), max_batch_size=8)  # doctest: +SKIP
    >>> req = engine.add(Request([1, 2, 3], max_tokens=16))  # doctest: +SKIP
    >>> while not req.finished: engine.step()  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.auto import AUTO, AutoDecoder
from dmtp_jax.decode.batch import RequestError, StopTracker, pad_prompts, round_up
from dmtp_jax.decode.prefill import chunk_length, prefill_chunks
from dmtp_jax.decode.sampling import SamplingParams, check as check_sampling
from dmtp_jax.decode.spec import to_host

_IDS = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and, as it runs, its output (`output_ids`, `finish_reason`)."""
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None          # default: the engine's (the model's EOS ids)
    id: int = dataclasses.field(default_factory=lambda: next(_IDS))
    output_ids: list[int] = dataclasses.field(default_factory=list)
    acceptance: list[int] = dataclasses.field(default_factory=list)    # tokens committed per round
    finish_reason: str | None = None                 # "stop", "length" or "cancelled"
    arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None
    cancelled: bool = False
    cancel_reason: str = "cancelled"
    tracker: StopTracker | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def acceptance_stats(self) -> dict:
        """This request's rounds and tokens per round (accepted drafts + bonus), for `usage`.

        Example:
            >>> Request([1], 4, acceptance=[3, 1]).acceptance_stats()["mean_acceptance_length"]
            2.0
        """
        rounds = len(self.acceptance)
        return {"verify_rounds": rounds,
                "mean_acceptance_length": sum(self.acceptance) / rounds if rounds else 0.0,
                "first_candidate_acceptance": sum(a > 1 for a in self.acceptance) / rounds if rounds else 0.0}


@dataclasses.dataclass
class Event:
    """What a step committed for a request: its new tokens (already cut at a stop token / the
    budget) and whether it finished."""
    request: Request
    tokens: list[int]
    finished: bool


def batch_axis(small_shape: tuple, big_shape: tuple) -> int:
    """The axis where a 1-row leaf and a B-row leaf differ (0 when they are equal: B == 1).

    Example:
        >>> batch_axis((4, 1, 128, 2, 8), (4, 8, 128, 2, 8))
        1
    """
    diff = [i for i, (a, b) in enumerate(zip(small_shape, big_shape)) if a != b]
    if len(small_shape) != len(big_shape) or len(diff) > 1 or (diff and small_shape[diff[0]] != 1):
        raise ValueError(f"a 1-row leaf {small_shape} does not fit {big_shape}")
    return diff[0] if diff else 0


def insert_row(state, row_state, row):
    """`state` with row `row` replaced by the 1-row `row_state` (same pytree, every leaf's batch
    axis found by `batch_axis`): no per-architecture code.

    Example:
        >>> out = insert_row({"k": jnp.zeros((2, 3, 4))}, {"k": jnp.ones((2, 1, 4))}, 2)
        >>> out["k"].sum(axis=(0, 2)).tolist()
        [0.0, 0.0, 8.0]
    """
    def put(big, small):
        axis = batch_axis(small.shape, big.shape)
        if small.shape == big.shape:
            return small.astype(big.dtype)
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), row, axis)
    return jax.tree.map(put, state, row_state)


class SpecRows:
    """The engine's view of a `SpecDecoder`: states, a 1-row chunked prefill, one round."""

    def __init__(self, decoder, seed: int = 0):
        self.decoder, self.method = decoder, decoder.method
        self.slots = decoder.slots
        self.base_key = jax.random.key(seed)

    def new_state(self, rows: int, max_len: int):
        return self.decoder.new_state(rows, max_len)

    def prefill(self, tokens_1t, lengths_1, max_len: int, sp, key, greedy: bool):
        """A generator running one prefill chunk per `next`; the call that runs the last chunk
        returns `(1-row state, first token)` (StopIteration's value)."""
        dec = self.decoder
        states, state = dec.model_states(), dec.new_state(1, max_len)
        for i, (start, chunk_bt, next_b) in enumerate(prefill_chunks(tokens_1t, dec.prefill_chunk)):
            if i:
                yield       # one chunk per `next`: the call that runs the last chunk returns
            state = dec.prefill_step(states, chunk_bt, next_b, start, lengths_1, state, sp, key, greedy=greedy)
        return state, int(to_host(state.pending_b)[0])

    def step(self, state, active_b, limits_b, pending_b, lengths_b, sp, index: int, greedy: bool):
        dec = self.decoder
        state, *out = dec.round(dec.model_states(), state, active_b, limits_b, sp, self.base_key, np.int32(index),
                                dec.knobs(), greedy=greedy)
        tokens_bn, acc_b, _ = to_host(tuple(out))
        return state, tokens_bn, acc_b


class PlainRows:
    """The engine's view of an `ARDecoder`: the state is the target cache; the pending token and
    position of each row come from the engine (its host copy)."""

    method, slots = "ar", 1

    def __init__(self, decoder: ARDecoder, seed: int = 0):
        self.decoder = decoder
        self.base_key = jax.random.key(seed)

    def new_state(self, rows: int, max_len: int):
        return self.decoder.caches.new(rows, max_len)

    def prefill(self, tokens_1t, lengths_1, max_len: int, sp, key, greedy: bool):
        dec = self.decoder
        first, cache = jnp.zeros(1, jnp.int32), dec.caches.new(1, max_len)
        for i, (start, chunk_bt, _) in enumerate(prefill_chunks(tokens_1t, dec.prefill_chunk)):
            if i:
                yield       # as `SpecRows.prefill`
            first, cache = dec.prefill_step(dec.target.state, chunk_bt, start, lengths_1, cache, first, sp, key,
                                            greedy=greedy)
        return cache, int(to_host(first)[0])

    def step(self, state, active_b, limits_b, pending_b, lengths_b, sp, index: int, greedy: bool):
        positions = np.where(active_b, lengths_b, self.max_len).astype(np.int32)    # free rows: scratch
        nxt, state = self.decoder.decode_step(self.decoder.target.state, pending_b, positions, state, sp,
                                              jax.random.fold_in(self.base_key, index), greedy=greedy)
        return state, to_host(nxt)[:, None], np.zeros(len(active_b), np.int32)


def engine_rows(decoder, seed: int = 0):
    """`(rows, gate)`: `SpecRows` / `PlainRows` for a decoder; a speculative decoder passes the
    exactness probe first and is served with plain decoding when the probe declines (`exactness_gate`).

    Example:
        >>> rows, gate = engine_rows(make_decoder("dflash", target, drafter))  # doctest: +SKIP
        >>> rows.method, gate.engaged  # doctest: +SKIP
        ('dflash', True)
    """
    if isinstance(decoder, ARDecoder):
        return PlainRows(decoder, seed), None
    from dmtp_jax.decode.probe import exactness_gate
    gate = exactness_gate(decoder)
    if gate.engaged:
        return SpecRows(decoder, seed), gate
    return PlainRows(ARDecoder(decoder.target, prefill_chunk=decoder.prefill_chunk), seed), gate


class Engine:
    """Continuous batching of `Request`s over one decoder (see the module docstring).

    `max_model_len`: the most tokens (prompt + max_tokens) a request may use (default: the model's
    `max_position_embeddings`). `stop_ids`: the default stop tokens (default: the model's EOS ids).
    Not thread-safe: one thread calls `add`, `cancel` and `step` (the server's scheduler).
    """

    def __init__(self, decoder, *, max_batch_size: int = 8, max_model_len: int | None = None, stop_ids=None,
                 seed: int = 0, max_top_k: int = 256):
        cfg = decoder.target.cfg
        self.max_top_k = int(max_top_k)          # top-k's search width in sampled rounds (static)
        if max_batch_size < 1:
            raise RequestError(f"--max-batch-size must be >= 1, got {max_batch_size}")
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        if not 2 <= self.max_model_len <= cfg.max_position_embeddings:
            raise RequestError(f"--max-model-len must be in [2, {cfg.max_position_embeddings}] "
                               f"(the model's max_position_embeddings), got {self.max_model_len}")
        self.decoder, self.cfg, self.seed = decoder, cfg, seed
        self.stop_ids = tuple(cfg.eos_token_ids if stop_ids is None else stop_ids)
        self.max_batch_size = int(max_batch_size)
        self.running: list[Request | None] = [None] * self.max_batch_size
        self.waiting: collections.deque[Request] = collections.deque()
        self._prefill = None                    # (request, row, generator, chunk width) being prefilled
        self._index = 0                          # rounds run (the round key's index)
        self.counters = collections.Counter()    # requests, prompt / generated tokens, rounds, accepted
        # auto: the method is the cached verdict for this batch, else measured on the first requests
        self.auto = decoder if isinstance(decoder, AutoDecoder) else None
        self.verdict = None if self.auto is None else self.auto.cached(self.max_batch_size, greedy=True)
        self.rows = self.gate = None
        self.method = AUTO
        if self.auto is None:
            self._start(decoder)
        elif self.verdict is not None:
            self._start(self.auto.candidates[self.verdict.method])

    def _start(self, decoder) -> None:
        """Serves with `decoder` from now on: its rows view, running state and row scatter."""
        self.rows, self.gate = engine_rows(decoder, self.seed)
        self.method = self.rows.method
        self.max_len = round_up(self.max_model_len + self.rows.slots, 128)
        self.rows.max_len = self.max_len
        self.state = self.rows.new_state(self.max_batch_size, self.max_len)
        shardings = jax.tree.map(lambda x: x.sharding, self.state)
        self._insert = counted_jit(insert_row, donate_argnums=0, out_shardings=shardings)
        self.prefill_budget = int(self.rows.decoder.prefill_chunk)   # prefill tokens per step

    def _choose(self) -> None:
        """auto, first requests: measures the candidates on the waiting prompts (repeated to the
        running batch's rows, greedy, up to `probe_tokens` new tokens each; outputs dropped), then
        serves with the fastest."""
        prompts = [r.prompt_ids for r in list(self.waiting)[:self.max_batch_size]]
        budget = min(self.max_model_len - len(p) for p in prompts)
        rows = [prompts[i % len(prompts)] for i in range(self.max_batch_size)]
        self.verdict = self.auto.choose(rows, budget, SamplingParams.make(), seed=self.seed, stop_ids=self.stop_ids,
                                        decide=True)
        self._start(self.auto.candidates[self.verdict.method])

    # ---- requests ------------------------------------------------------------------------------
    def check(self, req: Request) -> Request:
        """Validates a request (raises `RequestError` naming the problem); returns it.

        Example:
            >>> engine.check(Request([1, 2], max_tokens=0))  # doctest: +SKIP
            Traceback (most recent call last):
            dmtp_jax.errors.RequestError: max_tokens must be >= 1, got 0
        """
        if req.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {req.max_tokens}")
        check_sampling(req.temperature, req.top_p, req.top_k)
        if self.max_top_k < req.top_k < self.cfg.vocab_size:
            raise RequestError(f"top_k must be <= {self.max_top_k} (--max-top-k), or 0 / >= the vocabulary "
                               f"({self.cfg.vocab_size}) for none, got {req.top_k}")
        if not -2**63 <= req.seed < 2**63:
            raise RequestError(f"seed must be a 64-bit integer, got {req.seed}")
        total = len(req.prompt_ids) + req.max_tokens
        if total > self.max_model_len:
            raise RequestError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) = {total} "
                               f"exceeds --max-model-len {self.max_model_len}")
        pad_prompts([req.prompt_ids], req.max_tokens, self.cfg.vocab_size, self.max_model_len, batch_bucket=1)
        return req

    def add(self, req: Request) -> Request:
        """Queues a (checked) request; it is admitted by a later `step`.

        Example:
            >>> req = engine.add(Request([1, 2, 3], max_tokens=8, temperature=0.7))  # doctest: +SKIP
        """
        self.check(req)
        req.tracker = StopTracker(1, req.max_tokens, self.stop_ids if req.stop_ids is None else req.stop_ids)
        self.waiting.append(req)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        return req

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Ends a request at the next step (its row is freed then); `reason` is its finish reason.

        Example:
            >>> engine.cancel(req); engine.step()[0].finished  # doctest: +SKIP
            True
        """
        if not req.finished:
            req.cancelled, req.cancel_reason = True, reason

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self._prefill is not None or any(r is not None for r in self.running)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.running) + (self._prefill is not None)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Frees cancelled rows, runs at most one prefill chunk's worth of admissions (several short
        prompts, or one chunk of a long one), runs one round over the running rows; returns what
        each request committed.

        Example:
            >>> [(ev.request.id, ev.tokens, ev.finished) for ev in engine.step()]  # doctest: +SKIP
            [(1, [17, 4, 9], False)]
        """
        events: list[Event] = []
        self._drop_cancelled(events)
        if self.rows is None:           # auto before its verdict
            if not self.waiting:
                return events
            self._choose()
        self._admit(events)
        if any(r is not None for r in self.running):
            self._round(events)
        return events

    def _finish(self, req: Request, reason: str, events: list[Event], tokens=()) -> None:
        req.finish_reason, req.finished_s = reason, time.perf_counter()
        events.append(Event(req, list(tokens), True))

    def _drop_cancelled(self, events):
        for i, req in enumerate(self.running):
            if req is not None and req.cancelled:
                self.running[i] = None
                self._finish(req, req.cancel_reason, events)
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self._finish(req, req.cancel_reason, events)
        if self._prefill is not None and self._prefill[0].cancelled:
            req = self._prefill[0]
            self._prefill = None
            self._finish(req, req.cancel_reason, events)

    def abort_all(self, reason: str = "error") -> list[Event]:
        """Ends every request at once (the scheduler's answer to a failed step) and frees every row;
        the running state is rebuilt so the next request starts clean."""
        events: list[Event] = []
        reqs = [r for r in self.running if r is not None] + list(self.waiting)
        if self._prefill is not None:
            reqs.append(self._prefill[0])
        self.running, self._prefill = [None] * self.max_batch_size, None
        self.waiting.clear()
        for req in reqs:
            self._finish(req, reason, events)
        if self.rows is not None:
            self.state = self.rows.new_state(self.max_batch_size, self.max_len)
        return events

    def _top_k(self, req: Request) -> int:
        return req.top_k if req.top_k < self.cfg.vocab_size else 0      # k >= the vocabulary keeps all

    def _next_prefill(self):
        """Starts the prefill of the oldest waiting request that fits a free row (None if none)."""
        free = [i for i, r in enumerate(self.running) if r is None]
        if not free or not self.waiting:
            return None
        req = self.waiting.popleft()
        batch = pad_prompts([req.prompt_ids], req.max_tokens, self.cfg.vocab_size, self.max_model_len,
                            batch_bucket=1)
        sp = (SamplingParams.make() if req.greedy else
              SamplingParams.rows(req.temperature, req.top_p, self._top_k(req), top_k_cap=self.max_top_k))
        gen = self.rows.prefill(batch.tokens_bt, batch.lengths_b, self.max_len, sp,
                                jax.random.fold_in(jax.random.key(req.seed), 0), req.greedy)
        width = chunk_length(batch.tokens_bt.shape[1], self.prefill_budget)
        return req, free[0], gen, width

    def _admit(self, events):
        spent = 0                       # prefill tokens run this step: at most one chunk's worth
        while True:
            if self._prefill is None:
                self._prefill = self._next_prefill()
                if self._prefill is None:
                    return
            req, row, gen, width = self._prefill
            if spent and spent + width > self.prefill_budget:
                return                  # the running rows wait no longer than one chunk
            spent += width
            try:
                next(gen)
                continue
            except StopIteration as done:
                row_state, first = done.value
            self._prefill = None
            self.state = self._insert(self.state, row_state, np.int32(row))
            self.running[row] = req
            req.first_token_s = time.perf_counter()
            self._commit(row, req, [first], events)

    def _commit(self, row: int, req: Request, tokens, events):
        kept = req.tracker.add(0, tokens)
        req.output_ids.extend(kept)
        self.counters["generated_tokens"] += len(kept)
        if req.tracker.done[0]:
            self.running[row] = None
            reason = "stop" if kept and kept[-1] in req.tracker.stop_ids else "length"
            self._finish(req, reason, events, kept)
        elif kept:
            events.append(Event(req, kept, False))

    def _round(self, events):
        rows = self.max_batch_size
        active = np.array([r is not None for r in self.running])
        reqs = [r for r in self.running if r is not None]
        limits = np.zeros(rows, np.int32)
        pending = np.zeros(rows, np.int32)
        lengths = np.zeros(rows, np.int32)
        temperature = np.zeros(rows, np.float32)
        top_p = np.ones(rows, np.float32)
        top_k = np.zeros(rows, np.int64)
        for i, r in enumerate(self.running):
            if r is not None:
                limits[i] = len(r.prompt_ids) + r.max_tokens
                pending[i] = r.output_ids[-1]
                lengths[i] = len(r.prompt_ids) + len(r.output_ids) - 1
                if not r.greedy:         # a greedy row's top_p changes nothing: no compile for it
                    temperature[i], top_p[i], top_k[i] = r.temperature, r.top_p, self._top_k(r)
        greedy = all(r.greedy for r in reqs)
        sp = SamplingParams.rows(temperature, top_p, top_k, top_k_cap=0 if greedy else self.max_top_k)
        self._index += 1
        self.state, tokens_bn, acc_b = self.rows.step(self.state, active, limits, pending, lengths, sp, self._index,
                                                      greedy)
        self.counters["rounds"] += 1
        for i, req in enumerate(list(self.running)):
            if req is None:
                continue
            n = int(acc_b[i]) + 1
            req.acceptance.append(n)
            self.counters["row_rounds"] += 1
            self.counters["committed"] += n
            self.counters["first_accepted"] += n > 1
            self._commit(i, req, tokens_bn[i, :n].tolist(), events)

    def compile_counts(self) -> dict[str, int]:
        """The decoder's compile counts plus the row scatter's (auto before its verdict: the
        candidates' counts)."""
        if self.rows is None:
            return self.auto.compile_counts()
        dec = self.rows.decoder
        return {**dec.compile_counts(), "insert_row": self._insert.compiles}
