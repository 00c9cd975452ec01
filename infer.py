"""dmtp-jax inference CLI: generate | compare.

    python infer.py generate --prompt "def fibonacci(n):"            # tiny random demo checkpoint
    python infer.py generate --target DIR --prompt-ids 1,2,3 --json out.json
    python infer.py generate --target DIR --draft DFLASH_DIR --prompt "..."   # speculative
    python infer.py compare --target DIR [--draft DFLASH_DIR] [--dtype float32] [--json report.json]

Every subcommand uses the built-in tiny checkpoint when no `--target` is given.
"""

from __future__ import annotations

import argparse
import json
import sys


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids expects comma-separated integers, got '{text}'") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infer.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--target", help="HF target directory (default: the built-in tiny checkpoint)")
        sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        sp.add_argument("--mesh", default=None, help="mesh axes, e.g. tensor=4,data=2 (default: 1 device)")
        sp.add_argument("--json", dest="json_path", help="write the result as JSON to this file")

    g = sub.add_parser("generate", help="generate text (plain decoding for now)")
    common(g)
    g.add_argument("--method", default=None, choices=["ar", "dflash"],
                   help="ar (plain decoding) or dflash (speculative; needs --draft). Default: dflash "
                        "when --draft is given, else ar")
    g.add_argument("--draft", help="DFlash / DFlash2 drafter directory (z-lab format)")
    g.add_argument("--block-size", type=int, default=None,
                   help="verify slots per round (default: the drafter's block_size)")
    g.add_argument("--verify", default="rejection", choices=["rejection", "target-only"],
                   help="sampled verification: rejection sampling with draft probabilities, or "
                        "matching target samples (greedy is always exact match)")
    g.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable: one per row)")
    g.add_argument("--prompt-ids", action="append", default=[], type=_parse_ids,
                   help="comma-separated token ids (repeatable: one per row); works without a tokenizer")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=int, default=None,
                   help="rows to decode together; prompts are repeated to fill the batch")
    g.add_argument("--stop-token-ids", type=_parse_ids, default=None,
                   help="extra stop token ids, comma-separated (EOS ids of the checkpoint always stop)")

    c = sub.add_parser("compare", help="numerics of JAX vs transformers on the same checkpoint")
    common(c)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--draft", help="also compare this DFlash / DFlash2 drafter with the dflash package")
    return p


def cmd_generate(args) -> int:
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode.ar import ARDecoder
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer, stop_token_ids

    target_dir = resolve_target(args.target)
    sampling = SamplingParams.make(args.temperature, args.top_p, args.top_k)
    tokenizer = load_tokenizer(target_dir)
    prompts = [list(p) for p in args.prompt_ids]
    if args.prompt:
        if tokenizer is None:
            raise UserError(f"{target_dir} has no tokenizer; pass --prompt-ids instead of --prompt")
        prompts += [tokenizer(text).input_ids for text in args.prompt]
    if not prompts:
        raise UserError("give at least one --prompt or --prompt-ids")
    if args.batch_size is not None:
        if args.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.batch_size < len(prompts):
            raise UserError(f"--batch-size {args.batch_size} is smaller than the {len(prompts)} prompts given")
        prompts = [prompts[i % len(prompts)] for i in range(args.batch_size)]
    target = load_target(target_dir, args.dtype, make_mesh(args.mesh))
    stops = stop_token_ids(target_dir, target.cfg.eos_token_ids, tokenizer)
    stops = sorted(set(stops) | set(args.stop_token_ids or []))
    method = args.method or ("dflash" if args.draft else "ar")
    if method == "dflash":
        if not args.draft:
            raise UserError("--method dflash needs --draft DIR")
        from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
        from dmtp_jax.decode.spec import SpecDecoder
        decoder = SpecDecoder(target, load_drafter(args.draft, target.cfg, args.dtype, target.mesh),
                              block_size=args.block_size, verify=args.verify)
    else:
        decoder = ARDecoder(target)

    stream = len(prompts) == 1 and tokenizer is not None and not args.json_path
    def on_tokens(row, toks):
        print(tokenizer.decode(toks), end="", flush=True)
    if stream:
        print(tokenizer.decode(prompts[0]), end="", flush=True)
    result = decoder.generate(prompts, args.max_new_tokens, sampling, args.seed, stops,
                              on_tokens=on_tokens if stream else None)
    if stream:
        print()
    else:
        for i, out in enumerate(result.output_ids):
            text = tokenizer.decode(out) if tokenizer is not None else " ".join(map(str, out))
            print(f"[row {i}] {text}")
    stats = {**result.stats, "compiles": decoder.compile_counts()}
    acceptance = stats.pop("acceptance_lengths", None)
    print(format_stats(stats), file=sys.stderr)
    if args.json_path:
        record = {"prompt_ids": result.prompt_ids, "output_ids": result.output_ids, "stats": stats}
        if acceptance is not None:
            record["acceptance_lengths"] = acceptance
        with open(args.json_path, "w") as fh:
            json.dump(record, fh)
    return 0


def cmd_compare(args) -> int:
    from dmtp_jax.compare import compare_target, format_table

    report = compare_target(resolve_target(args.target), dtype=args.dtype, mesh_spec=args.mesh, seed=args.seed,
                            draft_dir=args.draft)
    print(format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0 if report["ok"] else 1


def format_stats(stats: dict) -> str:
    line = ("method={method} new_tokens={new_tokens} target_forwards={target_forwards} "
            "ttft={ttft_s:.3f}s decode={decode_tokens_per_s:.1f} tok/s compiles={compiles}").format(**stats)
    if "per_verify_acceptance_length" in stats:
        line += ("\nacceptance: per-request {per_request_acceptance_length:.3f} per-verify "
                 "{per_verify_acceptance_length:.3f} first-candidate {first_candidate_acceptance:.3f} "
                 "histogram {histogram}").format(**stats)
        line += "\nconditional acceptance by position: " + " ".join(
            f"{p:.2f}" for p in stats["conditional_acceptance"])
    return line


class UserError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


def resolve_target(path: str | None) -> str:
    if path:
        return path
    from dmtp_jax.tiny import ensure_tiny_target
    return ensure_tiny_target()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dmtp_jax.errors import USER_ERRORS
    try:
        return {"generate": cmd_generate, "compare": cmd_compare}[args.command](args)
    except (UserError, *USER_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
