"""The speculative round at real shapes, full vs efficient drafting head: XLA's bytes accessed, FLOPs
and its own time estimate of one greedy round, compiled for a TPU slice without weights (the plan's
abstract models and compile-only devices, `dmtp_jax/plan/`), the layer scan unrolled so the counts
cover every layer. Only the round is compiled (not the prefill), once per (method, head).

    python benchmarks/plan_draft_head.py --target configs/models/qwen3.6-27b.json \\
        --topology v5p:2x2x1 --mesh tensor=4 --methods dflash,dmtp --heads full,efficient

Prints one JSON line per (method, head) and the dmtp / dflash and efficient / full ratios.
"""

from __future__ import annotations

import argparse
import json
import time


def round_cost(target, method, head, topology, mesh, dtype, rank, shortlist, prompt_len, max_new_tokens):
    import jax

    from dmtp_jax.checkpoint.hf import place_abstract
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.models.draft_head import abstract_efficient_head, head_name
    from dmtp_jax.plan.compile import cost_of
    from dmtp_jax.plan.inference import inference_calls
    from dmtp_jax.plan.models import plan_models
    from dmtp_jax.plan.topology import open_topology
    from dmtp_jax.platform import compiling_for, unrolled_layers
    from dmtp_jax.sharding import make_mesh

    topo = open_topology(topology)
    device_mesh = make_mesh(mesh, devices=topo.devices)
    with compiling_for(topo.platform, device_mesh.size):
        models = plan_models(target, method, device_mesh, dtype)
        if head == "efficient":
            models["draft_head"] = place_abstract(*abstract_efficient_head(models["target"].cfg, dtype, rank,
                                                                           shortlist), device_mesh)
        decoder = make_decoder(method, models["target"], models.get("drafter"), mtp=models.get("mtp"),
                               fusion=models.get("fusion"), draft_head=models.get("draft_head"))
        call = next(c for c in inference_calls(decoder, 1, prompt_len, max_new_tokens, 0.0, None)
                    if c.name == "round")
        t0 = time.perf_counter()
        jax.clear_caches()
        with unrolled_layers():
            cost = cost_of(call.lower().compile())
        jax.clear_caches()
    return {"method": method, "head": head_name(models["draft_head"].cfg if head == "efficient" else None),
            "bytes_accessed": cost.get("bytes accessed"), "flops": cost.get("flops"),
            "estimated_s": cost.get("optimal_seconds"), "min_bytes": call.min_bytes,
            "compile_s": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="configs/models/qwen3.6-27b.json")
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--mesh", default="tensor=4")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--methods", default="dflash,dmtp")
    p.add_argument("--heads", default="full,efficient")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--shortlist", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    rows = []
    for head in args.heads.split(","):
        for method in args.methods.split(","):
            row = round_cost(args.target, method, head, args.topology, args.mesh, args.dtype, args.rank,
                             args.shortlist, args.prompt_len, args.max_new_tokens)
            print(json.dumps(row), flush=True)
            rows.append(row)
    by = {(r["method"], r["head"].split("(")[0]): r for r in rows}
    for (method, head), r in by.items():
        base = by.get(("dflash", head))
        full = by.get((method, "full"))
        for name, other in (("vs dflash", base), ("vs full head", full)):
            if other is not None and other is not r:
                print(f"{method}/{head} {name}: bytes {r['bytes_accessed'] / other['bytes_accessed']:.3f}x, "
                      f"estimated time {r['estimated_s'] / other['estimated_s']:.3f}x")


if __name__ == "__main__":
    main()
