"""Cost of the sampling filters: the jitted `filtered_probs`, and a sampled vs greedy speculative round.

    PYTHONPATH=. python benchmarks/bench_sampling.py [--vocab 151936] [--rows 16] [--repeats 20]
                                                     [--round-vocab 32768] [--new-tokens 64]

* `filtered_probs [rows, vocab]` (fp32 logits) for: temperature only (top-k / top-p off), top-k 20,
  top-p 0.9, and both; best wall time of `--repeats` calls after a compile.
* a tiny random Qwen3 target (`dmtp_jax.tiny.tiny_target_config`, vocab `--round-vocab`) with a
  random native MTP head (`checkpoint.mtp_ckpt.init_mtp`), method `mtp`, batch 1: wall time per
  speculative round (generate with `--new-tokens` minus generate with half as many, divided by the
  difference in rounds: prefill and per-call costs cancel) of greedy vs sampled
  (temperature 1, no filters) decoding, best of `--repeats` after a warm-up; the ratio sampled /
  greedy is the cost sampling adds to a round.

Numbers compare configurations within one run on one machine only.
"""

from __future__ import annotations

import argparse
import time


def best_of(fn, repeats: int) -> float:
    """Best wall time (s) of `repeats` calls of `fn` after one untimed warm-up call."""
    fn()
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return min(walls)


def filter_times(vocab: int, rows: int, repeats: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from dmtp_jax.decode.sampling import SamplingParams, filtered_probs

    logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32) * 3.0
    fn = jax.jit(filtered_probs)
    configs = {"temperature only": dict(temperature=1.0), "top-k 20": dict(temperature=1.0, top_k=20),
               "top-p 0.9": dict(temperature=1.0, top_p=0.9),
               "top-k 20 + top-p 0.9": dict(temperature=1.0, top_k=20, top_p=0.9)}
    out = {}
    for name, kw in configs.items():
        sp = SamplingParams.make(**kw)
        out[name] = best_of(lambda: fn(logits, sp).block_until_ready(), repeats)
    return out


def round_times(vocab: int, new_tokens: int, repeats: int) -> dict[str, float]:
    from dmtp_jax.checkpoint.hf import init_target
    from dmtp_jax.checkpoint.mtp_ckpt import init_mtp
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.tiny import tiny_target_config

    target = init_target(tiny_target_config(vocab_size=vocab, eos_id=vocab - 1), "float32", seed=0)
    dec = make_decoder("mtp", target, mtp=init_mtp(target.cfg, seed=1))
    prompt = [[(7 * i) % (vocab - 1) for i in range(20)]]
    out = {}
    for name, sp in (("greedy", SamplingParams.make()), ("sampled", SamplingParams.make(temperature=1.0))):
        walls, rounds = [], []
        for n in (new_tokens // 2, new_tokens):     # the difference drops prefill and per-call costs
            rounds.append(len(dec.generate(prompt, n, sp, stop_ids=[]).stats["acceptance_lengths"][0]))
            walls.append(best_of(lambda: dec.generate(prompt, n, sp, stop_ids=[]), repeats))
        out[name] = (walls[1] - walls[0]) / max(rounds[1] - rounds[0], 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936, help="filtered_probs vocabulary (Qwen3's)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--round-vocab", type=int, default=32768, help="the tiny target's vocabulary")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-round", action="store_true")
    args = ap.parse_args(argv)

    print(f"filtered_probs [{args.rows}, {args.vocab}] fp32, best of {args.repeats}:")
    for name, t in filter_times(args.vocab, args.rows, args.repeats).items():
        print(f"  {name:<22} {t * 1e3:9.3f} ms")
    if not args.skip_round:
        t = round_times(args.round_vocab, args.new_tokens, max(3, args.repeats // 3))
        print(f"mtp decoding, tiny target (vocab {args.round_vocab}), batch 1, {args.new_tokens} new tokens:")
        for name, v in t.items():
            print(f"  {name:<22} {v * 1e3:9.3f} ms/round")
        print(f"  sampled / greedy       {t['sampled'] / t['greedy']:9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
