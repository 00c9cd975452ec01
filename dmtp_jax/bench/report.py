"""The benchmark report: pooled statistics per method, the paper-style table, the JSON and the PNG.

Acceptance statistics are pooled over the workload (`decode.stats.acceptance_stats`); plain
decoding counts as a block of size 1. `tokens_per_second`: new tokens / wall time of the timed
calls (prefill in, compiles out); `decode_tokens_per_second`: the engines' decode timer; speedups
are over `ar` (null without it). JSON: `{"methods": {name: summary}, "config": {...}}`."""

from __future__ import annotations

import collections
import json

from dmtp_jax.bench.runner import MethodRun
from dmtp_jax.decode.auto import describe_verdict
from dmtp_jax.decode.stats import acceptance_stats, first_candidate_by_source
from dmtp_jax.errors import InputError


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize_run(run: MethodRun) -> dict:
    """The JSON entry of one method (speedups are filled in by `build_report`). Every row's acceptance
    statistics pool all of its rounds over all of its generations, `auto`'s too (whichever candidate
    served each one: `served` counts them), so they describe the generations its tokens/s counts."""
    served = [g.method for g in run.generations if g.method is not None]
    # plain decoding: one token per round after the prefill's first (also the plain calls of a
    # speculative run: `auto` may choose `ar` for one batch bucket and a speculative method for another)
    rows = [[1] * max(0, len(g.output_ids) - 1) if g.acceptance_lengths is None else g.acceptance_lengths
            for g in run.generations]
    block = run.block_size if run.speculative else 1        # auto: the widest block it served
    st = acceptance_stats(rows, block)
    empty = st["rounds"] == 0
    split = [(r, g.t1_from_mtp) for r, g in zip(rows, run.generations) if g.t1_from_mtp is not None]
    by_source = first_candidate_by_source(*map(list, zip(*split))) if split else None
    first_tokens = len(run.generations)
    return {
        "per_request_acceptance_length": 1.0 if empty else st["per_request_acceptance_length"],
        "per_verify_acceptance_length": 1.0 if empty else st["per_verify_acceptance_length"],
        "first_candidate_acceptance": 0.0 if empty else st["first_candidate_acceptance"],
        "conditional_acceptance": [] if empty else st["conditional_acceptance"],
        "cumulative_acceptance": [] if empty else st["cumulative_acceptance"],
        "tokens_per_second": run.new_tokens / run.wall_s if run.wall_s > 0 else 0.0,
        "speedup_vs_ar": None,
        "decode_tokens_per_second": (run.new_tokens - first_tokens) / run.decode_s if run.decode_s > 0 else 0.0,
        "decode_speedup_vs_ar": None,
        "histogram": st["histogram"],
        "rounds": st["rounds"],
        # one prefill per generation + one target forward per round (AR: 1.0)
        "target_forwards_per_token": (first_tokens + st["rounds"]) / run.new_tokens if run.new_tokens else None,
        "block_size": block,
        "generations": len(run.generations),
        "new_tokens": run.new_tokens,
        "wall_s": run.wall_s,
        "decode_s": run.decode_s,
        "mean_ttft_s": sum(run.ttft_s) / len(run.ttft_s) if run.ttft_s else None,
        "mean_round_s": run.decode_s / run.loop_steps if run.loop_steps else None,
        "calls": run.calls,
        "retimed_calls": run.retimed_calls,
        "skipped": len(run.skipped),
        "compiles": run.compiles,
        "exactness_probe": run.exactness_probe,
        "first_candidate_by_source": by_source,     # dmtp-adaptive: MTP's T1 vs the drafter's
        "auto": {str(b): v for b, v in sorted(run.auto.items())} or None,   # auto: batch bucket -> verdict
        "served": dict(collections.Counter(served)) or None,    # auto: generations decoded by each method
    }


def build_report(runs: dict[str, MethodRun], config: dict) -> dict:
    """`{"methods": {name: summary}, "config": config}` with speedups over `ar` when it ran."""
    methods = {name: summarize_run(run) for name, run in runs.items()}
    ar = methods.get("ar")
    for m in methods.values():
        if ar is not None:
            m["speedup_vs_ar"] = _ratio(m["tokens_per_second"], ar["tokens_per_second"])
            m["decode_speedup_vs_ar"] = _ratio(m["decode_tokens_per_second"], ar["decode_tokens_per_second"])
    return {"methods": methods, "config": dict(config)}


