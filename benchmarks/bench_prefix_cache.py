"""Two-turn chat through the serving engine with and without the prefix cache: second turns' TTFT.

    PYTHONPATH=. python benchmarks/bench_prefix_cache.py [--methods ar,dmtp] [--num-prompts 8]
        [--max-tokens 64] [--concurrency 1] [--max-model-len 512] [--target DIR ...]

For each method (on the demo by default, with its demo drafter, built as `infer.py serve` builds
it) and each of `--prefix-cache-gb 0` and `--prefix-cache-gb G`, an `Engine` over the same
decoder (compiles shared; `serve`'s warm-up first) serves the workload's prompts (the demo's
held-out `demo/prompts.jsonl`) as two-turn chats, `--concurrency` conversations at a time, the two
engines taking turns per group: turn 1 is the prompt, turn 2 is turn 1's prompt + its answer + a
follow-up text. Greedy, the model's stop
tokens. It prints each turn's TTFT p50 / p99 (arrival to first token, in the engine), the cache's
hits and hit tokens, and the ratio of the second turns' TTFT p50 with the cache to without (the
target of issue 34: <= 0.5). Every output, both turns, with and without the cache, must equal
the decoder's `generate` on the same full prompt alone (the exit status is 1 otherwise).

Numbers compare the two modes within one run on one machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

FOLLOW_UP = "\n\n# Now write a test for the function above.\ndef test_"


def pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def serve_turn(engine, prompts, max_tokens: int, concurrency: int):
    """Serves `prompts` (greedy), at most `concurrency` in the engine at a time; returns each
    request (outputs and timestamps)."""
    from dmtp_jax.serve.engine import Request

    reqs, pending, live = [], list(prompts), []
    while pending or live:
        while pending and len(live) < concurrency:
            reqs.append(engine.add(Request(pending.pop(0), max_tokens)))
            live.append(reqs[-1])
        engine.step()
        live = [r for r in live if not r.finished]
    return reqs


def run_modes(decoder, stops, prompts, follow_up, args) -> dict:
    """Both modes (cache off / on), each its own engine, interleaved: the conversations in groups of
    `--concurrency`, each group's turn 1 then turn 2 on one engine, then on the other (so a slower
    spell of a shared machine falls on both)."""
    from dmtp_jax.serve.app import warm_up
    from dmtp_jax.serve.engine import Engine

    runs = {}
    for gb in (0.0, args.prefix_cache_gb):
        engine = Engine(decoder, max_batch_size=args.max_batch_size, max_model_len=args.max_model_len,
                        stop_ids=stops, prefix_cache_gb=gb)
        warm_up(engine)
        runs[gb] = {"engine": engine, "method": engine.method, "first": [], "second": [], "second_prompts": []}
    for i in range(0, len(prompts), args.concurrency):
        group = prompts[i:i + args.concurrency]
        for run in runs.values():
            first = serve_turn(run["engine"], group, args.max_tokens, args.concurrency)
            second_prompts = [p + r.output_ids + follow_up for p, r in zip(group, first)]
            run["first"] += first
            run["second_prompts"] += second_prompts
            run["second"] += serve_turn(run["engine"], second_prompts, args.max_tokens, args.concurrency)
    for run in runs.values():
        cache = run["engine"].prefix_cache
        run.update(ttft1=[r.first_token_s - r.arrival_s for r in run["first"]],
                   ttft2=[r.first_token_s - r.arrival_s for r in run["second"]],
                   cache={} if cache is None else cache.metrics())
    return runs


def main(argv=None) -> int:
    import infer
    from dmtp_jax.commands.models import decoder_methods, load_decoder, resolve_target
    from dmtp_jax.decode.ar import ARDecoder
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None)
    p.add_argument("--methods", default="ar,dmtp")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1, help="conversations in the engine at a time")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--prefix-cache-gb", type=float, default=1.0)
    p.add_argument("--prompts", default=None, help="JSONL with a 'prompt' field per line (default: the demo's)")
    p.add_argument("--json", default=None, help="write the numbers here")
    args = p.parse_args(argv)
    target_dir = resolve_target(args.target)
    tokenizer = load_tokenizer(target_dir, plain=True)
    with open(args.prompts or os.path.join(ROOT, "demo", "prompts.jsonl")) as fh:
        texts = [json.loads(line)["prompt"] for line in fh if line.strip()]
    follow_up = tokenizer(FOLLOW_UP).input_ids
    room = args.max_model_len - 2 * args.max_tokens - len(follow_up)       # both turns fit --max-model-len
    prompts = [ids for ids in (tokenizer(t).input_ids for t in texts) if len(ids) <= room][:args.num_prompts]
    print(f"{len(prompts)} two-turn conversations (prompt tokens {min(map(len, prompts))}..{max(map(len, prompts))}, "
          f"follow-up {len(follow_up)}), greedy, {args.max_tokens} new tokens, concurrency {args.concurrency}, "
          f"max batch {args.max_batch_size}")
    print(f"{'method':7} {'cache':>5} {'ttft1 p50':>9} {'ttft2 p50':>9} {'ttft2 p99':>9} {'hits':>4} "
          f"{'hit tok':>7} {'2nd-turn tok':>12} {'exact':>5}")
    failures, summary = 0, {}
    for method in args.methods.split(","):
        sargs = infer.build_parser().parse_args(["serve", "--method", method] +
                                                (["--target", args.target] if args.target else []))
        methods, _ = decoder_methods(sargs, target_dir, [method])
        decoder, stops = load_decoder(sargs, target_dir, method, methods, make_mesh(None), tokenizer)
        runs = run_modes(decoder, stops, prompts, follow_up, args)
        # greedy: every method emits plain decoding's tokens
        gen = ARDecoder(decoder.target, prefill_chunk=runs[0.0]["engine"].bank.prefill_chunk)
        want1 = [gen.generate([q], args.max_tokens, stop_ids=stops).output_ids[0] for q in prompts]
        want2 = [gen.generate([q], args.max_tokens, stop_ids=stops).output_ids[0] for q in runs[0.0]["second_prompts"]]
        for gb, run in runs.items():
            exact = ([r.output_ids for r in run["first"]] == want1 and [r.output_ids for r in run["second"]] == want2
                     and run["second_prompts"] == runs[0.0]["second_prompts"])
            failures += not exact
            c = run["cache"]
            print(f"{run['method']:7} {gb:5.2g} {pct(run['ttft1'], 50):9.4f} {pct(run['ttft2'], 50):9.4f} "
                  f"{pct(run['ttft2'], 99):9.4f} {c.get('hits', 0):4d} {c.get('hit_tokens', 0):7d} "
                  f"{sum(map(len, run['second_prompts'])):12d} {'yes' if exact else 'NO':>5}", flush=True)
        ratio = pct(runs[args.prefix_cache_gb]["ttft2"], 50) / pct(runs[0.0]["ttft2"], 50)
        print(f"{method}: second turns' TTFT p50 with the cache / without = {ratio:.3f} (target <= 0.5)", flush=True)
        summary[method] = {"ratio_ttft2_p50": ratio, **{
            f"cache_{gb:g}": {"ttft1_p50": pct(r["ttft1"], 50), "ttft2_p50": pct(r["ttft2"], 50),
                              "ttft2_p99": pct(r["ttft2"], 99), **r["cache"]} for gb, r in runs.items()}}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    if failures:
        print(f"{failures} run(s) differ from generate", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
