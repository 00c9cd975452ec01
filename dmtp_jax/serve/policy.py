"""Which round the engine runs next: the method of the highest estimated output tokens/s at the
load, one over `(round_s(method, bucket, K) + host_s(bucket)) / (load x tau(method) x occupancy x
realized)` seconds per token plus a request's prefill over its tokens (`admission_s`), all measured
live, each method at the dispatch size K it would run. Switching, refreshes and in-step dispatches:
docs/serving-design.md#dispatch-size-refreshes-in-step-rounds-switching. `describe` says what the
last choice rests on.

Example:
    >>> p = LoadPolicy({"ar": 1, "dmtp": 8})
    >>> p.observe("ar", 1, rounds=1, seconds=0.01, row_rounds=1, committed=1)
    >>> p.observe("dmtp", 1, rounds=1, seconds=0.02, row_rounds=1, committed=4)
    >>> p.choose(rows=1, bucket=1)
    'dmtp'
    >>> p.observe("ar", 1, rounds=4, seconds=0.01, row_rounds=0, committed=0)   # 2.5 ms a round at K = 4
    >>> p.round_time("ar", 1, most=4), p.round_time("ar", 1)
    (0.0025, 0.01)
"""

from __future__ import annotations

import collections

from dmtp_jax.serve.prefill_share import PrefillShares
from dmtp_jax.serve.realized import Realizations
from dmtp_jax.serve.round_times import RoundTimes
from dmtp_jax.serve.stats import RecentMedians, RunningMean

REFRESH_EVERY = 32      # choices at least between two refresh runs of another method
PRIOR_ROW_ROUNDS = 4    # the row rounds a prior tau (a cached verdict, else slots / 2) weighs as; the
                        # prefill calls a prior request share (`admission_s`) weighs as
TRUSTED_ROW_ROUNDS = 48 # measured row rounds below which a method's tau is refreshed before any stale time
TAU_ROUNDS = 32         # rounds a tau averages over once measured (each row round weighs 1 / (this x the
                        # dispatch's rows)), at any rows: a few requests' lives
DISPATCH_S = 0.25       # the longest a multi-round dispatch may run by the estimate: what an arrival may wait
SWITCH_MARGIN = 0.05    # another method replaces the one serving once its estimate is this much higher
CONFIRM_AGE = 8         # choices after which a method's time at a bucket is re-taken before it replaces another
REFRESH_SHARE = 0.02    # refreshes cost at most this share of the serving seconds at a bucket (each other method
                        # its part of those since its last there)
LOAD_CHOICES = 16            # choices over which the load is the most requests the engine held at once


