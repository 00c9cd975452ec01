"""The serving engine (`dmtp_jax/serve/engine.py`): continuous batching equals `generate` token for
token (rows joining mid-flight, greedy and sampled rows sharing a batch, rows moving between row
buckets), rounds switched every step on one state, batched admission, K rounds per dispatch, fault
isolation, and bounded compiles. Tiny models shared with tests/test_serve.py (tests/serve_fixtures.py):
the engines here share one round bank per decoder, so its compiles are counted across tests."""

import collections
import itertools

import numpy as np
import pytest

from dmtp_jax.decode.prefill import chunk_length
from dmtp_jax.serve.admission import prompt_bucket
from dmtp_jax.serve.engine import Engine, Request, insert_row
from dmtp_jax.serve.warmup import time_rounds
from tests.serve_fixtures import MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, serve_decoder, serve_reference

BUCKETS = (2, 4)        # two row buckets: rows move and the state grows and shrinks, few compiles


@pytest.fixture(scope="module")
def decoder():
    return serve_decoder()


@pytest.fixture(scope="module")
def reference():
    return [list(r) for r in serve_reference()]


@pytest.fixture(scope="module")
def auto(decoder):
    """auto over ar and dmtp: its engine switches between ar and dmtp rounds (and mtp's, as an extra
    method) on one state."""
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.decode.auto import AutoDecoder, VerdictStore
    return AutoDecoder({"ar": make_decoder("ar", decoder.target), "dmtp": decoder}, store=VerdictStore(None))


def new_compiles(engine, before: dict) -> dict:
    """The compiles since `before` (the bank is shared by every engine of a decoder in this process,
    so a test counts what its own engine added)."""
    return {k: v - before.get(k, 0) for k, v in engine.compile_counts().items()}


def run(engine, joins=None):
    """Steps the engine until idle; `joins`: `{step: [Request, ...]}` added after that step."""
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
        for req in (joins or {}).get(steps, []):
            engine.add(req)
    return steps


class PrefillSpy:
    """The bank's prefill with `check(chunk_bt)` first (it may raise); `calls`: each call's rows. Keeps
    the compiled function's `compiles` (the engine reads it)."""

    def __init__(self, real, check=lambda chunk_bt: None):
        self.real, self.check, self.calls = real, check, []

    @property
    def compiles(self) -> int:
        return self.real.compiles

    def __call__(self, states, chunk_bt, *args, **kwargs):
        self.check(chunk_bt)
        self.calls.append(int(np.shape(chunk_bt)[0]))
        return self.real(states, chunk_bt, *args, **kwargs)


def spy_prefill(engine, monkeypatch, check=lambda chunk_bt: None) -> PrefillSpy:
    """Puts a `PrefillSpy` in the engine's bank until the test ends (the bank is the decoder's: shared)."""
    spy = PrefillSpy(engine.bank.prefill_step, check)
    monkeypatch.setattr(engine.bank, "prefill_step", spy)
    return spy


def test_insert_row_finds_each_leafs_batch_axis():
    state = {"k": np.zeros((2, 3, 4)), "n": np.zeros(3)}
    out = insert_row(state, {"k": np.ones((2, 1, 4)), "n": np.full(1, 7.0)}, 1)
    assert out["k"].sum(axis=(0, 2)).tolist() == [0.0, 8.0, 0.0] and out["n"].tolist() == [0.0, 7.0, 0.0]


def test_continuous_batching_equals_generate(decoder, reference):
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS)
    before = engine.compile_counts()
    kept, observe = [], engine.policy.observe
    engine.policy.observe = lambda *a, committed, **k: (kept.append(committed), observe(*a, committed=committed, **k))
    reqs = [engine.add(Request(PROMPTS[0], MAX_TOKENS[0])), engine.add(Request(PROMPTS[1], MAX_TOKENS[1]))]
    engine.step()
    assert all(len(r.output_ids) > 1 for r in reqs)       # a burst is admitted in one step
    assert engine.rows == 2
    late = [Request(p, m) for p, m in zip(PROMPTS[2:], MAX_TOKENS[2:])]
    sampled = Request([1, 2, 3], 12, temperature=0.8, top_p=0.9, seed=1)
    run(engine, {2: late + [sampled]})      # more than the free rows join mid-flight, a sampled row among them
    assert [r.output_ids for r in reqs + late] == reference
    assert all(r.finish_reason == "length" for r in reqs + late) and len(sampled.output_ids) == 12
    assert max(a for r in reqs + late for a in r.acceptance) > 1, "drafts should be partly accepted"
    served = reqs + late + [sampled]        # the policy's tau counts the tokens requests kept
    assert sum(kept) == sum(len(r.output_ids) - 1 for r in served) < engine.counters["committed"]
    assert engine.rows == 4                 # kept while its last choices held up to 4 requests (shrinking:
                                            # test_a_state_keeps_its_rows_while_the_recent_load_needs_them)
    counts = new_compiles(engine, before)   # greedy + sampled per bucket at most
    assert counts["round/dmtp"] <= 2 * len(BUCKETS) and counts["move_row"] <= len(BUCKETS)


