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
import dataclasses
import json
import os
import sys
import tempfile

from dmtp_jax.cli import (ArgumentParser, add_compile_cache_arg, add_plan_args, draft_head_options,
                          enable_compile_cache, int_list, finish_plan, model_sources, plan_progress, port_number,
                          run_command, skip_absent_gpu_plugin, use_host_backend)
from dmtp_jax.errors import InputError
from dmtp_jax.options import (DraftHeadOptions, check_max_model_len, check_non_negative, check_positive,
                              check_positive_int)

DTYPES = ["float32", "bfloat16", "float16"]
DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
DEMO_OUT = os.path.join(tempfile.gettempdir(), "dmtp-jax-demo")
DEMO_METHODS = "ar,mtp,dflash,dmtp,dmtp-adaptive,eagle3,lookup,auto"
DEMO_WEAK_METHODS = "mtp,dmtp,dmtp-adaptive"     # the second table: the same methods with the corpus-only head
DEMO_CORPUS_HEAD = os.path.join(DEMO_DIR, "mtp_corpus")
DEMO_EAGLE3 = os.path.join(DEMO_DIR, "eagle3")
DEMO_BENCH_ARGV = ["bench", "--methods", DEMO_METHODS, "--num-prompts", "12", "--max-new-tokens", "64",
                   "--json", os.path.join(DEMO_OUT, "bench.json"), "--plot", os.path.join(DEMO_OUT, "acceptance.png"),
                   "--outputs", os.path.join(DEMO_OUT, "outputs.jsonl"), "--show-sample"]


def draft_head_args(sp):
    """`--draft-head` and its shape (generate, bench, plan)."""
    from dmtp_jax.models.draft_head import DRAFT_HEADS
    sp.add_argument("--draft-head", default="full", choices=DRAFT_HEADS,
                    help="the drafting side's LM head (MTP's T1 and chain, the drafter's positions; verification "
                         "always uses the full head): full; efficient (a low-rank factor of the head, from its "
                         "truncated SVD at load time, shortlists candidates that are rescored exactly); or int8 "
                         "(the head quantized to int8 per vocabulary entry at load time)")
    sp.add_argument("--draft-head-rank", type=int, default=None, metavar="R",
                    help="efficient head: rank of the factor (default min(256, hidden/4))")
    sp.add_argument("--draft-head-shortlist", type=int, default=None, metavar="K",
                    help="efficient head: candidates rescored exactly (default min(1024, vocab/16))")
    sp.add_argument("--draft-head-vocab", type=int, default=None, metavar="N",
                    help="efficient head: score only the N most frequent tokens of the drafter's training data "
                         "(their counts: --draft-head-counts; default: the whole vocabulary)")
    sp.add_argument("--draft-head-factor", default=None, metavar="PATH",
                    help="efficient head (generate, bench, serve): a trained factor (`train.py head-factor`; a "
                         "drafter directory holding head_factor.safetensors, or the file) instead of the SVD; it "
                         "sets the rank and the subset (plan: give them as --draft-head-rank / --draft-head-vocab)")
    sp.add_argument("--draft-head-counts", default=None, metavar="PATH",
                    help="token counts for --draft-head-vocab: a .npy file or a directory holding token_counts.npy "
                         "(`train.py token-counts` writes it; default: the --draft directory, the demo's demo/dmtp)")


