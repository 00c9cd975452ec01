"""The sizing table of docs/sizing.md, from `plan`: the real Qwen3.6 configs compiled for GPU hosts and TPU
slices on this CPU machine (no weights, no hardware), per-device peak and the compiler's estimate.

Needs the compiler extras: `pip install -e ".[plan-tpu,plan-gpu]"`. Every row is one `plan`
call; each is also printed as the command that reproduces it. Rows run in one process, one after
another (minutes each on 2 cores); `--only SUBSTRING` keeps the rows whose command contains it.

    python benchmarks/plan_sizing.py --out sizing.jsonl            # every row, then the markdown table
    python benchmarks/plan_sizing.py --only h100x8 --only 32768    # a subset
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

Q27 = "configs/models/qwen3.6-27b.json"
Q35 = "configs/models/qwen3.6-35b-a3b.json"
SERVE_NEW_TOKENS = 1024


def serve(target, topo, mesh, batch, prompt, method="dmtp"):
    return ("infer", dict(target=target, topology=topo, mesh=mesh, batch_size=batch, prompt_len=prompt,
                          max_new_tokens=SERVE_NEW_TOKENS if prompt > 1024 else 256, method=method,
                          dtype="bfloat16"))


def train(target, topo, mesh, batch):
    return ("train", dict(target=target, topology=topo, mesh=mesh, batch_size=batch, seq_len=4096, method="dmtp"))


def factor(target, topo, mesh, batch, vocab=None):
    """`train.py plan --job head-factor`: the efficient head's factor trained toward the full head."""
    return ("factor", dict(target=target, topology=topo, mesh=mesh, batch_size=batch, seq_len=2048, vocab=vocab))


# the rows in the order they matter (docs/sizing.md's table; the targets first)
ROWS = [
    serve(Q27, "h100x8", "tensor=8", 32, 32768), serve(Q35, "h100x8", "expert=8", 32, 32768),
    train(Q27, "v5p:2x2x2", "data=2,fsdp=4", 64),
    serve(Q27, "v5p:2x2x1", "tensor=4", 1, 1024), serve(Q27, "v5p:2x2x1", "tensor=4", 1, 1024, method="ar"),
    serve(Q35, "v5p:2x2x1", "expert=4", 1, 1024), serve(Q35, "v5p:2x2x1", "expert=4", 1, 1024, method="dflash"),
    serve(Q27, "v5p:2x2x1", "tensor=4", 1, 1024, method="dflash"),
    serve(Q27, "v5p:2x2x2", "tensor=8", 32, 32768), serve(Q35, "v5p:2x2x2", "expert=8", 32, 32768),
    train(Q27, "v5p:4x4x4", "data=4,fsdp=16", 256),
    serve(Q27, "h100x8", "tensor=8", 1, 4096), serve(Q35, "h100x8", "expert=4,tensor=2", 32, 32768),
    serve(Q27, "h200x8", "tensor=8", 32, 32768), serve(Q27, "v6e:2x4", "tensor=8", 32, 4096),
    serve(Q27, "v5e:4x4", "tensor=8,data=2", 32, 4096), train(Q35, "v5p:2x2x2", "data=2,expert=4", 64),
    factor(Q27, "v5p:2x2x1", "tensor=4", 8), factor(Q27, "v5p:2x2x1", "tensor=4", 8, vocab=32768),
    factor(Q35, "v5p:2x2x1", "expert=4", 8),
]


def rows():
    return list(ROWS)


def command(kind: str, kw: dict) -> str:
    if kind == "infer":
        return (f"python infer.py plan --target {kw['target']} --method {kw['method']} --topology {kw['topology']} "
                f"--mesh {kw['mesh']} --batch-size {kw['batch_size']} --prompt-len {kw['prompt_len']} "
                f"--max-new-tokens {kw['max_new_tokens']} --dtype bfloat16")
    if kind == "factor":
        return (f"python train.py plan --job head-factor --target {kw['target']} --topology {kw['topology']} "
                f"--mesh {kw['mesh']} --batch-size {kw['batch_size']} --seq-len {kw['seq_len']}"
                + (f" --vocab {kw['vocab']}" if kw["vocab"] else ""))
    return (f"python train.py plan --target {kw['target']} --method dmtp --topology {kw['topology']} "
            f"--mesh {kw['mesh']} --batch-size {kw['batch_size']} --seq-len {kw['seq_len']}")


def run(kind: str, kw: dict) -> dict:
    from dmtp_jax.plan import plan_inference
    from dmtp_jax.plan.training import plan_head_factor, plan_training
    kw = {**kw, "target": os.path.join(ROOT, kw["target"])}
    t0 = time.perf_counter()
    plan = {"infer": plan_inference, "train": plan_training, "factor": plan_head_factor}[kind](**kw)
    record = plan.to_json()
    record["wall_s"] = time.perf_counter() - t0
    return record


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def markdown(results: list[dict]) -> str:
    lines = ["| model | machine | mesh | batch | prompt | peak / device (GiB) | of (GiB) | fits | "
             "prefill est. | round est. | compile (s) | command |", "|" + " --- |" * 12]
    for r in results:
        p, s = r["plan"], r["plan"]["settings"]
        est = {f["name"]: f["estimated_s"] for f in p["functions"]}
        fmt = lambda x: "-" if x is None else (f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s")  # noqa: E731
        model = os.path.basename(r["kw"]["target"]).replace(".json", "") + f" {s.get('method', s.get('job'))}"
        prompt = s.get("prompt", s.get("seq"))
        first = {"infer": "prefill", "train": "train_step", "factor": "head_factor_step"}[r["kind"]]
        second = est.get("round", est.get("multi_round")) if r["kind"] == "infer" else None
        lines.append(f"| {model} | {p['topology']} | `{r['kw']['mesh']}` | {s['batch']} | {prompt} | "
                     f"{gib(p['per_device_peak_bytes'])} | {gib(p['hbm_bytes'])} | {'yes' if p['fits'] else 'no'} | "
                     f"{fmt(est.get(first))} | {fmt(second)} | "
                     f"{sum(f['compile_s'] for f in p['functions']):.0f} | `{r['command']}` |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="plan_sizing.jsonl", help="results, one JSON line per row (appended)")
    ap.add_argument("--only", action="append", default=[], help="keep rows whose command contains this")
    args = ap.parse_args()
    import jax
    jax.config.update("jax_platforms", "cpu")
    results = []
    for kind, kw in rows():
        cmd = command(kind, kw)
        if args.only and not all(o in cmd for o in args.only):
            continue
        print(f"== {cmd}", flush=True)
        try:
            plan = run(kind, kw)
        except Exception as e:      # noqa: BLE001 -- a row that cannot compile is reported, the rest go on
            print(f"   failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            continue
        print(f"   peak {gib(plan['per_device_peak_bytes'])} GiB of {gib(plan['hbm_bytes'])} "
              f"({'fits' if plan['fits'] else 'does not fit'}), {plan['wall_s']:.0f} s", flush=True)
        record = {"kind": kind, "kw": kw, "command": cmd, "plan": plan}
        results.append(record)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(record) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
