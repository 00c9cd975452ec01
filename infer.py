"""dmtp-jax inference CLI: generate | serve | compare | bench | plan.

    python infer.py                                                  # the demo benchmark (see below)
    python infer.py --num-prompts 2 --max-new-tokens 16              # the same, shorter (bench flags)
    python infer.py generate --prompt "def fibonacci(n):"            # the shipped demo target
    python infer.py generate --target DIR --prompt-ids 1,2,3 --json out.json
    python infer.py generate --target DIR --draft DFLASH_DIR --prompt "..."   # speculative
    python infer.py serve --port 8000 --api-key KEY                  # OpenAI-compatible server (demo: dmtp)
    python infer.py compare --target DIR [--draft DFLASH_DIR] [--mtp ASSISTANT_DIR] [--dtype float32]
        [--json report.json]
    python infer.py bench --target DIR --draft DIR --methods ar,dflash --workload gsm8k --plot acc.png
    python infer.py plan --target configs/models/qwen3.6-27b.json --topology h100x8 --mesh tensor=8   # dry run

Every subcommand uses the shipped demo when no `--target` is given: `demo/target`, a miniature
Qwen3.5-format hybrid (three Gated DeltaNet layers and one gated-attention layer, 4.5 M parameters)
pretrained on the Python standard library with its native MTP head, and the drafters `demo/dflash`,
`demo/dmtp`, `demo/dmtp_adaptive`, the EAGLE-3 drafter `demo/eagle3` (plus `demo/mtp_corpus`, the
corpus-only head, and its drafters `demo/*_corpus`); without a `demo/` directory, the built-in tiny random checkpoint. One default
method per model for generate, bench and serve: with `--draft DIR`, that drafter's own method (its
`dmtp_config`, else dflash; draft-model when DIR is a smaller target checkpoint); on the demo, dmtp;
else ar. `python infer.py` with no arguments runs `bench` on the demo: methods ar, mtp, dflash, dmtp,
dmtp-adaptive, eagle3, lookup, auto over prompts cut from stdlib
modules held out of training (`demo/prompts.jsonl`), greedy, then the MTP methods again with the
corpus-only head.

Bad input is one `error:` line (plus at most one `hint:` line) and exit status 2, checked before any
model is loaded where it can be (`dmtp_jax/preflight.py`); speculative methods first run the
exactness probe (`dmtp_jax/decode/probe.py`; `--strict` makes a failed probe an error).
"""

from __future__ import annotations

import argparse
import os
import sys

from dmtp_jax.cli import (ArgumentParser, add_compile_cache_arg, add_plan_args, enable_compile_cache, int_list,
                          port_number, run_command, skip_absent_gpu_plugin, use_host_backend)
from dmtp_jax.commands.bench import cmd_bench, cmd_demo
from dmtp_jax.commands.flags import DEFAULT_METHOD_HELP, DTYPES, draft_head_args, method_args, server_limit_args
from dmtp_jax.commands.inference import cmd_compare, cmd_generate, cmd_plan, cmd_serve
from dmtp_jax.commands.models import DEMO_DIR, DEMO_METHODS, DEMO_OUT, demo_available

DEMO_BENCH_ARGV = ["bench", "--methods", DEMO_METHODS, "--num-prompts", "12", "--max-new-tokens", "64",
                   "--json", os.path.join(DEMO_OUT, "bench.json"), "--plot", os.path.join(DEMO_OUT, "acceptance.png"),
                   "--outputs", os.path.join(DEMO_OUT, "outputs.jsonl"), "--show-sample"]