def method_args(sp, verify_list: bool = False):
    """The flags that choose the models and shape of the speculative methods (generate, bench);
    `verify_list`: `--verify` takes a comma-separated list (bench runs every verifier)."""
    from dmtp_jax.options import VERIFY_MODES
    sp.add_argument("--draft", help="DFlash / DFlash2 / DMTP drafter directory (dflash, dmtp*)")
    sp.add_argument("--eagle3", default=None, metavar="DIR",
                    help="EAGLE-3 drafter directory (eagle3; the LlamaForCausalLMEagle3 layout of SpecForge / "
                         "SGLang / vLLM, or `train.py export` of a --method eagle3 run)")
    sp.add_argument("--mtp", default=None, help="directory with the native MTP head (mtp, dmtp*; "
                                                "default: the target directory)")
    sp.add_argument("--mtp-steps", type=int, default=None, help="chain length of mtp (default 4: MTP415)")
    sp.add_argument("--block-size", type=int, default=None,
                    help="verify slots per round (default: the drafter's block_size)")
    sp.add_argument("--adaptive-threshold", type=float, default=None, metavar="P",
                    help="dmtp-adaptive: a row takes MTP's T1 when the MTP's top-1 probability is >= P "
                         "(0..1.01, 1.01: never; default: the drafter's calibrated threshold)")
    sp.add_argument("--rounds-per-dispatch", type=int, default=None, metavar="K",
                    help="speculative rounds per jitted call, rows stopping on device (default 1: the host syncs "
                         "after every round; serve: the most per call while nobody waits and K rounds take under "
                         "0.25 s, default 4); same outputs, streamed every K rounds")
    sp.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                    help="prefill prompts longer than N tokens in chunks of N (default 512): prefill memory "
                         "stays that of one chunk")
    verify_help = ("sampled verification: rejection (token-level rejection sampling with the proposers' "
                   "probabilities), block (block verification with the same probabilities: lossless, accepts "
                   "at least as much), or target-only (match target samples; what the paper measured). "
                   "Greedy is always exact match")
    if verify_list:
        sp.add_argument("--verify", default="rejection",
                        help=verify_help + ". A comma-separated list runs every speculative method once per "
                                           "verifier, side by side (e.g. rejection,target-only,block)")
    else:
        sp.add_argument("--verify", default="rejection", choices=VERIFY_MODES,
                        help=verify_help)
    draft_head_args(sp)
    sp.add_argument("--strict", action="store_true",
                    help="fail (instead of falling back to plain decoding) when the exactness probe finds "
                         "that a verify block differs from single-token decoding on this backend / dtype")


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


def cmd_generate(args) -> int:
    from dmtp_jax import preflight
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.decode.stats import format_stats
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer

    # cheap checks first: every bad input ends here, before the model load and before any output
    target_dir = resolve_target(args.target)
    cfg = preflight.target_config(target_dir)
    method = args.method or default_method(args)
    preflight.check_decode_options(args.mtp_steps, args.block_size, args.max_new_tokens, args.rounds_per_dispatch,
                                   args.adaptive_threshold, args.prefill_chunk)
    methods, _ = decoder_methods(args, target_dir, [method])
    preflight.check_draft_head(model_sources(args))
    sampling = SamplingParams.make(args.temperature, args.top_p, args.top_k)
    mesh = make_mesh(args.mesh)
    tokenizer = load_tokenizer(target_dir, plain=True)     # no transformers / torch import when exact
    prompts = [list(p) for p in args.prompt_ids]
    if args.prompt:
        if tokenizer is None:
            raise InputError(f"{target_dir} has no tokenizer; pass --prompt-ids instead of --prompt")
        prompts += [tokenizer(text).input_ids for text in args.prompt]
    if not prompts:
        raise InputError("give at least one --prompt or --prompt-ids")
    if args.batch_size is not None:
        check_positive_int("--batch-size", args.batch_size)
        if args.batch_size < len(prompts):
            raise InputError(f"--batch-size {args.batch_size} is smaller than the {len(prompts)} prompts given")
        prompts = [prompts[i % len(prompts)] for i in range(args.batch_size)]
    preflight.check_prompts(prompts, args.max_new_tokens, cfg)

    decoder, stops = load_decoder(args, target_dir, method, methods, mesh, tokenizer)

    stream = len(prompts) == 1 and tokenizer is not None and not args.json_path
    streamed = []

    def on_tokens(row, toks):
        if not streamed:                # the prompt goes out with the first new tokens, never before
            print(tokenizer.decode(prompts[0]), end="", flush=True)
        streamed.extend(toks)
        print(tokenizer.decode(toks), end="", flush=True)
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


