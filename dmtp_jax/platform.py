"""The platform jitted programs are compiled for: the running backend, or the one `plan` compiles for.
Hardware-dependent kernel choices ask `compile_platform()`, so a CPU dry run picks the kernels of
the planned machine; `compiling_for(...)` sets it for a block (this thread only).

Example:
    >>> with compiling_for("tpu"):
    ...     compile_platform()
    'tpu'
"""

from __future__ import annotations

import contextlib
import threading

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_local = threading.local()


def compile_platform() -> str:
    """`"cpu"`, `"gpu"` or `"tpu"`: the `compiling_for` platform if one is set, else the backend's."""
    forced = getattr(_local, "platform", None)
    if forced:
        return forced
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def compile_device_count() -> int:
    """Devices the programs run on: the `compiling_for` count if set, else the backend's (kernels that
    cannot be partitioned are chosen only when this is 1)."""
    forced = getattr(_local, "devices", None)
    return forced if forced else jax.device_count()


@contextlib.contextmanager
def compiling_for(platform: str, devices: int | None = None):
    """Traces inside this block pick the kernels of `platform` (one of `PLATFORMS`) on `devices`
    devices (default: the backend's count)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got '{platform}'")
    before = getattr(_local, "platform", None), getattr(_local, "devices", None)
    _local.platform, _local.devices = platform, devices
    try:
        yield
    finally:
        _local.platform, _local.devices = before


def layers_unrolled() -> bool:
    """Whether the target's layer scan is unrolled in traces of this thread (`unrolled_layers`)."""
    return bool(getattr(_local, "unroll", False))


@contextlib.contextmanager
def unrolled_layers():
    """Traces inside this block unroll the target's layer scan (cost analysis only: XLA counts a loop
    body once)."""
    before = layers_unrolled()
    _local.unroll = True
    try:
        yield
    finally:
        _local.unroll = before
