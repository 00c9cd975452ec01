"""Running statistics of the serving policy and engine: a mean that turns into an exponential average
(`RunningMean`: acceptance, shares, occupancy) and the median of recent samples per key
(`RecentMedians`: round, host, catch-up and prefill times)."""

from __future__ import annotations

import collections
import statistics

ALPHA = 0.05            # a sample's weight once a mean holds 1 / ALPHA samples (by default)
TIME_WINDOW = 5         # recent samples a time is the median of


class RunningMean:
    """A mean over the first `1 / alpha` samples, an exponential average (weight `alpha` per sample,
    `ALPHA` unless `add` is given another) after; `add(mean, count)` adds the mean of `count` samples,
    weighing as many.

    Example:
        >>> m = RunningMean(); m.add(4.0); m.add(1.0); m.value
        2.5
        >>> m.add(1.0, count=2); m.value
        1.75
    """

    def __init__(self, value: float | None = None, samples: int = 0):
        self.value, self.samples = value, samples

    def add(self, sample: float, count: int = 1, alpha: float = ALPHA) -> None:
        self.samples += count
        weight = max(1.0 - (1.0 - alpha) ** count, count / self.samples)
        self.value = sample if self.value is None else (1 - weight) * self.value + weight * sample


class RecentMedians:
    """Per key, the median of its last `TIME_WINDOW` samples (one slow sample is outvoted by two normal
    ones): the policy's round, host and catch-up times, the engine's prefill call times.

    Example:
        >>> m = RecentMedians(); m.add("a", 0.2); m.add("a", 0.02); m.add("a", 0.021)
        >>> m.get("a"), m.get("b"), m.get("b", 0.0), "a" in m
        (0.021, None, 0.0, True)
    """

    def __init__(self):
        self._recent: dict = {}

    def add(self, key, sample: float) -> None:
        self._recent.setdefault(key, collections.deque(maxlen=TIME_WINDOW)).append(sample)

    def restart(self, key, sample: float) -> None:
        """`key`'s samples are `sample` alone (what superseded the older ones)."""
        self._recent[key] = collections.deque([sample], maxlen=TIME_WINDOW)

    def get(self, key, default: float | None = None) -> float | None:
        return statistics.median(self._recent[key]) if key in self._recent else default

    def __contains__(self, key) -> bool:
        return key in self._recent

    def as_dict(self) -> dict:
        return {k: statistics.median(v) for k, v in self._recent.items()}
