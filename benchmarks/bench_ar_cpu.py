"""Plain-decoding throughput of a checkpoint (default: the tiny built-in one), compile excluded.

    python benchmarks/bench_ar_cpu.py [--target DIR] [--batch-sizes 1,4] [--new-tokens 64]

Prints, per batch size: prefill time, decode tokens/s (all rows), and the compile counts after a
warm-up generation and a timed one. Numbers are for comparison within one run on one machine.
"""

import argparse
import time

from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.tiny import ensure_tiny_target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args()
    target = load_target(args.target or ensure_tiny_target(), args.dtype)
    print(f"target: {target.model_dir} ({target.cfg.model_type}, {target.cfg.num_hidden_layers} layers, "
          f"hidden {target.cfg.hidden_size}, dtype {args.dtype})")
    print(f"{'batch':>5} {'prefill_s':>9} {'decode_tok/s':>12} {'tok/s/row':>9}  compiles")
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        dec = ARDecoder(target)
        prompts = [[(7 * r + i) % target.cfg.vocab_size for i in range(args.prompt_len)] for r in range(bs)]
        dec.generate(prompts, args.new_tokens, stop_ids=[])            # warm-up: compiles
        t0 = time.perf_counter()
        res = dec.generate(prompts, args.new_tokens, stop_ids=[])
        wall = time.perf_counter() - t0
        s = res.stats
        print(f"{bs:>5} {s['ttft_s']:>9.4f} {s['decode_tokens_per_s']:>12.1f} "
              f"{s['decode_tokens_per_s'] / bs:>9.1f}  {dec.compile_counts()}  (wall {wall:.2f}s)")


if __name__ == "__main__":
    main()
