"""DMTP's extra cost per round over DFlash: the fused round of `dmtp` / `dflash` on the same target,
drafter and state, greedy and sampled, with the MTP advance as the round runs it (keys and values of
every verified row, the whole MTP layer for the last accepted row only: `MtpHead.advance`) and, for
comparison, the whole layer over every row (what the round did before, and still does for the
context-fusion variants, which feed every row's MTP output to the drafter).

    python benchmarks/bench_dmtp_overhead.py                      # demo-sized and 0.2B random targets, CPU
    python benchmarks/bench_dmtp_overhead.py --sizes small --batches 1
    python benchmarks/bench_dmtp_overhead.py --ab b9ae296                 # dmtp / dflash round time, A/B

Random weights (timing does not depend on them), block 8, a context of `--context` committed tokens
per row (reset every round, so every round sees the same context). Median of `--iters` rounds after
a warm-up; ratios are within one run.

`--ab COMMIT`: the guard of DMTP's round cost. The dmtp / dflash mean round time (greedy generate
calls, decode time over rounds, as `infer.py bench` reports it) on the demo checkpoints and on a
tiny random Qwen3 (`fixture_decoders`), for this working tree and for COMMIT checked out in a
temporary `git worktree`, each in its own worker process, the two alternating prompt by prompt;
prints every pass, the medians of `--passes` and of the prompts' runs (each ratio of times taken
back to back, the steadier figure on a busy machine), and whether each method's outputs and
acceptance are identical in both trees.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
from roofline import SIZES, build, target_configs, time_round  # noqa: E402

SIZES.setdefault("medium", dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=3072, num_attention_heads=8,
                                num_key_value_heads=4, head_dim=128, vocab_size=32000))


class _EveryRow:
    """The fusion, except that `round.mtp_advance` asks it for every row's output (the whole-layer
    path); its own methods are the fusion's."""
    uses_mtp_context = True

    def __init__(self, fusion):
        self._fusion = fusion

    def __getattr__(self, name):
        return getattr(self._fusion, name)


def whole_layer_advance(decoder):
    """The same decoder, except that its MTP advance runs the whole layer over every verified row."""
    import copy
    import dataclasses

    from dmtp_jax.decode.round import merge_models, spec_round

    def entry(states, state, active_b, limits_b, sp, base_key, round_index, knobs, greedy):
        models = merge_models(decoder.setup.graphdefs, states)
        models = dataclasses.replace(models, fusion=_EveryRow(models.fusion))
        return spec_round(decoder.proposer, decoder.verify_mode, models, state, active_b, limits_b, sp,
                          jax.random.fold_in(base_key, round_index), greedy, knobs)

    clone = copy.copy(decoder)
    clone.round = jax.jit(entry, donate_argnames=("state",), static_argnames=("greedy",))
    return clone


# ---- A/B against another commit: the dmtp / dflash mean round time over real generate calls ---------
DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")
FIXTURES = ("demo", "qwen3")


def fixture_decoders(fixture: str):
    """`({method: decoder}, prompts)`: `demo` loads the demo checkpoints (target, `demo/dflash`,
    `demo/dmtp` with the target's MTP head) and tokenizes `demo/prompts.jsonl`; `qwen3` is the tiny
    random Qwen3 fixture (4 layers, a 2-layer DFlash drafter, block 8, float32) with 12 random
    prompts of the demo's lengths. Only APIs older commits share are used (`worker`)."""
    import json

    import numpy as np

    from dmtp_jax.decode import make_decoder
    if fixture == "qwen3":
        _, decoders, _ = build("qwen3", target_configs("small")["qwen3"], "float32", 2, 8, ["dflash", "dmtp"])
        rng = np.random.default_rng(0)
        return decoders, [rng.integers(2, 4096, n).tolist() for n in (64, 33, 37, 34, 109, 34, 56, 66, 105, 68, 20, 40)]
    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
    from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    from dmtp_jax.tokenizer import load_tokenizer
    target_dir = os.path.join(DEMO_DIR, "target")
    target = load_target(target_dir, "float32")
    drafter, fusion = load_dmtp_drafter(os.path.join(DEMO_DIR, "dmtp"), target.cfg, "dmtp", "float32", target.mesh)
    decoders = {"dflash": make_decoder("dflash", target, load_drafter(os.path.join(DEMO_DIR, "dflash"), target.cfg,
                                                                      "float32", target.mesh)),
                "dmtp": make_decoder("dmtp", target, drafter, mtp=load_mtp(target_dir, target.cfg, "float32",
                                                                            target.mesh), fusion=fusion)}
    tok = load_tokenizer(target_dir, plain=True)
    with open(os.path.join(DEMO_DIR, "prompts.jsonl")) as f:
        return decoders, [list(tok(json.loads(line)["prompt"]).input_ids) for line in f if line.strip()]