def decoder_methods(args, target_dir: str, methods: list[str]) -> tuple[list[str], list[str]]:
    """`(every method a decoder is built for, auto's candidates)` for the requested `methods`: auto
    stands for every method the models allow; the models and block sizes of all of them checked
    once, before any load."""
    from dmtp_jax import preflight
    from dmtp_jax.decode.auto import AUTO
    demo = uses_demo(args)
    eagle3 = eagle3_source(args)
    candidates = preflight.auto_candidates(target_dir, args.draft, args.mtp, demo, eagle3) if AUTO in methods else []
    built = list(dict.fromkeys([*(m for m in methods if m != AUTO), *candidates]))
    preflight.check_method_models(built, target_dir, args.draft, args.mtp, demo_drafters=demo, eagle3=eagle3)
    preflight.check_drafter_block(built, args.draft, args.block_size, eagle3)
    return built, candidates


def load_decoder(args, target_dir: str, method: str, methods: list[str], mesh, tokenizer):
    """`(decoder, stop token ids)` of `method` on the target, from generate's / serve's model flags;
    auto: an `AutoDecoder` over the decoders of `methods`."""
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode.auto import AUTO, AutoDecoder
    from dmtp_jax.decode.loading import make_decoders
    from dmtp_jax.tokenizer import stop_token_ids

    target = load_target(target_dir, args.dtype, mesh)
    stops = stop_token_ids(target_dir, target.cfg.eos_token_ids, tokenizer)
    stops = sorted(set(stops) | set(getattr(args, "stop_token_ids", None) or []))
    decoders = make_decoders(methods, target, method_models(args, target, methods), block_size=args.block_size,
                             verify=args.verify, mtp_steps=args.mtp_steps, strict=args.strict,
                             rounds_per_dispatch=args.rounds_per_dispatch, prefill_chunk=args.prefill_chunk,
                             adaptive_threshold=args.adaptive_threshold)
    return (AutoDecoder(decoders) if method == AUTO else decoders[method]), stops


