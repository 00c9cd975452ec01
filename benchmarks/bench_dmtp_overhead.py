"""DMTP's extra cost per round over DFlash: the fused round of `dmtp` / `dflash` on the same target,
drafter and state, greedy and sampled, with the MTP advance as the round runs it (keys and values of
every verified row, the whole MTP layer for the last accepted row only: `MtpHead.advance`) and, for
comparison, the whole layer over every row (what the round did before, and still does for the
context-fusion variants, which feed every row's MTP output to the drafter).

    python benchmarks/bench_dmtp_overhead.py                      # demo-sized and 0.2B random targets, CPU
    python benchmarks/bench_dmtp_overhead.py --sizes small --batches 1

Random weights (timing does not depend on them), block 8, a context of `--context` committed tokens
per row (reset every round, so every round sees the same context). Median of `--iters` rounds after
a warm-up; ratios are within one run.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--targets", default="qwen3,qwen3_5")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
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
