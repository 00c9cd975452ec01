"""Speculative decoding on CPU, JAX vs PyTorch, on the same tiny weights and prompts, in one run.

    PYTHONPATH=. python benchmarks/bench_spec_cpu.py [--new-tokens 64] [--num-prompts 4] [--repeats 3]

Builds on the fly a tiny random Qwen3 target (`tests/conftest.build_tiny_checkpoint`, with a few
LM-head rows scaled up so the drafter is sometimes right: acceptance is partial, as in the engine
tests; `--no-peak` keeps it fully random) and a tiny `dflash` reference drafter
(`tests/dflash_fixtures.build_reference_drafter`), then measures at batch 1, greedy, no stop token:

* `jax ar`           -- our plain decoding (`make_decoder("ar")`),
* `jax dflash`       -- our speculative engine (`make_decoder("dflash")`),
* `torch generate`   -- the transformers target's greedy `generate` (the PyTorch AR baseline),
* `torch dflash`     -- `dflash.model.dflash_generate` (the reference implementation).

Every implementation first runs every prompt once untimed (warm-up: jit compiles, torch lazy
init), then `--repeats` timed passes; the best pass counts. tokens/s = new tokens / wall time of the
generate calls (prefill included). It checks that the four greedy outputs agree token for token and
that both speculative implementations report the same acceptance lengths. Numbers compare
implementations within one run on one machine only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

BOOSTED_ROWS = (10, 11, 12, 13, 14, 15)


def build_models(out_dir: str, peak: bool, seed: int):
    """(target dir, drafter dir, torch drafter): tiny target (+ scaled LM-head rows) and drafter."""
    from conftest import build_tiny_checkpoint
    from dflash_fixtures import build_reference_drafter
    from dmtp_jax.checkpoint.safetensors_io import CheckpointReader, write_safetensors

    target_dir = build_tiny_checkpoint(os.path.join(out_dir, "target"), "qwen3", seed=seed)
    if peak:
        reader = CheckpointReader(target_dir)
        tensors = {k: np.array(reader.array(k)) for k in reader.keys()}
        del reader
        tensors["lm_head.weight"][list(BOOSTED_ROWS)] *= 6.0
        write_safetensors(os.path.join(target_dir, "model.safetensors"), tensors)
    draft_dir = os.path.join(out_dir, "draft")
    ref = build_reference_drafter(draft_dir, seed=seed + 3)
    return target_dir, draft_dir, ref


def time_impl(fn, prompts, repeats: int):
    """Warm-up pass, then `repeats` timed passes; returns (outputs of the last pass, best wall, walls)."""
    for p in prompts:
        fn(p)
    walls, outs = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = [fn(p) for p in prompts]
        walls.append(time.perf_counter() - t0)
    return outs, min(walls), walls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peak", action="store_true", help="keep the LM head fully random")
    args = ap.parse_args(argv)

    import torch
    import dflash.model
    from dflash.model import dflash_generate
    from transformers import AutoModelForCausalLM

    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.decode.stats import acceptance_stats

    dflash.model._cuda_time = time.perf_counter          # its stats timer syncs CUDA
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, 120, size=int(n)).tolist()
               for n in rng.integers(17, 32, size=args.num_prompts)]   # one prompt bucket (32)
    n_new = args.new_tokens

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir, ref = build_models(tmp, not args.no_peak, args.seed)
        target = load_target(target_dir)
        drafter = load_drafter(draft_dir, target.cfg)
        hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    jax_ar, jax_spec = make_decoder("ar", target), make_decoder("dflash", target, drafter)
    block = jax_spec.generate([prompts[0]], 2, stop_ids=[]).stats["block_size"]

    def run_jax(dec):
        def fn(p):
            r = dec.generate([p], n_new, stop_ids=[])
            return r.output_ids[0], r.stats.get("acceptance_lengths", [None])[0]
        return fn

    def run_torch_ar(p):
        with torch.inference_mode():
            ids = torch.tensor([p])     # explicit mask: a prompt token equal to pad_token_id stays visible
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False)
        return out[0, len(p):].tolist(), None

    def run_torch_dflash(p):
        r = dflash_generate(ref, hf, torch.tensor([p]), n_new, None, return_stats=True)
        return r.output_ids[0, r.num_input_tokens:].tolist(), list(r.acceptance_lengths)

    impls = {"jax ar": run_jax(jax_ar), "jax dflash": run_jax(jax_spec),
             "torch generate": run_torch_ar, "torch dflash": run_torch_dflash}
    results = {}
    for name, fn in impls.items():
        outs, best, walls = time_impl(fn, prompts, args.repeats)
        tokens = sum(len(o) for o, _ in outs)
        results[name] = dict(outputs=[o for o, _ in outs], acceptance=[a for _, a in outs],
                             tok_s=tokens / best, walls=walls, tokens=tokens)

    ref_out = results["jax ar"]["outputs"]
    print(f"tiny Qwen3 target (hidden {target.cfg.hidden_size}, {target.cfg.num_hidden_layers} layers, vocab "
          f"{target.cfg.vocab_size}) + DFlash drafter (block {block}); {len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {n_new} new tokens each, batch 1, greedy, "
          f"CPU ({os.cpu_count()} cores), best of {args.repeats} after a warm-up pass")
    print(f"{'implementation':<16} {'tok/s':>8} {'ms/tok':>7} {'tau/verify':>10}  output == jax ar")
    for name, r in results.items():
        acc = [a for a in r["acceptance"] if a is not None]
        tau = acceptance_stats(acc, block)["per_verify_acceptance_length"] if acc else 1.0
        same = r["outputs"] == ref_out
        print(f"{name:<16} {r['tok_s']:>8.1f} {1e3 / r['tok_s']:>7.2f} {tau:>10.3f}  {same}")
    # dflash_generate cuts its last round's length at the budget; ours counts the whole round
    same_acc = all(a[:-1] == b[:-1] and a[-1] >= b[-1] for a, b in
                   zip(results["jax dflash"]["acceptance"], results["torch dflash"]["acceptance"]))
    print(f"acceptance lengths identical (jax dflash vs dflash_generate, last round cut at the budget "
          f"in the reference): {same_acc}")
    t = {k: v["tok_s"] for k, v in results.items()}
    print("ratios:")
    print(f"  jax dflash / jax ar            {t['jax dflash'] / t['jax ar']:.2f}x")
    print(f"  torch dflash / torch generate  {t['torch dflash'] / t['torch generate']:.2f}x")
    print(f"  jax ar / torch generate        {t['jax ar'] / t['torch generate']:.2f}x")
    print(f"  jax dflash / torch dflash      {t['jax dflash'] / t['torch dflash']:.2f}x")
    ok = all(r["outputs"] == ref_out for r in results.values()) and same_acc
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