def test_a_state_whose_rows_all_finished_keeps_them_until_a_dispatch_runs_fewer(decoder, reference):
    """A first wave's prefill group becomes the running state (no resize, no copy); once its rows all
    finish the state stays as large while nobody runs: a smaller wave goes into its rows without
    growing it (growing zero-fills every cache), and the first dispatch over fewer rows shrinks it;
    outputs stay `generate`'s."""
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS)
    resizes, real = [], engine.moves.resize
    engine.moves.resize = lambda state, rows: (resizes.append(rows), real(state, rows))[1]
    first = [engine.add(Request(p, 1)) for p in PROMPTS[:3]]      # one token each: done once admitted
    run(engine)
    assert resizes == [] and engine.rows == 4
    second = [engine.add(Request(PROMPTS[3], 1))]                 # a 2-row group into the 4-row state
    run(engine)
    assert resizes == [] and engine.rows == 4
    assert [r.output_ids for r in first + second] == [ref[:1] for ref in reference[:4]]
    last = engine.add(Request(PROMPTS[0], MAX_TOKENS[0]))
    run(engine)
    assert resizes == [2] and engine.rows == 2 and last.output_ids == reference[0]


def test_a_state_keeps_its_rows_while_the_recent_load_needs_them(decoder, reference):
    """A dip in the rows running (a wave's requests ended, their successors on their way) does not
    shrink the state: it shrinks once the most requests held at once over the last `LOAD_CHOICES`
    choices fit the smaller bucket (plain rounds, one per dispatch: one choice per token)."""
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.serve.policy import LOAD_CHOICES
    engine = Engine(make_decoder("ar", decoder.target), max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[],
                    buckets=BUCKETS, rounds_per_dispatch=1)
    resizes, real = [], engine.moves.resize
    engine.moves.resize = lambda state, rows: (resizes.append((rows, engine.policy.choices)), real(state, rows))[1]
    short = [engine.add(Request(p, 2)) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[3])]
    long = engine.add(Request(PROMPTS[2], MAX_TOKENS[2]))
    run(engine)     # choice 1 runs 4 rows, choices 2.. the long one alone
    assert resizes == [(2, 1 + LOAD_CHOICES)] and engine.rows == 2
    assert [r.output_ids for r in short] == [reference[i][:2] for i in (0, 1, 3)] and long.output_ids == reference[2]


def test_prefix_cache_on_a_dense_target_equals_generate(decoder, reference):
    """The prefix cache on the tiny Qwen3 (attention only) with dmtp: a second turn (prompt +
    answer + new text) resumes from the first turn's state and equals `generate` on the full prompt
    (rows finishing in rows 0..2 of a running batch; the deeper checks, on a hybrid target:
    tests/test_prefix_cache.py)."""
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS,
                    prefix_cache_gb=0.01)
    first = [engine.add(Request(p, m)) for p, m in zip(PROMPTS[:3], MAX_TOKENS[:3])]
    while engine.busy:
        engine.step()
    assert [r.output_ids for r in first] == reference[:3]
    turn2 = [p + r.output_ids + [7, 8, 9] for p, r in zip(PROMPTS[:3], first)]
    second = [engine.add(Request(p, 10)) for p in turn2]
    while engine.busy:
        engine.step()
    assert [r.output_ids for r in second] == [decoder.generate([p], 10, stop_ids=[]).output_ids[0] for p in turn2]
    stats = engine.prefix_cache.metrics()
    assert stats["hits"] == 3 and stats["hit_tokens"] >= sum(len(p) - 4 - 4 for p in turn2)   # within a round


