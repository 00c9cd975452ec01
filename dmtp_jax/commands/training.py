"""`train.py`'s commands: train, export, regen, calibrate, pretrain, distil-mtp, token-counts,
head-factor and plan."""

from __future__ import annotations

import dataclasses
import json
import sys

from dmtp_jax.cli import finish_plan, load_config_file, plan_progress


def cmd_plan(args) -> int:
    """`train.py plan`: the train step's table, `--json`, exit 2 when it does not fit."""
    from dmtp_jax.plan.topology import parse_topology
    from dmtp_jax.plan.training import plan_head_factor, plan_training
    from dmtp_jax.preflight import target_config

    parse_topology(args.topology)
    target_config(args.target)
    if args.job == "head-factor":
        plan = plan_head_factor(args.target, mesh=args.mesh, batch_size=args.batch_size, seq_len=args.seq_len,
                                target_dtype=args.target_dtype, rank=args.rank, vocab=args.vocab,
                                ce_chunk=args.ce_chunk, topology=args.topology, hbm_gb=args.hbm_gb,
                                exact_cost=args.exact_cost, progress=plan_progress)
        return finish_plan(plan, args.json_path)
    plan = plan_training(args.target, method=args.method, mesh=args.mesh, batch_size=args.batch_size,
                         seq_len=args.seq_len, target_dtype=args.target_dtype, compute_dtype=args.compute_dtype,
                         draft_layers=args.draft_layers, block_size=args.block_size, num_anchors=args.num_anchors,
                         grad_accum=args.grad_accum, topology=args.topology, hbm_gb=args.hbm_gb,
                         exact_cost=args.exact_cost, progress=plan_progress)
    return finish_plan(plan, args.json_path)


def train_config(args):
    """TrainConfig defaults < config file < flags given on the command line."""
    from dmtp_jax.train.config import TrainConfig
    merged = load_config_file(args.config) if args.config else {}
    skip = {"command", "config", "coordinator", "num_processes", "process_id"}
    merged.update({k: v for k, v in vars(args).items() if k not in skip and v is not None})
    return TrainConfig.from_dict(merged)


def init_distributed(args) -> None:
    from dmtp_jax.train.distributed import initialize_distributed
    initialize_distributed(args.coordinator, args.num_processes, args.process_id)


def training_logs() -> None:
    """Warnings on stderr, one line each; a full disk reported once (even at exit)."""
    import logging
    from dmtp_jax.train.resilience import QuietDiskFull
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(QuietDiskFull())


def cmd_train(args) -> int:
    cfg = train_config(args)
    cfg.validate()
    init_distributed(args)
    from dmtp_jax.train.run import run_training
    training_logs()
    return report_run(run_training(cfg))     # SIGTERM / SIGINT: checkpoint, then a clean return (see loop.py)


def report_run(summary: dict) -> int:
    """Prints a training summary (process 0; a stop by a signal also on stderr); the exit status."""
    import jax
    if jax.process_index() == 0:
        print(json.dumps({k: v for k, v in summary.items() if k not in ("records", "losses", "last", "data")}))
        if summary.get("stopped_by"):
            print(f"training stopped by {summary['stopped_by']} after step {summary['last_checkpoint']}; "
                  f"checkpoint written: continue with --resume", file=sys.stderr)
    return summary.get("exit_status", 0)


def cmd_export(args) -> int:
    from dmtp_jax.train.export import export_run
    print(json.dumps(export_run(args.run, args.out, args.step, args.dtype)))
    return 0


def cmd_regen(args) -> int:
    init_distributed(args)
    from dmtp_jax.train.regen import RegenConfig, run_regen
    fields = {f.name for f in dataclasses.fields(RegenConfig)}
    cfg = RegenConfig(**{k: v for k, v in vars(args).items() if k in fields})
    print(json.dumps(run_regen(cfg)))
    return 0


def cmd_pretrain(args) -> int:
    from dmtp_jax.demo.build import PretrainConfig, run_pretrain
    training_logs()
    merged = load_config_file(args.config)
    merged.update({k: v for k, v in vars(args).items() if k not in ("command", "config") and v is not None})
    return report_run(run_pretrain(PretrainConfig.from_dict(merged)))


def cmd_calibrate(args) -> int:
    from dmtp_jax.train.calibrate import CalibrateConfig, run_calibrate
    fields = {f.name for f in dataclasses.fields(CalibrateConfig)}
    summary = run_calibrate(CalibrateConfig(**{k: v for k, v in vars(args).items() if k in fields}))
    for row in summary["table"]:
        mark = "  <- chosen" if row["threshold"] == summary["threshold"] else ""
        print(f"threshold {row['threshold']:.2f}: {row['tokens_per_verify']:.3f} tokens/verify, "
              f"MTP's T1 in {row['mtp_fraction']:.0%} of rounds{mark}")
    print(json.dumps({k: v for k, v in summary.items() if k != "table"}))
    return 0


def cmd_distil(args) -> int:
    from dmtp_jax.demo.distil import DistilConfig, run_distil
    training_logs()
    merged = load_config_file(args.config)
    merged.update({k: v for k, v in vars(args).items()
                   if k not in ("command", "config", "compile_cache") and v is not None})
    return report_run(run_distil(DistilConfig.from_dict(merged)))


def cmd_token_counts(args) -> int:
    from dmtp_jax.train.token_counts import write_token_counts
    print(json.dumps(write_token_counts(args.target, args.data, args.out, args.seq_len, args.progress)))
    return 0


def cmd_head_factor(args) -> int:
    from dmtp_jax.train.head_factor import FactorConfig, train_head_factor
    training_logs()
    fields = {f.name for f in dataclasses.fields(FactorConfig)}
    summary = train_head_factor(FactorConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None}))
    print(json.dumps(summary))
    return summary.get("exit_status", 0)
