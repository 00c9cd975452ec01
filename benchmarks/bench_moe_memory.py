"""Compile-only memory and cost of one MoE layer (`moe_mlp`) at Qwen3.6-35B-A3B sizes, for TPU v5p and
8xH100 targets, on any machine (no chips: the real compilers via `jax.experimental.topologies`).

    JAX_PLATFORMS=cpu python benchmarks/bench_moe_memory.py [--tokens 1,32,256,4096,16384]
        [--impls auto] [--targets tpu,gpu] [--tpu-meshes expert=4] [--gpu-meshes "expert=8;expert=4,tensor=2"]

Needs a jax with libtpu (TPU) and/or the CUDA plugin (GPU) installed; a target whose compiler package
is missing (or, for libtpu, held by another process: `ALLOW_MULTIPLE_LIBTPU_LOAD=1` lets compile-only
runs share it) is skipped with a one-line note. Layer: hidden 2048, 256 experts, top-8, expert
intermediate 512, bf16 (the shared expert is a plain dense MLP outside `moe_mlp`). Tokens are `[N, H]`
(decode: batch 1..32 x 1..8 tokens; prefill: 4K-token chunks, 32 x 512 = 16K tokens), replicated over
the expert / tensor axes, weights placed like the model places them (`dmtp_jax.sharding`).

Per (target, mesh, tokens, kernel) it prints, per device:
- `temp`: XLA's temporary buffers (`memory_analysis().temp_size_in_bytes`); `rows*(H+I)`: the
  routed rows' `N*k*(H + I_local)` bf16 bytes, the scale temporaries should stay near (they cannot
  go below the `[N, H]` fp32 partial sum the shards all-reduce), and `E_loc*H*I`: one local weight
  matrix, what an unbounded kernel's temporaries grow with.
- `args`: argument bytes (local weights + tokens).
- TPU only (the GPU compiler leaves `cost_analysis` empty): `flops` and `bytes` accessed against the
  routed minimum per device, `N*k*3*H*I*2 / devices` flops and the touched experts' weights
  (`E*(1-(1-k/E)^N)` experts expected under uniform routing) `/ devices` bytes. XLA's cost analysis
  counts a loop body once: for the token-chunked kernels the per-chunk figures are multiplied by the
  number of chunks (`~`); the scan kernel's per-block loop is shown as `loop`.
Under expert parallelism each shard is sized (and, for ragged on TPU, costed) for the worst case
where all N*k rows are routed to its experts, so static flops are `devices` times the routed share.

Compile times on a busy 2-core machine: 2-3 minutes for the defaults.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from dmtp_jax.layers import moe  # noqa: E402
from dmtp_jax.platform import compiling_for  # noqa: E402
from dmtp_jax.sharding import DEFAULT_RULES, make_mesh, parse_mesh_spec, spec_for  # noqa: E402

H, E, K, I = 2048, 256, 8, 512                     # Qwen3.6-35B-A3B MoE layer
MIB = 2 ** 20

H100_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.755
  device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 1 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def topology_devices(target: str):
    """The compile-only devices of a v5p 2x2x1 slice or an 8xH100 host; raises if the compiler is missing."""
    from jax.experimental import topologies
    if target == "tpu":
        return topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    return topologies.get_topology_desc("h100", "cuda", target_config=H100_CONFIG, topology="1x1x8").devices


def layer_args(mesh, tokens: int):
    shapes = [((tokens, H), ("batch", None)), ((H, E), ("embed", None)),
              ((E, H, I), ("experts", "embed", "mlp")), ((E, H, I), ("experts", "embed", "mlp")),
              ((E, I, H), ("experts", "mlp", "embed"))]
    return [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec_for(ax, s, mesh, DEFAULT_RULES)))
            for s, ax in shapes]


def measure(target: str, mesh, tokens: int, impl: str) -> dict:
    local_tokens = tokens // (mesh.shape["data"] * mesh.shape["fsdp"])
    with compiling_for(target):
        kernel = moe.resolve_impl(impl, local_tokens)        # what moe_mlp picks in each shard
        fn = jax.jit(lambda *a: moe.moe_mlp(*a, K, True, impl=impl, rules=DEFAULT_RULES))
        t0 = time.perf_counter()
        compiled = fn.lower(*layer_args(mesh, tokens)).compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return {"kernel": kernel, "temp": mem.temp_size_in_bytes, "args": mem.argument_size_in_bytes,
            "flops": cost.get("flops"), "bytes": cost.get("bytes accessed"),
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,32,256,4096,16384")
    ap.add_argument("--impls", default="auto", help="of auto, ragged, blocked, scan, dense")
    ap.add_argument("--targets", default="tpu,gpu")
    ap.add_argument("--tpu-meshes", default="expert=4", help="';'-separated mesh specs")
    ap.add_argument("--gpu-meshes", default="expert=8;expert=4,tensor=2", help="';'-separated mesh specs")
    args = ap.parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",")]
    impls = args.impls.split(",")
    print(f"MoE layer H={H} E={E} top-{K} I={I} bf16, compile-only; per device; "
          f"ragged/blocked token chunk {moe.MAX_ROUTED_ROWS // K} tokens; AUTO_IMPL {moe.AUTO_IMPL}, "
          f"dense up to {moe.AUTO_DENSE_MAX_TOKENS} tokens")
    header = (f"{'target':6} {'mesh':16} {'tokens':>6} {'kernel':8} {'temp MiB':>9} {'rows*(H+I)':>10} "
              f"{'E_loc*H*I':>9} {'args MiB':>8} {'GFLOP':>9} {'/routed':>7} {'GB read':>8} {'/routed':>7} "
              f"{'compile s':>9}")
    for target in args.targets.split(","):
        try:
            devices = topology_devices(target)
        except Exception as e:   # noqa: BLE001 - any missing plugin / libtpu
            print(f"{target}: skipped, no compiler for it here ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        meshes = getattr(args, f"{target}_meshes").split(";")
        print(header)
        for spec in meshes:
            sizes = parse_mesh_spec(spec)
            mesh = make_mesh(spec, devices=devices)
            ndev, ep, tp = mesh.size, sizes["expert"], sizes["tensor"]
            local_weight = (E // ep) * H * (I // tp) * 2
            for tokens in tokens_list:
                rows_bytes = tokens * K * (H + I // tp) * 2
                routed_flops = tokens * K * 3 * H * I * 2 / ndev
                touched = E * (1 - (1 - K / E) ** tokens)
                routed_bytes = touched * 3 * H * I * 2 / ndev
                for impl in impls:
                    r = measure(target, mesh, tokens, impl)
                    rows_per_token = E // ep if r["kernel"] == "dense" else K
                    chunks = math.ceil(tokens / max(1, moe.MAX_ROUTED_ROWS // rows_per_token))
                    if r["flops"] is None:
                        flops = nbytes = "-"
                        f_ratio = b_ratio = ""
                    elif r["kernel"] == "scan":
                        flops, nbytes, f_ratio, b_ratio = "loop", "loop", "", ""
                    else:
                        scale = chunks if r["kernel"] in moe.CHUNKED_IMPLS else 1
                        mark = "~" if scale > 1 else ""
                        flops = f"{mark}{r['flops'] * scale / 1e9:.1f}"
                        nbytes = f"{mark}{r['bytes'] * scale / 1e9:.2f}"
                        f_ratio = f"{r['flops'] * scale / routed_flops:.1f}x"
                        b_ratio = f"{r['bytes'] * scale / routed_bytes:.1f}x"
                    print(f"{target:6} {spec:16} {tokens:>6} {r['kernel']:8} {r['temp'] / MIB:>9.1f} "
                          f"{rows_bytes / MIB:>10.1f} {local_weight / MIB:>9.1f} {r['args'] / MIB:>8.1f} "
                          f"{flops:>9} {f_ratio:>7} {nbytes:>8} {b_ratio:>7} {r['seconds']:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
