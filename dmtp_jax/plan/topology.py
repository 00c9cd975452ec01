"""The machine a plan compiles for, without the machine (`--topology`):

- TPU slices as libtpu spells them (`v5p:2x2x1`, `v5e:4x4`, `v6e:2x4`, ...): the `plan-tpu` extra.
- GPU hosts `h100x8`, `h200x8`, `b200x8` (or x1, x2, x4): the `plan-gpu` extra (CUDA plugin),
  with XLA's GPU target config filled from each part's datasheet.
- `cpu:N`: N host CPU devices (set before JAX starts its CPU backend; CPU computes bf16 in fp32,
  so its memory and bytes are no evidence for an accelerator).

Example:
    >>> topo = open_topology("cpu:1")
    >>> topo.platform, len(topo.devices)
    ('cpu', 1)
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
from jax.experimental import topologies

from dmtp_jax.errors import UserError

GB = 1e9


class TopologyError(UserError, ValueError):
    """A topology name that cannot be compiled for here (unknown, or its compiler is missing)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    platform: str                 # "tpu" | "gpu" | "cpu"
    devices: tuple                # compile-only (TPU / GPU) or real (CPU) jax devices
    device_kind: str
    hbm_bytes: int                # memory per device
    peak_bytes_per_s: float | None    # HBM bandwidth per device (datasheet)
    peak_flops: float | None          # dense bf16 FLOP/s per device (datasheet)


# per chip: (HBM bytes, HBM bytes/s, bf16 FLOP/s), datasheet values
TPU_CHIPS = {
    "v4": (32 * 2**30, 1.2e12, 275e12),
    "v5e": (16 * 2**30, 0.82e12, 197e12),
    "v5p": (95 * 2**30, 2.76e12, 459e12),
    "v6e": (32 * 2**30, 1.64e12, 918e12),
}


@dataclasses.dataclass(frozen=True)
class GpuPart:
    description: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    bandwidth: float              # bytes/s
    clock_ghz: float
    l2_bytes: int
    bf16_flops: float


GPU_PARTS = {
    "h100": GpuPart("NVIDIA H100 80GB HBM3", (9, 0), 132, 84978434048, 3.35232e12, 1.755, 52428800, 989e12),
    "h200": GpuPart("NVIDIA H200", (9, 0), 132, 150754820096, 4.8e12, 1.755, 52428800, 989e12),
    "b200": GpuPart("NVIDIA B200", (10, 0), 148, 192265846784, 8.0e12, 1.965, 132644864, 2250e12),
}


def gpu_target_config(part: GpuPart) -> str:
    """XLA's GPU target-config text proto for `part` (what the compiler needs to know of the GPU)."""
    major, minor = part.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {part.sm_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(part.bandwidth)}
  l2_cache_size: {part.l2_bytes}
  clock_rate_ghz: {part.clock_ghz}
  device_memory_size: {part.memory_bytes}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 1
}}
device_description_str: "{part.description}"
"""


def _tpu(name: str) -> Topology:
    chip = name.split(":", 1)[0]
    try:
        import libtpu  # noqa: F401     optional: the `plan-tpu` extra
    except ImportError:
        raise TopologyError(f"compiling for '{name}' needs libtpu: pip install -e \".[plan-tpu]\"") from None
    # compile-only: no chip is opened, so several planners (or a planner beside a TPU job) may share libtpu
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:      # libtpu's own message names what is wrong with the shape
        raise TopologyError(f"libtpu cannot describe topology '{name}': {str(e).splitlines()[0]}") from None
    hbm, bw, flops = TPU_CHIPS[chip]
    return Topology(name, "tpu", tuple(desc.devices), desc.devices[0].device_kind, hbm, bw, flops)


def _gpu(name: str, part_name: str, count: int) -> Topology:
    part = GPU_PARTS[part_name]
    try:
        import jax_cuda12_plugin  # noqa: F401     optional: the `plan-gpu` extra
    except ImportError:
        raise TopologyError(f"compiling for '{name}' needs the CUDA plugin: pip install -e \".[plan-gpu]\"") from None
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    desc = topologies.get_topology_desc(part_name, "cuda", target_config=gpu_target_config(part),
                                        topology=f"1x1x{count}")
    return Topology(name, "gpu", tuple(desc.devices), part.description, part.memory_bytes, part.bandwidth,
                    part.bf16_flops)


def _cpu(name: str, count: int) -> Topology:
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except Exception:           # the CPU backend already started: use what it has
        pass
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise TopologyError(f"'{name}' needs {count} CPU devices but JAX started with {len(devices)}; run plan "
                            f"in a fresh process (or set XLA_FLAGS=--xla_force_host_platform_device_count={count})")
    mem = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return Topology(name, "cpu", tuple(devices[:count]), devices[0].device_kind, mem, None, None)


def parse_topology(name: str) -> tuple[str, str, int]:
    """`(kind, part, count)` of a topology name, checked without loading a compiler: kind "cpu", "gpu"
    or "tpu" (for TPU, part is the whole name).

    Example:
        >>> parse_topology("h100x8"), parse_topology("v5p:2x2x2"), parse_topology("cpu:4")
        (('gpu', 'h100', 8), ('tpu', 'v5p:2x2x2', 0), ('cpu', 'cpu', 4))
    """
    name = name.strip().lower()
    if m := re.fullmatch(r"cpu(?::(\d+))?", name):
        return "cpu", "cpu", int(m.group(1) or 1)
    if m := re.fullmatch(r"([a-z]\d+)x(\d+)", name):
        if m.group(1) not in GPU_PARTS:
            raise TopologyError(f"unknown GPU '{m.group(1)}' in '{name}'; known: "
                                f"{', '.join(p + 'x8' for p in GPU_PARTS)}")
        return "gpu", m.group(1), int(m.group(2))
    if re.fullmatch(r"v\d+[a-z]?:\d+(x\d+)+", name):
        chip = name.split(":", 1)[0]
        if chip not in TPU_CHIPS:
            raise TopologyError(f"unknown TPU '{chip}' in '{name}'; known: {', '.join(TPU_CHIPS)} "
                                "(e.g. v5p:2x2x2, v5e:4x4, v6e:2x4)")
        return "tpu", name, 0
    raise TopologyError(f"unknown topology '{name}'; use a TPU slice (v5p:2x2x2, v5e:4x4, v6e:2x4), "
                        f"a GPU host ({', '.join(p + 'x8' for p in GPU_PARTS)}) or cpu:N")


def open_topology(name: str) -> Topology:
    """The compile-only devices of `name`; one-line `TopologyError`s for unknown names and missing
    compiler packages."""
    kind, part, count = parse_topology(name)
    name = name.strip().lower()
    if kind == "cpu":
        return _cpu(name, count)
    if kind == "gpu":
        return _gpu(name, part, count)
    return _tpu(name)
