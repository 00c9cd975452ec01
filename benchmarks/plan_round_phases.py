"""Where a round's bytes go at real shapes: XLA's bytes accessed and time estimate of each phase of
one greedy round (`decode/round.py`, `decode/proposers.py`), compiled for a TPU slice without
weights (the plan's abstract models and compile-only devices, `dmtp_jax/plan/`), the layer scan
unrolled so the counts cover every layer; next to the fused round and its analytic minimum.

    python benchmarks/plan_round_phases.py --target configs/models/qwen3.6-27b.json \\
        --topology v5p:2x2x1 --mesh tensor=4 --methods dflash,dmtp --heads full,efficient

`--heads`: the drafting side's LM heads, of full, efficient and int8 (`models/draft_head.py`: a
low-rank shortlist, rank / shortlist from `--rank` / `--shortlist` or `head_shape`'s defaults, over
`--vocab` N ids only when given; the head in int8); `--round-only`
compiles the fused round alone (one compile per method and head instead of three or four).

Phases, each jitted alone on the round's own inputs:
  propose-mtp      `proposer.first` (MTP's T1 from the state's MTP hidden)
  propose-drafter  `proposer.draft` given T1 (the drafter block and its draft logits)
  verify           `round.verify_forward` (the target over `[pending, drafts]`, its logits)
  commit           the fused round minus the phases above (accept, `target.commit`, `mtp_advance`,
                   `write_context`): XLA fuses across phases, so this is the remainder, not a compile
                   (it can be negative: `mtp`'s chain re-reads what the fused round reads once)

Prints one JSON line per (method, head): GB and XLA's estimate per phase, the round's GB, its minimum
and their ratio; then each round against the dflash round and against the full head. This is
how the 27B round's extra bytes were found (issue 19: a transposed copy of every attention layer's
`q_proj` per verify and drafter block, `models/qwen3.py:q_gate`).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8}
SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES.get(dtype, 4)
    return total


def biggest_ops(hlo_text: str, top: int) -> list[tuple[int, str]]:
    """The compiled program's top-level instructions (fusions, copies, collectives, custom calls),
    largest first, grouped by JAX op name and result shape: `(bytes, "op_name -> shape, from operands")`,
    bytes = operands + result of each instruction: an upper bound on what XLA charges for it (a
    gather or dynamic slice reads less than its whole operand). A map of where the bytes go, not a
    second cost model."""
    entry = hlo_text[hlo_text.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    shapes, groups = {}, collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(?:, |$)", line)
        if not m:
            continue
        name, shape, opcode, operands = m.groups()
        shapes[name] = shape
        if opcode in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
            continue
        ins = re.findall(r"%[\w.\-]+", operands)
        meta = re.search(r'op_name="([^"]*)"', line)
        op = re.sub(r"(jit\([^)]*\)/)+", "", meta.group(1)) if meta else opcode
        big_in = max(ins, key=lambda o: _shape_bytes(shapes.get(o, "")), default=None)
        key = f"{op} [{opcode}] -> {shape.split('{')[0]}" + (f" <- {shapes.get(big_in, '?').split('{')[0]}"
                                                            if big_in else "")
        groups[key] += _shape_bytes(shape.split("{")[0]) + sum(_shape_bytes(shapes.get(o, "").split("{")[0])
                                                                for o in ins)
    return [(b, w) for w, b in groups.most_common(top)]


def phase_costs(target, method, topology, mesh, dtype, prompt_len, max_new_tokens, head="full", rank=None,
                shortlist=None, round_only=False, top=0, vocab=None) -> dict:
    import jax
    import numpy as np

    from dmtp_jax.checkpoint.hf import place_abstract
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.decode.round import merge_models, verify_forward
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.checkpoint.draft_head_ckpt import abstract_draft_head
    from dmtp_jax.models.draft_head import head_name
    from dmtp_jax.plan.compile import cost_of
    from dmtp_jax.plan.inference import inference_calls, request_shapes
    from dmtp_jax.plan.models import abstract_args, plan_models
    from dmtp_jax.plan.topology import open_topology
    from dmtp_jax.platform import compiling_for, unrolled_layers
    from dmtp_jax.sharding import at_shardings, make_mesh

    topo = open_topology(topology)
    device_mesh = make_mesh(mesh, devices=topo.devices)

    biggest = []

    def cost(lower):
        jax.clear_caches()
        with unrolled_layers():
            compiled = lower().compile()
        c = cost_of(compiled)
        if top and not biggest:           # the first compile is the fused round
            biggest.extend(biggest_ops(compiled.as_text(), top))
        jax.clear_caches()
        return {"gb": round(c.get("bytes accessed", 0.0) / 1e9, 3),
                "est_ms": None if not c.get("optimal_seconds") else round(1e3 * c["optimal_seconds"], 3)}

    t0 = time.perf_counter()
    with compiling_for(topo.platform, device_mesh.size):
        models = plan_models(target, method, device_mesh, dtype)
        if head != "full":
            models["draft_head"] = place_abstract(*abstract_draft_head(head, models["target"].cfg, dtype, rank,
                                                                       shortlist, vocab), device_mesh)
        dec = make_decoder(method, models["target"], models.get("drafter"), mtp=models.get("mtp"),
                           fusion=models.get("fusion"), draft_head=models.get("draft_head"))
        call = next(c for c in inference_calls(dec, 1, prompt_len, max_new_tokens, 0.0, None) if c.name == "round")
        rows, _, max_len = request_shapes(dec.target.cfg, 1, prompt_len, max_new_tokens, dec.slots)
        shapes = jax.eval_shape(lambda: dec.new_state(rows, max_len))
        state = at_shardings(shapes, dec.state_shardings(shapes))
        states, knobs, proposer = dec.model_states(), dec.knobs(), dec.proposer
        sp, key = SamplingParams.make(), jax.random.key(0)
        limits = jax.ShapeDtypeStruct((rows,), np.int32)
        merged = lambda s: merge_models(dec.setup.graphdefs, s)  # noqa: E731
        phases = {"round": cost(call.lower)}
        first = None
        if not round_only:
            if proposer.needs["mtp"] and proposer.needs["drafter"]:
                first_fn = jax.jit(lambda s, st: proposer.first(merged(s), st, sp, key, True))
                phases["propose-mtp"] = cost(lambda: first_fn.lower(states, state))
                first = jax.eval_shape(first_fn, states, state)
            if proposer.needs["drafter"]:
                draft_fn = jax.jit(lambda s, st, fi, lim: proposer.draft(merged(s), st, fi, sp, key, True, lim,
                                                                         knobs))
                phases["propose-drafter"] = cost(lambda: draft_fn.lower(states, state,
                                                                        *abstract_args((first, limits), device_mesh)))
            else:
                prop_fn = jax.jit(lambda s, st, lim: proposer.propose(merged(s), st, sp, key, True, lim, knobs))
                phases["propose-mtp"] = cost(lambda: prop_fn.lower(states, state,
                                                                   *abstract_args((limits,), device_mesh)))
            drafts = jax.ShapeDtypeStruct((rows, dec.slots - 1), np.int32)
            verify_fn = jax.jit(lambda s, st, d: verify_forward(merged(s).target, st, d,
                                                                merged(s).capture_layers).logits_bnv)
            phases["verify"] = cost(lambda: verify_fn.lower(states, state, *abstract_args((drafts,), device_mesh)))
    if not round_only:
        parts = sum(v["gb"] for k, v in phases.items() if k != "round")
        phases["commit (remainder)"] = {"gb": round(phases["round"]["gb"] - parts, 3), "est_ms": None}
    name = head_name(models["draft_head"].cfg if head != "full" else None)
    return {"method": method, "head": name, "phases": phases, "min_gb": round(call.min_bytes / 1e9, 3),
            "round_over_min": round(phases["round"]["gb"] * 1e9 / call.min_bytes, 3),
            "parts_gb": {k: round(v / 1e9, 3) for k, v in call.parts.items()},
            "compile_s": round(time.perf_counter() - t0, 1),
            **({"biggest_ops_gb": [[round(b / 1e9, 4), w] for b, w in biggest]} if top else {})}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="configs/models/qwen3.6-27b.json")
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--mesh", default="tensor=4")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--methods", default="dflash,dmtp")
    p.add_argument("--heads", default="full", help="comma-separated, of full, efficient, int8")
    p.add_argument("--rank", type=int, default=None, help="efficient head: rank of the factor")
    p.add_argument("--shortlist", type=int, default=None, help="efficient head: candidates rescored")
    p.add_argument("--vocab", type=int, default=None, help="efficient head: score only N vocabulary ids "
                   "(the frequency subset; default: all)")
    p.add_argument("--round-only", action="store_true", help="compile the fused round only, no phases")
    p.add_argument("--top", type=int, default=0, help="also list the fused round's N largest source lines "
                   "(operand + result bytes of the instructions each made)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    from dmtp_jax.cli import use_host_backend
    use_host_backend()
    rows = {}
    for head in args.heads.split(","):
        for method in args.methods.split(","):
            row = phase_costs(args.target, method, args.topology, args.mesh, args.dtype, args.prompt_len,
                              args.max_new_tokens, head, args.rank, args.shortlist, args.round_only, args.top,
                              args.vocab)
            print(json.dumps(row), flush=True)
            rows[(method, head)] = row["phases"]["round"]
    for (method, head), r in rows.items():
        for name, other in (("vs dflash", rows.get(("dflash", head))), ("vs full head", rows.get((method, "full")))):
            if other is not None and other is not r:
                est = (f", estimated time {r['est_ms'] / other['est_ms']:.3f}x" if r["est_ms"] and other["est_ms"]
                       else "")
                print(f"{method}/{head} {name}: bytes {r['gb'] / other['gb']:.3f}x{est}")

if __name__ == "__main__":
    main()