def _fmt(x, spec=".3f", width=7):
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def format_table(report: dict) -> str:
    """The paper-style table: acceptance lengths (per request, per verify), first-candidate and
    conditional acceptance T1..Tn, tokens/s and speedup over `ar`.

    Example:
        >>> print(format_table(build_report({"ar": MethodRun("ar", new_tokens=10, wall_s=1.0)}, {})))
        ... # doctest: +NORMALIZE_WHITESPACE
        method  tau/req tau/ver   first |  tok/s speedup
        ar        1.000   1.000   0.000 |   10.0   1.00x
    """
    methods = report["methods"]
    n_pos = max([len(m["conditional_acceptance"]) for m in methods.values()] + [0])
    width = max([len(n) for n in methods] + [6])
    head = f"{'method':<{width}} {'tau/req':>7} {'tau/ver':>7} {'first':>7}"
    head += "".join(f" {'T' + str(k + 1):>5}" for k in range(n_pos)) + f" | {'tok/s':>6} {'speedup':>7}"
    lines = [head]
    for name, m in methods.items():
        cond = m["conditional_acceptance"]
        line = (f"{name:<{width}} {_fmt(m['per_request_acceptance_length'])} "
                f"{_fmt(m['per_verify_acceptance_length'])} {_fmt(m['first_candidate_acceptance'])}")
        line += "".join(f" {cond[k]:>5.2f}" if k < len(cond) else f" {'-':>5}" for k in range(n_pos))
        speed = m["speedup_vs_ar"]
        line += f" | {m['tokens_per_second']:>6.1f} " + (f"{speed:>6.2f}x" if speed is not None else f"{'-':>7}")
        lines.append(line)
    return "\n".join(lines)


def format_footer(report: dict) -> str:
    """One line per method: generations, tokens, decode-only tokens/s, TTFT, rounds, target
    forwards per generated token (prefill + rounds over new tokens), skips."""
    out = []
    for name, m in report["methods"].items():
        ttft = m["mean_ttft_s"]
        dec = m["decode_speedup_vs_ar"]
        out.append(f"{name}: {m['generations']} generations, {m['new_tokens']} tokens in {m['wall_s']:.2f}s; "
                   f"decode-only {m['decode_tokens_per_second']:.1f} tok/s"
                   + (f" ({dec:.2f}x ar)" if dec is not None else "")
                   + (f", mean TTFT {ttft * 1e3:.1f} ms" if ttft is not None else "")
                   + (f", {m['mean_round_s'] * 1e3:.2f} ms/round" if m["mean_round_s"] else "")
                   + f", {m['rounds']} rounds"
                   + (f", {m['target_forwards_per_token']:.3f} target forwards/token"
                      if m.get("target_forwards_per_token") is not None else "")
                   + f", histogram {m['histogram']}"
                   + (f", {m['skipped']} skipped (too long)" if m["skipped"] else "")
                   + ("; exactness probe failed: ran plain decoding" if (m.get("exactness_probe") or {}).get(
                       "decision") == "plain" else ""))
    return "\n".join(out)


def format_auto(report: dict) -> str:
    """One line per batch bucket of every `auto` run (`decode.auto.describe_verdict`); "" without one.

    Example:
        >>> rep = {"methods": {"auto": {"auto": {"1": {"method": "ar", "source": "cache", "batch_bucket": 1,
        ...        "measured": {"ar": {"decode_tokens_per_s": 50.0, "tau_per_verify": 1.0}}}}}}}
        >>> print(format_auto(rep))
        auto, batch bucket 1: ar (cached verdict; decode tok/s ar 50.0 (tau 1.00))
    """
    lines = []
    for name, m in report["methods"].items():
        lines += [f"{name}, {describe_verdict(v)}" for v in (m.get("auto") or {}).values()]
        if len(m.get("served") or {}) > 1:
            lines.append(f"{name} served " + ", ".join(f"{k} {n}" for k, n in m["served"].items())
                         + " generations; its acceptance statistics pool the rounds of all of them")
    return "\n".join(lines)


def format_head_comparison(strong: dict, weak: dict, strong_head: str, weak_head: str) -> str:
    """The demo's two-heads table: each MTP method with the target's head (`strong`) and another
    (`weak`), beside the methods without MTP: first-candidate acceptance, tokens per verify, share of
    MTP T1 rounds, speedup over `ar`.

    Example:
        >>> r = build_report({"ar": MethodRun("ar", new_tokens=10, wall_s=1.0)}, {})
        >>> print(format_head_comparison(r, {"methods": {}}, "distilled", "corpus"))  # doctest: +NORMALIZE_WHITESPACE
        method  MTP head   first tau/ver MTP T1 speedup
        ar      -          0.000   1.000      -   1.00x
    """
    ar = strong["methods"].get("ar")
    rows = []
    for name, m in strong["methods"].items():
        rows.append((name, strong_head if name in weak["methods"] else "-", m))
        if name in weak["methods"]:
            rows.append((name, weak_head, weak["methods"][name]))
    width = max([len(r[0]) for r in rows] + [6])
    hw = max([len(r[1]) for r in rows] + [8])
    lines = [f"{'method':<{width}} {'MTP head':<{hw}} {'first':>7} {'tau/ver':>7} {'MTP T1':>6} {'speedup':>7}"]
    for name, head, m in rows:
        src = m.get("first_candidate_by_source") or {}
        share = src.get("mtp_t1_fraction")
        speed = _ratio(m["tokens_per_second"], ar["tokens_per_second"]) if ar else None
        lines.append(f"{name:<{width}} {head:<{hw}} {_fmt(m['first_candidate_acceptance'])} "
                     f"{_fmt(m['per_verify_acceptance_length'])} {_fmt(share, '.0%', 6)} "
                     + (f"{speed:>6.2f}x" if speed is not None else f"{'-':>7}"))
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    """Writes the report as indented JSON."""
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)