def build_parser() -> argparse.ArgumentParser:
    from dmtp_jax.decode.auto import AUTO
    from dmtp_jax.options import DECODE_METHODS as METHODS, VERIFY_MODES
    p = ArgumentParser(prog="infer.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--target", help="HF target directory (default: the shipped demo, demo/target)")
        sp.add_argument("--dtype", default="float32", choices=DTYPES)
        sp.add_argument("--mesh", default=None, help="mesh axes, e.g. tensor=4,data=2 (default: 1 device)")
        sp.add_argument("--json", dest="json_path", help="write the result as JSON to this file")
        add_compile_cache_arg(sp)

    g = sub.add_parser("generate", help="generate text with any method (plain or speculative)")
    common(g)
    g.add_argument("--method", default=None, choices=METHODS + (AUTO,),
                   help="ar (plain), mtp (native MTP chained --mtp-steps), dflash, dmtp (main: MTP's T1 + "
                        "DFlash with two anchors), a DMTP ablation, eagle3 (an EAGLE-3 drafter, --eagle3 DIR), or auto (measures the methods the models "
                        "allow on the first request of each batch size and keeps the fastest; the verdict is "
                        "cached in $DMTP_JAX_CACHE/auto-verdicts.json). Default: " + DEFAULT_METHOD_HELP)
    method_args(g)
    g.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable: one per row)")
    g.add_argument("--prompt-ids", action="append", default=[], type=int_list,
                   help="comma-separated token ids (repeatable: one per row); works without a tokenizer")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-size", type=int, default=None,
                   help="rows to decode together; prompts are repeated to fill the batch")
    g.add_argument("--stop-token-ids", type=int_list, default=None,
                   help="extra stop token ids, comma-separated (EOS ids of the checkpoint always stop)")

    sv = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching (see docs/serving.md)")
    common(sv)
    method_args(sv)
    sv.add_argument("--method", default=None, choices=METHODS + (AUTO,),
                    help="decoding method (default: " + DEFAULT_METHOD_HELP + "); auto measures the allowed "
                         "methods on the first requests at --max-batch-size rows")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=port_number, default=8000, help="0 picks a free port (printed)")
    sv.add_argument("--max-batch-size", type=int, default=8, help="rows of the running batch")
    sv.add_argument("--max-model-len", type=int, default=None,
                    help="most tokens (prompt + max_tokens) per request (default: max_position_embeddings)")
    sv.add_argument("--prefix-cache-gb", type=float, default=0.0, metavar="GB",
                    help="keep finished and prefilled requests' states (GiB, LRU; 0 = off): a prompt that begins "
                         "with a served text, e.g. a chat's next turn, prefills only the rest (exact)")
    sv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                                                               "target directory's name)")
    server_limit_args(sv)

    c = sub.add_parser("compare", help="numerics of JAX vs transformers on the same checkpoint")
    common(c)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--draft", help="also compare this DFlash / DFlash2 drafter with the dflash package")
    c.add_argument("--mtp", help="also compare this MTP head directory (a gemma4_assistant) with transformers "
                                 "(default: the target's own native MTP head, if it carries one)")

    b = sub.add_parser("bench", help="the paper's benchmark: acceptance and speed of methods over a workload")
    common(b)
    method_args(b, verify_list=True)
    b.add_argument("--methods", default=None,
                   help="comma-separated methods, `auto` among them (default: ar,dflash with --draft; the demo: "
                        "ar,mtp,dflash,dmtp,dmtp-adaptive,eagle3,lookup,auto; else ar)")
    b.add_argument("--workload", default=None,
                   help="default: the demo's held-out prompts (demo/prompts.jsonl) on the demo, else gsm8k. "
                        "gsm8k|math500|humaneval|mt_bench|alpaca_eval|spec_bench|bfcl, or a .jsonl of "
                        '{"prompt": ...} / {"turns": [...]} / {"prompt_ids": [...]} records')
    b.add_argument("--data-dir", default=None,
                   help="local copy of the named workloads' files (default: $DMTP_JAX_DATA); without one they "
                        "load from the Hugging Face hub with the `datasets` library (pip install 'dmtp-jax[data]')")
    b.add_argument("--num-prompts", type=int, default=8, help="first N records of the workload")
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0, help="0 = off")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--plot", default=None, help="write the cumulative acceptance plot (PNG) here")
    b.add_argument("--outputs", default=None, help="write every generation (ids, text) as JSONL here")
    b.add_argument("--show-sample", action="store_true", help="print the first prompt and each method's answer")
    b.add_argument("--no-phases", action="store_true",
                   help="skip the per-phase breakdown (propose / verify / accept / commit) of each speculative round")

    pl = sub.add_parser("plan", help="dry run: compile prefill and the round for a TPU slice / GPU host / CPU "
                                     "without the weights or the hardware; per-device memory, bytes, time")
    add_plan_args(pl)
    pl.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights and caches (default bfloat16)")
    pl.add_argument("--draft", help="DFlash / DMTP drafter directory or its config.json (default: a 5-layer "
                                    "DFlash drafter of the target's width)")
    pl.add_argument("--method", default="dmtp", choices=METHODS)
    pl.add_argument("--block-size", type=int, default=None, help="verify slots per round (default: the drafter's; 8)")
    pl.add_argument("--mtp-steps", type=int, default=4, help="chain length of mtp")
    pl.add_argument("--mtp", default=None, help="a separate MTP head's directory or config.json (mtp, dmtp*: a "
                                                "gemma4_assistant for a Gemma 4 target; default: the target's "
                                                "native head)")
    pl.add_argument("--verify", default="rejection", choices=VERIFY_MODES)
    pl.add_argument("--batch-size", type=int, default=1)
    pl.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per row")
    pl.add_argument("--max-new-tokens", type=int, default=256)
    pl.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the sampled round is larger)")
    pl.add_argument("--rounds-per-dispatch", type=int, default=1, metavar="K")
    pl.add_argument("--exact-cost", action="store_true",
                    help="also compile each function with the layer scan unrolled, for total FLOPs / bytes / time "
                         "(XLA counts a loop body once; slower)")
    pl.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                    help="prompt tokens per prefill call (default: the decoders' 512)")
    pl.add_argument("--prefix-cache-gb", type=float, default=0.0, metavar="GB",
                    help="serve's prefix-cache budget: held per device besides the calls, part of the peak")
    draft_head_args(pl)
    pl.add_argument("--accept-len", type=float, default=None, metavar="TAU",
                    help="tokens committed per round (from a bench): turns the round's time estimate into tokens/s")
    return p