def test_stop_tokens_and_cancel_free_rows(decoder, reference):
    engine = Engine(decoder, max_batch_size=2, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(2,))
    stop = reference[2][5]
    a = engine.add(Request(PROMPTS[2], MAX_TOKENS[2], stop_ids=(stop,)))
    b = engine.add(Request(PROMPTS[0], MAX_TOKENS[0]))
    c = engine.add(Request(PROMPTS[3], MAX_TOKENS[3]))       # waits for a free row
    while not b.output_ids:
        engine.step()
    engine.cancel(b)
    run(engine)
    assert a.output_ids == reference[2][:reference[2].index(stop) + 1] and a.finish_reason == "stop"
    assert b.finish_reason == "cancelled" and len(b.output_ids) < MAX_TOKENS[0]
    assert c.output_ids == reference[3]


def test_plain_decoding_engine_equals_generate(decoder, reference):
    """`ar` through the same engine (the one-slot round on the target alone), rows joining
    mid-flight; also what a speculative decoder declined by the exactness probe serves. (The
    reference is greedy dmtp's `generate`, which equals ar's: tests/test_mtp_dmtp.py.)"""
    from dmtp_jax.decode.ar import ARDecoder
    engine = Engine(ARDecoder(decoder.target), max_batch_size=2, max_model_len=MAX_MODEL_LEN, stop_ids=[],
                    buckets=(2,))
    reqs = [engine.add(Request(PROMPTS[0], 8))]
    late = [Request(p, 8) for p in PROMPTS[1:3]]
    run(engine, {1: late})
    assert [r.output_ids for r in reqs + late] == [ref[:8] for ref in reference[:3]] and engine.method == "ar"


def test_rounds_switched_every_step_equal_generate(auto, reference):
    """auto's engine on one state: ar, mtp and dmtp rounds forced in turn, every step, on a mixed
    batch (rows joining, leaving, moving between buckets): every row equals `generate`; the policy's
    own choice and /metrics' account of it after. (Sampled rows: each round is lossless on its own,
    tests/test_spec_decode.py; here they would double the compiles.)"""
    from dmtp_jax.serve.metrics import ServerMetrics
    engine = Engine(auto, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS,
                    extra_methods=("mtp",))
    before = engine.compile_counts()
    assert engine.method == "auto" and set(engine.bank.methods) == {"ar", "dmtp", "mtp"}
    turns = itertools.cycle(engine.bank.methods)
    real_choose = engine.policy.choose
    engine.policy.choose = lambda rows, bucket, most=1, idle=True, held=None: (
        real_choose(rows, bucket, most, idle, held), next(turns))[1]
    leans = itertools.cycle(["ar", "dmtp"])      # admissions alternate lean and full prefills
    engine.policy.best = lambda rows, bucket, most=1: next(leans)
    reqs = [engine.add(Request(p, m)) for p, m in zip(PROMPTS[:2], MAX_TOKENS[:2])]
    late = [Request(p, m) for p, m in zip(PROMPTS[2:], MAX_TOKENS[2:])]
    run(engine, {2: late[:2], 4: late[2:]})
    assert [r.output_ids for r in reqs + late] == reference
    assert all(engine.counters[f"rounds/{m}"] >= 3 for m in engine.bank.methods)
    assert engine.counters["lean_prefills"] >= 1
    counts = new_compiles(engine, before)   # per method: one per bucket; prefill: full and lean per bucket
    assert all(counts[f"round/{m}"] <= len(BUCKETS) for m in engine.bank.methods), counts
    assert counts["prefill"] <= 2 * len(BUCKETS), counts
    # every method was timed at the buckets it ran: the choice rests on live numbers, shown in /metrics
    del engine.policy.choose, engine.policy.best
    req = engine.add(Request(PROMPTS[0], 6))
    run(engine)
    assert req.output_ids == reference[0][:6]
    choice = engine.choice
    assert choice["method"] in engine.bank.methods and choice["rows"] == 1 and choice["bucket"] == 2
    assert set(engine.policy.host_s) <= set(BUCKETS) and engine.policy.host_s    # the host's time per round
    # warm-up's timing of the compiled rounds: every (method, bucket, dispatch size) has its first
    # sample, no compile (the engines share the decoder's bank: timing the first compiles what its
    # rounds did not run)
    time_rounds(engine)
    fresh = Engine(auto, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS,
                   extra_methods=("mtp",))
    before = fresh.compile_counts()
    time_rounds(fresh)
    dispatches = sorted({1, fresh.rounds_per_dispatch})
    assert set(fresh.policy.round_s) == set(itertools.product(fresh.bank.methods, BUCKETS, dispatches))
    assert not any(new_compiles(fresh, before).values())
    assert fresh.policy.choose(1, 2) in fresh.bank.methods and fresh.choice["why"] == "highest estimated tok/s"
    text = ServerMetrics().render(engine)
    assert f'dmtp_engine_choice{{method="{choice["method"]}"' in text and "dmtp_engine_tau{" in text


