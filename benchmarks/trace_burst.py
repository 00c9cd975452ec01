"""Per-request timeline of one burst against the `infer.py serve`-like server of bench_serve.py: where a
request's time to first token goes.

    PYTHONPATH=. python benchmarks/trace_burst.py [--method ar] [--clients 8] [--bursts 2] [--max-tokens 64]

It builds and warms up the method's engine and serves it in this process exactly as bench_serve.py does
(`build_engines`: demo model, row buckets 1, 8, 32, serve's rounds per dispatch), then sends `--bursts`
bursts of `--clients` greedy streaming completions at once from a client process of its own, and prints
per request, in ms from the burst's first send (one clock: `time.perf_counter` is CLOCK_MONOTONIC,
shared by both processes on Linux):

    send     the client starts the POST            arrive   the handler built the `Request`
    added    the scheduler thread queued it in the engine (`Engine.add`)
    group    the prefill group it was admitted in: #, rows x width, prefill start / end
    commit   its first token committed (`Engine._insert`)    deliver  the scheduler handed it to the sink
    sse      its first SSE chunk went to the socket       recv     the client read it (recvT: first text)
    disp1    end of the first decode dispatch that ran its row     fin   the server finished it

then the engine's own timeline (each inbox drain, admission and dispatch) and `generate`'s time to first
token over the same prompts as one static batch. The hooks are monkeypatches in this script; nothing is
timed against a threshold."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# ---- the client (its own process) ---------------------------------------------------------------

async def _one(client, base: str, prompt_ids, max_tokens: int) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out = {"prompt": list(prompt_ids), "send": time.perf_counter(), "recv": None, "recv_text": None}
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        out["headers"] = time.perf_counter()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            out["recv"] = out["recv"] or now
            chunk = json.loads(line[6:])
            if out["recv_text"] is None and chunk["choices"] and chunk["choices"][0]["text"]:
                out["recv_text"] = now
    out["end"] = time.perf_counter()
    return out


async def _burst(base: str, prompts, max_tokens: int) -> list[dict]:
    import httpx
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        return await asyncio.gather(*(_one(client, base, p, max_tokens) for p in prompts))


def burst_client(base: str, prompts, max_tokens: int) -> tuple[list[dict], float]:
    """One burst of all `prompts` at once: `(per request its client-side timestamps, the client
    process's CPU seconds)`."""
    t = os.times()
    out = asyncio.run(_burst(base, prompts, max_tokens))
    return out, sum(os.times()[:2]) - sum(t[:2])


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name of this process (Linux `/proc/self/task`; {} elsewhere)."""
    out = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh, open(f"/proc/self/task/{tid}/stat") as st:
                name, fields = fh.read().strip(), st.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] += (int(fields[11]) + int(fields[12])) / tick       # utime + stime
    return out


# ---- the server's hooks -------------------------------------------------------------------------

class Trace:
    """Timestamps per request id (`req`) and the engine's timeline (`log`), set by `install`."""

    def __init__(self):
        self.req = collections.defaultdict(dict)
        self.log: list[tuple[float, float, str]] = []
        self.groups = 0
        self.reqs: list = []                    # the burst's `Request`s

    def clear(self):
        self.req.clear()
        self.log.clear()
        self.groups = 0

    def first(self, req, key, t=None):
        self.req[req.id].setdefault(key, time.perf_counter() if t is None else t)


def install(trace: Trace) -> None:
    """Wraps the scheduler's inbox drain and delivery, the engine's admission, insert and dispatch, the
    prefill group's start and steps, and the app's streaming response (first body chunk sent)."""
    from starlette.responses import StreamingResponse

    from dmtp_jax.serve import admission, app, engine, scheduler

    sched_admit, sched_deliver = scheduler.Scheduler._admit, scheduler.Scheduler._deliver
    eng_admit, eng_round, eng_insert = engine.Engine._admit, engine.Engine._round, engine.Engine._insert
    group_start, group_step = admission.PrefillGroup.start.__func__, admission.PrefillGroup.step

    def _admit(self, inbox):
        t0 = time.perf_counter()
        for req, _ in inbox:
            trace.first(req, "added", t0)
        sched_admit(self, inbox)
        if inbox:
            trace.log.append((t0, time.perf_counter(), f"inbox: {len(inbox)} request(s) queued in the engine"))

    def _deliver(self, event):
        trace.first(event.request, "deliver")
        sched_deliver(self, event)

    def _e_admit(self, events):
        t0 = time.perf_counter()
        spent = eng_admit(self, events)
        if spent:
            trace.log.append((t0, time.perf_counter(), f"admit: {spent} prefill tokens, "
                                                       f"{len(self.waiting)} left waiting"))
        return spent

    def _insert(self, group, events):
        t0 = time.perf_counter()
        eng_insert(self, group, events)
        trace.log.append((t0, time.perf_counter(), f"insert group {group.trace_no}: running state now "
                                                   f"{self.rows} rows, {len(self.running)} running"))

    def _round(self, events):
        reqs, rows, rounds, t0 = list(self.running), self.rows, self.counters["rounds"], time.perf_counter()
        eng_round(self, events)
        t1 = time.perf_counter()
        for req in reqs:
            trace.first(req, "disp1", t1)
        trace.log.append((t0, t1, f"dispatch: {self.counters['rounds'] - rounds} round(s), {len(reqs)} of "
                                  f"{rows} rows, {len(self.waiting)} waiting"))

    def _start(cls, bank, reqs, rows, *a, **kw):
        group = group_start(cls, bank, reqs, rows, *a, **kw)
        trace.groups += 1
        group.trace_no = trace.groups
        for req in reqs:
            trace.req[req.id]["group"] = f"{trace.groups}:{group.rows}x{group.width}"
        return group

    def _step(self, bank):
        t0 = time.perf_counter()
        done = group_step(self, bank)
        t1 = time.perf_counter()
        for req in self.reqs:
            trace.first(req, "pf_start", t0)
            if done:
                trace.first(req, "pf_end", t1)
        trace.log.append((t0, t1, f"prefill chunk of group {self.trace_no} ({self.rows}x{self.width})"
                                  + (", first tokens read back" if done else "")))
        return done

    class TracedStream(StreamingResponse):
        def __init__(self, content, *a, **kw):
            frame = getattr(content, "ag_frame", None)      # app.run's `stream()`: its closure holds `req`
            self.traced = None if frame is None else frame.f_locals.get("req")
            super().__init__(content, *a, **kw)

        async def stream_response(self, send):
            async def timed(message):
                if self.traced is not None and message["type"] == "http.response.body" and message.get("body"):
                    trace.first(self.traced, "sse")
                await send(message)
            await super().stream_response(timed)

    scheduler.Scheduler._admit, scheduler.Scheduler._deliver = _admit, _deliver
    engine.Engine._admit, engine.Engine._round, engine.Engine._insert = _e_admit, _round, _insert
    admission.PrefillGroup.start, admission.PrefillGroup.step = classmethod(_start), _step
    app.StreamingResponse = TracedStream


