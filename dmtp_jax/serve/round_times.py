"""The serving policy's round times (`RoundTimes`): seconds per round by (method, bucket, rounds the
dispatch ran), the median of a key's recent samples (one slow sample is outvoted by two normal
ones), and when each (method, bucket) was last timed, in the policy's choices.

Example:
    >>> t = RoundTimes()
    >>> for now, seconds in enumerate((0.004, 0.010, 0.004)):     # one slow sample: the median
    ...     t.add("ar", 8, rounds=1, per_round=seconds, now=now, serving=True)
    >>> t.at("ar", 8, 1), t.at("ar", 8, 4), t.age("ar", 8, now=7)
    (0.004, 0.004, 5)
    >>> t.add("ar", 8, rounds=4, per_round=0.003, now=8, serving=True)
    >>> t.at("ar", 8, 4)
    0.003
"""

from __future__ import annotations

from dmtp_jax.serve.stats import RecentMedians


class RoundTimes:
    """Seconds per round by (method, bucket, rounds)."""

    def __init__(self):
        self._medians = RecentMedians()
        self._measured_at: dict[tuple[str, int], int] = {}         # a (method, bucket)'s last sample, any size

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        return key in self._medians

    def get(self, key: tuple[str, int, int], default: float | None = None) -> float | None:
        return self._medians.get(key, default)

    def as_dict(self) -> dict[tuple[str, int, int], float]:
        return self._medians.as_dict()

    def at(self, method: str, bucket: int, rounds: int) -> float:
        """Seconds per round of `method` at `bucket` in dispatches of `rounds`: that size's time once
        measured, else the 1-round time, and never above the 1-round time (a key needs its 1-round
        time first): K rounds in one dispatch cost no more a round than K dispatches of one, so a
        K-round time above it was taken in a slower spell than the 1-round one."""
        one = self._medians.get((method, bucket, 1))
        return min(self._medians.get((method, bucket, rounds), one), one)

    def age(self, method: str, bucket: int, now: int) -> int:
        """Choices since `method`'s last time at `bucket`, any dispatch size (`now` before any)."""
        return now - self._measured_at.get((method, bucket), 0)

    def add(self, method: str, bucket: int, *, rounds: int, per_round: float, now: int, serving: bool,
            restart: bool = False) -> None:
        """A dispatch of `rounds` rounds of `method` at `bucket` took `per_round` a round at choice
        `now`: the median of the key's recent samples, or alone when `restart` (a confirming
        dispatch supersedes the older ones). For a method not `serving`, its other dispatch sizes'
        times at the bucket move by the ratio this size's time moved: they were taken as long ago
        (only the serving method's sizes are all taken live)."""
        key = (method, bucket, rounds)
        old = self._medians.get(key)
        if restart:
            self._medians.restart(key, per_round)
        else:
            self._medians.add(key, per_round)
        self._measured_at[(method, bucket)] = now
        ratio = self._medians.get(key) / old if old else 1.0
        if not serving and ratio != 1.0:
            for other, value in self._medians.as_dict().items():
                if other[:2] == (method, bucket) and other[2] != rounds:
                    self._medians.restart(other, value * ratio)
