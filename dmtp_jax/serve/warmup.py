"""What an `Engine` compiles before its first request (`Engine.warm_up`), so that a request compiles
nothing: one round program per method, row bucket and sampling mode, row moves, prefills, and the
prefix cache's programs. `warm_up_jobs` lists them; `warm_up_engine` compiles them under the
host's memory-map budget (`MapBudget`), showing its progress, then times rounds and prefills."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import time
from collections.abc import Callable, Hashable

import jax
import numpy as np
from tqdm.auto import tqdm

from dmtp_jax.decode.batch import PROMPT_BUCKET_FLOOR, next_pow2
from dmtp_jax.decode.prefill import chunk_length
from dmtp_jax.errors import InputError
from dmtp_jax.serve.admission import PrefillGroup, resume_widths
from dmtp_jax.serve.request import Request, row_sampling

TIMED_RUNS = 3          # timed runs whose fastest seeds a round's time and a prefill call's
MAP_SHARE = 0.8         # the share of `vm.max_map_count` the compiled programs may take (the rest: serving)


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One program to compile: `family` groups programs of one size (the budget's estimate unit),
    `name` says which; `run()` compiles it (running it on zero inputs)."""
    family: str
    name: str
    run: Callable[[], object]


class MapBudget:
    """The process's memory maps against the kernel's `vm.max_map_count` (Linux; elsewhere no limit):
    each compiled program holds some, and past the limit a compile dies ("LLVM ERROR: Unable to
    allocate section memory" or a segmentation fault, no Python error). `check` projects the maps of
    the programs still to compile from those each family's compiled ones took, and raises an
    `InputError` naming the limit when the projection passes `MAP_SHARE` of it."""

    def __init__(self, maps_path: str = "/proc/self/maps", limit_path: str = "/proc/sys/vm/max_map_count"):
        self.maps_path = maps_path
        try:
            with open(limit_path) as fh:
                self.limit: int | None = int(fh.read())
        except (OSError, ValueError):
            self.limit = None
        self.per_family: dict[str, list[int]] = {}

    def maps(self) -> int:
        """The process's memory maps now (0 where the kernel does not say)."""
        try:
            with open(self.maps_path) as fh:
                return sum(1 for _ in fh)
        except OSError:
            return 0

    def record(self, family: str, maps_before: int) -> None:
        """Counts the maps one compile of `family` added since `maps_before`."""
        self.per_family.setdefault(family, []).append(max(0, self.maps() - maps_before))

    def projected(self, pending: list[CompileJob]) -> int:
        """The maps once `pending` are compiled too: each at its family's largest compile so far (a
        family not compiled yet at the largest of any)."""
        seen = [max(v) for v in self.per_family.values()] or [0]
        return self.maps() + sum(max(self.per_family.get(j.family, seen)) for j in pending)

    def check(self, pending: list[CompileJob], total: int) -> None:
        """Raises `InputError` when the maps projected for `pending` pass `MAP_SHARE` of the limit."""
        if self.limit is None or not pending:
            return
        need = self.projected(pending)
        if need > MAP_SHARE * self.limit:
            raise InputError(
                f"the server's {total} programs would take about {need:,} memory maps, past "
                f"{MAP_SHARE:.0%} of this host's vm.max_map_count ({self.limit:,}); it would die while compiling",
                hint="serve fewer programs (a smaller --max-batch-size, or one --method instead of auto), "
                     "or raise the limit: sudo sysctl -w vm.max_map_count=262144")


