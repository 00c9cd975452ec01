"""The plan's verdict and table: per function the compile time, per-device peak, FLOPs, bytes
accessed against the analytic minimum and the time estimate; per device what the weights and
caches take; whether it fits.

Example:
    >>> print(gib(3 * 2**30))
    3.00 GiB
"""

from __future__ import annotations

import dataclasses

from dmtp_jax.plan.compile import FunctionPlan


@dataclasses.dataclass
class PlanResult:
    """A plan: the machine, the functions, the verdict. `to_json()` is what `--json` writes."""
    kind: str                       # "inference" | "training"
    topology: str
    platform: str
    device_kind: str
    num_devices: int
    mesh: dict
    hbm_bytes: int
    peak_bytes_per_s: float | None
    settings: dict
    weight_bytes: dict              # per device, by model
    state_bytes: dict               # per device: caches / DeltaNet states, or optimizer state
    functions: list[FunctionPlan]
    notes: list[str] = dataclasses.field(default_factory=list)
    resident_bytes: int = 0         # per device, held across calls besides their arguments (the prefix cache)

    @property
    def peak(self) -> FunctionPlan:
        return max(self.functions, key=lambda f: f.peak_bytes)

    @property
    def per_device_peak_bytes(self) -> int:
        return self.peak.peak_bytes + self.resident_bytes

    @property
    def fits(self) -> bool:
        return self.per_device_peak_bytes <= self.hbm_bytes

    def to_json(self) -> dict:
        return {"kind": self.kind, "fits": self.fits, "per_device_peak_bytes": self.per_device_peak_bytes,
                "hbm_bytes": self.hbm_bytes, "resident_bytes": self.resident_bytes,
                "topology": self.topology, "platform": self.platform,
                "device_kind": self.device_kind, "num_devices": self.num_devices, "mesh": self.mesh,
                "settings": self.settings, "weight_bytes": self.weight_bytes, "state_bytes": self.state_bytes,
                "functions": [f.to_json() for f in self.functions], "notes": self.notes}

    def misfit_message(self) -> str:
        """`does not fit ...`: the function with the largest peak and its largest consumers."""
        f = self.peak
        weights = sum(v for k, v in f.parts.items() if k.startswith("weights:"))
        state = sum(v for k, v in f.parts.items() if not k.startswith("weights:"))
        consumers = {"temporaries": f.temp_bytes, "weights": weights, self._state_name(): state,
                     "outputs not in place": max(0, f.output_bytes - f.alias_bytes)}
        top = sorted(((v, k) for k, v in consumers.items() if v > 0), reverse=True)[:3]
        detail = ", ".join(f"{k} {gib(v)}" for v, k in top)
        resident = f" + {gib(self.resident_bytes)} prefix cache" if self.resident_bytes else ""
        return (f"does not fit {gib(self.hbm_bytes)} per device: {f.name} needs {gib(f.peak_bytes)} "
                f"({detail}){resident}")

    def _state_name(self) -> str:
        return "caches" if self.kind == "inference" else "train state"


def cost_notes(functions, exact_cost: bool) -> list[str]:
    """What the FLOPs / bytes / estimate columns cover (XLA's cost analysis counts a loop body once)."""
    if not any(f.flops is not None for f in functions):
        return []
    if exact_cost:
        return ["FLOPs, bytes and estimates from copies with the layer scan unrolled (inner loops -- blockwise "
                "attention, DeltaNet token scans -- still count once)"]
    return ["FLOPs, bytes and estimates count each loop body once (XLA): the scanned layers as ONE group, "
            "so they are not totals; --exact-cost compiles unrolled copies for totals"]


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _si(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def _time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def format_plan(plan: PlanResult) -> str:
    """The table `plan` prints."""
    mesh = ",".join(f"{k}={v}" for k, v in plan.mesh.items() if v > 1) or "1 device"
    head = (f"{plan.kind} plan: {plan.topology} ({plan.num_devices} x {plan.device_kind}, {gib(plan.hbm_bytes)} "
            f"each), mesh {mesh}; " + ", ".join(f"{k} {v}" for k, v in plan.settings.items()))
    lines = [head, "", "per device:"]
    for name, b in plan.weight_bytes.items():
        lines.append(f"  weights  {name:<20} {gib(b):>12}")
    for name, b in plan.state_bytes.items():
        lines.append(f"  {'state':<8} {name:<20} {gib(b):>12}")
    lines += ["", f"{'function':<12} {'compile':>8} {'peak/dev':>11} {'args':>10} {'temps':>10} {'FLOPs':>10} "
                  f"{'accessed':>10} {'minimum':>10} {'ratio':>6} {'est/call':>9} {'bound':>9} {'calls':>6} "
                  f"{'tok/s':>9}"]
    bw = plan.peak_bytes_per_s
    for f in plan.functions:
        ratio = f"{f.bytes_accessed / f.min_bytes:.2f}x" if f.bytes_accessed and f.min_bytes else "-"
        bound = f.min_bytes / bw if bw else None
        per_call = f.estimated_s
        tok_s = f.tokens_per_call / per_call if per_call and f.tokens_per_call else None
        lines.append(f"{f.name:<12} {f.compile_s:>7.1f}s {gib(f.peak_bytes):>11} {gib(f.argument_bytes):>10} "
                     f"{gib(f.temp_bytes):>10} {_si(f.flops, 'F'):>10} {_si(f.bytes_accessed, 'B'):>10} "
                     f"{_si(f.min_bytes, 'B'):>10} {ratio:>6} {_time(per_call):>9} {_time(bound):>9} "
                     f"{f.calls:>6} {'-' if tok_s is None else f'{tok_s:,.0f}':>9}")
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    resident = f" + prefix cache {gib(plan.resident_bytes)}" if plan.resident_bytes else ""
    lines += ["", f"per-device peak {gib(plan.per_device_peak_bytes)} ({plan.peak.name}{resident}) of "
                  f"{gib(plan.hbm_bytes)}: {verdict}",
              "peak = arguments + outputs not written in place + temporaries + program; minimum = weights it "
              "runs + caches, each read once; est/call = the compiler's estimate (TPU only); bound = "
              "minimum / HBM bandwidth; tok/s = tokens per call / est/call"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
