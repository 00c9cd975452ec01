"""The platform jitted programs are compiled for: the running backend, or the one `plan` compiles for.

Kernel choices that depend on the hardware (the MoE grouped matmul, the attention kernel) ask
`compile_platform()` instead of `jax.default_backend()`: a dry run on a CPU machine compiles for a
TPU slice or a GPU host without the chips (`dmtp_jax.plan`), and must pick the kernels that machine
would run. `compiling_for("tpu")` sets that platform for the duration of a block (this thread only).

Example:
    >>> compile_platform() in ("cpu", "gpu", "tpu")
    True
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


@contextlib.contextmanager
def compiling_for(platform: str):
    """Traces inside this block pick the kernels of `platform` (one of `PLATFORMS`)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got '{platform}'")
    before = getattr(_local, "platform", None)
    _local.platform = platform
    try:
        yield
    finally:
        _local.platform = before