def cmd_serve(args) -> int:
    from dmtp_jax import preflight
    from dmtp_jax.serve.app import serve
    from dmtp_jax.serve.limits import bind_socket
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer

    target_dir = resolve_target(args.target)
    cfg = preflight.target_config(target_dir)
    method = args.method or default_method(args)
    limits = server_limits(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    preflight.check_decode_options(args.mtp_steps, args.block_size, 1, args.rounds_per_dispatch,
                                   args.adaptive_threshold, args.prefill_chunk)
    methods, _ = decoder_methods(args, target_dir, [method])
    preflight.check_draft_head(model_sources(args))
    if args.max_model_len is not None:
        check_max_model_len(args.max_model_len, cfg.max_position_embeddings)
    check_positive_int("--max-batch-size", args.max_batch_size)
    check_non_negative("--prefix-cache-gb", args.prefix_cache_gb)
    sock = bind_socket(args.host, args.port)             # a port in use fails here, before the models load
    tokenizer = load_tokenizer(target_dir, plain=True)     # transformers' only where it adds something (chat template)
    decoder, stops = load_decoder(args, target_dir, method, methods, make_mesh(args.mesh), tokenizer)
    name = args.served_model_name or os.path.basename(os.path.normpath(target_dir))
    return serve(decoder, tokenizer, name, host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                 max_model_len=args.max_model_len, stop_ids=stops, limits=limits, api_key=api_key,
                 enable_docs=args.enable_docs, sock=sock, max_top_k=args.max_top_k,
                 prefix_cache_gb=args.prefix_cache_gb, rounds_per_dispatch=args.rounds_per_dispatch)


def cmd_compare(args) -> int:
    from dmtp_jax import preflight
    from dmtp_jax.compare import compare_target, format_table, mtp_tensors_expected

    target_dir = resolve_target(args.target)
    preflight.target_config(target_dir)
    preflight.check_method_models(["dflash"] * bool(args.draft) + ["mtp"] * bool(args.mtp), target_dir, args.draft,
                                  args.mtp)
    with mtp_tensors_expected():
        report = compare_target(target_dir, dtype=args.dtype, mesh_spec=args.mesh, seed=args.seed,
                                draft_dir=args.draft, mtp_dir=args.mtp)
    print(format_table(report))
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0 if report["ok"] else 1


def cmd_plan(args) -> int:
    """`infer.py plan`: the table, the JSON, and exit status 2 with one `error:` line when the run
    would not fit the devices' memory."""
    from dmtp_jax import preflight
    from dmtp_jax.plan import plan_inference

    preflight.check_plan_options(target=args.target, draft=args.draft, topology=args.topology,
                                 batch_size=args.batch_size, prompt_len=args.prompt_len,
                                 max_new_tokens=args.max_new_tokens, mtp_steps=args.mtp_steps,
                                 block_size=args.block_size, rounds_per_dispatch=args.rounds_per_dispatch,
                                 prefill_chunk=args.prefill_chunk, prefix_cache_gb=args.prefix_cache_gb,
                                 draft_head=draft_head_options(args))
    plan = plan_inference(args.target, method=args.method, draft=args.draft, block_size=args.block_size,
                          mesh=args.mesh, batch_size=args.batch_size, prompt_len=args.prompt_len,
                          max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                          rounds_per_dispatch=args.rounds_per_dispatch, topology=args.topology, hbm_gb=args.hbm_gb,
                          temperature=args.temperature, mtp_steps=args.mtp_steps, verify=args.verify,
                          accept_len=args.accept_len, prefill_chunk=args.prefill_chunk,
                          exact_cost=args.exact_cost, draft_head=args.draft_head,
                          draft_head_rank=args.draft_head_rank, draft_head_shortlist=args.draft_head_shortlist,
                          draft_head_vocab=args.draft_head_vocab, prefix_cache_gb=args.prefix_cache_gb,
                          mtp=args.mtp, progress=plan_progress)
    return finish_plan(plan, args.json_path)


def cmd_bench(args) -> int:
    run_bench(args)
    return 0


def cmd_demo(args) -> int:
    """`python infer.py`: the demo bench with the target's MTP head (the main table), then the MTP
    methods again with the corpus-only head `demo/mtp_corpus` and their own drafters (the paper's
    weak-MTP limitation), a table of both heads side by side, and one PNG with every run."""
    from dmtp_jax.bench import report as rep

    plot, args.plot = args.plot, None
    main = run_bench(args)
    every = dict(main["methods"])
    weak_methods = [m for m in DEMO_WEAK_METHODS.split(",") if m in main["methods"]]
    if weak_methods and os.path.isdir(DEMO_CORPUS_HEAD) and not args.mtp:
        json_path = args.json_path and os.path.splitext(args.json_path)[0] + "_corpus_mtp.json"
        print(f"\n== the same methods with the corpus-only MTP head ({os.path.relpath(DEMO_CORPUS_HEAD)}: "
              "the head before its distillation phase) and drafters trained with it ==")
        weak = run_bench(argparse.Namespace(**{**vars(args), "methods": ",".join(weak_methods), "mtp": DEMO_CORPUS_HEAD,
                                               "json_path": json_path, "outputs": None, "show_sample": False,
                                               "no_phases": True}))
        print("\n== both MTP heads: first-candidate acceptance decides whether MTP's T1 pays ==")
        print(rep.format_head_comparison(main, weak, "distilled", "corpus-only"))
        every.update({f"{m} (corpus-only MTP)": v for m, v in weak["methods"].items()})
    if plot:
        rep.plot_cumulative({**main, "methods": every}, plot)
        print(f"wrote {plot}")
    return 0


def run_bench(args) -> dict:
    """The bench: runs, prints the tables, writes the requested files; returns the report."""
    from dmtp_jax import preflight
    from dmtp_jax.bench import report as rep
    from dmtp_jax.bench.runner import run_benchmark
    from dmtp_jax.decode.loading import make_decoders
    from dmtp_jax.bench.workloads import check_tokenizer, load_workload
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode import METHODS
    from dmtp_jax.decode.auto import AUTO, AutoDecoder
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.options import verify_modes
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer, stop_token_ids

    target_dir = resolve_target(args.target)
    preflight.target_config(target_dir)             # "model directory not found" before anything else
    demo = uses_demo(args)
    default_methods = (f"ar,{default_method(args)}" if args.draft or getattr(args, "eagle3", None)
                       else DEMO_METHODS if demo else "ar")
    methods = [m.strip() for m in (args.methods or default_methods).split(",") if m.strip()]
    if args.workload is None:
        args.workload = os.path.join(DEMO_DIR, "prompts.jsonl") if demo else "gsm8k"
    unknown = [m for m in methods if m not in METHODS and m != AUTO]
    if unknown or not methods:
        raise InputError(f"unknown method(s) {unknown or methods}; available: {', '.join(METHODS + (AUTO,))}")
    check_positive_int("--batch-size", args.batch_size)
    verifies = verify_modes(args.verify)
    if AUTO in methods and len(verifies) > 1:
        raise InputError("--methods auto takes one --verify mode")
    preflight.check_decode_options(args.mtp_steps, args.block_size, args.max_new_tokens, args.rounds_per_dispatch,
                                   args.adaptive_threshold, args.prefill_chunk)
    built, candidates = decoder_methods(args, target_dir, methods)
    preflight.check_draft_head(model_sources(args))
    sampling = SamplingParams.make(args.temperature, args.top_p, args.top_k)
    mesh = make_mesh(args.mesh)
    workload = load_workload(args.workload, args.data_dir, args.num_prompts)
    tokenizer = load_tokenizer(target_dir, plain=True)     # no transformers / torch import when exact
    check_tokenizer(workload, tokenizer, target_dir)
    if args.plot:
        rep.plot_backend()              # matplotlib missing: say so before the run, not after it
    target = load_target(target_dir, args.dtype, mesh)
    stops = stop_token_ids(target_dir, target.cfg.eos_token_ids, tokenizer)
    models = method_models(args, target, built)
    decoders = {}
    for verify in verifies:         # several verifiers: every speculative method once per verifier
        made = make_decoders(built if verify == verifies[0] else [m for m in built if m != "ar"], target,
                             models, block_size=args.block_size, mtp_steps=args.mtp_steps, verify=verify,
                             strict=args.strict, rounds_per_dispatch=args.rounds_per_dispatch,
                             prefill_chunk=args.prefill_chunk, adaptive_threshold=args.adaptive_threshold)
        if AUTO in methods:         # auto measures its candidates' decoders: the same objects (compiles shared)
            made[AUTO] = AutoDecoder({m: made[m] for m in candidates})
        made = {m: made[m] for m in methods if m in made}
        decoders.update({m if m == "ar" or len(verifies) == 1 else f"{m}/{verify}": d for m, d in made.items()})
    if len(verifies) > 1:           # side by side: method by method, each with every verifier
        order = {m: i for i, m in enumerate(methods)}
        decoders = dict(sorted(decoders.items(), key=lambda kv: order[kv[0].split("/")[0]]))
    runs = run_benchmark(decoders, workload, tokenizer, max_new_tokens=args.max_new_tokens,
                         batch_size=args.batch_size, sampling=sampling, seed=args.seed, stop_ids=stops,
                         max_positions=target.cfg.max_position_embeddings, progress=True)
    config = {"target": target_dir, "draft": args.draft, "methods": methods, "workload": workload.name,
              "source": workload.source, "requests": len(workload.requests),
              "generations": workload.num_generations, "batch_size": args.batch_size,
              "max_new_tokens": args.max_new_tokens, "block_size": args.block_size, "mtp": args.mtp,
              "mtp_steps": args.mtp_steps, "verify": verifies[0] if len(verifies) == 1 else verifies,
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
              "dtype": args.dtype, "mesh": args.mesh, "stop_ids": stops, "strict": args.strict,
              "rounds_per_dispatch": args.rounds_per_dispatch or 1, "prefill_chunk": args.prefill_chunk,
              "draft_head": args.draft_head, "draft_head_rank": args.draft_head_rank,
              "draft_head_shortlist": args.draft_head_shortlist, "draft_head_vocab": args.draft_head_vocab,
              "draft_head_factor": args.draft_head_factor}
    report = rep.build_report(runs, config)
    from dmtp_jax.bench.head_agreement import t1_agreement
    for name, run in runs.items():      # efficient head: how often its T1 is the full head's
        agreement = t1_agreement(decoders[name], [g.prompt_ids + g.output_ids for g in run.generations],
                                 [len(g.prompt_ids) for g in run.generations])
        report["methods"][name]["t1_agreement"] = agreement
        if agreement is not None:
            print(f"{name}: T1 from the drafting head equals the full head's at {agreement:.2%} of the positions "
                  "rounds drafted from")
    from dmtp_jax.bench.efficiency import format_efficiency, method_efficiency
    report["efficiency"] = {name: method_efficiency(decoders[name], run) for name, run in runs.items() if name != AUTO}
    print(f"workload {workload.name}: {len(workload.requests)} requests, {workload.num_generations} generations, "
          f"batch {args.batch_size}, max_new_tokens {args.max_new_tokens}, temperature {args.temperature}"
          + (f", verify {','.join(verifies)}" if args.temperature > 0 else ""))
    print(rep.format_table(report))
    print(rep.format_footer(report))
    print(format_efficiency(report["efficiency"]))
    if AUTO in runs:
        print(rep.format_auto(report))
    if not args.no_phases and sampling.is_greedy:
        from dmtp_jax.bench.phases import bench_phases, format_phases
        report["phases"] = bench_phases(decoders)
        print(format_phases(report["phases"]))
    if args.json_path:
        rep.write_json(report, args.json_path)
    if args.plot:
        rep.plot_cumulative(report, args.plot)
    if args.outputs:
        rep.write_outputs(runs, args.outputs, tokenizer)
    for path in (args.json_path, args.plot, args.outputs):
        if path:
            print(f"wrote {path}")
    if args.show_sample:
        print(rep.format_sample(runs, tokenizer))
    return report


def demo_available() -> bool:
    """Whether the shipped demo (`demo/target` with its weights) is present."""
    return os.path.isfile(os.path.join(DEMO_DIR, "target", "model.safetensors"))


def resolve_target(path: str | None) -> str:
    """`path`, else the shipped demo target, else the built-in tiny random checkpoint.

    Example:
        >>> resolve_target("/models/x")
        '/models/x'
    """
    if path:
        return path
    if demo_available():
        return os.path.join(DEMO_DIR, "target")
    from dmtp_jax.tiny import ensure_tiny_target
    return ensure_tiny_target()


DEFAULT_METHOD_HELP = ("with --draft, the drafter directory's own method (its dmtp_config, else dflash); "
                       "on the demo, dmtp; else ar")
API_KEY_ENV = "DMTP_JAX_API_KEY"


def default_method(args) -> str:
    """The one default method of a model (generate, bench with --draft, serve): the drafter
    directory's own method with `--draft` (`dmtp_config.method`, else dflash: a plain DFlash
    directory), dmtp on the demo, else ar.

    Example:
        >>> default_method(argparse.Namespace(draft=None, target="/models/x"))
        'ar'
    """
    from dmtp_jax.config import read_config_json
    from dmtp_jax.preflight import draft_is_target
    if args.draft:
        try:
            config = read_config_json(args.draft)
            if draft_is_target(args.draft):
                return "draft-model"
        except Exception:       # noqa: BLE001 -- a missing / bad directory is preflight's error to report
            config = {}
        if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
            return "eagle3"
        return (config.get("dmtp_config") or {}).get("method") or "dflash"
    if getattr(args, "eagle3", None):
        return "eagle3"
    return "dmtp" if uses_demo(args) else "ar"


def server_limit_args(sp) -> None:
    """serve's limits and access flags (`dmtp_jax.serve.protocol.ServerLimits` holds the defaults)."""
    from dmtp_jax.serve.protocol import ServerLimits
    d = ServerLimits()
    sp.add_argument("--api-key", default=None,
                    help=f"require 'Authorization: Bearer KEY' on /v1/*, /metrics and every other path but "
                         f"/health (default: ${API_KEY_ENV}; unset: no key)")
    sp.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (off by default)")
    sp.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20,
                    help="largest request body in MiB; larger ones get 413 before they are parsed "
                         "(default %(default)s)")
    sp.add_argument("--max-waiting", type=int, default=d.max_waiting,
                    help="requests that may wait for a row; more get 429 (default %(default)s)")
    sp.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                    help="stop strings per request (default %(default)s)")
    sp.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                    help="characters per stop string (default %(default)s)")
    sp.add_argument("--max-top-k", type=int, default=256, metavar="K",
                    help="largest top_k a request may ask (the sampled round's top-k search width; any k up "
                         "to it compiles nothing; >= the vocabulary means off) (default %(default)s)")
    sp.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="S",
                    help="seconds a connection may take to send a whole request head (default %(default)s)")


