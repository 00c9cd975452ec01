"""The server under a hostile client (issue 35's targets), loopback only, every loop bounded.

    PYTHONPATH=. python benchmarks/bench_server_abuse.py [--streams 64] [--sequential 300] [--idle 3000]

A tiny random DMTP decoder (`dmtp_jax.tiny`), a byte tokenizer, `--rows` rows, the server on a free
local port in this process (so RSS is the server's plus the clients'). Prints:

* a 50 MB body, sent (a) with its Content-Length at the default body limit, (b) chunked, (c) as a
  50 MB text prompt with the body limit raised to 64 MiB (refused by the prompt-size check, not
  tokenised): the slowest /health answer while it is sent, its status, RSS before and after;
* three sampled requests with new top_k values while a greedy stream runs: the round's and the
  prefill's compiles during them, and the stream's time over its time alone (the stall ratio);
* `--streams` concurrent greedy streams, `--sequential` requests one after another and `--idle`
  connections that send half a request head and wait (closed by the header timeout): outputs
  equal to each prompt's output alone, RSS before and after each.

Numbers compare within one run on one machine only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 1024


@contextlib.contextmanager
def warm_server(decoder, tokenizer, limits, rows: int, max_model_len: int):
    """`(base url, scheduler)` of a warmed-up server on a free local port, while in the block."""
    from dmtp_jax.serve.app import Scheduler, build_app, serving_in_thread, warm_up
    from dmtp_jax.serve.engine import SERVE_ROUNDS_PER_DISPATCH, Engine

    engine = Engine(decoder, max_batch_size=rows, max_model_len=max_model_len, stop_ids=[],
                    rounds_per_dispatch=SERVE_ROUNDS_PER_DISPATCH)      # as `serve` runs it
    warm_up(engine, every_bucket=False)
    scheduler = Scheduler(engine, max_waiting=limits.max_waiting)
    app = build_app(scheduler, tokenizer, "tiny", drain_s=5, limits=limits, api_key=KEY)
    with serving_in_thread(app, limits.header_timeout_s, log_level="error", backlog=4096) as base:
        yield base, scheduler


def stream_text(base: str, prompt, max_tokens: int) -> tuple[str, float]:
    import httpx
    t0, text = time.perf_counter(), ""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text, time.perf_counter() - t0


def big_body(base: str, mode: str, size: int = 50 * 2**20) -> dict:
    """Sends a `size`-byte body (`mode`: length / chunked / prompt) while probing /health."""
    import httpx
    host, port = base.removeprefix("http://").split(":")
    before, probes, status = rss_mb(), [], None
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t0 = time.perf_counter()
            httpx.get(base + "/health", timeout=60)
            probes.append(time.perf_counter() - t0)
            time.sleep(0.05)
    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    piece = b"x" * 2**20
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
    head += KEY.encode() + b"\r\n"
    with socket.create_connection((host, int(port))) as sock:
        try:
            if mode == "chunked":
                sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
                for _ in range(size // len(piece)):
                    sock.sendall(b"100000\r\n" + piece + b"\r\n")
                sock.sendall(b"0\r\n\r\n")
            else:
                prefix, suffix = b'{"prompt": "', b'", "max_tokens": 4}'
                total = size if mode == "length" else len(prefix) + size + len(suffix)
                sock.sendall(head + b"Content-Length: " + str(total).encode() + b"\r\n\r\n")
                if mode == "prompt":
                    sock.sendall(prefix)
                for _ in range(size // len(piece)):
                    sock.sendall(piece)
                if mode == "prompt":
                    sock.sendall(suffix)
        except (BrokenPipeError, ConnectionResetError):
            pass
        sock.settimeout(120)
        try:
            reply = sock.recv(4096)
            status = int(reply.split()[1]) if reply else "closed"
        except (ConnectionResetError, socket.timeout):
            status = "reset"
    time.sleep(0.5)
    stop.set()
    prober.join()
    import gc
    gc.collect()
    return {"health_max_s": max(probes), "status": status, "rss_before_mb": before, "rss_after_mb": rss_mb()}


def top_k_stall(base: str, scheduler, prompt, max_tokens: int) -> dict:
    import httpx
    _, alone = stream_text(base, prompt, max_tokens)
    before = scheduler.engine.compile_counts()
    result = {}
    t = threading.Thread(target=lambda: result.update(zip(("text", "wall"), stream_text(base, prompt, max_tokens))))
    t.start()
    time.sleep(alone * 0.1)
    for k in (3, 17, 101):
        r = httpx.post(base + "/v1/completions", headers=AUTH, timeout=300,
                       json={"prompt": [4, 8, 15, 16], "max_tokens": 8, "temperature": 0.8, "top_k": k, "seed": k})
        assert r.status_code == 200, r.text
    t.join()
    after = scheduler.engine.compile_counts()
    return {"new_compiles": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)},
            "stream_alone_s": alone, "stream_with_top_k_s": result["wall"], "stall_ratio": result["wall"] / alone}


def idle_connections(base: str, n: int, timeout_s: float) -> dict:
    import httpx
    host, port = base.removeprefix("http://").split(":")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1024), hard))
    before, socks = rss_mb(), []
    for _ in range(n):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.perf_counter()
    ok = httpx.get(base + "/health", timeout=60).status_code == 200
    health = time.perf_counter() - t0
    closed = 0
    deadline = time.time() + timeout_s + 60
    for s in socks:
        s.settimeout(max(0.1, deadline - time.time()))
        try:
            closed += s.recv(10) == b""
        except (socket.timeout, ConnectionResetError):
            pass
        s.close()
    return {"connections": n, "closed_by_server": closed, "health_ok": ok, "health_s": health,
            "rss_before_mb": before, "rss_after_mb": rss_mb()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--sequential", type=int, default=300)
    ap.add_argument("--idle", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)

    import tempfile

    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter
    from dmtp_jax.checkpoint.dmtp_ckpt import init_fusion
    from dmtp_jax.checkpoint.hf import init_target
    from dmtp_jax.checkpoint.mtp_ckpt import init_mtp
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.models.drafter_shape import default_drafter_config
    from dmtp_jax.serve.protocol import ServerLimits
    from dmtp_jax.tiny import save_byte_tokenizer, tiny_target_config
    from dmtp_jax.tokenizer import load_tokenizer

    cfg = tiny_target_config()
    target = init_target(cfg, "float32", seed=0)
    drafter = init_drafter(default_drafter_config(cfg, num_layers=1, block_size=4), seed=2)
    decoder = make_decoder("dmtp", target, drafter, mtp=init_mtp(cfg, seed=1),
                           fusion=init_fusion("dmtp", cfg.hidden_size, cfg.rms_norm_eps, seed=3))
    tok_dir = tempfile.mkdtemp()
    save_byte_tokenizer(tok_dir)
    tokenizer = load_tokenizer(tok_dir, plain=True)
    limits = ServerLimits(max_waiting=4 * args.streams, header_timeout_s=5.0)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 9)] for i in range(8)]
    with warm_server(decoder, tokenizer, limits, args.rows, 120) as (base, _):
        alone = [stream_text(base, p, args.max_tokens)[0] for p in prompts]
        print("== 50 MB bodies (default limit 16 MiB)")
        for mode in ("length", "chunked"):
            print(f"  {mode:8s}", big_body(base, mode))
    big = ServerLimits(max_body_bytes=64 * 2**20, max_waiting=4 * args.streams, header_timeout_s=5.0)
    with warm_server(decoder, tokenizer, big, args.rows, 120) as (base, scheduler):
        probe_server(args, base, scheduler, prompts, alone)
    return 0


def probe_server(args, base: str, scheduler, prompts, alone) -> None:
    """The probes after the body limits, on one server allowing 64 MiB bodies."""
    print("  prompt   (limit 64 MiB: refused by the prompt-size check)", big_body(base, "prompt"))

    print("== three new top_k values during a greedy stream")
    print("  ", top_k_stall(base, scheduler, prompts[0], 100))

    print(f"== {args.streams} concurrent streams")
    before = rss_mb()
    with ThreadPoolExecutor(args.streams) as pool:
        texts = list(pool.map(lambda i: stream_text(base, prompts[i % 8], args.max_tokens)[0], range(args.streams)))
    print(f"  correct {sum(t == alone[i % 8] for i, t in enumerate(texts))}/{args.streams}, "
          f"RSS {before:.0f} -> {rss_mb():.0f} MB")

    print(f"== {args.sequential} sequential requests")
    before, correct, t0 = rss_mb(), 0, time.perf_counter()
    for i in range(args.sequential):
        correct += stream_text(base, prompts[i % 8], args.max_tokens)[0] == alone[i % 8]
    print(f"  correct {correct}/{args.sequential} in {time.perf_counter() - t0:.1f} s, "
          f"RSS {before:.0f} -> {rss_mb():.0f} MB")

    print(f"== {args.idle} idle connections (half a request head each; header timeout 5 s)")
    print("  ", idle_connections(base, args.idle, 5.0))
    text, _ = stream_text(base, prompts[1], args.max_tokens)
    print(f"  afterwards a stream is correct: {text == alone[1]}")


if __name__ == "__main__":
    raise SystemExit(main())