def warm_up_jobs(engine, every_bucket: bool = True, sampled: bool = True) -> list[CompileJob]:
    """The programs a request may run, one job each: every round of the bank at every row bucket
    (greedy, and with every sampling filter on when `sampled`; one program for every dispatch size
    up to the engine's `rounds_per_dispatch`), the catch-up at every bucket and one row, the row
    moves between buckets, the prefill (one sampling form) of every prompt bucket's chunk width
    (`every_bucket`; else the shortest) at every row bucket the burst budget admits, full and, where
    the bank can, lean, and the prefix cache's programs. Largest families first."""
    bank, jobs = engine.bank, []
    temperatures = (0.0, 1.0) if sampled else (0.0,)
    for method, rows, t in itertools.product(bank.methods, sorted(engine.buckets, reverse=True), temperatures):
        jobs.append(CompileJob(f"round/{method}", f"{method} round, {rows} rows, {'sampled' if t else 'greedy'}",
                               functools.partial(_compile_round, engine, method, rows, t)))
    for (rows, width, lean), length in sorted(prefill_shapes(engine, every_bucket).items(), reverse=True):
        jobs.append(CompileJob(f"prefill/{'lean' if lean else 'full'}", f"prefill, {rows} x {width}"
                               + (" lean" if lean else ""), functools.partial(
                                   run_prefill, engine, [Request([0] * length, 1)] * rows, rows, lean=lean)))
    for rows in sorted({1, *engine.buckets}):       # catch-ups: the running state's, a resumed snapshot's
        jobs.append(CompileJob("catch_up", f"catch-up, {rows} rows", functools.partial(
            lambda r: bank.catch_up_step(bank.model_states(), bank.new_state(r, engine.max_len)), rows)))
    new_state = functools.partial(bank.new_state, max_len=engine.max_len)
    for rows, other in itertools.product(engine.buckets, engine.buckets):     # the row moves between buckets
        if other != rows:       # (the engine resizes only to another bucket)
            jobs.append(CompileJob("rows", f"resize, {rows} -> {other} rows", functools.partial(
                lambda r, o: engine.moves.resize(new_state(r), o), rows, other)))
        leans = ((False, True) if bank.defer_window else (False,)) if other <= rows else ()    # full, lean groups
        for lean in leans:
            jobs.append(CompileJob("rows", f"put {other} into {rows} rows" + (" lean" if lean else ""),
                                   functools.partial(lambda r, o, lean: engine.moves.put(
                                       new_state(r), new_state(o, lean=lean), np.full(o, r, np.int32)),
                                       rows, other, lean)))
    for rows in engine.buckets:
        jobs.append(CompileJob("rows", f"row move, {rows} rows", functools.partial(
            lambda r: engine.moves.move(new_state(r), np.int32(0), np.int32(0)), rows)))
    if engine.prefix_cache is not None:
        jobs += prefix_cache_jobs(engine)
    return jobs