def worker(tree: str, fixture: str, max_new: int) -> None:
    """A/B worker: imports `dmtp_jax` from `tree`, builds `fixture_decoders`, runs every prompt once
    (compiles), prints the prompt count, then answers each line `I` on stdin with one JSON line: per
    method the decode seconds and rounds of one greedy generate of prompt I (the methods' order
    flipped with I) and its outputs' and acceptance lengths' digest."""
    import hashlib
    import json
    sys.path.insert(0, tree)
    import dmtp_jax
    if not os.path.abspath(dmtp_jax.__file__).startswith(os.path.abspath(tree)):
        raise SystemExit(f"dmtp_jax came from {dmtp_jax.__file__}, not {tree}")
    decoders, prompts = fixture_decoders(fixture)
    for p in prompts:
        for dec in decoders.values():
            dec.generate([p], max_new, stop_ids=[])
    print(len(prompts), flush=True)
    for line in sys.stdin:
        i = int(line)
        out = {}
        for m in (list(decoders) if i % 2 == 0 else list(decoders)[::-1]):
            r = decoders[m].generate([prompts[i]], max_new, stop_ids=[])
            digest = hashlib.sha1(repr((r.output_ids, r.stats["acceptance_lengths"])).encode()).hexdigest()[:12]
            out[m] = (r.stats["decode_s"], r.stats["target_forwards"] - 1, digest)
        print(json.dumps(out), flush=True)


