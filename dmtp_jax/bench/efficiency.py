"""A hardware-independent efficiency figure for a decode method: XLA's count of the bytes a compiled
greedy round (or AR step) accesses and the FLOPs it runs, per round and per committed token, next
to the analytic minimum of a memory-bound round (every model's weights plus the caches at their
allocated size, each read once). `ratio` = accessed / minimum is 1.0 for an ideal memory-bound
step. Reading the figures: docs/benchmarks.md#efficiency."""

from __future__ import annotations

import jax
import numpy as np

from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.plan.compile import cost_of


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of a pytree (None leaves are skipped)."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)
                   if hasattr(x, "shape")))


def _models(decoder) -> dict:
    out = {"target": decoder.target}
    for name in ("drafter", "mtp", "fusion", "draft_head", "draft_model"):
        loaded = getattr(decoder, name, None)
        if loaded is not None:
            out[name] = loaded
    return out


def round_cost(decoder, batch: int, max_len: int) -> dict:
    """XLA's cost of one greedy round (`SpecDecoder.round`) or AR step at `[batch, max_len]`, and the
    analytic minimum bytes of that round (lowering hits JAX's compile caches for shapes already run)."""
    sp = SamplingParams.make()
    key = jax.random.key(0)
    weights = {name: tree_bytes(loaded.state) for name, loaded in _models(decoder).items()}
    if hasattr(decoder, "round"):           # speculative: SpecDecoder
        last = decoder.last_state       # the bench's own last state: same shardings, a compile-cache hit
        same = last is not None and last.target_cache.kv.k_lbskd.shape[1:3] == (batch, max_len)
        state = last if same else decoder.new_state(batch, max_len)
        limits = np.full(batch, max_len, np.int32)
        compiled = decoder.round.lower(decoder.model_states(), state, np.ones(batch, bool), limits, sp, key,
                                       np.int32(1), decoder.knobs(), greedy=True).compile()
        caches = {"target_cache": tree_bytes(state.target_cache), "mtp_cache": tree_bytes(state.mtp_cache)}
        if state.draft_cache is not None:
            caches["draft_cache"] = tree_bytes(state.draft_cache)
        if state.ctx_cache is not None:     # the drafter attends over its context window only
            ctx = tree_bytes(state.ctx_cache)
            caches["ctx_cache"] = ctx * min(1.0, decoder.context_window / max_len)
    else:                                   # plain decoding: ARDecoder
        cache = decoder.caches.new(batch, max_len)
        zeros = np.zeros(batch, np.int32)
        compiled = decoder.decode_step.lower(decoder.target.state, zeros, zeros, cache, sp, key,
                                             greedy=True).compile()
        caches = {"target_cache": tree_bytes(cache)}
    cost = cost_of(compiled)
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    minimum = sum(weights.values()) + sum(caches.values())
    return {"batch": batch, "max_len": max_len, "flops_per_round": flops, "bytes_per_round": accessed,
            "min_bytes_per_round": float(minimum), "weight_bytes": weights,
            "cache_bytes": {k: float(v) for k, v in caches.items()},
            "bytes_ratio": accessed / minimum if minimum else None}


def method_efficiency(decoder, run) -> dict | None:
    """`round_cost` at the shape a bench run spent most rounds in, plus per committed token; None when
    nothing ran."""
    shapes = getattr(run, "shapes", None) or {}
    if not shapes or not run.loop_steps:
        return None
    (batch, max_len), _ = max(shapes.items(), key=lambda kv: kv[1])
    cost = round_cost(decoder, batch, max_len)
    per_round = (run.new_tokens - len(run.generations)) / run.loop_steps     # prefill tokens excluded
    cost["tokens_per_round"] = per_round
    for name in ("flops", "bytes", "min_bytes"):
        cost[f"{name}_per_token"] = cost[f"{name}_per_round"] / per_round if per_round else None
    return cost


def _si(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def format_efficiency(eff: dict) -> str:
    """The bench's efficiency table: per method, bytes and FLOPs per round and per committed token, the
    minimum bytes per round, and accessed / minimum.

    Example:
        >>> print(format_efficiency({}))
        efficiency (XLA cost analysis of the compiled greedy round): no rounds ran
    """
    head = "efficiency (XLA cost analysis of the compiled greedy round)"
    rows = {m: e for m, e in eff.items() if e}
    if not rows:
        return head + ": no rounds ran"
    width = max([len(m) for m in rows] + [6])     # the longest method name sets the column
    lines = [head + "; minimum = weights + caches read once:",
             f"{'method':<{width}} {'shape':>9} {'bytes/round':>12} {'min/round':>11} {'ratio':>6} "
             f"{'bytes/token':>12} {'FLOPs/round':>12} {'FLOPs/token':>12}"]
    for m, e in rows.items():
        shape = f"{e['batch']}x{e['max_len']}"
        lines.append(f"{m:<{width}} {shape:>9} {_si(e['bytes_per_round'], 'B'):>12} "
                     f"{_si(e['min_bytes_per_round'], 'B'):>11} {e['bytes_ratio']:>5.2f}x "
                     f"{_si(e['bytes_per_token'], 'B'):>12} {_si(e['flops_per_round'], 'F'):>12} "
                     f"{_si(e['flops_per_token'], 'F'):>12}")
    return "\n".join(lines)
