"""MoE layer time against the number of experts at a fixed top-k: sparse (`moe_mlp`) vs dense.

    python benchmarks/bench_moe.py [--experts 8,64,256] [--top-k 8] [--tokens 8,512]
                                   [--hidden 128] [--inter 64] [--impls dense,sparse] [--repeats 7]

Prints one row per (tokens, experts): the median wall time (ms) of warm jitted forwards of each impl
(`dense` = `moe_mlp_dense`, every expert on every token; `sparse` = `moe_mlp` with its default
kernel for this backend; `scan` / `blocked` / `ragged` = `moe_mlp` forcing that grouped-matmul kernel) and
dense/sparse. The sparse time should stay nearly flat as experts grow; dense grows linearly.
Defaults use small hidden sizes so a CPU run takes well under a minute. Numbers compare within one
run on one machine (run on an idle machine for stable ones). Memory at real sizes on TPU / GPU
compile targets: `benchmarks/bench_moe_memory.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dmtp_jax.layers.moe import moe_mlp, moe_mlp_dense, resolve_impl  # noqa: E402


def layer_fn(impl: str, top_k: int):
    if impl == "dense":
        return jax.jit(lambda *a: moe_mlp_dense(*a, top_k, True))
    kernel = "auto" if impl == "sparse" else impl
    return jax.jit(lambda *a: moe_mlp(*a, top_k, True, impl=kernel))


def random_layer(tokens: int, hidden: int, experts: int, inter: int, seed: int = 0):
    """`(x_nh, router_he, gate_ehi, up_ehi, down_eih)` as fp32 device arrays."""
    rng = np.random.default_rng(seed)
    shapes = [(tokens, hidden), (hidden, experts), (experts, hidden, inter), (experts, hidden, inter),
              (experts, inter, hidden)]
    return [jax.device_put(rng.standard_normal(s, np.float32) * 0.1) for s in shapes]


def median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))                     # compile + warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", default="8,64,256")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", default="8,512", help="decode-ish and prefill-ish token counts")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--inter", type=int, default=64, help="per-expert intermediate size")
    ap.add_argument("--impls", default="dense,sparse", help="of dense, sparse, scan, blocked, ragged")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    impls = args.impls.split(",")
    print(f"MoE layer, {jax.default_backend()}, hidden {args.hidden}, expert inter {args.inter}, "
          f"top-{args.top_k}, fp32; sparse kernel here: {resolve_impl('auto')}; "
          f"median of {args.repeats} warm jitted forwards, ms")
    print(f"{'tokens':>6} {'experts':>7} " + " ".join(f"{i:>9}" for i in impls)
          + (f" {'dense/sparse':>12}" if {"dense", "sparse"} <= set(impls) else ""))
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for experts in [int(e) for e in args.experts.split(",")]:
            layer = random_layer(tokens, args.hidden, experts, args.inter)
            ms = {i: median_ms(layer_fn(i, args.top_k), layer, args.repeats) for i in impls}
            ratio = f" {ms['dense'] / ms['sparse']:>12.1f}" if {"dense", "sparse"} <= set(ms) else ""
            print(f"{tokens:>6} {experts:>7} " + " ".join(f"{ms[i]:>9.3f}" for i in impls) + ratio,
                  flush=True)


if __name__ == "__main__":
    main()
