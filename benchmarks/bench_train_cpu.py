"""Train-step throughput on CPU for a stated tiny config, 1 device vs 8 fake devices.

    PYTHONPATH=. python benchmarks/bench_train_cpu.py [--steps 20] [--batch-size 8] [--seq-len 128]

Config: the built-in tiny target (`dmtp_jax.tiny`: Qwen3, vocab 320, hidden 64, 2 layers, 4 heads,
2 KV heads, head_dim 16), a fresh 1-layer DFlash drafter (block 8, target layers 0,1), 16 anchors
per sequence, fp32 compute, random token data. The 8-device part runs in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` and `--mesh data=8` (same global batch).
Prints one JSON line per device count: compile seconds, median step seconds, tokens/s, compile
count of the train step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(args) -> dict:
    import jax
    import numpy as np
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tiny import ensure_tiny_target
    from dmtp_jax.train.config import TrainConfig, fresh_drafter_config
    from dmtp_jax.train.optim import OptimConfig
    from dmtp_jax.train.step import StepConfig, Trainer

    mesh = make_mesh(args.mesh)
    target = load_target(ensure_tiny_target(), "float32", mesh)
    dcfg = fresh_drafter_config(TrainConfig(draft_layers=1, block_size=8, target_layer_ids=(0, 1)), target.cfg)
    drafter = init_drafter(dcfg, "float32", mesh)
    trainer = Trainer(target, dcfg, StepConfig(num_anchors=args.num_anchors, compute_dtype="float32"),
                      OptimConfig(total_steps=args.steps), mesh)
    state = trainer.init_state({"drafter": drafter.state})
    shape = (args.batch_size, args.seq_len)
    rng = np.random.default_rng(0)
    local = {"tokens_bt": rng.integers(0, 300, shape).astype(np.int32),
             "loss_mask_bt": np.ones(shape, np.int32)}
    tokens_bt, loss_mask_bt = trainer.global_batch(local, shape)
    batch = {"tokens_bt": tokens_bt, "loss_mask_bt": loss_mask_bt}
    t0 = time.perf_counter()
    state, m = trainer.step(state, batch)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = trainer.step(state, batch)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    return {"devices": len(jax.devices()), "mesh": args.mesh or "1 device", "batch": shape,
            "num_anchors": args.num_anchors, "first_step_s (compile)": round(compile_s, 2),
            "median_step_s": round(step_s, 5), "tokens_per_s": round(shape[0] * shape[1] / step_s, 1),
            "compile_count": trainer.compile_count(), "last_loss": round(float(m["loss"]), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--mesh", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    print(json.dumps(measure(args)), flush=True)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": REPO}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mesh", "data=8", "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--num-anchors", str(args.num_anchors)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
        return out.returncode
    print(out.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