def test_in_step_dispatches_keep_rows_in_step(auto, reference):
    """Speculative rounds run in step (`describe()["in_step"]`: auto's timing and refresh dispatches
    while plain rounds serve) commit one token per row: requests admitted together keep equal lengths
    through ar, dmtp and mtp rounds and equal `generate`, and the drafts the target accepted still
    reach the policy's acceptance."""
    engine = Engine(auto, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS,
                    extra_methods=("mtp",))
    turns = itertools.cycle(["ar", "dmtp", "mtp"])
    real_choose, real_observe = engine.policy.choose, engine.policy.observe

    def in_step(rows, bucket, most=1, idle=True, held=None):
        real_choose(rows, bucket, most, idle, held)
        method = next(turns)
        engine.policy.last.update(method=method, rounds=1, in_step=method != "ar")
        return method
    measured = collections.Counter()

    def observe(method, bucket, **kw):
        measured[method, "row_rounds"] += kw["row_rounds"]
        measured[method, "committed"] += kw["committed"]
        real_observe(method, bucket, **kw)
    engine.policy.choose, engine.policy.observe = in_step, observe
    rows = (0, 2, 4)
    reqs = [engine.add(Request(PROMPTS[i], 12)) for i in rows]
    lengths = []
    while engine.busy:
        engine.step()
        lengths.append({len(r.output_ids) for r in reqs})
    assert all(len(seen) == 1 for seen in lengths), lengths
    assert [r.output_ids for r in reqs] == [reference[i][:12] for i in rows]
    assert all(set(r.acceptance) == {1} for r in reqs)
    spec_rounds = measured["dmtp", "row_rounds"] + measured["mtp", "row_rounds"]
    assert spec_rounds > 0 and measured["dmtp", "committed"] + measured["mtp", "committed"] > spec_rounds
    assert engine.counters["first_accepted"] > 0


def test_burst_is_one_prefill_and_k_rounds_per_dispatch(decoder, reference, monkeypatch):
    """Four arrivals of one prompt bucket: one prefill call. Nobody waiting: up to 3 rounds per
    dispatch (on-device stopping), outputs unchanged."""
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(4,),
                    rounds_per_dispatch=3)
    before = engine.compile_counts()
    spy = spy_prefill(engine, monkeypatch)
    reqs = [engine.add(Request(p, m)) for p, m in zip(PROMPTS[:4], MAX_TOKENS[:4])]
    engine.step()
    monkeypatch.undo()
    assert len(spy.calls) == 1 and all(r.output_ids for r in reqs)
    steps = 0
    while engine.busy:
        ids = [ev.request.id for ev in engine.step()]
        steps += 1
        assert len(ids) == len(set(ids)), ids           # a dispatch's tokens: one event per request
    assert [r.output_ids for r in reqs] == reference[:4]
    assert engine.counters["rounds"] > steps + 1        # several rounds per dispatch
    counts = new_compiles(engine, before)
    assert counts["multi_round/dmtp"] <= 1 and counts["round/dmtp"] <= 2 * len(BUCKETS) + 1, counts


def test_served_seconds_leave_admissions_out(decoder, reference, monkeypatch):
    """What a dispatch realized (`LoadPolicy.observe_served`) is timed without the admissions before it
    (prefill is modelled apart): with every prefill call slowed by 0.3 s and requests joining
    mid-flight, no served dispatch is charged that long; outputs unchanged."""
    import time
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS)
    spy = spy_prefill(engine, monkeypatch, check=lambda chunk_bt: time.sleep(0.3))
    served = []
    real = engine.policy.observe_served
    monkeypatch.setattr(engine.policy, "observe_served", lambda *a: served.append(a[3]) or real(*a))
    reqs = [engine.add(Request(p, m)) for p, m in zip(PROMPTS[:2], MAX_TOKENS[:2])]
    joins = {2: [Request(PROMPTS[2], MAX_TOKENS[2])], 3: [Request(PROMPTS[3], MAX_TOKENS[3])]}
    run(engine, joins)
    assert len(spy.calls) >= 2 and len(served) > 2 and max(served) < 0.3, (spy.calls, served)
    assert [r.output_ids for r in reqs + joins[2] + joins[3]] == reference[:4]