def demo_argv(argv: list[str]) -> list[str] | None:
    """`python infer.py [bench flags]` (no subcommand) runs the demo benchmark; flags given
    override the demo's (e.g. `--num-prompts 2 --max-new-tokens 16`, the CI's short run). None
    when `argv` names a subcommand or asks for help.

    Example:
        >>> demo_argv(["generate", "--prompt", "x"]) is None
        True
        >>> demo_argv(["--num-prompts", "2"])[-2:]
        ['--num-prompts', '2']
    """
    if argv and (not argv[0].startswith("-") or argv[0] in ("-h", "--help")):
        return None
    return [*DEMO_BENCH_ARGV, *argv]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    demo = demo_argv(argv)
    if demo is not None:            # `python infer.py`: the demo benchmark
        if not demo_available():
            print(f"error: no demo at {DEMO_DIR}\nhint: run 'python infer.py --help' for the subcommands",
                  file=sys.stderr)
            return 2
        os.makedirs(DEMO_OUT, exist_ok=True)
        argv = demo
    args = build_parser().parse_args(argv)
    if args.command == "plan":      # compile-only: no backend but the host's, no cache (compile time is reported)
        use_host_backend()
    else:
        skip_absent_gpu_plugin()
        enable_compile_cache(args.compile_cache)
    handler = cmd_demo if demo is not None else {"generate": cmd_generate, "serve": cmd_serve, "compare": cmd_compare,
                                                 "bench": cmd_bench, "plan": cmd_plan}[args.command]
    return run_command(handler, args)


if __name__ == "__main__":
    sys.exit(main())
