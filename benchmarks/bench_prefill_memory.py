"""Compiled prefill temporaries against prompt length: does prefill memory grow linearly?

Compiles (never runs) the prefill of a tiny hybrid Qwen3.5 target (3 Gated DeltaNet layers + 1
gated attention layer, 4 heads of 16, fp32) at several prompt lengths and prints XLA's
`memory_analysis().temp_size_in_bytes`:

* `one-call`: the whole padded prompt in one forward over the cache (the prefill before chunking;
  with blockwise attention its temporaries grow linearly, with dense attention quadratically);
* `chunk`:    one `decode/prefill.py:target_chunk` call of `--chunk` tokens over the same cache (what
  `ARDecoder` / `SpecDecoder` run per chunk; temporaries nearly flat in the prompt length).

`--config paper4` takes Qwen3.6-27B's widths (hidden 5120, 24 heads and 4 K/V heads of 256, DeltaNet
16 / 48 heads of 128, MLP 17408) with its first 4 layers (3 DeltaNet + 1 attention): per-layer
temporaries at the paper's shapes (params are abstract, nothing is allocated).

The cache has `round_up(P + 72, 128)` slots, as `pad_prompts` makes for 64 new tokens. With
`--platform gpu|tpu` it compiles for an H100 / a TPU v5p chip without one (run it with a JAX that
has the CUDA plugin / libtpu, e.g. the planning venv; JAX_PLATFORMS=cpu), the attention kernel
choice following `compiling_for`. No timing.

    PYTHONPATH=. python benchmarks/bench_prefill_memory.py [--lengths 1024,4096,8192] [--batch 1]
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. /work/venv_plan/bin/python \\
        benchmarks/bench_prefill_memory.py --platform gpu --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.config import TargetConfig
from dmtp_jax.layers.kv_cache import KVCache, TargetCache

TINY_HYBRID = dict(model_type="qwen3_5_text", vocab_size=128, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=1 << 20,
                   rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
PAPER4 = dict(TINY_HYBRID, vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
              num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
              linear_key_head_dim=128, linear_value_head_dim=128,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
CONFIGS = {"tiny": TINY_HYBRID, "paper4": PAPER4}
GPU_SPEC = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.755
  device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 1 } device_description_str: "NVIDIA H100 80GB HBM3"
"""


def target_device(platform: str):
    """A device to compile for: the local CPU, or one chip of a compile-only GPU / TPU topology."""
    if platform == "cpu":
        return jax.devices("cpu")[0]
    from jax.experimental import topologies
    if platform == "gpu":
        return topologies.get_topology_desc("h100", "cuda", target_config=GPU_SPEC, topology="1x1x1").devices[0]
    return topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices[0]


def build(config: str, dtype):
    """`(cfg, graphdef, abstract state)`: nothing is allocated."""
    from dmtp_jax.models.qwen3 import QwenTarget
    cfg = TargetConfig.from_hf_dict(CONFIGS[config])
    graphdef, state = nnx.split(nnx.eval_shape(lambda: QwenTarget(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    return cfg, graphdef, state


def abstract(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def cache_spec(cfg, batch, max_len, dtype, sharding):
    kv = (len(cfg.attention_layers), batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    conv = (len(cfg.linear_layers), batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim)
    ssm = (len(cfg.linear_layers), batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
           cfg.linear_value_head_dim)
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    return TargetCache(KVCache(sds(kv, dtype), sds(kv, dtype)), sds(conv, dtype), sds(ssm, jnp.float32))


def one_call(graphdef, state, tokens_bt, lengths_b, cache):
    """The whole prompt in one forward (the prefill before chunking), and the last row's logits."""
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    out = model(tokens_bt, positions, cache, kv_valid_bt=positions < lengths_b[:, None])
    last = jnp.take_along_axis(out.hidden_bth, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    return jnp.argmax(model.logits(last), axis=-1), out.cache


def one_chunk(graphdef, state, tokens_bt, start, lengths_b, cache, first_b):
    from dmtp_jax.decode.prefill import target_chunk
    from dmtp_jax.decode.sampling import SamplingParams
    res = target_chunk(nnx.merge(graphdef, state), tokens_bt, start, lengths_b, cache, first_b,
                       SamplingParams.make(), jax.random.key(0), True)
    return res.first_b, res.out.cache


def temp_bytes(fn, *args) -> int:
    return jax.jit(fn, static_argnums=0, donate_argnames=("cache",)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths (comma-separated)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (the `chunk` column)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--platform", default="cpu", choices=("cpu", "gpu", "tpu"))
    ap.add_argument("--skip-one-call", action="store_true", help="only the chunk column")
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS),
                    help="tiny: the tiny hybrid; paper4: Qwen3.6-27B's widths, 4 layers (3 DeltaNet + 1 attention)")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    cfg, graphdef, state = build(args.config, dtype)
    device = target_device(args.platform)
    rep = jax.sharding.SingleDeviceSharding(device)
    state_spec = abstract(state, rep)
    try:
        from dmtp_jax.platform import compiling_for
        target_platform = compiling_for(args.platform)
    except ImportError:                 # an older checkout
        target_platform = contextlib.nullcontext()
    try:
        import dmtp_jax.decode.prefill  # noqa: F401
        has_chunks = True
    except ImportError:
        has_chunks = False
    mib = 1 << 20
    print(f"{args.config} hybrid ({len(cfg.linear_layers)} DeltaNet + {len(cfg.attention_layers)} attention layers, "
          f"hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads of {cfg.head_dim}), batch {args.batch}, {args.dtype}, "
          f"compiled for {device.platform} ({device.device_kind})")
    print(f"{'prompt':>7} {'cache':>7} {'one-call MiB':>13} {'chunk ' + str(args.chunk) + ' MiB':>15}")
    with target_platform:
        for p in (int(x) for x in args.lengths.split(",")):
            max_len = -(-(p + 72) // 128) * 128
            i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)  # noqa: E731
            cache = cache_spec(cfg, args.batch, max_len, dtype, rep)
            one = None if args.skip_one_call else temp_bytes(
                one_call, graphdef, state_spec, i32((args.batch, p)), i32((args.batch,)), cache)
            chunk = temp_bytes(one_chunk, graphdef, state_spec, i32((args.batch, args.chunk)), i32(()),
                               i32((args.batch,)), cache, i32((args.batch,))) if has_chunks else None
            fmt = lambda b: "-" if b is None else f"{b / mib:.1f}"  # noqa: E731
            print(f"{p:>7} {max_len:>7} {fmt(one):>13} {fmt(chunk):>15}", flush=True)


if __name__ == "__main__":
    main()