def server_limits(args):
    """`ServerLimits` from serve's flags (each checked: an `InputError` names the flag)."""
    from dmtp_jax.serve.protocol import ServerLimits
    positive = {"--max-body-mb": args.max_body_mb, "--max-stop-chars": args.max_stop_chars,
                "--max-top-k": args.max_top_k, "--header-timeout": args.header_timeout}
    for flag, value in positive.items():
        check_positive(flag, value)
    for flag, value in {"--max-waiting": args.max_waiting, "--max-stop-strings": args.max_stop_strings}.items():
        check_non_negative(flag, value)
    return ServerLimits(max_body_bytes=int(args.max_body_mb * 2**20), max_waiting=args.max_waiting,
                        max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                        header_timeout_s=args.header_timeout)


def uses_demo(args) -> bool:
    """No `--target` given and the demo is present: the demo's drafters are the defaults."""
    return not args.target and demo_available()


def eagle3_source(args) -> str | None:
    """The EAGLE-3 drafter directory: `--eagle3`, else the demo's `demo/eagle3` when the demo is in
    use without `--draft` (and ships one), else None.

    Example:
        >>> eagle3_source(argparse.Namespace(eagle3="runs/e3", draft=None, target=None))
        'runs/e3'
    """
    given = getattr(args, "eagle3", None)
    if given or args.draft or not uses_demo(args) or not os.path.isdir(DEMO_EAGLE3):
        return given
    return DEMO_EAGLE3


