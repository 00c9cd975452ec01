"""Which round the engine runs next: the method of the highest estimated output tokens/s at the live
batch, `rows x tau(method) / round_s(method, bucket)`.

`tau`: tokens a row commits per round, an exponential average over live rounds (`ar`: 1; before
any round: the auto verdict's `tau_per_verify`, else `slots / 2`); `round_s`: live seconds per
round at that bucket (compiling dispatches not counted). An untimed method is run once to time it;
every `refresh_every` choices the speculative method with the oldest tau runs once.

Example:
    >>> p = LoadPolicy({"ar": 1, "dmtp": 8})
    >>> p.observe("ar", 1, rounds=1, seconds=0.01, row_rounds=1, committed=1)
    >>> p.observe("dmtp", 1, rounds=1, seconds=0.02, row_rounds=1, committed=4)
    >>> p.choose(rows=1, bucket=1)
    'dmtp'
"""

from __future__ import annotations

ALPHA = 0.25            # weight of a new sample in the running averages
REFRESH_EVERY = 32      # choices between two refresh runs of a stale speculative method


class LoadPolicy:
    """Live per-method acceptance and per-(method, bucket) round time; `choose` the fastest."""

    def __init__(self, slots: dict[str, int], prior_tau: dict[str, float] | None = None,
                 refresh_every: int = REFRESH_EVERY):
        self.slots = dict(slots)
        self.tau = {m: 1.0 if m == "ar" else float((prior_tau or {}).get(m, max(1.0, n / 2)))
                    for m, n in self.slots.items()}
        self.round_s: dict[tuple[str, int], float] = {}
        self.tau_age = {m: 0 for m in self.slots}       # choices since a method's tau was last measured
        self.refresh_every = int(refresh_every)
        self.choices = 0
        self.last: dict = {"method": None, "why": "nothing run yet", "rows": 0, "bucket": 0, "estimates": {}}

    def estimates(self, rows: int, bucket: int) -> dict[str, float]:
        """Estimated output tokens/s per method timed at `bucket`."""
        return {m: rows * self.tau[m] / self.round_s[(m, bucket)] for m in self.slots
                if self.round_s.get((m, bucket), 0) > 0}

    def choose(self, rows: int, bucket: int) -> str:
        """The method of the next round (see the module docstring)."""
        self.choices += 1
        for m in self.tau_age:
            self.tau_age[m] += 1
        est = self.estimates(rows, bucket)
        untimed = [m for m in self.slots if (m, bucket) not in self.round_s]
        if len(self.slots) == 1:
            method, why = next(iter(self.slots)), "the only round"
        elif untimed:
            method, why = untimed[0], f"timing {untimed[0]} at {bucket} rows"
        else:
            best = max(est, key=est.get)
            stale = [m for m in self.slots if m != "ar" and m != best and self.tau_age[m] >= self.refresh_every]
            if stale and self.choices % self.refresh_every == 0:
                method = max(stale, key=self.tau_age.get)
                why = f"refreshing {method}'s acceptance"
            else:
                method, why = best, "highest estimated tok/s"
        self.last = {"method": method, "why": why, "rows": rows, "bucket": bucket, "estimates": est,
                     "tau": dict(self.tau)}
        return method

    def observe(self, method: str, bucket: int, *, rounds: int, seconds: float, row_rounds: int, committed: int,
                compiled: bool = False) -> None:
        """A dispatch of `rounds` rounds of `method` at `bucket` rows took `seconds`; its running rows
        ran `row_rounds` row rounds committing `committed` tokens (before stop cuts)."""
        if rounds > 0 and not compiled:
            key, sample = (method, bucket), seconds / rounds
            old = self.round_s.get(key)
            self.round_s[key] = sample if old is None else (1 - ALPHA) * old + ALPHA * sample
        if row_rounds > 0 and method != "ar":
            self.tau[method] = (1 - ALPHA) * self.tau[method] + ALPHA * committed / row_rounds
            self.tau_age[method] = 0

    def describe(self) -> dict:
        """The last choice: method, why, rows, bucket, each method's tau and estimated tok/s."""
        return dict(self.last)
