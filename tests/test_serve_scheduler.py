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

    def __init__(self, recent_load: int = 0):
        self.waiting, self.running, self.admissions = [], [], []
        self.recent_load = recent_load

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


def test_an_idle_engine_admits_a_burst_arriving_ms_apart_as_one_group():
    """A burst's first request arrives alone and two more 50 ms later: one admission of three (before:
    one of the first, then one of the rest: two prefills)."""
    engine = CountingEngine()
    scheduler = Scheduler(engine, gather_s=0.5, gather_max_s=5.0)
    done = threading.Semaphore(0)
    try:
        scheduler.submit(Request([1], 1), lambda ev: done.release())
        threading.Event().wait(0.05)
        for _ in range(2):
            scheduler.submit(Request([1], 1), lambda ev: done.release())
        assert all(done.acquire(timeout=30) for _ in range(3))
        assert engine.admissions == [3]
    finally:
        scheduler.shutdown(drain_s=1)


def burst_admissions(recent_load: int) -> list[int]:
    """The admissions of a burst whose first request arrives alone and two more 200 ms later, on an
    idle engine that recently held `recent_load` requests at once (a 10 ms quiet gap ends a gather)."""
    engine = CountingEngine(recent_load)
    scheduler = Scheduler(engine, gather_s=0.01, gather_max_s=5.0)
    done = threading.Semaphore(0)
    try:
        scheduler.submit(Request([1], 1), lambda ev: done.release())
        threading.Event().wait(0.2)
        for _ in range(2):
            scheduler.submit(Request([1], 1), lambda ev: done.release())
        assert all(done.acquire(timeout=30) for _ in range(3))
        return engine.admissions
    finally:
        scheduler.shutdown(drain_s=1)


def test_an_idle_engine_waits_for_as_many_requests_as_it_recently_held():
    """Under a steady load of 3 clients the quiet gap does not end the gather until 3 arrived (their
    next requests, sent as each was answered): one admission; with no load on record, two."""
    assert burst_admissions(recent_load=3) == [3]
    assert burst_admissions(recent_load=0) == [1, 2]


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
