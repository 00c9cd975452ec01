"""dmtp-jax training CLI: train | export | regen | calibrate | pretrain | distil-mtp | token-counts |
head-factor.

    python train.py train --target DIR --method dflash --data FILE --steps N --batch-size B \\
        --seq-len L --out RUN [--init-from DRAFTER] [--resume] [--config configs/xxx.py]
    python train.py export --run RUN --out DRAFTER_DIR
    python train.py regen --target DIR --data FILE --out FILE [--method ar|dflash --draft DIR]
    python train.py calibrate --target DIR --draft DMTP_ADAPTIVE_DIR --data REGEN_FILE [--mtp DIR]
    python train.py pretrain --config configs/demo_target.py [--steps N] [--resume] [--data-only]
    python train.py distil-mtp --config configs/demo_mtp.py [--steps N] [--resume]
    python train.py token-counts --target DIR --data FILE --out DRAFTER_DIR   # for --draft-head-vocab
    python train.py head-factor --target DIR --data FILE --out DRAFTER_DIR --rank R   # for --draft-head-factor
    python train.py --config configs/demo_dmtp.py      # the subcommand named by the config's COMMAND
    python train.py plan --target configs/models/qwen3.6-27b.json --topology v5p:2x2x2 --mesh data=2,fsdp=4

A config file defines `get_config()` returning a dict (or dataclass) of `TrainConfig` fields; flags
given on the command line override it. Many hosts: `--coordinator HOST:PORT --num-processes N
--process-id I` (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from dmtp_jax.cli import (ArgumentParser, add_compile_cache_arg, add_plan_args, enable_compile_cache, int_list,
                          run_command, skip_absent_gpu_plugin, use_host_backend)
from dmtp_jax.commands.training import (cmd_calibrate, cmd_distil, cmd_export, cmd_head_factor, cmd_plan,
                                        cmd_pretrain, cmd_regen, cmd_token_counts, cmd_train)


def build_parser() -> argparse.ArgumentParser:
    from dmtp_jax.options import TRAIN_METHODS
    p = ArgumentParser(prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def dist(sp):
        sp.add_argument("--coordinator", help="host:port of process 0 (multi-process runs)")
        sp.add_argument("--num-processes", type=int)
        sp.add_argument("--process-id", type=int)

    t = sub.add_parser("train", help="train a drafter (flags override --config)")
    t.add_argument("--config", help="python file with get_config() -> dict of TrainConfig fields")
    t.add_argument("--target", help="HF target directory (frozen)")
    t.add_argument("--method", choices=TRAIN_METHODS,
                   help="dflash, dmtp (main: [A, E(T1)+delta, MASK x6]) or a DMTP ablation; the DMTP "
                        "methods train against the target's frozen native MTP head")
    t.add_argument("--mtp", help="directory of the frozen MTP head (default: the target directory)")
    t.add_argument("--fusion-rank", type=int, help="rank of dmtp-lowrank's residual")
    t.add_argument("--data", help="training data (.jsonl or .parquet)")
    t.add_argument("--out", help="run directory (checkpoints, metrics.jsonl, run_config.json)")
    t.add_argument("--steps", type=int)
    t.add_argument("--batch-size", type=int, help="global batch (sequences per optimizer step)")
    t.add_argument("--seq-len", type=int)
    t.add_argument("--init-from", help="start from this DFlash drafter directory (DMTP methods: a DFlash "
                                       "directory starts with a zero fusion, a DMTP one with its own; "
                                       "dmtp-adaptive may start from a dmtp drafter)")
    t.add_argument("--resume", action="store_true", default=None, help="continue from the run's last checkpoint")
    t.add_argument("--draft-layers", type=int)
    t.add_argument("--block-size", type=int)
    t.add_argument("--mask-token-id", type=int)
    t.add_argument("--target-layer-ids", type=int_list)
    t.add_argument("--num-anchors", type=int)
    t.add_argument("--gamma", type=float, help="loss decay (default 7/5/4 for block 16/10/8)")
    t.add_argument("--lr", type=float)
    t.add_argument("--warmup-steps", type=int)
    t.add_argument("--weight-decay", type=float)
    t.add_argument("--max-grad-norm", type=float)
    t.add_argument("--grad-accum", type=int)
    t.add_argument("--compute-dtype", choices=["bfloat16", "float32", "float16"])
    t.add_argument("--target-dtype", choices=["bfloat16", "float32", "float16"])
    t.add_argument("--ce-chunk", type=int, help="block rows per sequence whose vocabulary logits the loss holds "
                   "at once (default 512; 0: all rows at once). Memory only: the loss is the same")
    t.add_argument("--remat", choices=["off", "full", "dots"],
                   help="recompute drafter layers in the backward pass (default full; dots keeps matmul "
                        "outputs). Memory only: the loss is the same")
    t.add_argument("--mesh", help="mesh axes, e.g. data=8 or fsdp=4,tensor=2")
    t.add_argument("--seed", type=int)
    t.add_argument("--checkpoint-every", type=int)
    t.add_argument("--keep-checkpoints", type=int)
    t.add_argument("--stop-at", type=int, help="stop (with a checkpoint) after this step; "
                   "the LR schedule still spans --steps")
    t.add_argument("--max-nonfinite", type=int,
                   help="stop after this many consecutive steps with a non-finite loss or gradient (each one's "
                        "update is skipped; default 10)")
    t.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    dist(t)

    e = sub.add_parser("export", help="write a run's drafter as an HF-format directory")
    e.add_argument("--run", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])

    r = sub.add_parser("regen", help="the frozen target answers the prompts of a dataset")
    r.add_argument("--target", required=True)
    r.add_argument("--data", required=True)
    r.add_argument("--out", required=True, help="output JSONL (appended to: resumable)")
    r.add_argument("--method", default="ar", choices=["ar", "dflash"])
    r.add_argument("--draft", help="drafter directory for --method dflash")
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-prompt-len", type=int, default=None)
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--mesh", default=None)
    r.add_argument("--no-progress", dest="progress", action="store_false")
    dist(r)

    pt = sub.add_parser("pretrain", help="pretrain the demo target jointly with its MTP head (dmtp_jax.demo)")
    pt.add_argument("--config", required=True, help="python file with get_config() -> PretrainConfig fields")
    pt.add_argument("--steps", type=int)
    pt.add_argument("--work-dir", help="data, tokenizer and run directory (default demo_out)")
    pt.add_argument("--export-dir", help="the HF target directory written at the end")
    pt.add_argument("--resume", action="store_true", default=None)
    pt.add_argument("--data-only", action="store_true", default=None,
                    help="only build the tokenizer, token streams and prompt files")
    pt.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    c = sub.add_parser("calibrate", help="dmtp-adaptive: pick the MTP-confidence threshold on target-written "
                       "training text and store it in the drafter directory (dmtp_jax.train.calibrate)")
    c.add_argument("--target", required=True)
    c.add_argument("--draft", required=True, help="dmtp-adaptive drafter directory (its config.json is updated)")
    c.add_argument("--data", required=True, help="target-written records (train.py regen output), not eval prompts")
    c.add_argument("--mtp", help="MTP head directory (default: the target's)")
    c.add_argument("--seq-len", type=int, default=256)
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--num-anchors", type=int, default=32)
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--dry-run", dest="write", action="store_false", help="print the table, write nothing")

    dm = sub.add_parser("distil-mtp", help="train only the MTP head toward its frozen target's own next-token "
                        "distributions (dmtp_jax.demo.distil)")
    dm.add_argument("--config", required=True, help="python file with get_config() -> DistilConfig fields")
    dm.add_argument("--target", help="target directory (frozen; its mtp.* tensors are replaced)")
    dm.add_argument("--data", help="text the target wrote (train.py regen output)")
    dm.add_argument("--steps", type=int)
    dm.add_argument("--resume", action="store_true", default=None)
    dm.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    tc = sub.add_parser("token-counts", help="count the supervised tokens of training data (the efficient "
                        "drafting head's frequency subset, infer.py --draft-head-vocab)")
    tc.add_argument("--target", required=True, help="target directory (its tokenizer and vocabulary)")
    tc.add_argument("--data", required=True, help="the drafter's training data (.jsonl or .parquet)")
    tc.add_argument("--out", required=True, help="drafter directory (writes token_counts.npy) or a .npy file")
    tc.add_argument("--seq-len", type=int, default=4096, help="rows truncated as in training (default 4096)")
    tc.add_argument("--no-progress", dest="progress", action="store_false")
    hf = sub.add_parser("head-factor", help="train the efficient drafting head's low-rank factor toward the full "
                        "head on the drafter's data (dmtp_jax.train.head_factor; infer.py --draft-head-factor)")
    hf.add_argument("--target", required=True, help="target directory (frozen)")
    hf.add_argument("--data", required=True, help="the drafter's training data (.jsonl or .parquet)")
    hf.add_argument("--out", required=True, help="drafter directory: writes head_factor.safetensors "
                    "(the run: OUT/head_factor_run)")
    hf.add_argument("--mtp", help="MTP head directory (default: the target's, when it has one)")
    hf.add_argument("--rank", type=int, help="rank of the factor (default min(256, hidden/4))")
    hf.add_argument("--shortlist", type=int, help="K of the recall metric (default min(1024, vocab/16))")
    hf.add_argument("--vocab", type=int, help="a frequency subset of N ids (token counts: --counts, default "
                    "OUT/token_counts.npy)")
    hf.add_argument("--counts", help="token counts (.npy or a directory holding token_counts.npy)")
    hf.add_argument("--mesh", help="device mesh, e.g. tensor=4 (default: one device)")
    hf.add_argument("--target-dtype", choices=["float32", "bfloat16", "float16"],
                    help="the frozen target's weights (default float32; bfloat16 at real sizes)")
    hf.add_argument("--ce-chunk", type=int, help="rows per sequence whose vocabulary scores are live at once "
                    "(default 256; 0: all)")
    hf.add_argument("--steps", type=int)
    hf.add_argument("--batch-size", type=int)
    hf.add_argument("--seq-len", type=int)
    hf.add_argument("--lr", type=float)
    hf.add_argument("--seed", type=int)
    hf.add_argument("--resume", action="store_true", default=None)
    hf.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    for sp in (t, e, r, c, pt, dm, tc, hf):
        add_compile_cache_arg(sp)

    pl = sub.add_parser("plan", help="dry run: compile the train step for a TPU slice / GPU host / CPU without "
                                     "the weights or the hardware; per-device memory, FLOPs, time")
    add_plan_args(pl)
    pl.add_argument("--job", default="train", choices=["train", "head-factor"],
                    help="the step to compile: the drafter's (train) or the efficient head factor's (head-factor)")
    pl.add_argument("--method", default="dmtp", choices=TRAIN_METHODS)
    pl.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per optimizer step)")
    pl.add_argument("--seq-len", type=int, default=4096)
    pl.add_argument("--draft-layers", type=int, default=5, help="layers of the fresh drafter (default 5)")
    pl.add_argument("--block-size", type=int, default=8)
    pl.add_argument("--num-anchors", type=int, default=16)
    pl.add_argument("--grad-accum", type=int, default=1)
    pl.add_argument("--target-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    pl.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    pl.add_argument("--rank", type=int, help="head-factor: rank of the factor (default min(256, hidden/4))")
    pl.add_argument("--vocab", type=int, help="head-factor: a vocabulary subset of N ids (default: all)")
    pl.add_argument("--ce-chunk", type=int, default=256, help="head-factor: rows per sequence scored at once")
    pl.add_argument("--exact-cost", action="store_true",
                    help="also compile the step with the layer scan unrolled, for total FLOPs / bytes / time")
    return p


def _config_command(argv: list[str]) -> list[str]:
    """`--config FILE ...` without a subcommand -> the config's `COMMAND` (default `train`)."""
    if not argv or argv[0] not in ("--config",) or len(argv) < 2:
        return argv
    spec = importlib.util.spec_from_file_location("_train_config_cmd", argv[1])
    command = "train"
    if spec is not None and argv[1].endswith(".py"):
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
            command = getattr(module, "COMMAND", "train")
        except FileNotFoundError:
            pass
    return [command, *argv]


def main(argv=None) -> int:
    argv = _config_command(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    if args.command == "plan":
        use_host_backend()
    else:
        skip_absent_gpu_plugin()
        enable_compile_cache(args.compile_cache)
    return run_command({"train": cmd_train, "export": cmd_export, "regen": cmd_regen, "calibrate": cmd_calibrate,
                        "pretrain": cmd_pretrain, "distil-mtp": cmd_distil, "plan": cmd_plan,
                        "token-counts": cmd_token_counts, "head-factor": cmd_head_factor}[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
