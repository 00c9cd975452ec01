"""The server's Prometheus metrics, hand-formatted (text exposition format 0.0.4).

Example:
    >>> h = Histogram((0.1, 1.0))
    >>> h.observe(0.5)
    >>> print("\\n".join(h.lines("ttft_seconds")))
    ttft_seconds_bucket{le="0.1"} 0
    ttft_seconds_bucket{le="1.0"} 1
    ttft_seconds_bucket{le="+Inf"} 1
    ttft_seconds_sum 0.5
    ttft_seconds_count 1
"""

from __future__ import annotations

import bisect

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        for j in range(i, len(self.buckets)):
            self.counts[j] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        lab = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{lab} {self.sum}", f"{name}_count{lab} {self.count}"]


def choice_lines(choice: dict, prefix: str = "dmtp") -> list[str]:
    """The engine's current round choice (`Engine.choice`): the method and why, the rows, load and
    bucket, and each method's live tau and estimated tokens/s (at the load).

    Example:
        >>> print("\\n".join(choice_lines({"method": "ar", "why": "highest estimated tok/s", "rows": 3,
        ...     "load": 4, "bucket": 4, "estimates": {"ar": 90.0}, "tau": {"ar": 1.0}})[2:3]))
        dmtp_engine_choice{method="ar",why="highest estimated tok/s",rows="3",load="4",bucket="4"} 1
    """
    if not choice.get("method"):
        return []
    out = [f"# HELP {prefix}_engine_choice the round the engine runs now, why, and for how many rows",
           f"# TYPE {prefix}_engine_choice gauge",
           f'{prefix}_engine_choice{{method="{choice["method"]}",why="{choice["why"]}",rows="{choice["rows"]}",'
           f'load="{choice["load"]}",bucket="{choice["bucket"]}"}} 1',
           f"# HELP {prefix}_engine_tau tokens a row commits per round of each method, measured live",
           f"# TYPE {prefix}_engine_tau gauge"]
    out += [f'{prefix}_engine_tau{{method="{m}"}} {t}' for m, t in choice.get("tau", {}).items()]
    out += [f"# HELP {prefix}_engine_estimated_tokens_per_second each method's estimated output tok/s at the "
            "load (the most requests held at once of late)",
            f"# TYPE {prefix}_engine_estimated_tokens_per_second gauge"]
    out += [f'{prefix}_engine_estimated_tokens_per_second{{method="{m}"}} {v}'
            for m, v in choice.get("estimates", {}).items()]
    return out


class ServerMetrics:
    """What `/metrics` shows: the engine's counters and rows, and latency histograms per request."""

    def __init__(self):
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.finished = {}          # finish reason -> count

    def observe_finished(self, req) -> None:
        """A finished `engine.Request`: its time to first token and time per output token."""
        self.finished[req.finish_reason] = self.finished.get(req.finish_reason, 0) + 1
        if req.first_token_s is None:
            return
        self.ttft.observe(req.first_token_s - req.arrival_s)
        if len(req.output_ids) > 1 and req.finished_s is not None:
            self.tpot.observe((req.finished_s - req.first_token_s) / (len(req.output_ids) - 1))

    def render(self, engine, prefix: str = "dmtp") -> str:
        """The exposition text for `engine` (an `engine.Engine`)."""
        c, m = engine.counters, f'method="{engine.method}"'
        rows = max(c["row_rounds"], 1)
        gauges = [
            ("requests_total", "counter", "requests admitted", c["requests"], ""),
            ("prompt_tokens_total", "counter", "prompt tokens of admitted requests", c["prompt_tokens"], ""),
            ("generation_tokens_total", "counter", "tokens generated", c["generated_tokens"], ""),
            ("running_rows", "gauge", "rows of the running batch in use", engine.num_running, ""),
            ("waiting_requests", "gauge", "requests waiting for a row", len(engine.waiting), ""),
            ("compiled_programs", "gauge", "programs the engine compiled (warm-up's, and any since)",
             sum(engine.compile_counts().values()), ""),
            ("verify_rounds_total", "counter", "rounds run over the batch", c["rounds"], m),
            ("lean_prefills_total", "counter", "prefill groups that left the drafting caches to a later catch-up "
             "(auto while plain rounds serve)", c["lean_prefills"], m),
            ("acceptance_length", "gauge", "mean tokens committed per row per round", c["committed"] / rows, m),
            ("first_candidate_acceptance", "gauge", "fraction of row rounds whose first draft was accepted",
             c["first_accepted"] / rows, m),
        ]
        out = []
        for name, kind, help_text, value, labels in gauges:
            out += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} {kind}",
                    f"{prefix}_{name}{{{labels}}} {value}" if labels else f"{prefix}_{name} {value}"]
        out += choice_lines(engine.choice, prefix)
        verdict = getattr(engine, "verdict", None)
        if verdict is not None:         # auto: the choice and what it was chosen from
            out += [f"# HELP {prefix}_auto_chosen the method auto serves with (1), by where the verdict came from",
                    f"# TYPE {prefix}_auto_chosen gauge",
                    f'{prefix}_auto_chosen{{method="{verdict.method}",source="{verdict.source}"}} 1',
                    f"# HELP {prefix}_auto_measured_decode_tokens_per_second each candidate's measured decode speed",
                    f"# TYPE {prefix}_auto_measured_decode_tokens_per_second gauge"]
            out += [f'{prefix}_auto_measured_decode_tokens_per_second{{method="{c}"}} {x["decode_tokens_per_s"]}'
                    for c, x in verdict.measured.items()]
        cache = getattr(engine, "prefix_cache", None)
        if cache is not None:           # --prefix-cache-gb: reuse of stored prefixes
            pc = cache.metrics()
            out += _lines(prefix, [
                ("prefix_cache_hits_total", "counter", "requests started from a stored prefix", pc["hits"]),
                ("prefix_cache_hit_tokens_total", "counter", "prompt tokens not prefilled thanks to a stored prefix",
                 pc["hit_tokens"]),
                ("prefix_cache_lookups_total", "counter", "requests that looked for a stored prefix", pc["lookups"]),
                ("prefix_cache_entries", "gauge", "snapshots held", pc["entries"]),
                ("prefix_cache_bytes", "gauge", "bytes of the snapshots held", pc["bytes"]),
                ("prefix_cache_budget_bytes", "gauge", "the budget (--prefix-cache-gb)", pc["budget_bytes"]),
                ("prefix_cache_evicted_total", "counter", "snapshots evicted past the budget", pc["evicted"])])
        out += [f"# HELP {prefix}_requests_finished_total requests finished, by reason",
                f"# TYPE {prefix}_requests_finished_total counter"]
        out += [f'{prefix}_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
        histograms = (("time_to_first_token_seconds", self.ttft, "arrival to first token"),
                      ("time_per_output_token_seconds", self.tpot, "decode time per token after the first"))
        for name, hist, help_text in histograms:
            out += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} histogram"]
            out += hist.lines(f"{prefix}_{name}")
        return "\n".join(out) + "\n"


def _lines(prefix: str, gauges) -> list[str]:
    """Exposition lines of unlabelled `(name, kind, help, value)` metrics."""
    out = []
    for name, kind, help_text, value in gauges:
        out += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} {kind}", f"{prefix}_{name} {value}"]
    return out
