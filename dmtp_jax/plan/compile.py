"""Compile one lowered function for the plan's machine and read what the compiler says of it:
per-device memory, FLOPs, bytes accessed and, on TPU, XLA's time estimate (GPU: memory only).

Example:
    >>> import jax, jax.numpy as jnp
    >>> f = jax.jit(lambda a: a @ a)
    >>> fp = compile_function("matmul", lambda: f.lower(jnp.ones((64, 64))), min_bytes=64 * 64 * 4)
    >>> fp.flops, fp.argument_bytes
    (524288.0, 16384)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax

from dmtp_jax.errors import UserError
from dmtp_jax.platform import unrolled_layers


@dataclasses.dataclass
class FunctionPlan:
    """What one compiled function costs on one device."""
    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int              # outputs written into donated arguments
    temp_bytes: int
    code_bytes: int
    flops: float | None
    bytes_accessed: float | None
    min_bytes: int                # analytic minimum: the weights it runs + caches, each read once
    estimated_s: float | None     # the compiler's own estimate (TPU)
    calls: int = 1                # calls per request (prefill chunks; rounds are counted per call)
    tokens_per_call: float | None = None
    parts: dict = dataclasses.field(default_factory=dict)   # argument bytes by kind (weights, caches)

    @property
    def peak_bytes(self) -> int:
        """Bytes live on a device while it runs: arguments, outputs not written in place, temporaries
        and the program."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("name", "compile_s", "peak_bytes", "flops", "bytes_accessed",
                                             "min_bytes", "estimated_s", "argument_bytes", "output_bytes",
                                             "alias_bytes", "temp_bytes", "code_bytes", "calls", "tokens_per_call")}
        out["parts"] = dict(self.parts)
        return out


def cost_of(compiled) -> dict:
    """`cost_analysis()` as one dict (a list of one on some versions; None / empty on GPU)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return dict(ca or {})


class DoesNotFitError(UserError):
    """The planned run needs more memory per device than the machine has (exit status 2)."""


def compile_or_refuse(name: str, lower: Callable[[], jax.stages.Lowered]):
    """`lower().compile()`; a TPU RESOURCE_EXHAUSTED refusal is a `DoesNotFitError` (exit status 2, one
    line with the compiler's figures), not a crash."""
    try:
        return lower().compile()
    except Exception as e:  # noqa: BLE001 -- jax raises JaxRuntimeError / XlaRuntimeError by version
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        detail = str(e).split("RESOURCE_EXHAUSTED:", 1)[-1].strip().splitlines()[0]
        raise DoesNotFitError(f"does not fit: the compiler refused {name}: {detail}") from None


def compile_function(name: str, lower: Callable[[], jax.stages.Lowered], *, min_bytes: int, calls: int = 1,
                     tokens_per_call: float | None = None, parts: dict | None = None,
                     exact_cost: bool = False) -> FunctionPlan:
    """Lowers and compiles, timing both, and reads the compiler's analyses. XLA counts a loop body once;
    `exact_cost` compiles a second copy with the layer scan unrolled for FLOPs, bytes and estimate."""
    t0 = time.perf_counter()
    compiled = compile_or_refuse(name, lower)
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = cost_of(compiled)
    if exact_cost and cost:
        jax.clear_caches()          # the jit's trace cache would hand back the scanned program
        with unrolled_layers():
            cost = cost_of(compile_or_refuse(name, lower))
        jax.clear_caches()
    flops = cost.get("flops")
    accessed = cost.get("bytes accessed")
    estimate = cost.get("optimal_seconds")
    return FunctionPlan(
        name, compile_s, int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
        int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes), int(mem.generated_code_size_in_bytes),
        None if flops is None else float(flops), None if accessed is None else float(accessed), int(min_bytes),
        None if estimate is None or estimate <= 0 else float(estimate), calls, tokens_per_call, dict(parts or {}))