def test_idle_burst_is_one_prefill_then_the_budget_holds(decoder, reference, monkeypatch):
    """A prefill budget of one row: a burst into an idle engine is still one prefill (nobody decodes, so
    nobody stalls); arrivals while rows decode are admitted one group per step; outputs unchanged."""
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS,
                    prefill_budget=64)
    spy = spy_prefill(engine, monkeypatch)
    reqs = [engine.add(Request(p, m)) for p, m in zip(PROMPTS[:2], MAX_TOKENS[:2])]
    engine.step()
    assert len(spy.calls) == 1 and all(r.output_ids for r in reqs)
    late = [engine.add(Request(p, m)) for p, m in zip(PROMPTS[2:4], MAX_TOKENS[2:4])]
    engine.step()
    assert len(spy.calls) == 2 and late[0].output_ids and not late[1].output_ids
    monkeypatch.undo()
    run(engine)
    assert [r.output_ids for r in reqs + late] == reference[:4]


def test_prefill_groups_follow_measured_times(decoder, reference, monkeypatch):
    """Three arrivals: where a prefill call's time grows with its rows they go as 2 + 1 rows (the 4-row
    bucket would cost 4/3 of their share), where it does not as one 4-row call; outputs unchanged. A
    live one-call prefill updates its key's time unless warm-up timed that key (the times a group's
    size rests on are taken alike, not some under load and some alone)."""
    reqs_of = lambda: [Request(p, m) for p, m in zip(PROMPTS[:3], MAX_TOKENS[:3])]    # noqa: E731
    cases = (({2: 0.02, 4: 0.04}, [2, 2], False), ({2: 0.02, 4: 0.021}, [4], False),
             ({2: 0.02, 4: 0.04}, [2, 2], True))
    for seconds, rows, warm in cases:
        engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=BUCKETS)
        widths = {chunk_length(prompt_bucket(r), engine.bank.prefill_chunk) for r in reqs_of()}
        for width, (bucket, s) in itertools.product(widths, seconds.items()):
            engine.prefill_times.add((bucket, width, False), s)
            if warm:
                engine.warm_prefills.add((bucket, width, False))
        spy = spy_prefill(engine, monkeypatch)
        reqs = [engine.add(r) for r in reqs_of()]
        engine.step()
        assert spy.calls == rows and all(r.output_ids for r in reqs)
        monkeypatch.undo()
        run(engine)
        assert [r.output_ids for r in reqs] == reference[:3]
        if rows == [2, 2]:      # the second call compiled nothing: a live one-call prefill was timed
            assert (engine.prefill_times.get((2, max(widths), False)) == seconds[2]) == warm


def test_faults_end_their_requests_only(decoder, reference, monkeypatch):
    """A request whose prefill fails ends with "error" alone (its group's others are prefilled alone
    and run on); a failed round ends the running requests, the waiting ones run on."""
    engine = Engine(decoder, max_batch_size=2, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(2,))
    poison = [9, 9, 9, 9]

    def check(chunk_bt):
        if any(list(row[:4]) == poison for row in np.asarray(chunk_bt)):
            raise RuntimeError("injected prefill fault")
    spy_prefill(engine, monkeypatch, check)
    bad = engine.add(Request(poison, 5))
    good = engine.add(Request(PROMPTS[0], MAX_TOKENS[0]))
    run(engine)
    assert bad.finish_reason == "error" and good.output_ids == reference[0]

    real_run = engine.bank.run

    def fail_once(*args, **kwargs):
        engine.bank.run = real_run
        raise RuntimeError("injected round fault")
    engine.bank.run = fail_once
    running = [engine.add(Request(p, m)) for p, m in zip(PROMPTS[1:3], MAX_TOKENS[1:3])]
    waiting = engine.add(Request(PROMPTS[3], MAX_TOKENS[3]))
    events = engine.step()
    assert [r.finish_reason for r in running] == ["error", "error"] and waiting.finish_reason is None
    assert {e.request.id for e in events if e.finished} == {r.id for r in running}
    run(engine)
    assert waiting.output_ids == reference[3] and engine.rows == 2
