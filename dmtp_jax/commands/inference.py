"""`infer.py generate`, `serve`, `compare` and `plan`."""

from __future__ import annotations

import json
import os
import sys

from dmtp_jax.cli import draft_head_options, finish_plan, model_sources, plan_progress
from dmtp_jax.commands.flags import API_KEY_ENV
from dmtp_jax.commands.models import decoder_methods, default_method, load_decoder, resolve_target
from dmtp_jax.errors import InputError
from dmtp_jax.options import check_max_model_len, check_non_negative, check_positive, check_positive_int


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


def server_limits(args):
    """`ServerLimits` from serve's flags (each checked: an `InputError` names the flag)."""
    from dmtp_jax.serve.protocol import ServerLimits
    positive = {"--max-body-mb": args.max_body_mb, "--max-stop-chars": args.max_stop_chars,
                "--max-top-k": args.max_top_k, "--header-timeout": args.header_timeout,
                "--body-timeout": args.body_timeout}
    for flag, value in positive.items():
        check_positive(flag, value)
    for flag, value in {"--max-waiting": args.max_waiting, "--max-stop-strings": args.max_stop_strings}.items():
        check_non_negative(flag, value)
    return ServerLimits(max_body_bytes=int(args.max_body_mb * 2**20), max_waiting=args.max_waiting,
                        max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)


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
