"""A request's share of its prefill call while a method serves at a bucket (`LoadPolicy.admission_s`):
a table of one-call prefill seconds warm-up times, scaled by how live calls compare with it, and per
(method, bucket) a running mean of the table's seconds per request of the calls made while it served.

Example:
    >>> shares = PrefillShares({"ar": 1, "dmtp": 8}, prior_calls=4)
    >>> shares.time(True, 8, 0.04); shares.time(False, 1, 0.012)
    >>> shares.per_request("ar", 8), shares.per_request("dmtp", 8)   # priors: 8 requests a lean call; 1 a full one
    (0.005, 0.012)
"""

from __future__ import annotations

from dmtp_jax.serve.stats import RunningMean


class PrefillShares:
    """Prefill seconds per request by the serving method and bucket. `prior_calls`: the calls a prior
    share weighs as."""

    def __init__(self, slots: dict[str, int], prior_calls: int):
        self.slots, self.prior_calls = dict(slots), int(prior_calls)
        self._table: dict[tuple[bool, int], float] = {}        # one-call prefill seconds by (lean, rows)
        self._scale = RunningMean()             # live one-call prefill seconds over the table's at their rows
        self._request_s: dict[tuple[str, int], RunningMean] = {}   # table seconds per request, by (method, bucket)

    def per_request(self, method: str, bucket: int) -> float | None:
        """Seconds of a request's share of its prefill call while `method` serves at `bucket` (lean while
        plain rounds serve and the bank can, else full); None before warm-up timed a call. A call's
        seconds are the table's at the call's rows, scaled by how live calls compare with it (longer
        prompts, a busier machine); the calls are those made while the method served at the bucket
        (`observe`); before any, weighing as `prior_calls`, a call holding as many requests as the
        bucket has rows for plain rounds (rows that began together end together) and a call of one
        request for speculative ones (their rows end at different rounds, so their successors come one
        by one)."""
        if not self._table:
            return None
        return self._share(method, bucket).value * (self._scale.value or 1.0)

    def _share(self, method: str, bucket: int) -> RunningMean:
        if (method, bucket) not in self._request_s:
            rows = bucket if self.slots[method] == 1 else 1
            self._request_s[(method, bucket)] = RunningMean(self._call_s(method, rows) / rows, self.prior_calls)
        return self._request_s[(method, bucket)]

    def _call_s(self, method: str, rows: int) -> float:
        """The table's seconds of a call of `method`'s kind (lean for plain rounds where the bank can)
        on `rows` rows: the fewest timed rows that hold them, else the most."""
        lean = self.slots[method] == 1 and any(k for k, _ in self._table)
        timed = sorted(r for k, r in self._table if k == lean)
        return self._table[(lean, next((r for r in timed if r >= rows), timed[-1]))]

    def time(self, lean: bool, rows: int, seconds: float) -> None:
        """Warm-up's one-call prefill of `rows` rows of the shortest prompts took `seconds` (`lean`: the
        target alone): the table."""
        self._table[(bool(lean), int(rows))] = float(seconds)

    def observe(self, lean: bool, rows: int, requests: int, seconds: float, serving: str | None,
                bucket: int) -> None:
        """A live one-call prefill of `requests` requests on `rows` rows took `seconds` (`lean`: the
        target alone) while `serving` served at `bucket`: the table's scale, and a sample of that
        method's share there."""
        if (bool(lean), int(rows)) in self._table:
            self._scale.add(seconds / self._table[(bool(lean), int(rows))])
        if serving is not None and self._table:
            self._share(serving, bucket).add(self._call_s(serving, rows) / max(1, requests))
