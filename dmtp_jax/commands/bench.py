"""`infer.py bench` and the demo (`python infer.py`): the benchmark's runs, tables and files."""

from __future__ import annotations

import os

from dmtp_jax.cli import model_sources
from dmtp_jax.commands.models import (DEMO_CORPUS_HEAD, DEMO_DIR, DEMO_METHODS, DEMO_WEAK_METHODS, decoder_methods,
                                      default_method, method_models, resolve_target, uses_demo)
from dmtp_jax.errors import InputError
from dmtp_jax.options import check_positive_int


def cmd_bench(args) -> int:
    """`infer.py bench`: `run_bench`, exit status 0."""
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
        weak = run_bench(type(args)(**{**vars(args), "methods": ",".join(weak_methods), "mtp": DEMO_CORPUS_HEAD,
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
