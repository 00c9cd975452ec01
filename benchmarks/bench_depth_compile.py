"""Compile time against depth: a decode step and a prefill of a small-width target at 4, 16 and 64
layers (hidden 128), on whatever backend JAX picks (CPU here). With the layers scanned
(`models/layer_stack.py`) the program holds one group's layers whatever the depth, so these times
should stay flat; the unrolled loop grew with depth.

Prints, per family and depth: `build_s` (random params at their sharding, `init_target`),
`trace_s` (tracing + lowering) and `compile_s` (XLA) of `decode` (one token per row over a cache)
and `prefill` (a 128-token prompt into the cache), both with the cache donated as the decoders do.
No timing is asserted. Run: `python benchmarks/bench_depth_compile.py [--layers 4 16 64]
[--families qwen3 qwen3_5]`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.checkpoint.hf import abstract_target, init_target
from dmtp_jax.config import TargetConfig
from dmtp_jax.decode.caches import target_cache_spec


def config(family: str, layers: int) -> TargetConfig:
    """A hidden-128 target of `family` ("qwen3" or the hybrid "qwen3_5") with `layers` layers."""
    d = {"model_type": family, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 4096, "tie_word_embeddings": False}
    if family == "qwen3_5":
        d.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4, full_attention_interval=4)
    return TargetConfig.from_hf_dict(d)


def compile_times(cfg, tokens: int, batch: int = 1, max_len: int = 256) -> tuple[float, float]:
    """`(trace + lower seconds, compile seconds)` of one cached forward of `tokens` tokens per row."""
    graphdef, state = abstract_target(cfg, "float32")

    def step(state, tokens_bt, positions_bt, cache):
        model = nnx.merge(graphdef, state)
        out = model(tokens_bt, positions_bt, cache)
        return model.logits(out.hidden_bth[:, -1]), out.cache

    ints = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    t0 = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(3,)).lower(state, ints, ints, target_cache_spec(cfg, batch, max_len, "float32"))
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--families", nargs="+", default=["qwen3", "qwen3_5"])
    p.add_argument("--prefill-tokens", type=int, default=128)
    args = p.parse_args()
    print(f"backend {jax.default_backend()}, hidden 128")
    print(f"{'family':8} {'layers':>6} {'build_s':>8} {'decode trace_s':>15} {'compile_s':>10} "
          f"{'prefill trace_s':>16} {'compile_s':>10}")
    for family in args.families:
        for n in args.layers:
            cfg = config(family, n)
            t0 = time.perf_counter()
            jax.block_until_ready(init_target(cfg, "float32").state)
            build = time.perf_counter() - t0
            decode = compile_times(cfg, 1)
            prefill = compile_times(cfg, args.prefill_tokens)
            print(f"{family:8} {n:6d} {build:8.2f} {decode[0]:15.2f} {decode[1]:10.2f} "
                  f"{prefill[0]:16.2f} {prefill[1]:10.2f}", flush=True)


if __name__ == "__main__":
    main()