def write_outputs(runs: dict[str, MethodRun], path: str, tokenizer=None) -> None:
    """Every generation as JSONL: `{"method", "request_id", "turn", "prompt_ids", "output_ids",
    "acceptance_lengths", "text"?}` (`text` with a tokenizer), methods in order."""
    with open(path, "w") as fh:
        for name, run in runs.items():
            for g in run.generations:
                rec = {"method": name, "request_id": g.request_id, "turn": g.turn, "prompt_ids": g.prompt_ids,
                       "output_ids": g.output_ids, "acceptance_lengths": g.acceptance_lengths}
                if tokenizer is not None:
                    rec["text"] = tokenizer.decode(g.output_ids, skip_special_tokens=True)
                fh.write(json.dumps(rec) + "\n")


def legend_label(name: str, m: dict) -> str:
    """A method's entry in the acceptance plot's legend: its tau/ver as `format_table` prints it.

    Example:
        >>> legend_label("dmtp", {"cumulative_acceptance": [0.9], "per_verify_acceptance_length": 5.4374})
        'dmtp (tau/ver 5.437)'
    """
    if not m["cumulative_acceptance"]:
        return f"{name} (no drafts)"
    return f"{name} (tau/ver {_fmt(m['per_verify_acceptance_length'], width=0)})"


def plot_cumulative(report: dict, path: str, title: str | None = None) -> None:
    """PNG of the cumulative acceptance `P(L >= k)` by draft position, one line per method ("method
    (variant)" dashed in its method's colour). Agg backend, no global matplotlib state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg     # lazy: seconds to import, only --plot needs it
    from matplotlib.figure import Figure     # lazy: as above

    fig = Figure(figsize=(8.4, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    n_pos, colors = 1, {}
    for name, m in report["methods"].items():
        cum = m["cumulative_acceptance"]
        base = name.split(" (")[0]          # "dmtp (corpus-only MTP)": dmtp's colour, dashed
        style = dict(linestyle="--" if base != name else "-", color=colors.get(base))
        if cum:
            ks = list(range(1, len(cum) + 1))
            line, = ax.plot(ks, cum, marker="o", label=legend_label(name, m), **style)
            colors.setdefault(base, line.get_color())
            n_pos = max(n_pos, len(cum))
        else:
            ax.plot([], [], linestyle="none", label=legend_label(name, m))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(L >= k)")
    ax.set_xticks(list(range(1, n_pos + 1)))
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    cfg = report.get("config", {})
    ax.set_title(title or f"cumulative acceptance - {cfg.get('workload', '')} "
                          f"(T={cfg.get('temperature', 0)})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


def format_sample(runs: dict, tokenizer) -> str:
    """One request's prompt and each method's answer (ids without a tokenizer): the request whose first
    method's answer has the most distinct tokens."""
    runs = {name: run for name, run in runs.items() if run.generations}
    if not runs:
        return "(no generations)"
    lead = next(iter(runs.values())).generations
    pick = max(range(len(lead)), key=lambda i: (len(set(lead[i].output_ids)), -i))
    first = {name: run.generations[pick] for name, run in runs.items() if len(run.generations) > pick}
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else str
    prompt = next(iter(first.values())).prompt_ids
    lines = ["=" * 30 + " sample: prompt " + "=" * 30, decode(prompt)]
    seen = {}
    for name, g in first.items():
        same = next((other for other, ids in seen.items() if ids == g.output_ids), None)
        seen[name] = g.output_ids
        if same is not None:
            lines.append(f"---- {name}: identical to {same}")
            continue
        lines += [f"---- {name} answer " + "-" * 20, decode(g.output_ids)]
    return "\n".join(lines)


def plot_backend():
    """matplotlib's Agg canvas, or an `InputError` saying how to install it.

    Example:
        >>> plot_backend().__name__
        'FigureCanvasAgg'
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg     # lazy: seconds to import
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed",
                         hint="pip install matplotlib (a dependency of dmtp-jax: pip install -e .)") from None
    return FigureCanvasAgg
