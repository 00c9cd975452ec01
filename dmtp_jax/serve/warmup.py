"""What an `Engine` compiles before its first request (`Engine.warm_up`), so that a request compiles
nothing: rounds at every row bucket, row moves, prefills, and the prefix cache's programs."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Hashable

import jax
import numpy as np

from dmtp_jax.decode.batch import PROMPT_BUCKET_FLOOR, next_pow2
from dmtp_jax.decode.prefill import chunk_length
from dmtp_jax.serve.admission import PrefillGroup, resume_widths
from dmtp_jax.serve.request import Request, row_sampling

TIMED_RUNS = 3          # timed runs whose fastest seeds a round's time and a prefill call's


def warm_up_engine(engine, every_bucket: bool = True, sampled: bool = True) -> None:
    """Compiles every round of the bank at every row bucket (greedy, and with every sampling filter on
    when `sampled`; K-round dispatches when K > 1) and, when the bank has several, times them
    (`time_rounds`); compiles the catch-up at every bucket and one row, the row moves between
    buckets, and the prefill of every prompt bucket (`every_bucket`; else the shortest) at every
    row bucket the burst budget admits, full and, where the bank can, lean (`lean_variants`), each
    one-call greedy prefill timed once all are compiled (`time_prefills`)."""
    top = next_pow2(engine.max_model_len - 1, PROMPT_BUCKET_FLOOR) if every_bucket else PROMPT_BUCKET_FLOOR
    dispatches = sorted({1, engine.rounds_per_dispatch})
    temperatures = (0.0, 1.0) if sampled else (0.0,)
    for rows, method, k, t in itertools.product(engine.buckets, engine.bank.methods, dispatches, temperatures):
        sp, greedy = row_sampling([Request([0], 1, temperature=t)], rows, engine.max_top_k)
        engine.bank.run(method, engine.bank.new_state(rows, engine.max_len), np.zeros(rows, bool),
                        np.zeros(rows, np.int32), sp, engine.base_key, 1, greedy, k, engine.stop_ids)
    if len(engine.bank.methods) > 1:
        time_rounds(engine)
    for rows in sorted({1, *engine.buckets}):       # catch-ups: the running state's, a resumed snapshot's
        engine.bank.catch_up_step(engine.bank.model_states(), engine.bank.new_state(rows, engine.max_len))
    puts = (False, True) if engine.bank.defer_window else (False,)    # full and lean groups' rows: `rows.put_rows`
    for rows, other in itertools.product(engine.buckets, engine.buckets):     # the row moves between buckets
        state = engine.moves.resize(engine.bank.new_state(rows, engine.max_len), other)
        if other <= rows:
            state = engine.moves.resize(state, rows)
            for lean in puts:
                state = engine.moves.put(state, engine.bank.new_state(other, engine.max_len, lean=lean),
                                         np.full(other, rows, np.int32))
            state = engine.moves.move(state, np.int32(0), np.int32(0))
    shapes = {}         # (rows, width, lean) of each one-call greedy prefill -> its requests
    for bucket in itertools.takewhile(lambda b: b <= top, (PROMPT_BUCKET_FLOOR << i for i in itertools.count())):
        width = chunk_length(bucket, engine.bank.prefill_chunk)
        leans = lean_variants(engine, width, -(-bucket // width))
        rows_fit = [r for r in engine.buckets if r == 1 or r * width <= engine.burst_budget]
        for rows, t, lean in itertools.product(rows_fit, temperatures, leans):
            reqs = [Request([0] * min(bucket, engine.max_model_len - 2), 1, temperature=t) for _ in range(rows)]
            run_prefill(engine, reqs, rows, lean=lean)      # compiles
            if t == 0 and bucket <= width:                  # one call: timed below
                shapes[(rows, width, lean)] = reqs
    time_prefills(engine, shapes, chunk_length(PROMPT_BUCKET_FLOOR, engine.bank.prefill_chunk))
    if engine.prefix_cache is not None:
        warm_up_prefix_cache(engine, temperatures)


def lean_variants(engine, width: int, chunks: int) -> tuple[bool, ...]:
    """The prefills a group of `chunks` calls `width` wide may run: full, and lean where the bank can."""
    return (False, True) if engine.bank.lean_prefill(width, chunks) else (False,)


def run_prefill(engine, reqs, rows: int, cache=None, lean: bool = False) -> float:
    """Runs the prefill of `reqs` on `rows` rows (from `cache`'s stored prefix, if any; `lean`: deferring
    the drafting caches where the bank can) to its first tokens; returns its seconds, the making of its
    starting state included (an admitted group waits for it as well: the larger a bank's state, the
    more each call costs beside its prefill)."""
    start = time.perf_counter()
    group = PrefillGroup.start(engine.bank, reqs, rows, engine.max_len, engine.cfg.vocab_size, engine.max_top_k,
                               cache, lean)
    while not group.step(engine.bank):
        pass
    return time.perf_counter() - start


def fastest_of_runs(calls: dict[Hashable, Callable[[], float]], runs: int = TIMED_RUNS) -> dict[Hashable, float]:
    """Each key's fastest of `runs` calls of `calls[key]` (each returns its seconds), the runs going over
    every key in turn: a slow spell of the machine only adds to a call's time, and one that covers
    consecutive calls slows one run of several keys, not every run of one.

    Example:
        >>> clock = iter([1.0, 9.0, 9.0, 9.0, 2.0, 3.0])     # a spell covers the 2nd to 4th calls
        >>> fastest_of_runs({"a": lambda: next(clock), "b": lambda: next(clock), "c": lambda: next(clock)}, 2)
        {'a': 1.0, 'b': 2.0, 'c': 3.0}
    """
    seconds: dict[Hashable, list[float]] = {key: [] for key in calls}
    for _, key in itertools.product(range(runs), calls):
        seconds[key].append(calls[key]())
    return {key: min(s) for key, s in seconds.items()}


def time_prefills(engine, shapes: dict[tuple[int, int, bool], list[Request]], table_width: int,
                  runs: int = TIMED_RUNS) -> None:
    """Times each compiled one-call greedy prefill of `shapes` ((rows, chunk width, lean) -> its
    requests): the fastest of `runs` calls (`fastest_of_runs`), into `Engine.prefill_times`, which
    sizes the prefill groups and keeps them as timed here (`Engine.warm_prefills`); those
    `table_width` wide (the shortest prompt bucket's) are the policy's table of prefill calls
    (`LoadPolicy.time_prefill`). Group sizes rest on the ratios of these times, so a slow spell
    must not fall on one shape's runs alone."""
    calls = {key: functools.partial(run_prefill, engine, reqs, key[0], lean=key[2]) for key, reqs in shapes.items()}
    for (rows, width, lean), seconds in fastest_of_runs(calls, runs).items():
        engine.prefill_times.add((rows, width, lean), seconds)
        engine.warm_prefills.add((rows, width, lean))
        if width == table_width:
            engine.policy.time_prefill(lean, rows, seconds)


def time_rounds(engine, runs: int = TIMED_RUNS) -> None:
    """Gives the policy each (method, row bucket, dispatch size) round time's first sample: the fastest
    of `runs` greedy dispatches of 1 and of `engine.rounds_per_dispatch` rounds over full rows of a
    fresh scratch state, built before the clock starts (compiled already; no stop ids, so a K-round
    dispatch runs K rounds), so a first choice at a bucket rests on more than one live round, in the
    dispatch each method would run. The runs go over every method and size in turn, and the fastest
    counts: a slow spell of the machine only adds to a dispatch's time, and one that covers a run
    covers every method's."""
    dispatches = sorted({1, engine.rounds_per_dispatch})
    for rows in engine.buckets:
        sp, greedy = row_sampling([], rows, engine.max_top_k)
        active, limits = np.ones(rows, bool), np.full(rows, engine.max_model_len, np.int32)

        def per_round(method, k, rows=rows, sp=sp, greedy=greedy, active=active, limits=limits):
            scratch = jax.block_until_ready(engine.bank.new_state(rows, engine.max_len))     # not in the time
            *_, ran, s, _ = engine.bank.run(method, scratch, active, limits, sp, engine.base_key, 1, greedy, k)
            return s / ran

        calls = {key: functools.partial(per_round, *key) for key in itertools.product(engine.bank.methods, dispatches)}
        for (method, k), seconds in fastest_of_runs(calls, runs).items():
            engine.policy.observe(method, rows, rounds=k, seconds=k * seconds, row_rounds=0, committed=0)


def warm_up_prefix_cache(engine, temperatures=(0.0, 1.0)) -> None:
    """Compiles the prefix cache's programs (row extraction per row bucket, the resumed state's scatter,
    the row copy, the resumed prefills below the prompt buckets); leaves the cache empty."""
    cache, one = engine.prefix_cache, engine.bank.new_state(1, engine.max_len)
    for rows in engine.buckets:
        cache.extract(engine.bank.new_state(rows, engine.max_len), np.int32(0))
        engine.moves.put(engine.bank.new_state(rows, engine.max_len), one, np.full(1, rows, np.int32))
    base = [0] * 8
    for width, t in itertools.product(resume_widths(engine.bank.prefill_chunk), temperatures):
        for lean in lean_variants(engine, width, 1):
            cache.offer(base + [0], one, greedy=False)
            req = Request(base + [0] * width, 1, temperature=t)      # resumes at 8: `width` tokens run
            run_prefill(engine, [req], 1, cache, lean)
    cache.clear()
    cache.counters.clear()