def prefill_shapes(engine, every_bucket: bool = True) -> dict[tuple[int, int, bool], int]:
    """`{(rows, chunk width, lean): prompt length}` of the prefills to compile: each prompt bucket's
    chunk width (up to `max_model_len`'s bucket when `every_bucket`, else the shortest) at every row
    bucket the burst budget admits, full and, where the bank can, lean; the length is the shortest
    prompt bucket of that width (one call where one exists)."""
    top = next_pow2(engine.max_model_len - 1, PROMPT_BUCKET_FLOOR) if every_bucket else PROMPT_BUCKET_FLOOR
    shapes: dict[tuple[int, int, bool], int] = {}
    for bucket in itertools.takewhile(lambda b: b <= top, (PROMPT_BUCKET_FLOOR << i for i in itertools.count())):
        width = chunk_length(bucket, engine.bank.prefill_chunk)
        for rows, lean in itertools.product(engine.buckets, lean_variants(engine, width, -(-bucket // width))):
            if rows == 1 or rows * width <= engine.burst_budget:
                shapes.setdefault((rows, width, lean), min(bucket, engine.max_model_len - 2))
    return shapes


def _compile_round(engine, method: str, rows: int, temperature: float) -> None:
    """Runs the round program of `method` on `rows` inactive rows (compiles it)."""
    sp, greedy = row_sampling([Request([0], 1, temperature=temperature)], rows, engine.max_top_k)
    engine.bank.run(method, engine.bank.new_state(rows, engine.max_len), np.zeros(rows, bool),
                    np.zeros(rows, np.int32), sp, engine.base_key, 1, greedy, 1, engine.stop_ids,
                    buffer=engine.rounds_per_dispatch)


def warm_up_engine(engine, every_bucket: bool = True, sampled: bool = True, progress: bool = False,
                   budget: MapBudget | None = None) -> None:
    """Compiles `warm_up_jobs` (a bar on stderr when `progress`), the first of each family first, then
    checks the memory-map `budget` (default `MapBudget()`) before each compile; times the rounds when
    the bank has several methods (`time_rounds`) and every one-call prefill (`time_prefills`).
    Raises `InputError` (`MapBudget.check`) before the host runs out of memory maps."""
    jobs, budget = warm_up_jobs(engine, every_bucket, sampled), budget or MapBudget()
    firsts = list({j.family: j for j in reversed(jobs)}.values())[::-1]     # the first of each family
    order = firsts + [j for j in jobs if j not in firsts]
    with tqdm(total=len(order), desc="compiling", unit="program", file=sys.stderr, disable=not progress,
              dynamic_ncols=True) as bar:
        for i, job in enumerate(order):
            if i >= len(firsts):
                budget.check(order[i:], len(order))
            bar.set_postfix_str(job.name, refresh=False)
            before = budget.maps()
            job.run()
            budget.record(job.family, before)
            bar.update()
    if len(engine.bank.methods) > 1:
        time_rounds(engine)
    one_call = {key: [Request([0] * length, 1)] * key[0]
                for key, length in prefill_shapes(engine, every_bucket).items() if length <= key[1]}
    time_prefills(engine, one_call, chunk_length(PROMPT_BUCKET_FLOOR, engine.bank.prefill_chunk))


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
    """Times each compiled one-call prefill of `shapes` ((rows, chunk width, lean) -> its requests):
    the fastest of `runs` calls (`fastest_of_runs`), into `Engine.prefill_times`, which sizes the
    prefill groups and keeps them as timed here (`Engine.warm_prefills`); those `table_width` wide
    (the shortest prompt bucket's) are the policy's table of prefill calls (`LoadPolicy.time_prefill`)."""
    calls = {key: functools.partial(run_prefill, engine, reqs, key[0], lean=key[2]) for key, reqs in shapes.items()}
    for (rows, width, lean), seconds in fastest_of_runs(calls, runs).items():
        engine.prefill_times.add((rows, width, lean), seconds)
        engine.warm_prefills.add((rows, width, lean))
        if width == table_width:
            engine.policy.time_prefill(lean, rows, seconds)


def time_rounds(engine, runs: int = TIMED_RUNS) -> None:
    """Gives the policy each (method, row bucket, dispatch size) round time's first sample: the fastest
    of `runs` greedy dispatches of 1 and of `engine.rounds_per_dispatch` rounds over full rows of a
    fresh scratch state, built before the clock starts (no stop ids, so a K-round dispatch runs K
    rounds). The runs go over every method and size in turn (`fastest_of_runs`)."""
    dispatches = sorted({1, engine.rounds_per_dispatch})
    for rows in engine.buckets:
        sp, greedy = row_sampling([], rows, engine.max_top_k)
        active, limits = np.ones(rows, bool), np.full(rows, engine.max_model_len, np.int32)

        def per_round(method, k, rows=rows, sp=sp, greedy=greedy, active=active, limits=limits):
            scratch = jax.block_until_ready(engine.bank.new_state(rows, engine.max_len))     # not in the time
            *_, ran, s, _ = engine.bank.run(method, scratch, active, limits, sp, engine.base_key, 1, greedy, k,
                                            buffer=engine.rounds_per_dispatch)
            return s / ran

        calls = {key: functools.partial(per_round, *key) for key in itertools.product(engine.bank.methods, dispatches)}
        for (method, k), seconds in fastest_of_runs(calls, runs).items():
            engine.policy.observe(method, rows, rounds=k, seconds=k * seconds, row_rounds=0, committed=0)


def prefix_cache_jobs(engine) -> list[CompileJob]:
    """The prefix cache's programs: the row extraction and the 1-row put per row bucket, and the
    resumed prefills below the prompt buckets (leaving the cache empty)."""
    def per_bucket(rows):
        one = engine.bank.new_state(1, engine.max_len)
        engine.prefix_cache.extract(engine.bank.new_state(rows, engine.max_len), np.int32(0))
        engine.moves.put(engine.bank.new_state(rows, engine.max_len), one, np.full(1, rows, np.int32))

    def resumed(width, lean):
        cache, base = engine.prefix_cache, [0] * 8
        cache.offer(base + [0], engine.bank.new_state(1, engine.max_len), greedy=False)
        run_prefill(engine, [Request(base + [0] * width, 1)], 1, cache, lean)   # resumes at 8: `width` run
        cache.clear()
        cache.counters.clear()

    jobs = [CompileJob("prefix_cache", f"prefix cache rows, {rows} rows", functools.partial(per_bucket, rows))
            for rows in engine.buckets]
    for width in resume_widths(engine.bank.prefill_chunk):
        jobs += [CompileJob("prefill/resumed", f"resumed prefill, {width} wide" + (" lean" if lean else ""),
                            functools.partial(resumed, width, lean)) for lean in lean_variants(engine, width, 1)]
    return jobs
