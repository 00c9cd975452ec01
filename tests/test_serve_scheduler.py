"""The scheduler thread (`dmtp_jax/serve/scheduler.py`) over a stand-in engine (no model, no compile):
an idle engine's first admission gathers a burst whose requests arrive some ms apart, and a running
scheduler lowers the GIL switch interval."""

import sys
import threading

from dmtp_jax.serve.request import Event, Request
from dmtp_jax.serve.scheduler import SWITCH_INTERVAL_S, Scheduler


class CountingEngine:
    """Admits every waiting request at once and finishes it; records how many each admission took."""
    max_batch_size = 8

    def __init__(self):
        self.waiting, self.running, self.admissions = [], [], []

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def check(self, req):
        return req

    def add(self, req):
        self.waiting.append(req)

    def cancel(self, req, reason="cancelled"):
        pass

    def admit(self):
        self.admissions.append(len(self.waiting))
        for req in self.waiting:
            req.finish_reason = "length"
        events, self.waiting = [Event(r, [1], True) for r in self.waiting], []
        return events

    def decode(self):
        return []


def straggling_wave(answered: int, gap_s: float = 0.5, gather_s: float = 0.1) -> list[int]:
    """The admissions of a wave whose first request reaches an idle engine alone and two more `gap_s`
    later (a `gather_s` quiet gap ends a gather), after a first wave of `answered` requests was
    answered."""
    engine = CountingEngine()
    scheduler = Scheduler(engine, gather_s=gather_s, gather_max_s=5.0)
    done = threading.Semaphore(0)
    try:
        for _ in range(answered):
            scheduler.submit(Request([1], 1), lambda ev: done.release())
        assert all(done.acquire(timeout=30) for _ in range(answered))
        first = len(engine.admissions)
        scheduler.submit(Request([1], 1), lambda ev: done.release())
        threading.Event().wait(gap_s)
        for _ in range(2):
            scheduler.submit(Request([1], 1), lambda ev: done.release())
        assert all(done.acquire(timeout=30) for _ in range(3))
        return engine.admissions[first:]
    finally:
        scheduler.shutdown(drain_s=1)


def test_an_idle_engine_admits_a_burst_arriving_ms_apart_as_one_group():
    """A burst's first request arrives alone and two more 50 ms later: one admission of three (before:
    one of the first, then one of the rest: two prefills)."""
    assert straggling_wave(answered=0, gap_s=0.05, gather_s=0.5) == [3]


def test_an_idle_engine_waits_for_the_successors_of_the_requests_it_answered():
    """A closed loop of 3 clients: each sends again once answered, so after 3 answers the quiet gap
    does not end the gather until 3 arrived: one admission; with no answer on record, two."""
    assert straggling_wave(answered=3) == [3]
    assert straggling_wave(answered=0) == [1, 2]


def test_a_running_scheduler_lowers_the_gil_switch_interval():
    """The engine thread's device calls re-take the GIL behind the HTTP thread: a scheduler leaves the
    process's switch interval at most `SWITCH_INTERVAL_S` (Python's default is 10x that)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    scheduler = Scheduler(CountingEngine())
    try:
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S < 0.005
    finally:
        scheduler.shutdown(drain_s=1)
        sys.setswitchinterval(before)
