"""The scheduler thread: the only caller of the `Engine`. It admits submitted requests, runs
`Engine.admit()` and `Engine.decode()` while anything runs and hands each request's events to its
sink after each (a first token is sent before the next round runs). On an idle engine the first
admission waits for the rest of a burst (`gather_s`; while requests answered since are still to
come back, up to `gather_max_s`), so requests that reach the server some ms apart (each parsed in
turn, clients answered in turn) are one prefill, as a static batch's.

Every submitted request gets exactly one final event: a failed admission ends that request
("error"), a failing step ends the requests the engine gives up on, requests queued at shutdown
end "cancelled"; no request's failure ends the thread. `submit` refuses with 429 when
`max_waiting` requests already wait, and 503 once shutting down."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from dmtp_jax.serve.engine import Engine
from dmtp_jax.serve.request import Event, Request
from dmtp_jax.serve.metrics import ServerMetrics
from dmtp_jax.serve.protocol import ApiError

log = logging.getLogger(__name__)
GATHER_S = 0.004        # an idle engine admits once no request arrived for this long (10x the HTTP thread's
                        # parse of a request: the burst's wait for its first round, benchmarks/bench_serve.py) ...
GATHER_MAX_S = 0.05     # ... once no answered request is owed a successor; else this long after the first
                        # arrival (or once a batch is full)
SWITCH_INTERVAL_S = 0.0005  # the process's GIL switch interval while a scheduler runs (Python's default: 5 ms):
                            # each device call of the scheduler thread lets go of the GIL and takes it back,
                            # and while the HTTP thread runs Python every take-back waits out one interval


class Scheduler:
    """The thread that drives an `Engine`: `submit` from any thread, events to each request's sink.
    `gather_s`: how long an idle engine's first admission waits for another arrival (0: not at all)
    once every request answered since the last gather was followed by a submission,
    `gather_max_s`: for all of them (`_gather`). Starting one lowers the process's GIL switch
    interval to `SWITCH_INTERVAL_S` (benchmarks/bench_engine_gil.py shows why)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None, max_waiting: int = 256,
                 gather_s: float = GATHER_S, gather_max_s: float = GATHER_MAX_S):
        self.engine, self.metrics = engine, metrics or ServerMetrics()
        self.max_waiting = int(max_waiting)
        self.gather_s, self.gather_max_s = float(gather_s), float(gather_max_s)
        self.accepting = True
        self._inbox: list = []
        self._open = 0                      # submitted requests without their final event yet
        self._owed = 0                      # requests answered and not yet followed by a submission (at most
                                            # a batch): a closed loop's clients send their next ones at once
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._sinks: dict[int, tuple[Request, Any]] = {}     # request id -> (request, sink)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="dmtp-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: Request, sink) -> Request:
        """Checks and queues `req`; `sink(event)` is called on the scheduler thread per event."""
        return self.submit_many([req], sink)[0]

    def submit_many(self, reqs: list[Request], sink) -> list[Request]:
        """Checks and queues `reqs` (a request's `n` choices) at once, all or none: one admission
        sees them together; each counts against `max_waiting`."""
        if not self.accepting:
            raise ApiError("the server is shutting down", 503, kind="server_error")
        for req in reqs:
            self.engine.check(req)
        with self._lock:
            if self._open + len(reqs) > self.engine.max_batch_size + self.max_waiting:
                raise ApiError(f"too many requests: {self.max_waiting} already wait for a row "
                               f"(--max-waiting); retry later", 429, kind="rate_limit_error")
            self._open += len(reqs)
            self._owed = max(0, self._owed - len(reqs))
            self._inbox.extend((req, sink) for req in reqs)
        self._wake.set()
        return reqs

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        self.engine.cancel(req, reason)
        self._wake.set()

    def _deliver(self, event: Event) -> None:
        """Hands `event` to its request's sink (a sink that fails is logged, never fatal)."""
        if event.finished:
            _, sink = self._sinks.pop(event.request.id, (None, None))
            with self._lock:
                self._open -= sink is not None
                self._owed = min(self.engine.max_batch_size, self._owed + (sink is not None))
            try:
                self.metrics.observe_finished(event.request)
            except Exception:       # noqa: BLE001 -- a metric is no reason to lose the event
                log.exception("metrics of request %s failed", event.request.id)
        else:
            _, sink = self._sinks.get(event.request.id, (None, None))
        if sink is None:
            return
        try:
            sink(event)
        except Exception:           # noqa: BLE001 -- e.g. the handler's event loop is gone
            log.exception("delivering an event of request %s failed", event.request.id)

    def _fail(self, req: Request, reason: str) -> None:
        req.finish_reason, req.finished_s = reason, time.perf_counter()
        self._deliver(Event(req, [], True))

    def _gather(self, inbox: list) -> list:
        """`inbox` and, when the engine is idle, the requests that follow it closely: until none arrived
        for `gather_s` once each request answered before is followed by a submission (`_owed`: a
        closed loop's clients send their next requests as each is answered; an open loop's arrivals
        owe nothing to the answers, and a wait that runs out forgets what is owed), at most
        `gather_max_s` after the first or until a batch is full. Without it a burst's first arrivals
        are prefilled alone and the rest in a second prefill, which costs about as much as the whole
        burst's (same row and prompt buckets), or one by one (a 1-row prefill costs a third of an
        8-row one), and the rest wait for both."""
        if not inbox or self.gather_s <= 0 or self.engine.busy:
            return inbox
        start = last = time.perf_counter()
        while len(inbox) < self.engine.max_batch_size:
            quiet = last + self.gather_s if self._owed == 0 else float("inf")
            wait = min(quiet, start + self.gather_max_s) - time.perf_counter()
            if wait <= 0:
                break
            self._wake.wait(wait)
            self._wake.clear()          # cleared before the inbox is read: no arrival's wake-up is lost
            with self._lock:
                more, self._inbox = self._inbox, []
            if more:
                inbox += more
                last = time.perf_counter()
        with self._lock:
            self._owed = 0
        return inbox

    def _admit(self, inbox) -> None:
        for req, sink in inbox:
            self._sinks[req.id] = (req, sink)
            try:
                self.engine.add(req)
            except Exception:       # noqa: BLE001 -- this request's fault: it alone ends
                log.exception("admitting request %s failed; ending it alone", req.id)
                self._fail(req, "error")

    def _run(self):
        engine = self.engine
        while not self._stop:
            try:
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                self._admit(self._gather(inbox))
                if not engine.busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for phase in (engine.admit, engine.decode):     # first tokens go out before the round
                    try:
                        events = phase()
                    except Exception:   # a bug, not bad input: logged, its requests end, the server lives on
                        log.exception("engine step failed; ending the requests it ran")
                        events = engine.abort_all("error")
                    for event in events:
                        self._deliver(event)
            except Exception:           # noqa: BLE001 -- the thread outlives any one failure
                log.exception("scheduler loop failed; continuing")
                time.sleep(0.01)
        with self._lock:
            left, self._inbox = self._inbox, []
        for req, sink in left:          # submitted as the thread stopped: still answered
            self._sinks[req.id] = (req, sink)
        for req, _ in list(self._sinks.values()):
            self._fail(req, "cancelled")

    def shutdown(self, drain_s: float = 30.0) -> None:
        """Stops admitting, lets running requests finish for up to `drain_s`, cancels the rest."""
        self.accepting = False
        deadline = time.monotonic() + drain_s
        while (self.engine.busy or self._inbox) and time.monotonic() < deadline:
            time.sleep(0.02)
        for req in [r for r in self.engine.running if r is not None] + list(self.engine.waiting):
            self.engine.cancel(req, "cancelled")
        end = time.monotonic() + 5
        while self.engine.busy and time.monotonic() < end:
            time.sleep(0.02)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