class LoadPolicy:
    """Live per-method acceptance and per-(method, bucket) round time; `choose` the fastest."""

    def __init__(self, slots: dict[str, int], prior_tau: dict[str, float] | None = None,
                 refresh_every: int = REFRESH_EVERY, refresh_share: float = REFRESH_SHARE):
        self.slots = dict(slots)
        prior = prior_tau or {}
        self._tau = {m: RunningMean(1.0, 1) if m == "ar" else
                     RunningMean(float(prior[m]) if m in prior else max(1.0, n / 2), PRIOR_ROW_ROUNDS)
                     for m, n in self.slots.items()}
        self._measured = {m: TRUSTED_ROW_ROUNDS if m == "ar" else 0 for m in self.slots}    # ar's tau is exact
        self._round_s = RoundTimes()     # seconds per round by (method, bucket, rounds the dispatch ran)
        self._host_s = RecentMedians()      # host seconds per round outside the dispatch, by bucket
        self.refresh_every, self.refresh_share = int(refresh_every), float(refresh_share)
        self._serving_at: dict[int, float] = {}     # seconds of the dispatches that ran rows, catch-ups included,
                                                    # by bucket (`serving_s`: all of them)
        self.refresh_s = 0.0        # of which refresh dispatches
        self._refreshed_s: dict[tuple[str, int], float] = {}    # `_serving_at[bucket]` at a (method, bucket)'s last
                                                                # refresh
        self._catch_up_s = RecentMedians()      # seconds of the catch-ups before dispatches, by bucket
        self.prefill = PrefillShares(self.slots, PRIOR_ROW_ROUNDS)     # a request's share of its prefill call
        self._occupancies: dict[tuple[str, int], RunningMean] = {}  # row rounds run over offered, by (method, bucket)
        self._realized = Realizations()
        self._output_tokens = RunningMean()     # tokens a finished request generated
        self.choices = 0
        self._held: collections.deque[int] = collections.deque(maxlen=LOAD_CHOICES)  # requests held at recent choices
        self._refreshed_at = 0                  # the choice count of the last refresh (`refresh_every`)
        self._serving: str | None = None        # the method last chosen as the best (refreshes aside)
        self._serving_bucket = 0                # the bucket it last served at
        self._replaced: tuple[str, int, int] | None = None     # (method, bucket, choice) of the last switch
                                                                # between two serving at one bucket
        self.last: dict = {"method": None, "why": "nothing run yet", "rows": 0, "load": 0, "bucket": 0, "rounds": 0,
                           "estimates": {}, "refresh": False, "confirm": False, "retake": False, "in_step": False,
                           "served": False, "rounds_rate": None}

    @property
    def tau(self) -> dict[str, float]:
        return {m: t.value for m, t in self._tau.items()}

    @property
    def serving_s(self) -> float:
        """Seconds of the dispatches that ran rows (catch-ups included), at every bucket."""
        return sum(self._serving_at.values())

    @property
    def round_s(self) -> dict[tuple[str, int, int], float]:
        """Seconds per round by (method, bucket, rounds the dispatch ran)."""
        return self._round_s.as_dict()

    def timed(self, method: str, bucket: int) -> bool:
        """Whether `method` has a 1-round time at `bucket` (what its estimate needs first)."""
        return (method, bucket, 1) in self._round_s

    def round_time(self, method: str, bucket: int, most: int = 1) -> float:
        """Seconds per round of `method` at `bucket` in the dispatch it would run (`rounds`, at most
        `most`; `RoundTimes.at`, needs `timed`)."""
        return self._round_s.at(method, bucket, self.rounds(method, bucket, most))

    @property
    def host_s(self) -> dict[int, float]:
        return self._host_s.as_dict()

    def estimates(self, rows: int, bucket: int, most: int = 1) -> dict[str, float]:
        """Estimated output tokens/s per method timed at `bucket`: the `modelled` rate with its rounds'
        seconds per token over what the method's dispatches served there realized of them
        (`realized`); the prefill's share stands as modelled (`admission_s`, measured apart)."""
        return self._estimated(self._per_token(rows, bucket, most), bucket)

    def _estimated(self, per_token: dict[str, tuple[float, float]], bucket: int) -> dict[str, float]:
        return {m: 1.0 / (rounds_s / self.realized(m, bucket) + prefill_s)
                for m, (rounds_s, prefill_s) in per_token.items()}

    def realized(self, method: str, bucket: int) -> float:
        """How much of its modelled rounds' rate `method` realized while it served at `bucket`
        (`Realizations.factor`, from `observe_served`): what the rounds' model leaves out or gets
        wrong (dispatches cut short by arrivals, rows that idle, a busy host) it corrects, within
        `realized.REALIZED_SPAN`; a method whose shortfall outweighs its lead gives way within
        `realized.REALIZED_DISPATCHES` of its dispatches, sooner the larger the shortfall. Prefill is
        not in it (a burst's admission, paid at one dispatch, would weigh as that dispatch's alone).
        Forgotten once others have served at the bucket long enough (`Realizations.add`): a method
        held back by what it realized in one spell (a slow machine, the first burst) serves again on
        its model."""
        return self._realized.factor(method, bucket)

    def modelled(self, rows: int, bucket: int, most: int = 1) -> dict[str, float]:
        """Modelled output tokens/s per method timed at `bucket`, each in the dispatch it would run (at
        most `most` rounds): a round's time includes the host's work around it (committing,
        streaming), which a method of more rounds per token pays more often, and each token carries
        its share of its request's prefill (`admission_s`)."""
        return {m: 1.0 / (r + p) for m, (r, p) in self._per_token(rows, bucket, most).items() if r + p > 0}

    def _per_token(self, rows: int, bucket: int, most: int) -> dict[str, tuple[float, float]]:
        """Per method timed at `bucket`: (its rounds' seconds per token, its prefill's per token)."""
        host = self._host_s.get(bucket, 0.0)
        times = {m: self.round_time(m, bucket, most) + host for m in self.slots if self.timed(m, bucket)}
        return {m: (t / (rows * self._tau[m].value * self.occupancy(m, bucket, most)), self.admission_s(m, bucket))
                for m, t in times.items()}

    def occupancy(self, method: str, bucket: int, most: int = 1) -> float:
        """The share of the row rounds a dispatch offers the load (K x the load, `_load`) that its rows
        run when `method` serves at `bucket` in the dispatch it would run: 1 for one round; for K
        rounds a row that ends mid-dispatch idles to its end (the dispatch stops once no row runs),
        and a row whose request ended waits for its client's next one. A running mean over the
        K-round dispatches it served there (`observe`), before any, weighing as `PRIOR_ROW_ROUNDS` of
        them: 1 for plain rounds and on one row (rows that began together end together, and their
        successors are admitted together), else the lower of a request's rounds (its tokens over tau)
        over those plus the (K - 1) / 2 rounds its row idles on average at its end (speculative rows
        end at different rounds) and the K rounds of the next dispatch, which starts before its
        client's next request arrives (the client sends it once answered), and the mean of the other
        speculative methods' measured there (their rows wait for their successors alike)."""
        k = self.rounds(method, bucket, most)
        if k == 1:
            return 1.0
        return self._occupancy(method, bucket, k).value

    def _occupancy(self, method: str, bucket: int, k: int) -> RunningMean:
        """The running mean of `occupancy`; until a dispatch is observed its prior follows the live tau
        and request length (a prior fixed before the first request finished would stay at 1)."""
        mean = self._occupancies.get((method, bucket))
        if mean is None or mean.samples == PRIOR_ROW_ROUNDS:
            prior = 1.0
            if self.slots[method] > 1 and bucket > 1:
                if self._output_tokens.value is not None:
                    per_request = max(1.0, self._output_tokens.value / self._tau[method].value)
                    prior = per_request / (per_request + (k - 1) / 2 + k)
                seen = [o.value for (m, b), o in self._occupancies.items()
                        if b == bucket and m != method and self.slots[m] > 1 and o.samples > PRIOR_ROW_ROUNDS]
                if seen:
                    prior = min(prior, sum(seen) / len(seen))
            mean = self._occupancies[(method, bucket)] = RunningMean(prior, PRIOR_ROW_ROUNDS)
        return mean

    def admission_s(self, method: str, bucket: int) -> float:
        """Prefill seconds per output token while `method` serves at `bucket`: a request's share of its
        prefill call (`PrefillShares.per_request`) over the tokens a finished request generated
        (`observe_output`); 0 before both are known. Under load this is what plain rounds save
        besides their rounds: calls that batch, each lean."""
        share = self.prefill.per_request(method, bucket)
        if share is None or self._output_tokens.value is None:
            return 0.0
        return share / max(1.0, self._output_tokens.value)

    def rounds(self, method: str, bucket: int, most: int) -> int:
        """Rounds of `method`'s next dispatch at `bucket` rows when nobody waits: `most` when that many
        take at most `DISPATCH_S` by its round time (an arrival waits for the dispatch in progress),
        else 1; 1 before the round is timed."""
        key = (method, bucket, 1)
        fits = most > 1 and key in self._round_s and most * self._round_s.get(key) <= DISPATCH_S
        return most if fits else 1

    def best(self, rows: int, bucket: int, most: int = 1) -> str | None:
        """The method of the highest estimate at `rows` live rows on `bucket`, the one serving kept on a
        near tie (switching costs: a plain round's rows catch up, and it flips); None while a method is
        untimed there. Counts no choice (the engine asks it before a prefill)."""
        return self._best(self.estimates(rows, bucket, most))

    def _best(self, est: dict[str, float]) -> str | None:
        if len(est) < len(self.slots):
            return None
        best, held = max(est, key=est.get), self._serving
        if held in est and held != best and est[best] < (1 + SWITCH_MARGIN) * est[held]:
            return held
        return best

    def choose(self, rows: int, bucket: int, most: int = 1, idle: bool = True, held: int | None = None) -> str:
        """The method of the next dispatch of at most `most` rounds over `rows` running rows (see the
        module docstring); one round unless `idle` (nobody waits), the methods still compared at
        `most`. `held`: the requests the engine holds (running, being admitted or waiting; default
        `rows`). The methods are compared at the load (`_load`), not at `rows`: what a method loses
        to rows that wait for their next request (its rows ending at different rounds, their
        successors arriving one by one, each while a dispatch runs) is in its `occupancy` and what it
        `realized`, and what it loses to dispatches cut short by arrivals in what it `realized`."""
        self.choices += 1
        load = self._load(rows, bucket, held)
        per_token = self._per_token(load, bucket, most)
        est = self._estimated(per_token, bucket)
        untimed = [m for m in self.slots if not self.timed(m, bucket)]
        rounds, refresh, confirm, in_step, served = 1, False, False, False, False     # a timing dispatch: one round
        retake = False
        if len(self.slots) == 1:
            method, why, served = next(iter(self.slots)), "the only round", True
            rounds = self.rounds(method, bucket, most)
        elif untimed:
            method, why = untimed[0], f"timing {untimed[0]} at {bucket} rows"
            in_step = self._in_step(method, self._serving, rows)
        else:
            best = self._best(est)
            due = idle and self.choices - self._refreshed_at >= self.refresh_every
            stale = self._retake(best, bucket) if idle else None
            retake = stale is not None
            if not retake:
                stale = self._refresh_candidate(best, bucket, most) if due else None
            if stale is not None:
                self._refreshed_at = self.choices
            elif self._unconfirmed(best, bucket):
                stale, confirm = best, True
            if stale is not None:
                incumbent = self._serving if confirm else best
                method, refresh = stale, True
                why = (f"confirming {stale}'s estimate before it replaces {incumbent}" if confirm else
                       f"re-taking {stale}'s time at {bucket} rows after {best} replaced it" if retake
                       else f"refreshing {stale}'s estimate at {bucket} rows")
                rounds = self._refresh_rounds(stale, incumbent, bucket, most, rows)
                in_step = self._in_step(stale, incumbent, rows)
            else:
                method, why = best, "highest estimated tok/s"
                in_step = rows > 1 and self.slots[best] > 1 and self._measured[best] < TRUSTED_ROW_ROUNDS
                rounds = 1 if in_step else self.rounds(method, bucket, most)
                served = not in_step
                if self._serving not in (None, best) and self._serving_bucket == bucket:
                    self._replaced = (self._serving, bucket, self.choices)
                self._serving, self._serving_bucket = best, bucket
        rounds = rounds if idle else 1
        rounds_s = per_token.get(method, (0.0, 0.0))[0]     # modelled, per token
        self.last = {"method": method, "why": why, "rows": rows, "load": load, "bucket": bucket, "rounds": rounds,
                     "estimates": est,
                     "tau": self.tau, "refresh": refresh, "confirm": confirm, "retake": retake,
                     "in_step": in_step, "served": served,
                     "rounds_rate": 1.0 / rounds_s if rounds_s > 0 else None}
        return method

    def _load(self, rows: int, bucket: int, held: int | None = None) -> int:
        """The rows the methods are compared at: the most requests the engine held at once over the
        last `LOAD_CHOICES` choices (this one's `held`, default `rows`, included), within [`rows`,
        `bucket`]. Under a steady load that is every client's request: a row whose request ended
        still counts while its client's next one is on its way, so a method whose rows end at
        different rounds, each waiting out a dispatch for its successor, serves fewer of the load's
        rows than plain rounds, whose rows end, and are refilled, together."""
        self._held.append(max(rows, rows if held is None else int(held)))
        return max(rows, min(bucket, self.recent_load))

    @property
    def recent_load(self) -> int:
        """The most requests the engine held at once over the last `LOAD_CHOICES` choices (0 before any
        choice; `_load` before it is bounded by the rows and the bucket)."""
        return max(self._held, default=0)

    def _unconfirmed(self, best: str, bucket: int) -> bool:
        """Whether `best` would replace the method serving on a time at `bucket` older than `CONFIRM_AGE`
        choices: taken on other rows (warm-up's scratch rows, shorter ones) or in another spell of the
        machine than the serving method's live ones."""
        return (self._serving is not None and best != self._serving
                and self._round_s.age(best, bucket, self.choices) > CONFIRM_AGE)

    def _retake(self, best: str, bucket: int) -> str | None:
        """The method `best` replaced at `bucket`, once `CONFIRM_AGE` choices have passed since (once per
        switch, `best` still serving): its time there is re-taken, since its samples were taken while it
        served, maybe in the slow spell in which the challenger's fresh time won. A re-take faster than
        their median supersedes them, as a confirming dispatch's time does the challenger's; a slower
        one joins them (`observe`): one slow sample must not hold a method back alone."""
        if self._replaced is None or self._replaced[1] != bucket or self.choices - self._replaced[2] < CONFIRM_AGE:
            return None
        replaced, self._replaced = self._replaced[0], None
        return replaced if best == self._serving != replaced else None

    def _in_step(self, method: str, serving: str | None, rows: int) -> bool:
        """Whether a timing or refresh dispatch of `method` over `rows` rows commits one token per row,
        as the plain rounds serving (or none yet) do: a speculative round's rows would end at
        different rounds, and requests that arrived together would no longer be admitted together."""
        return rows > 1 and self.slots[method] > 1 and (serving is None or self.slots[serving] == 1)

    def _refresh_rounds(self, method: str, best: str, bucket: int, most: int, rows: int) -> int:
        """A refresh's rounds: one when it runs in step (`_in_step`); else the dispatch its estimate uses
        when that takes no longer than the best method's dispatch (so the estimate compared is
        re-measured), else one round (exploring a slow round costs little)."""
        if self._in_step(method, best, rows):
            return 1
        k = self.rounds(method, bucket, most)
        dispatch_s = lambda m: self.rounds(m, bucket, most) * self.round_time(m, bucket, most)  # noqa: E731
        return k if dispatch_s(method) <= dispatch_s(best) else 1

    def refresh_cost(self, method: str, best: str, bucket: int, most: int) -> float:
        """Estimated seconds of a refresh of `method` while `best` serves: its dispatch by the round time,
        and the bucket's recent catch-up time when it is a speculative round after plain ones."""
        k = self._refresh_rounds(method, best, bucket, most, bucket)
        switch = self.slots[method] > 1 and self.slots[best] == 1
        return k * self.round_time(method, bucket, k) + (self._catch_up_s.get(bucket, 0.0) if switch else 0.0)

    def _refresh_candidate(self, best: str, bucket: int, most: int) -> str | None:
        """The other method to run once: the least measured while under `TRUSTED_ROW_ROUNDS` row rounds,
        else, among those whose `refresh_cost` is at most `refresh_share` / (the other methods) of the
        seconds served at `bucket` since their last refresh there, the one timed longest ago if that is
        `refresh_every` choices or more; None otherwise."""
        others = [m for m in self.slots if m != best]
        fewest = min(others, key=lambda m: self._measured[m])
        if self._measured[fewest] < TRUSTED_ROW_ROUNDS:
            return fewest
        serving = self._serving_at.get(bucket, 0.0)
        since = {m: serving - self._refreshed_s.get((m, bucket), 0.0) for m in others}
        budget = self.refresh_share / len(others)
        affordable = [m for m in others if self.refresh_cost(m, best, bucket, most) <= budget * since[m]]
        age = {m: self._round_s.age(m, bucket, self.choices) for m in affordable}
        stalest = max(age, key=age.get, default=None)
        return stalest if stalest is not None and age[stalest] >= self.refresh_every else None

    def observe(self, method: str, bucket: int, *, rounds: int, seconds: float, row_rounds: int, committed: int,
                compiled: bool = False, catch_up_s: float = 0.0) -> None:
        """A dispatch that ran `rounds` rounds of `method` at `bucket` rows took `seconds` after a
        catch-up of `catch_up_s`; its running rows ran `row_rounds` row rounds in which the requests
        kept `committed` tokens (a round's tokens past a stop or `max_tokens` serve nobody and are not
        counted)."""
        if catch_up_s > 0:
            self._catch_up_s.add(bucket, catch_up_s)
        if row_rounds > 0 and not compiled:
            self._serving_at[bucket] = self._serving_at.get(bucket, 0.0) + seconds + catch_up_s
            if self.last["refresh"] and self.last["method"] == method:
                self.refresh_s += seconds + catch_up_s
                self._refreshed_s[(method, bucket)] = self._serving_at[bucket]
        if rounds > 0 and not compiled:     # a confirming dispatch supersedes the older samples, a re-take
            per_round, last = seconds / rounds, self.last      # those it beats (it ends a slow spell, not starts one)
            restart = last["method"] == method and (
                last["confirm"] or (last["retake"] and per_round < self._round_s.get((method, bucket, rounds),
                                                                                     float("inf"))))
            self._round_s.add(method, bucket, rounds=rounds, per_round=per_round, now=self.choices,
                              serving=method == self._serving, restart=restart)
        if row_rounds > 0 and method != "ar":       # one row round: one sample
            rows = max(1.0, row_rounds / max(1, rounds))
            self._tau[method].add(committed / row_rounds, row_rounds, alpha=1.0 / (TAU_ROUNDS * rows))
            self._measured[method] += row_rounds
        last = self.last
        if rounds > 1 and not compiled and last["method"] == method and not last["refresh"] and last["rows"] > 0:
            self._occupancy(method, bucket, rounds).add(row_rounds / (last["load"] * rounds))     # load >= rows

    def observe_served(self, method: str, bucket: int, tokens: int, seconds: float) -> None:
        """The last choice's dispatch of `method` at `bucket` rows committed `tokens` kept tokens in
        `seconds` of the engine's busy time since the dispatch before it, admissions left out: a
        sample of `realized` when the dispatch served (not a timing, refresh or in-step one)."""
        last = self.last
        if last["method"] != method or not last["served"]:
            return
        rate = last["rounds_rate"]
        if not rate or tokens <= 0 or seconds <= 0:
            return
        self._realized.add(method, bucket, tokens / rate, seconds)

    def time_prefill(self, lean: bool, rows: int, seconds: float) -> None:
        """Warm-up timed a one-call prefill (`PrefillShares.time`)."""
        self.prefill.time(lean, rows, seconds)

    def observe_prefill(self, lean: bool, rows: int, requests: int, seconds: float, bucket: int) -> None:
        """A live one-call prefill, its rows going to a state of `bucket` rows (`PrefillShares.observe`,
        a sample of the method serving)."""
        self.prefill.observe(lean, rows, requests, seconds, self._serving, bucket)

    def observe_output(self, tokens: int) -> None:
        """A request finished with `tokens` generated."""
        self._output_tokens.add(float(tokens))

    def observe_host(self, bucket: int, seconds: float) -> None:
        """The host spent `seconds` per round at `bucket` rows between one dispatch's results and the
        next dispatch (no prefill between them)."""
        self._host_s.add(bucket, max(0.0, seconds))

    def describe(self) -> dict:
        """The last choice: method, why, rows, load, bucket, rounds (the dispatch's), each method's tau
        and estimated tok/s (at the load)."""
        return dict(self.last)