def ab(commit: str, fixtures: list[str], passes: int, max_new: int) -> None:
    """The working tree (`new`) against `commit` (`old`, checked out in a temporary `git worktree`):
    one worker per tree and fixture; a pass runs every prompt in both, old and new alternating
    prompt by prompt (so both see the same machine), and gives each tree's mean round time per
    method (decode seconds over rounds); prints every pass, the medians of the ratios over the passes
    and over the prompts' runs, and whether the outputs and acceptance lengths are identical in both
    trees."""
    import json
    import statistics
    import subprocess
    import tempfile
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="dmtp-ab-")
    old_tree = os.path.join(tmp, "old")
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", old_tree, commit], check=True,
                   capture_output=True)
    try:
        for fixture in fixtures:
            trees = {"old": old_tree, "new": root}
            procs = {k: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", t, "--fixture",
                                          fixture, "--max-new-tokens", str(max_new)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True) for k, t in trees.items()}
            counts = {k: proc.stdout.readline().strip() for k, proc in procs.items()}
            if not all(c.isdigit() for c in counts.values()):
                raise SystemExit(f"a worker failed ({counts})")
            print(f"{fixture}: {commit} (old) against the working tree (new), greedy, {max_new} new tokens, "
                  f"{counts['new']} prompts a pass; mean ms per round")
            print(f"{'pass':<6}{'old dflash':>11}{'old dmtp':>10}{'old ratio':>10}{'new dflash':>11}{'new dmtp':>10}"
                  f"{'new ratio':>10}{'dmtp new/old':>13}{'dflash new/old':>15}")
            rows, digests, pairs = [], {}, []
            for n in range(passes):
                tot = {(k, m): [0.0, 0] for k in procs for m in ("dflash", "dmtp")}
                for i in range(int(counts["new"])):
                    one = {}
                    for k in (("old", "new") if (i + n) % 2 == 0 else ("new", "old")):
                        procs[k].stdin.write(f"{i}\n")
                        procs[k].stdin.flush()
                        for m, (secs, rounds, digest) in json.loads(procs[k].stdout.readline()).items():
                            tot[k, m][0] += secs
                            tot[k, m][1] += rounds
                            one[k, m] = secs / rounds
                            digests.setdefault((k, m), {})[i] = digest
                    pairs.append((one["old", "dmtp"] / one["old", "dflash"], one["new", "dmtp"] / one["new", "dflash"],
                                  one["new", "dmtp"] / one["old", "dmtp"], one["new", "dflash"] / one["old", "dflash"]))
                t = {key: 1e3 * secs / rounds for key, (secs, rounds) in tot.items()}
                row = (t["old", "dmtp"] / t["old", "dflash"], t["new", "dmtp"] / t["new", "dflash"],
                       t["new", "dmtp"] / t["old", "dmtp"], t["new", "dflash"] / t["old", "dflash"])
                rows.append(row)
                print(f"{n:<6}{t['old', 'dflash']:>11.3f}{t['old', 'dmtp']:>10.3f}{row[0]:>10.3f}"
                      f"{t['new', 'dflash']:>11.3f}{t['new', 'dmtp']:>10.3f}{row[1]:>10.3f}{row[2]:>13.3f}"
                      f"{row[3]:>15.3f}", flush=True)
            med = [statistics.median(r[j] for r in rows) for j in range(4)]
            print(f"{'median':<6}{'':>21}{med[0]:>10.3f}{'':>21}{med[1]:>10.3f}{med[2]:>13.3f}{med[3]:>15.3f}")
            med = [statistics.median(r[j] for r in pairs) for j in range(4)]
            print(f"{'prompt':<6}{'':>21}{med[0]:>10.3f}{'':>21}{med[1]:>10.3f}{med[2]:>13.3f}{med[3]:>15.3f}"
                  f"   (median over the {len(pairs)} prompts' runs, each timed back to back in both trees)")
            for m in ("dflash", "dmtp"):
                same = digests["old", m] == digests["new", m]
                print(f"  {m}: outputs and acceptance {'identical' if same else 'DIFFER'} in both trees")
            for proc in procs.values():
                proc.stdin.close()
                proc.wait()
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", old_tree], check=False)
        os.rmdir(tmp)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--targets", default="qwen3,qwen3_5")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ab", metavar="COMMIT", help="A/B of the dmtp / dflash round time against COMMIT")
    p.add_argument("--fixtures", default=",".join(FIXTURES), help="--ab: demo and/or qwen3")
    p.add_argument("--passes", type=int, default=3, help="--ab: timed passes per tree")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--worker", metavar="TREE", help=argparse.SUPPRESS)
    p.add_argument("--fixture", choices=FIXTURES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.fixture, args.max_new_tokens)
    if args.ab:
        return ab(args.ab, args.fixtures.split(","), args.passes, args.max_new_tokens)
    from dmtp_jax.decode.batch import round_up

    max_len = round_up(args.context + 16, 128)
    print(f"device {jax.devices()[0].device_kind}; {args.dtype}, block 8, context {args.context}; median ms per round")
    print(f"{'size':<8}{'target':<9}{'batch':>6}{'mode':>8}{'dflash':>9}{'dmtp':>9}{'ratio':>7}"
          f"{'dmtp, whole-layer advance':>27}{'ratio':>7}")
    for size in args.sizes.split(","):
        configs = target_configs(size)
        for family in args.targets.split(","):
            target, decoders, params = build(family, configs[family], args.dtype, 2, 8, ["dflash", "dmtp"])
            old = whole_layer_advance(decoders["dmtp"])
            for b in (int(x) for x in args.batches.split(",")):
                for greedy in (True, False):
                    t = {name: 1e3 * time_round(dec, b, max_len, args.context, args.iters, greedy)
                         for name, dec in (("dflash", decoders["dflash"]), ("dmtp", decoders["dmtp"]), ("old", old))}
                    print(f"{size:<8}{family:<9}{b:>6}{'greedy' if greedy else 'sampled':>8}{t['dflash']:>9.2f}"
                          f"{t['dmtp']:>9.2f}{t['dmtp'] / t['dflash']:>7.3f}{t['old']:>27.2f}"
                          f"{t['old'] / t['dflash']:>7.3f}", flush=True)
            print(f"{'':<8}({family} {size}: {params / 1e6:.0f} M target parameters)")
            del target, decoders, old


if __name__ == "__main__":
    main()