def demo_drafter(method: str, mtp_dir: str | None = None) -> str | None:
    """The demo drafter of a method: `demo/dflash`, `demo/dmtp`, `demo/dmtp_adaptive`,
    `demo/eagle3`; the DMTP drafters trained against the corpus-only head (`demo/*_corpus`) when
    `mtp_dir` is that head.

    Example:
        >>> os.path.basename(demo_drafter("dmtp")), demo_drafter("ar")
        ('dmtp', None)
        >>> os.path.basename(demo_drafter("dmtp-adaptive", DEMO_CORPUS_HEAD))
        'dmtp_adaptive_corpus'
    """
    from dmtp_jax.decode import method_needs
    from dmtp_jax.methods import EAGLE3
    if not method_needs(method)["drafter"]:
        return None
    if method == EAGLE3:
        return DEMO_EAGLE3
    if not method_needs(method)["fusion"]:
        return os.path.join(DEMO_DIR, "dflash")
    name = method.replace("-", "_") if method == "dmtp-adaptive" else "dmtp"
    corpus = mtp_dir is not None and os.path.abspath(mtp_dir) == os.path.abspath(DEMO_CORPUS_HEAD)
    return os.path.join(DEMO_DIR, name + ("_corpus" if corpus else ""))


def method_models(args, target, methods) -> dict:
    """`load_method_models`, with each method's demo drafter when the demo is in use and no
    `--draft` is given (so dflash and dmtp run their own drafters in one bench; one drafting head
    shared by all), and the demo's token counts (`demo/dmtp/token_counts.npy`) unless
    `--draft-head-counts` is given."""
    from dmtp_jax.decode.loading import load_draft_head, load_method_models
    sources = model_sources(args)
    if args.draft or not uses_demo(args):
        return load_method_models(sources, target, methods)
    groups: dict = {}
    for m in methods:
        groups.setdefault(demo_drafter(m, args.mtp), []).append(m)
    # the demo drafters' token counts are one file's (same training data); mtp has no drafter directory
    counts = sources.draft_head.counts or os.path.join(DEMO_DIR, "dmtp")
    head = load_draft_head(dataclasses.replace(sources, draft_head=dataclasses.replace(sources.draft_head,
                                                                                       counts=counts)),
                           target, methods)
    out = {}
    for draft, group in groups.items():       # the drafting head is built once, above, for every group
        out.update(load_method_models(dataclasses.replace(sources, draft=draft, draft_head=DraftHeadOptions()),
                                      target, group))
    return {m: {**out[m], **({"draft_head": head} if head is not None and m != "ar" else {})} for m in methods}


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
