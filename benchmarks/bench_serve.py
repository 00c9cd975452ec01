"""Load test of `infer.py serve`: N concurrent streaming clients against the OpenAI-compatible server.

    PYTHONPATH=. python benchmarks/bench_serve.py [--methods ar,dflash,dmtp] [--clients 1,4,8]
        [--num-requests 8] [--max-tokens 64] [--rate inf] [--max-batch-size 8] [--target DIR ...]

For each method (on the demo by default, each with its demo drafter) it builds the engine, serves it
on a free local port in this process (uvicorn thread, the same app as `infer.py serve`) and sends
`--num-requests` greedy streaming completions of the workload's prompts (the demo's
`demo/prompts.jsonl`, or `--prompts FILE.jsonl`, cycled) with at most `--clients` in flight, arriving
at `--rate` requests/s (Poisson; `inf`: all at once). Per run it prints throughput (output
tokens/s), time to first token and time per output token (p50 / p99) and request latency; no
request may fail. Then:

* `seq / conc`: the wall time of the requests sent one after another (1 client) over the same
  requests with `max(--clients)` concurrent clients, measured in this run;
* `static batch`: the decoder's `generate` on the same prompts in one static batch of the same
  size (the throughput continuous batching is compared with);
* every server output equals `generate`'s on its prompt alone (greedy: token for token, compared
  as text).

Numbers compare methods and concurrency levels within one run on one machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def load_prompts(path: str | None) -> list[str]:
    path = path or os.path.join(ROOT, "demo", "prompts.jsonl")
    with open(path) as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def start_server(engine, tokenizer, name: str):
    """`(base url, uvicorn server, thread)` of the app on a free local port."""
    import uvicorn

    from dmtp_jax.serve.app import Scheduler, build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(Scheduler(engine), tokenizer, name), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", srv, thread


async def one_request(client, base: str, prompt_ids, max_tokens: int) -> dict:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"{r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None:
                first = time.perf_counter()
            text.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    return {"ok": usage is not None, "ttft": first - t0, "latency": end - t0, "tokens": n,
            "tpot": (end - first) / (n - 1) if n > 1 else 0.0, "text": "".join(text)}


async def load(base: str, prompts, clients: int, max_tokens: int, rate: float, seed: int = 0) -> tuple[list, float]:
    """Sends every prompt (arrivals at `rate`/s, at most `clients` in flight); `(results, wall s)`."""
    import httpx

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(prompts)) if rate == float("inf") else rng.exponential(1 / rate, len(prompts))
    arrivals = np.cumsum(gaps)
    gate = asyncio.Semaphore(clients)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()

        async def run(i):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            async with gate:
                return await one_request(client, base, prompts[i], max_tokens)
        results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
        return results, time.perf_counter() - t0


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def main(argv=None) -> int:
    import infer
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.serve.app import warm_up
    from dmtp_jax.serve.engine import Engine
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--mtp", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--methods", default="ar,dflash,dmtp")
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=float("inf"), help="arrivals per second (inf: all at once)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--prompts", default=None, help="JSONL with a 'prompt' field per line (default: the demo's)")
    args = p.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    target_dir = infer.resolve_target(args.target)
    tokenizer = load_tokenizer(target_dir, plain=True)
    texts = load_prompts(args.prompts)
    prompts = [tokenizer(texts[i % len(texts)]).input_ids for i in range(args.num_requests)]
    opts = argparse.Namespace(target=args.target, draft=args.draft, mtp=args.mtp, dtype=args.dtype, block_size=None,
                              verify="rejection", mtp_steps=None, strict=False, rounds_per_dispatch=None,
                              prefill_chunk=None, adaptive_threshold=None, stop_token_ids=None)
    mesh = make_mesh(None)
    failures = 0
    print(f"{args.num_requests} greedy requests x {args.max_tokens} tokens, rate {args.rate}/s, "
          f"max batch {args.max_batch_size}")
    print(f"{'method':8} {'clients':>7} {'tok/s':>7} {'wall s':>7} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} "
          f"{'tpot p99':>9} {'lat p50':>8} {'lat p99':>8} {'fail':>4}")
    summary = []
    for method in args.methods.split(","):
        decoder, stops = infer.load_decoder(opts, target_dir, method, mesh, tokenizer)
        engine = Engine(decoder, max_batch_size=args.max_batch_size, max_model_len=args.max_model_len,
                        stop_ids=stops)
        warm_up(engine)
        base, srv, thread = start_server(engine, tokenizer, "bench")
        asyncio.run(load(base, prompts[:1], 1, 4, float("inf")))        # the HTTP path warmed up
        walls, outputs = {}, None
        for c in clients:
            results, wall = asyncio.run(load(base, prompts, c, args.max_tokens, args.rate))
            ok = [r for r in results if r["ok"]]
            failures += len(results) - len(ok)
            tokens = sum(r["tokens"] for r in ok)
            walls[c] = wall
            outputs = outputs or [r.get("text") for r in results]
            print(f"{method:8} {c:7d} {tokens / wall:7.1f} {wall:7.2f} {pct([r['ttft'] for r in ok], 50):9.3f} "
                  f"{pct([r['ttft'] for r in ok], 99):9.3f} {pct([r['tpot'] for r in ok], 50):9.4f} "
                  f"{pct([r['tpot'] for r in ok], 99):9.4f} {pct([r['latency'] for r in ok], 50):8.2f} "
                  f"{pct([r['latency'] for r in ok], 99):8.2f} {len(results) - len(ok):4d}", flush=True)
        srv.should_exit = True
        thread.join(timeout=60)
        # the same prompts as static batches of the server's size, and each alone (the exactness reference)
        gen = decoder if engine.method == method else engine.rows.decoder
        sp = SamplingParams.make()
        size = args.max_batch_size
        gen.generate(prompts[:size], args.max_tokens, sp, 0, stops)                     # compile
        t0 = time.perf_counter()
        static_tokens = 0
        for i in range(0, len(prompts), size):
            static_tokens += sum(map(len, gen.generate(prompts[i:i + size], args.max_tokens, sp, 0, stops).output_ids))
        static_s = time.perf_counter() - t0
        alone = [tokenizer.decode(gen.generate([q], args.max_tokens, sp, 0, stops).output_ids[0],
                                  skip_special_tokens=True) for q in prompts]
        exact = sum(a == o for a, o in zip(alone, outputs))
        ratio = walls[min(clients)] / walls[max(clients)] if len(clients) > 1 else float("nan")
        line = (f"{method:8} seq/conc wall {walls[min(clients)]:.2f}s / {walls[max(clients)]:.2f}s = {ratio:.2f}x; "
                f"static batch of {size}: {static_tokens / static_s:.1f} tok/s ({static_s:.2f}s); "
                f"outputs == generate alone: {exact}/{len(prompts)}")
        summary.append(line)
        print(line, flush=True)
    print("\n".join(["", *summary]))
    print(f"failed requests: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
