"""What a busy Python thread costs the serving engine's device calls, at two GIL switch intervals.

    PYTHONPATH=. python benchmarks/bench_engine_gil.py [--methods ar,auto] [--rows 32] [--repeats 20]

`serve` runs the engine on the scheduler thread and HTTP on another thread of the same process. Each
jitted call on the engine thread lets go of the GIL and takes it back; while another thread runs
Python, each take-back waits until that thread's switch interval runs out. Per method (the state
`serve` keeps on the demo: `ar`'s, or `auto`'s switching bank with its drafting caches and deferred
rows), per switch
interval (Python's default 5 ms, and the scheduler's `SWITCH_INTERVAL_S`) and per number of
threads spinning Python beside it (0, 1): the mean time to dispatch one `RowMoves.put` of a 1-row
state into a `--rows`-row state (the row insert of every admission) and the time until its result
is ready, over `--repeats` calls after a warm-up.

Numbers compare configurations within one run on one machine only.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time


def spin(stop: threading.Event) -> None:
    """Python bytecode until `stop` (an HTTP thread's parsing and streaming, roughly)."""
    while not stop.is_set():
        sum(range(1000))


def time_puts(moves, big, small, repeats: int) -> tuple[object, float, float]:
    """`(state, dispatch s, ready s)`: mean over `repeats` puts of `small` into row 3 of `big`."""
    import jax
    import numpy as np

    dst = np.array([3], np.int32)
    big = jax.block_until_ready(moves.put(big, small, dst))      # compiled, warm
    dispatch = ready = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        big = moves.put(big, small, dst)
        t1 = time.perf_counter()
        jax.block_until_ready(big)
        dispatch, ready = dispatch + t1 - t0, ready + time.perf_counter() - t1
    return big, dispatch / repeats, ready / repeats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="ar,auto")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)

    import jax

    from bench_serve import load_served_decoder
    from dmtp_jax.commands.models import resolve_target
    from dmtp_jax.serve.engine import SERVE_ROUNDS_PER_DISPATCH
    from dmtp_jax.serve.rounds import engine_bank
    from dmtp_jax.serve.rows import RowMoves
    from dmtp_jax.serve.scheduler import SWITCH_INTERVAL_S
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer

    target_dir = resolve_target(None)
    demo = argparse.Namespace(target=None, draft=None, mtp=None, dtype=None)      # serve's defaults on the demo
    tokenizer, mesh = load_tokenizer(target_dir, plain=True), make_mesh(None)
    default = sys.getswitchinterval()
    print(f"state of {args.rows} rows, max len {args.max_len}; put of one row; mean of {args.repeats} calls")
    print(f"{'method':8s} {'arrays':>6s} {'switch':>8s} {'busy':>4s} {'dispatch ms':>11s} {'ready ms':>8s}")
    for method in args.methods.split(","):
        decoder, _ = load_served_decoder(demo, target_dir, method, SERVE_ROUNDS_PER_DISPATCH, mesh, tokenizer)
        bank = engine_bank(decoder)[0]
        moves = RowMoves(bank.new_state(1, args.max_len), bank.new_state(2, args.max_len))
        big, small = bank.new_state(args.rows, args.max_len), bank.new_state(1, args.max_len)
        arrays = len(jax.tree.leaves(small))
        for interval in (default, SWITCH_INTERVAL_S):
            sys.setswitchinterval(interval)
            for busy in (0, 1):
                stop = threading.Event()
                threads = [threading.Thread(target=spin, args=(stop,)) for _ in range(busy)]
                for t in threads:
                    t.start()
                big, dispatch, ready = time_puts(moves, big, small, args.repeats)
                stop.set()
                for t in threads:
                    t.join()
                print(f"{method:8s} {arrays:6d} {interval * 1e3:6.1f}ms {busy:4d} {dispatch * 1e3:11.2f} "
                      f"{ready * 1e3:8.2f}", flush=True)
    sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
