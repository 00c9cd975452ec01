"""Load test of `infer.py serve`: a concurrency sweep of streaming clients against the OpenAI-compatible
server, per method, with every output checked against `generate`.

    PYTHONPATH=. python benchmarks/bench_serve.py [--methods ar,dmtp,auto] [--concurrency 1,8,32]
        [--arrival all|poisson] [--rate 4] [--max-tokens 64] [--max-batch-size 32] [--max-model-len 512]
        [--rounds-per-dispatch K] [--repeats 3] [--plot serve.png] [--target DIR ...]

It builds every method's engine (on the demo by default, each with its demo drafter; greedy programs
compiled before any clock starts; serve's row buckets unless `--buckets`; at most
`--rounds-per-dispatch` rounds per dispatch while nobody waits, default `serve`'s, and as many in
the static batches) and serves each on a free local port in this process (uvicorn thread, the same
app as `infer.py serve`); the clients run in a process of their own. Per concurrency level `c` it
sends `max(c, --min-requests)` greedy streaming completions (default 64: 8 clients send 8 each, so a
level measures steady serving, not one burst) of the workload's prompts (the demo's
`demo/prompts.jsonl`, or `--prompts`, cycled), at most `c` in flight, arriving all at once
(`--arrival all`) or as a Poisson process of `--rate` requests/s, to every method in turn,
`--repeats` times with the order rotated (a shared machine's slow spells fall on every method
alike). Per level and method it prints the median output tokens/s, time to first token p50 / p99,
inter-token latency p50 / p99 (streamed chunks: a speculative round's tokens arrive together) and
the ratio to a static batch: the method's `generate` over the same prompts in batches of `c` (auto:
the better of ar's and dmtp's). Every server output must equal `generate` of its prompt alone
(greedy, compared as text); no request may fail. With auto it ends with auto's tok/s over the better
of ar's and dmtp's per level, of the medians and within each pass (the spread is the machine's
noise). `--plot` writes tok/s and TTFT p50 against concurrency, one line per method.

Numbers compare methods and concurrency levels within one run on one machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def load_prompts(path: str | None) -> list[str]:
    path = path or os.path.join(ROOT, "demo", "prompts.jsonl")
    with open(path) as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


async def one_request(client, base: str, prompt_ids, max_tokens: int) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"{r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
            text.append(chunk["choices"][0]["text"] if chunk["choices"] else "")
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    return {"ok": usage is not None, "ttft": (stamps[0] if stamps else end) - t0, "latency": end - t0, "tokens": n,
            "itl": list(np.diff(stamps)), "text": "".join(text)}


def client_load(base: str, prompts, clients: int, max_tokens: int, rate: float) -> tuple[list, float]:
    """`load` in the calling process: what the client process (`ClientProcess`) runs."""
    return asyncio.run(load(base, prompts, clients, max_tokens, rate))


class ClientProcess:
    """The load generator in its own process, so the clients' HTTP parsing never holds the servers'
    interpreter lock (real clients run elsewhere; on a CPU machine they still share the cores)."""

    def __init__(self):
        import concurrent.futures
        import multiprocessing
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def load(self, *args) -> tuple[list, float]:
        return self.pool.submit(client_load, *args).result()

    def close(self) -> None:
        self.pool.shutdown()


def memory_maps() -> str:
    """This process's memory maps against the kernel's limit (Linux; '' elsewhere): every compiled
    program holds some, and a process past `vm.max_map_count` fails to compile ("Cannot allocate memory")."""
    try:
        with open("/proc/self/maps") as fh, open("/proc/sys/vm/max_map_count") as lim:
            return f"{sum(1 for _ in fh)} memory maps of {int(lim.read())} allowed"
    except OSError:
        return ""


async def load(base: str, prompts, clients: int, max_tokens: int, rate: float, seed: int = 0) -> tuple[list, float]:
    """Sends every prompt (arrivals at `rate`/s, `inf`: all at once; at most `clients` in flight);
    `(results, wall s)`."""
    import httpx

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(prompts)) if rate == float("inf") else rng.exponential(1 / rate, len(prompts))
    arrivals = np.cumsum(gaps)
    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        t0 = time.perf_counter()

        async def run(i):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            async with gate:
                return await one_request(client, base, prompts[i], max_tokens)
        results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
        return results, time.perf_counter() - t0


def pct(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def static_rate(decoder, prompts, size: int, max_tokens: int, stops) -> float:
    """Output tokens/s of `decoder.generate` over `prompts` in static batches of `size` (compiled
    and, for auto, measured first)."""
    from dmtp_jax.decode.sampling import SamplingParams
    sp = SamplingParams.make()
    for i in range(0, len(prompts), size):      # every batch's shapes compiled first
        decoder.generate(prompts[i:i + size], max_tokens, sp, 0, stops)
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), size):
        tokens += sum(map(len, decoder.generate(prompts[i:i + size], max_tokens, sp, 0, stops).output_ids))
    return tokens / (time.perf_counter() - t0)


def choice_line(engine, c: int) -> str:
    """What an auto engine's policy estimates for `c` running rows after a level: each method's tok/s,
    tau, round ms and rounds per dispatch at their bucket, and the host's ms per round there."""
    from dmtp_jax.serve.admission import row_bucket
    policy, rows = engine.policy, min(c, engine.max_batch_size)
    bucket = row_bucket(rows, engine.buckets)
    most = engine.rounds_per_dispatch
    parts = [f"{m} {est:.0f} tok/s (tau {policy.tau[m]:.2f}, {1e3 * policy.round_time(m, bucket, most):.1f} ms "
             f"x{policy.rounds(m, bucket, most)})" for m, est in sorted(policy.estimates(rows, bucket, most).items())]
    host = policy.host_s.get(bucket)
    return (f"estimates at {rows} of {bucket} rows: " + ", ".join(parts)
            + ("" if host is None else f"; host {1e3 * host:.1f} ms per round"))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        ax1.plot([r["c"] for r in mine], [r["tok_s"] for r in mine], marker="o", label=method)
        ax2.plot([r["c"] for r in mine], [r["ttft_p50"] for r in mine], marker="o", label=method)
    for ax, label in ((ax1, "output tok/s"), (ax2, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def load_served_decoder(args, target_dir: str, method: str, rounds: int, mesh, tokenizer):
    """`(decoder, stop ids)` of `method` on `target_dir` as `infer.py serve` builds it, from `args.target`
    (None: the demo, with its drafters), `args.draft`, `args.mtp` and `args.dtype`, running `rounds`
    rounds per dispatch."""
    from dmtp_jax.commands.models import decoder_methods, load_decoder

    opts = argparse.Namespace(target=args.target, draft=args.draft, mtp=args.mtp, dtype=args.dtype, block_size=None,
                              verify="rejection", mtp_steps=None, strict=False,
                              rounds_per_dispatch=rounds, prefill_chunk=None,
                              adaptive_threshold=None, stop_token_ids=None)
    built, _ = decoder_methods(opts, target_dir, [method])
    return load_decoder(opts, target_dir, method, built, mesh, tokenizer)


def build_engines(args, methods, target_dir, tokenizer, prompts, stack, client) -> tuple[dict, list]:
    """`({method: (decoder, stops, engine, base url)}, reference texts)`: every method's engine warmed
    up and served (in `stack`) before any clock starts; the reference is `generate` of each prompt
    alone (greedy: every method's output is ar's)."""
    from dmtp_jax.serve.app import Scheduler, build_app, serving_in_thread
    from dmtp_jax.serve.engine import SERVE_ROUNDS_PER_DISPATCH, Engine
    from dmtp_jax.sharding import make_mesh

    rounds = args.rounds_per_dispatch or SERVE_ROUNDS_PER_DISPATCH     # the servers' and the static batches'
    mesh, served, reference = make_mesh(None), {}, None
    buckets = {"buckets": tuple(int(b) for b in args.buckets.split(","))} if args.buckets else {}
    for method in methods:
        decoder, stops = load_served_decoder(args, target_dir, method, rounds, mesh, tokenizer)
        if reference is None:
            ref_dec = decoder.candidates["ar"] if hasattr(decoder, "candidates") else decoder
            reference = [tokenizer.decode(ref_dec.generate([q], args.max_tokens, None, 0, stops).output_ids[0],
                                          skip_special_tokens=True) for q in prompts]
        engine = Engine(decoder, max_batch_size=args.max_batch_size, max_model_len=args.max_model_len,
                        stop_ids=stops, rounds_per_dispatch=rounds, **buckets)
        t0 = time.perf_counter()
        engine.warm_up(sampled=False)       # greedy requests only: half the programs (and memory maps)
        engine.counters.clear()
        print(f"{method}: engine compiled in {time.perf_counter() - t0:.1f}s", flush=True)
        base = stack.enter_context(serving_in_thread(build_app(Scheduler(engine), tokenizer, "bench")))
        client.load(base, prompts[:1], 1, 4, float("inf"))        # the HTTP path warmed up
        served[method] = (decoder, stops, engine, base)
    return served, reference


def measure_level(args, served: dict, reqs, c: int, rate: float, reference, client) -> list[dict]:
    """One concurrency level: `--repeats` passes over the methods, their order rotated each pass so
    that a slow spell of a shared machine falls on every method alike; a method's tok/s (and its
    static batch's) is the median of its passes, latencies pool every pass."""
    methods = list(served)
    runs = {m: [] for m in methods}
    for rep in range(args.repeats):
        for method in methods[rep % len(methods):] + methods[:rep % len(methods)]:
            decoder, stops, engine, base = served[method]
            engine.counters.clear()
            results, wall = client.load(base, reqs, c, args.max_tokens, rate)
            static = (float("nan") if method == "auto" or args.no_static
                      else static_rate(decoder, reqs, c, args.max_tokens, stops))
            runs[method].append((results, wall, static, dict(engine.counters)))
    rows = []
    for method in methods:
        ok = [r for results, *_ in runs[method] for r in results if r["ok"]]
        every = [r for results, *_ in runs[method] for r in results]
        passes = [sum(r["tokens"] for r in results if r["ok"]) / wall for results, wall, *_ in runs[method]]
        tok_s = float(np.median(passes))
        static = float(np.median([st for *_, st, _ in runs[method]]))
        itl = [x for r in ok for x in r["itl"]]
        rows.append({"method": method, "c": c, "requests": len(reqs), "repeats": args.repeats, "tok_s": tok_s,
                     "tok_s_passes": passes,
                     "static_tok_s": static, "ratio_static": tok_s / static,
                     "ttft_p50": pct([r["ttft"] for r in ok], 50), "ttft_p99": pct([r["ttft"] for r in ok], 99),
                     "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
                     "exact": sum(r.get("text") == reference[i % len(reqs)] for i, r in enumerate(every)),
                     "sent": len(every), "failed": len(every) - len(ok), "rounds": runs[method][-1][3]})
    if "auto" in served:        # auto's static batch: the better of ar's and dmtp's
        auto = next(r for r in rows if r["method"] == "auto")
        auto["static_tok_s"] = max([r["static_tok_s"] for r in rows if r["method"] in ("ar", "dmtp")]
                                   or [float("nan")])
        auto["ratio_static"] = auto["tok_s"] / auto["static_tok_s"]
    return rows


def auto_verdict(rows: list[dict]) -> str:
    """auto's median tok/s over the better of ar's and dmtp's at one level, and the same ratio within
    each pass (the methods of one pass ran back to back: the spread is the machine's noise).

    Example:
        >>> auto_verdict([{"method": "ar", "c": 8, "tok_s": 10.0, "tok_s_passes": [10.0, 12.0]},
        ...               {"method": "auto", "c": 8, "tok_s": 9.5, "tok_s_passes": [9.0, 12.0]}])
        'c=8: auto / best(ar, dmtp) = 0.95 (per pass 0.90, 1.00)'
        >>> auto_verdict([{"method": "ar", "c": 8, "tok_s": 0.0, "tok_s_passes": [0.0]},
        ...               {"method": "auto", "c": 8, "tok_s": 9.5, "tok_s_passes": [9.5]}])
        'c=8: auto / best(ar, dmtp): no ar or dmtp tok/s measured'
    """
    by = {r["method"]: r for r in rows}
    best = [by[m] for m in ("ar", "dmtp") if m in by]
    if "auto" not in by or not best or max(r["tok_s"] for r in best) <= 0:
        return f"c={rows[0]['c']}: auto / best(ar, dmtp): no ar or dmtp tok/s measured"
    auto = by["auto"]
    per_pass = [a / (max(r["tok_s_passes"][i] for r in best) or float("nan"))
                for i, a in enumerate(auto["tok_s_passes"])]
    return (f"c={auto['c']}: auto / best(ar, dmtp) = {auto['tok_s'] / max(r['tok_s'] for r in best):.2f} "
            f"(per pass {', '.join(f'{x:.2f}' for x in per_pass)})")


def main(argv=None) -> int:
    from dmtp_jax.commands.models import resolve_target
    from dmtp_jax.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--mtp", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--methods", default="ar,dmtp,auto")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--min-requests", type=int, default=64,
                   help="requests per level: max(concurrency, this); 8 at --concurrency 8 is one burst")
    p.add_argument("--repeats", type=int, default=3, help="passes over the methods per level (median tok/s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--arrival", choices=("all", "poisson"), default="all")
    p.add_argument("--rate", type=float, default=4.0, help="poisson arrivals per second")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--rounds-per-dispatch", type=int, default=None)
    p.add_argument("--buckets", default=None,
                   help="the engines' row buckets (default: serve's, `admission.row_buckets`; every method's "
                        "engine lives in this one process and their programs' memory maps add up: see the count "
                        "printed after the compile)")
    p.add_argument("--no-static", action="store_true", help="skip the static-batch reference")
    p.add_argument("--prompts", default=None, help="JSONL with a 'prompt' field per line (default: the demo's)")
    p.add_argument("--plot", default=None, help="PNG of tok/s and TTFT against concurrency")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    methods = args.methods.split(",")
    rate = float("inf") if args.arrival == "all" else args.rate
    target_dir = resolve_target(args.target)
    tokenizer = load_tokenizer(target_dir, plain=True)
    texts = load_prompts(args.prompts)
    n_max = max(max(levels), args.min_requests)
    prompts = [tokenizer(texts[i % len(texts)]).input_ids for i in range(n_max)]
    print(f"greedy requests x {args.max_tokens} tokens, arrival {args.arrival}"
          + (f" ({rate}/s)" if rate != float("inf") else "") + f", max batch {args.max_batch_size}, "
          f"max model len {args.max_model_len}, {args.repeats} interleaved passes per level")
    rows = []
    with contextlib.ExitStack() as stack:
        client = ClientProcess()
        stack.callback(client.close)
        served, reference = build_engines(args, methods, target_dir, tokenizer, prompts, stack, client)
        print(memory_maps())
        print(f"{'method':7} {'c':>3} {'reqs':>4} {'tok/s':>7} {'static':>7} {'ratio':>6} {'ttft50':>7} "
              f"{'ttft99':>7} {'itl50':>7} {'itl99':>7} {'exact':>7} {'fail':>4}")
        for c in levels:
            reqs = prompts[:max(c, args.min_requests)]
            for row in measure_level(args, served, reqs, c, rate, reference, client):
                rows.append(row)
                print(f"{row['method']:7} {c:3d} {len(reqs):4d} {row['tok_s']:7.1f} {row['static_tok_s']:7.1f} "
                      f"{row['ratio_static']:6.2f} {row['ttft_p50']:7.3f} {row['ttft_p99']:7.3f} "
                      f"{row['itl_p50']:7.4f} {row['itl_p99']:7.4f} {row['exact']:3d}/{row['sent']:<3d} "
                      f"{row['failed']:4d}", flush=True)
                if row["method"] == "auto":
                    print("        rounds (last pass): " + ", ".join(
                        f"{k[7:]} {v}" for k, v in sorted(row["rounds"].items()) if k.startswith("rounds/")),
                        flush=True)
                    print(f"        {choice_line(served['auto'][2], c)}", flush=True)
    failures = sum(r["sent"] - r["exact"] + r["failed"] for r in rows)
    if "auto" in methods:
        for c in levels:
            print(auto_verdict([r for r in rows if r["c"] == c]))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    print(f"failed or inexact requests: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
