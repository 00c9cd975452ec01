"""What each method's served dispatches realized of the policy's model of their rounds, per (method,
bucket) (`Realizations`): the serving policy divides a method's modelled round seconds by it
(`LoadPolicy.realized`).

Example:
    >>> r = Realizations()
    >>> for _ in range(REALIZED_DISPATCHES):     # modelled 10 ms of rounds, took 20 ms
    ...     r.add("dmtp", 8, modelled_s=0.01, busy_s=0.02)
    >>> round(r.factor("dmtp", 8), 6), r.factor("ar", 8)
    (0.5, 1.0)
"""

from __future__ import annotations

import dataclasses

REALIZED_DISPATCHES = 16    # served dispatches from which what a method realized counts in full (before, in
                            # proportion to them)
REALIZED_WEIGHT = 0.02      # one served dispatch's weight in it (a window of a few requests' lives: a burst's
                            # prefill, paid before its rows' first dispatch, is spread over them)
REALIZED_SPAN = 0.5         # what it realized counts within 1 -/+ this
REALIZED_FORGET = 128       # a method's is forgotten once others served at its bucket the seconds this many of
                            # its dispatches take


@dataclasses.dataclass
class Realization:
    """What a method's served dispatches at a bucket realized: the modelled round seconds of their
    tokens and their busy seconds, exponential sums (`REALIZED_WEIGHT`); how many served and their
    busy seconds in all; other methods' served seconds there since its last."""
    modelled_s: float = 0.0
    busy_s: float = 0.0
    dispatches: int = 0
    served_s: float = 0.0
    others_s: float = 0.0


class Realizations:
    """Per (method, bucket), what its served dispatches realized of their modelled rounds' rate."""

    def __init__(self):
        self._sums: dict[tuple[str, int], Realization] = {}

    def factor(self, method: str, bucket: int) -> float:
        """The modelled round seconds of the tokens `method`'s served dispatches at `bucket` committed
        over the busy seconds they took (exponential sums, each dispatch weighing `REALIZED_WEIGHT`),
        within [1 - `REALIZED_SPAN`, 1 + `REALIZED_SPAN`], counted in proportion to the n dispatches
        served until `REALIZED_DISPATCHES`: 1 + (that - 1) x min(1, n / `REALIZED_DISPATCHES`). 1 for a
        method with none there (never served, or forgotten: `add`)."""
        sums = self._sums.get((method, bucket))
        if sums is None:
            return 1.0
        ratio = min(1.0 + REALIZED_SPAN, max(1.0 - REALIZED_SPAN, sums.modelled_s / sums.busy_s))
        return 1.0 + (ratio - 1.0) * min(1.0, sums.dispatches / REALIZED_DISPATCHES)

    def add(self, method: str, bucket: int, modelled_s: float, busy_s: float) -> None:
        """A served dispatch of `method` at `bucket` whose tokens the model gave `modelled_s` round
        seconds took `busy_s`. Every other method's sums at `bucket` are forgotten once others have
        served there, since its last dispatch, the seconds `REALIZED_FORGET` of its dispatches took
        on average: a method held back by what it realized in one spell serves again on its model."""
        for key, other in list(self._sums.items()):
            if key[1] == bucket and key[0] != method:
                other.others_s += busy_s
                if other.others_s >= REALIZED_FORGET * other.served_s / other.dispatches:
                    del self._sums[key]
        sums = self._sums.setdefault((method, bucket), Realization())
        sums.modelled_s = (1 - REALIZED_WEIGHT) * sums.modelled_s + modelled_s
        sums.busy_s = (1 - REALIZED_WEIGHT) * sums.busy_s + busy_s
        sums.dispatches, sums.served_s, sums.others_s = sums.dispatches + 1, sums.served_s + busy_s, 0.0
