"""Decode tokens/s against rounds per dispatch (`SpecDecoder(rounds_per_dispatch=K)`), greedy.

    PYTHONPATH=. python benchmarks/bench_rounds_per_dispatch.py [--ks 1,2,4,8,16] [--batches 1,4]
        [--methods dflash,dmtp] [--num-prompts 4] [--max-new-tokens 64] [--repeats 3]

On the shipped demo (`demo/target` with `demo/dflash` and `demo/dmtp`, loaded as `infer.py` does;
prompts from `demo/prompts.jsonl`, the target's stop ids), or, when the demo does not load, on tiny
random checkpoints built on the fly (a hybrid Qwen3.5 target with its MTP head, a reference DFlash
drafter, a zero DMTP fusion; random prompts). For each method, batch size and K: one untimed pass
over the prompts (compiles), then `--repeats` timed passes; the best pass counts. Decode tokens/s =
tokens after the first / decode time (prefill excluded; `stats["decode_s"]`), summed over the
pass's generate calls (batch 1: one call per prompt; batch B: prompts in groups of B). The table
gives tokens/s, the ratio to K = 1 of the same method and batch, dispatches per request, and
whether outputs and acceptance lengths equal K = 1's. Numbers compare K within one run only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))


def load_demo(demo_dir: str, num_prompts: int):
    """(target, {method: decoder kwargs}, prompts, stop ids) of the shipped demo."""
    from dmtp_jax.bench.workloads import load_workload, render_prompt
    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
    from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    from dmtp_jax.tokenizer import load_tokenizer, stop_token_ids

    target_dir = os.path.join(demo_dir, "target")
    target = load_target(target_dir)
    mtp = load_mtp(target_dir, target.cfg)
    drafter, fusion = load_dmtp_drafter(os.path.join(demo_dir, "dmtp"), target.cfg, "dmtp")
    models = {"dflash": dict(drafter=load_drafter(os.path.join(demo_dir, "dflash"), target.cfg)),
              "dmtp": dict(drafter=drafter, mtp=mtp, fusion=fusion)}
    tokenizer = load_tokenizer(target_dir, plain=True)
    workload = load_workload(os.path.join(demo_dir, "prompts.jsonl"), None, num_prompts)
    prompts = [render_prompt(r, tokenizer, []) for r in workload.requests]
    return target, models, prompts, stop_token_ids(target_dir, target.cfg.eos_token_ids, tokenizer)


def build_tiny(out_dir: str, num_prompts: int):
    """The same, on tiny random checkpoints (no tokenizer: random prompts, no stop ids)."""
    from conftest import build_tiny_checkpoint
    from dflash_fixtures import build_reference_drafter
    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
    from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp

    target_dir = build_tiny_checkpoint(os.path.join(out_dir, "target"), "qwen3_5", seed=4)
    draft_dir = os.path.join(out_dir, "dflash")
    build_reference_drafter(draft_dir, seed=3)
    target = load_target(target_dir)
    drafter, fusion = load_dmtp_drafter(draft_dir, target.cfg, "dmtp")
    models = {"dflash": dict(drafter=load_drafter(draft_dir, target.cfg)),
              "dmtp": dict(drafter=drafter, mtp=load_mtp(target_dir, target.cfg), fusion=fusion)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 120, size=int(n)).tolist() for n in rng.integers(17, 60, size=num_prompts)]
    return target, models, prompts, []


def run_pass(decoder, prompts, batch: int, max_new_tokens: int, stop_ids):
    """(decode tokens, decode seconds, dispatches, outputs, acceptance lengths) over the prompts."""
    tokens = seconds = dispatches = 0
    outputs, acceptance = [], []
    for i in range(0, len(prompts), batch):
        res = decoder.generate(prompts[i:i + batch], max_new_tokens, stop_ids=stop_ids)
        s = res.stats
        tokens += s["new_tokens"] - len(res.output_ids)
        seconds += s["decode_s"]
        rounds = s["target_forwards"] - 1
        dispatches += -(-rounds // s["rounds_per_dispatch"])     # the last dispatch may exit early
        outputs += res.output_ids
        acceptance += s["acceptance_lengths"]
    return tokens, seconds, dispatches, outputs, acceptance


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--methods", default="dflash,dmtp")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--demo", default=os.path.join(ROOT, "demo"), help="demo directory")
    ap.add_argument("--tiny", action="store_true", help="tiny random checkpoints instead of the demo")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    methods = args.methods.split(",")
    if 1 not in ks:
        ks = [1] + ks

    from dmtp_jax.decode import make_decoder

    source = "demo"
    tmp = tempfile.TemporaryDirectory()
    try:
        if args.tiny:
            raise RuntimeError("--tiny")
        target, models, prompts, stops = load_demo(args.demo, args.num_prompts)
    except Exception as e:          # the demo is missing or being replaced: tiny random checkpoints
        if not args.tiny:
            print(f"demo did not load ({type(e).__name__}: {e}); using tiny random checkpoints", file=sys.stderr)
        source = "tiny random"
        target, models, prompts, stops = build_tiny(tmp.name, args.num_prompts)

    rows = []
    for method in methods:
        for batch in batches:
            base = None
            for k in ks:
                dec = make_decoder(method, target, **models[method], rounds_per_dispatch=k)
                run_pass(dec, prompts, batch, args.max_new_tokens, stops)            # warm-up: compiles
                best = None
                for _ in range(args.repeats):
                    tokens, seconds, dispatches, outputs, acceptance = run_pass(dec, prompts, batch,
                                                                                args.max_new_tokens, stops)
                    if best is None or tokens / seconds > best[0]:
                        best = (tokens / seconds, dispatches, outputs, acceptance)
                if k == 1:
                    base = best
                same = best[2] == base[2] and best[3] == base[3]
                requests = -(-len(prompts) // batch)
                rows.append((method, batch, k, best[0], best[0] / base[0], best[1] / requests, same))
                print(f"  {method} batch {batch} K {k}: {best[0]:.1f} tok/s", file=sys.stderr, flush=True)
    tmp.cleanup()

    print(f"{source} target ({target.cfg.num_hidden_layers} layers, hidden {target.cfg.hidden_size}); "
          f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy, CPU ({os.cpu_count()} cores), "
          f"best of {args.repeats} after a warm-up pass")
    print(f"{'method':<7} {'batch':>5} {'K':>3} {'decode tok/s':>12} {'vs K=1':>7} {'dispatches/req':>14}  "
          f"same as K=1")
    for method, batch, k, tok_s, ratio, disp, same in rows:
        print(f"{method:<7} {batch:>5} {k:>3} {tok_s:>12.1f} {ratio:>6.2f}x {disp:>14.1f}  {same}")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
