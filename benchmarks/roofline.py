"""Roofline of decoding on the running device: random bf16 targets, the AR step at several batch
sizes and the greedy verify round of dflash and dmtp, against the device's peak bandwidth and FLOP rate.

For every (target, method, batch): time per step / round (median of `--iters`, compile excluded),
XLA's bytes accessed and FLOPs of the compiled step (`dmtp_jax.bench.efficiency.round_cost`), the
analytic minimum bytes (weights of every model the method runs + caches read once), and

    achieved bandwidth = minimum bytes / time   (vs the peak: memory-bound steps, small batches)
    achieved FLOP rate = XLA FLOPs / time       (vs the peak: large batches)

Targets (`--size 1b`, the default, for an accelerator): a Qwen3 dense of ~1.1B parameters, a
Qwen3.5 hybrid (Gated DeltaNet + gated attention, ~1B) and a Qwen3.5 MoE (~1B total); the DFlash
drafter and the DMTP fusion / native MTP head are random too (timing does not depend on weights).
`--size small` is a demo-sized model for CPU. Peaks: a table of known accelerators by device kind,
else measured here (a large copy for bandwidth, a large matmul for FLOPs); `--peak-bw` / `--peak-flops`
override.

    python benchmarks/roofline.py                                  # accelerator, ~1B targets
    python benchmarks/roofline.py --size small --batches 1,8 --context 256   # CPU, a minute or two
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# (bytes/s, bf16 dense FLOP/s) by a substring of jax's device_kind
PEAKS = {
    "H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.04e12, 312e12), "L4": (0.3e12, 121e12),
    "TPU v6": (1.64e12, 918e12), "TPU v5p": (2.76e12, 459e12), "TPU v5": (0.82e12, 197e12),
    "TPU v4": (1.2e12, 275e12),
}

SIZES = {   # hidden, layers, intermediate, heads, kv heads, head_dim, vocab
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=6144, num_attention_heads=16,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=4096),
}


def target_configs(size: str) -> dict[str, dict]:
    """HF-style config dicts: qwen3 (dense), qwen3_5 (hybrid dense) and qwen3_5_moe (hybrid MoE)."""
    s = SIZES[size]
    common = dict(s, rms_norm_eps=1e-6, max_position_embeddings=65536, tie_word_embeddings=True,
                  eos_token_id=0)
    layers = s["num_hidden_layers"]
    hybrid = dict(common, layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
                  linear_num_key_heads=s["num_attention_heads"], linear_num_value_heads=2 * s["num_attention_heads"],
                  linear_key_head_dim=s["head_dim"], linear_value_head_dim=s["head_dim"], linear_conv_kernel_dim=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    experts = 64 if size == "1b" else 8
    moe_inter = s["intermediate_size"] // 8
    return {
        "qwen3": dict(common, model_type="qwen3", rope_theta=1e6),
        "qwen3_5": dict(hybrid, model_type="qwen3_5_text"),
        "qwen3_5_moe": dict(hybrid, model_type="qwen3_5_moe_text", num_experts=experts, num_experts_per_tok=8,
                            moe_intermediate_size=moe_inter, shared_expert_intermediate_size=moe_inter),
    }


# ---- peaks -------------------------------------------------------------------------------------
def measured_peaks() -> tuple[float, float, str]:
    """(copy bandwidth B/s, matmul FLOP/s) measured on the default device."""
    x = jnp.ones((64 << 20) // 4, jnp.float32)        # 64 MiB
    copy = jax.jit(lambda a: a + 1.0)
    bw = 2 * x.nbytes / _median_time(lambda: copy(x), 10)
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda p: p @ p)
    flops = 2 * n ** 3 / _median_time(lambda: mm(a), 5)
    return bw, flops, "measured (copy, f32 matmul)"


def device_peaks(args) -> tuple[float, float, str]:
    kind = jax.devices()[0].device_kind
    for name, (bw, fl) in PEAKS.items():
        if name.lower() in kind.lower():
            peaks = (bw, fl, f"{kind} datasheet")
            break
    else:
        peaks = measured_peaks()
    return (args.peak_bw or peaks[0], args.peak_flops or peaks[1],
            peaks[2] + (" (overridden)" if args.peak_bw or args.peak_flops else ""))


def _median_time(fn, iters: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# ---- timing --------------------------------------------------------------------------------------
def time_ar(decoder, batch: int, max_len: int, context: int, iters: int) -> float:
    """Median seconds of one greedy `decode_step` at `[batch, max_len]` with `context` cached tokens."""
    from dmtp_jax.decode.sampling import SamplingParams
    sp, key = SamplingParams.make(), jax.random.key(0)
    holder = {"cache": decoder.caches.new(batch, max_len)}
    tokens = np.ones(batch, np.int32)

    def step():
        nxt, holder["cache"] = decoder.decode_step(decoder.target.state, tokens, np.full(batch, context, np.int32),
                                                   holder["cache"], sp, key, greedy=True)
        return nxt
    return _median_time(step, iters)


def time_round(decoder, batch: int, max_len: int, context: int, iters: int, greedy: bool = True) -> float:
    """Median seconds of one verify round (greedy, or sampled at temperature 1) with `context`
    committed tokens per row (the committed length is reset every round, so every round sees the
    same context)."""
    from dmtp_jax.decode.sampling import SamplingParams
    sp = SamplingParams.make() if greedy else SamplingParams.make(temperature=1.0)
    key = jax.random.key(0)
    lengths = np.full(batch, context, np.int32)
    holder = {"state": dataclasses.replace(decoder.new_state(batch, max_len), lengths_b=lengths)}
    states, active, limits = decoder.model_states(), np.ones(batch, bool), np.full(batch, max_len, np.int32)
    knobs = decoder.knobs()

    def step():
        st, tokens, acc, _ = decoder.round(states, holder["state"], active, limits, sp, key, np.int32(1), knobs,
                                           greedy=greedy)
        holder["state"] = dataclasses.replace(st, lengths_b=lengths)
        return acc
    return _median_time(step, iters)


def build(family: str, cfg_dict: dict, dtype: str, draft_layers: int, block: int, methods: list[str]):
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter
    from dmtp_jax.checkpoint.dmtp_ckpt import init_fusion
    from dmtp_jax.checkpoint.hf import init_target
    from dmtp_jax.checkpoint.mtp_ckpt import init_mtp
    from dmtp_jax.config import TargetConfig
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.models.drafter_shape import default_drafter_config

    target = init_target(TargetConfig.from_hf_dict(cfg_dict), dtype)
    decoders = {}
    drafter = init_drafter(default_drafter_config(target.cfg, draft_layers, block), dtype) if \
        {"dflash", "dmtp"} & set(methods) else None
    for m in methods:
        if m == "ar":
            decoders[m] = make_decoder("ar", target)
        elif m == "dflash":
            decoders[m] = make_decoder("dflash", target, drafter)
        elif m == "dmtp":
            mtp = init_mtp(target.cfg, dtype)
            fusion = init_fusion("dmtp", target.cfg.hidden_size, target.cfg.rms_norm_eps, dtype)
            decoders[m] = make_decoder("dmtp", target, drafter, mtp=mtp, fusion=fusion)
        else:
            raise SystemExit(f"unknown method {m}")
    params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(target.state))
    return target, decoders, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1b", choices=sorted(SIZES), help="1b (accelerator) or small (CPU)")
    p.add_argument("--targets", default="qwen3,qwen3_5,qwen3_5_moe")
    p.add_argument("--methods", default="ar,dflash,dmtp")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=1024, help="cached tokens per row")
    p.add_argument("--block-size", type=int, default=16, help="verify slots of dflash / dmtp")
    p.add_argument("--draft-layers", type=int, default=None, help="default 5 (1b), 2 (small)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-bw", type=float, default=None, help="bytes/s (default: datasheet or measured)")
    p.add_argument("--peak-flops", type=float, default=None, help="FLOP/s (default: datasheet or measured)")
    args = p.parse_args()

    from dmtp_jax.bench.efficiency import round_cost
    from dmtp_jax.decode.batch import round_up

    peak_bw, peak_fl, source = device_peaks(args)
    dev = jax.devices()[0]
    print(f"device {dev.platform} {dev.device_kind}; peak {peak_bw / 1e9:.0f} GB/s, {peak_fl / 1e12:.1f} TFLOP/s "
          f"({source}); {args.dtype}, context {args.context}, block {args.block_size}")
    batches = [int(b) for b in args.batches.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    draft_layers = args.draft_layers or (5 if args.size == "1b" else 2)
    max_len = round_up(args.context + args.block_size + 8, 128)
    configs = target_configs(args.size)
    head = (f"{'target':<12}{'method':<8}{'batch':>6}{'ms':>9}{'min MB':>9}{'XLA MB':>9}{'XLA/min':>8}"
            f"{'GB/s':>8}{'%bw':>6}{'TFLOP/s':>9}{'%flop':>7}")
    for family in [t.strip() for t in args.targets.split(",")]:
        try:
            target, decoders, params = build(family, configs[family], args.dtype, draft_layers, args.block_size,
                                             methods)
        except Exception as e:              # a family this build does not have yet
            print(f"{family}: skipped ({type(e).__name__}: {e})")
            continue
        print(f"\n{family}: {params / 1e9:.2f}B target parameters")
        print(head)
        for m, dec in decoders.items():
            for b in batches:
                try:
                    cost = round_cost(dec, b, max_len)
                    t = (time_ar if m == "ar" else time_round)(dec, b, max_len, args.context, args.iters)
                except Exception as e:
                    print(f"{family:<12}{m:<8}{b:>6}  failed: {type(e).__name__}: {str(e)[:100]}")
                    continue
                bw = cost["min_bytes_per_round"] / t
                fl = cost["flops_per_round"] / t
                print(f"{family:<12}{m:<8}{b:>6}{t * 1e3:>9.2f}{cost['min_bytes_per_round'] / 1e6:>9.1f}"
                      f"{cost['bytes_per_round'] / 1e6:>9.1f}{cost['bytes_ratio']:>8.2f}{bw / 1e9:>8.1f}"
                      f"{100 * bw / peak_bw:>6.1f}{fl / 1e12:>9.3f}{100 * fl / peak_fl:>7.1f}", flush=True)
        del target, decoders


if __name__ == "__main__":
    main()