# ---- the report ---------------------------------------------------------------------------------

def report(trace: Trace, engine, client: list[dict]) -> None:
    reqs = {tuple(r.prompt_ids): r for r in trace.reqs}
    t0 = min(c["send"] for c in client)

    def ms(t):
        return "" if t is None else f"{1e3 * (t - t0):.0f}"
    cols = ("send", "arrive", "added", "group", "pf_start", "pf_end", "commit", "deliver", "sse", "recv", "recvT",
            "disp1", "fin", "end", "ttft")
    print(" ".join(f"{c:>8}" for c in ("req",) + cols))
    for c in sorted(client, key=lambda c: c["send"]):
        req = reqs[tuple(c["prompt"])]
        s = trace.req[req.id]
        row = [ms(c["send"]), ms(req.arrival_s), ms(s.get("added")), s.get("group", ""), ms(s.get("pf_start")),
               ms(s.get("pf_end")), ms(req.first_token_s), ms(s.get("deliver")), ms(s.get("sse")), ms(c["recv"]),
               ms(c["recv_text"]), ms(s.get("disp1")), ms(req.finished_s), ms(c["end"]),
               f"{1e3 * ((c['recv_text'] or c['end']) - c['send']):.0f}"]
        print(" ".join(f"{x:>8}" for x in [str(req.id)] + row))
    print("engine timeline (ms from the first send):")
    for a, b, what in sorted(trace.log):
        if b >= t0:
            print(f"  {ms(a):>6} - {ms(b):>6} ({1e3 * (b - a):5.1f} ms)  {what}")
    wall = max(c["end"] for c in client) - t0
    tokens = sum(len(r.output_ids) for r in trace.reqs)
    print(f"burst wall {wall:.3f} s, {tokens} tokens, {tokens / wall:.1f} tok/s")


def main(argv=None) -> int:
    import bench_serve
    from dmtp_jax.commands.models import resolve_target
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.serve import request as request_mod
    from dmtp_jax.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="ar")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--buckets", default="1,8,32")
    p.add_argument("--rounds-per-dispatch", type=int, default=None)
    args = p.parse_args(argv)
    args.target = args.draft = args.mtp = None
    args.dtype = "float32"

    trace = Trace()
    install(trace)
    made = []                                   # every Request the handlers build, to match the clients'
    request_init = request_mod.Request.__init__

    def init(self, *a, **kw):
        request_init(self, *a, **kw)
        made.append(self)
    request_mod.Request.__init__ = init

    target_dir = resolve_target(None)
    tokenizer = load_tokenizer(target_dir, plain=True)
    texts = bench_serve.load_prompts(None)
    prompts = [tokenizer(texts[i % len(texts)]).input_ids for i in range(args.clients)]
    print(f"prompt lengths {[len(q) for q in prompts]}", flush=True)
    clients = bench_serve.ClientProcess()
    with contextlib.ExitStack() as stack:
        stack.callback(clients.close)
        served, _ = bench_serve.build_engines(args, [args.method], target_dir, tokenizer, prompts, stack, clients)
        decoder, stops, engine, base = served[args.method]
        for burst in range(args.bursts):
            trace.clear()
            made.clear()
            cpu = thread_cpu()
            client, client_cpu = clients.pool.submit(burst_client, base, prompts, args.max_tokens).result()
            cpu = {k: v - cpu.get(k, 0.0) for k, v in thread_cpu().items()}
            trace.reqs = list(made)
            print(f"\n== burst {burst + 1}: {args.clients} requests at once, {args.method}, "
                  f"{engine.rounds_per_dispatch} rounds per dispatch at most", flush=True)
            report(trace, engine, client)
            print("CPU s during the burst: client process " + f"{client_cpu:.2f}, " + ", ".join(
                f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v > 0.005))
        sp = SamplingParams.make()
        print(f"\n== generate, the same {args.clients} prompts as one static batch (second run timed)")
        for run in range(2):
            t0 = time.perf_counter()
            out = decoder.generate(prompts, args.max_tokens, sp, 0, stops)
            wall = time.perf_counter() - t0
        tokens = sum(map(len, out.output_ids))
        print(f"ttft {1e3 * out.stats['ttft_s']:.0f} ms, wall {wall:.3f} s, {tokens} tokens, "
              f"{tokens / wall:.1f} tok/s, rows {out.stats.get('batch_bucket')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
