"""Batched admission: waiting prompts prefilled together, shorter ones padded to the group's longest.

`form_group` picks the requests to prefill next (short and long prompts apart when the measured
prefill call times, by (row bucket, chunk width, lean), say that admits them all sooner; as many as
those times say are cheapest per request); `PrefillGroup` runs their prefill chunk by chunk on a
compiled row bucket, and the engine scatters the finished rows into the running state
(`rows.put_rows`). A request whose group prefill failed is retried alone (`solo`). `start_of` is
the one place a request's starting state and position are chosen (fresh, or a prefix cache hit)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dmtp_jax.decode.batch import PROMPT_BUCKET_FLOOR, next_pow2, pad_prompts
from dmtp_jax.decode.prefill import chunk_length, prefill_chunks
from dmtp_jax.decode.spec import to_host
from dmtp_jax.serve.stats import RecentMedians
from dmtp_jax.serve.request import Request, row_sampling

RESUME_BUCKET_FLOOR = 16     # a resumed prefill's shortest bucket: a chat turn's new text is short
ROW_BUCKET_STEP = 4          # consecutive row buckets differ by this factor (`row_buckets`)
SPLIT_MARGIN = 0.05          # a group splits once its first part's time per request is this much lower


def prompt_bucket(req: Request) -> int:
    """The compiled prompt length a request's prefill runs at."""
    return next_pow2(len(req.prompt_ids), PROMPT_BUCKET_FLOOR)


def row_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest compiled row bucket holding `n` rows."""
    return next(b for b in buckets if b >= n)


def row_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The compiled row counts of the running state: 1, every `ROW_BUCKET_STEP`-th power below
    `max_batch_size`, and it (few buckets: each one is a set of programs to compile; a state pads its
    rows to at most `ROW_BUCKET_STEP` times the rows running).

    Example:
        >>> row_buckets(8), row_buckets(12), row_buckets(64)
        ((1, 4, 8), (1, 4, 12), (1, 4, 16, 64))
    """
    out = [1]
    while out[-1] * ROW_BUCKET_STEP < max_batch_size:
        out.append(out[-1] * ROW_BUCKET_STEP)
    return tuple(sorted(set(out + [max_batch_size])))


def start_of(req: Request, cache=None, take: bool = False):
    """`(1-row starting state or None for a fresh one, start position)` of a request's prefill: the
    longest stored prefix in `cache`, else `(None, 0)`. A peek unless `take`; with `take` the hit is
    counted and the state is a copy (the stored one itself when nothing runs)."""
    # a greedy repeat runs no prefill: no first-token logprobs, so a request asking for them resumes before
    hit = None if cache is None else cache.lookup(req.prompt_ids, req.greedy and req.logprobs is None, peek=not take)
    if hit is None:
        return None, 0
    if not take or hit.start == len(req.prompt_ids):
        return hit.snapshot.state, hit.start
    return cache.copy(hit.snapshot.state), hit.start


def resume_tokens(suffix) -> np.ndarray:
    """`[1, bucket]`: the tokens a resumed prefill runs, right-padded to a power of two from
    `RESUME_BUCKET_FLOOR` (from `PROMPT_BUCKET_FLOOR` on, the prompt buckets' programs).

    Example:
        >>> resume_tokens([7, 8, 9]).shape, resume_tokens(list(range(40))).shape, resume_tokens([1] * 70).shape
        ((1, 16), (1, 64), (1, 128))
    """
    tokens = np.zeros((1, next_pow2(len(suffix), RESUME_BUCKET_FLOOR)), np.int32)
    tokens[0, :len(suffix)] = suffix
    return tokens


def resume_widths(prefill_chunk: int) -> list[int]:
    """The resumed prefills' token widths below the prompt buckets (what `Engine.warm_up` adds)."""
    return sorted({chunk_length(w, prefill_chunk) for w in range(RESUME_BUCKET_FLOOR, PROMPT_BUCKET_FLOOR)
                   if w & (w - 1) == 0})


def call_s(times: RecentMedians | None, rows: int, width: int, lean: bool) -> float | None:
    """The measured seconds of a one-call prefill of `rows` rows `width` tokens wide (`times` by (rows,
    width, lean)): lean where asked and measured (a lean call is timed only where the bank can run one),
    else full; None while unmeasured. A lean call costs less than a full one of the same shape, so the
    two are not one sample set.

    Example:
        >>> t = RecentMedians(); t.add((8, 64, False), 0.12); t.add((8, 64, True), 0.09); t.add((8, 512, False), 0.5)
        >>> call_s(t, 8, 64, True), call_s(t, 8, 64, False), call_s(t, 8, 512, True), call_s(t, 8, 128, True)
        (0.09, 0.12, 0.5, None)
    """
    if times is None:
        return None
    return (lean and times.get((rows, width, True))) or times.get((rows, width, False))


def group_width(reqs: list[Request], prefill_chunk: int) -> int:
    """The chunk width a prefill of `reqs` runs at: its longest prompt's bucket, at most a chunk."""
    return chunk_length(max(prompt_bucket(r) for r in reqs), prefill_chunk)


def one_call_s(reqs: list[Request], buckets: tuple[int, ...], prefill_chunk: int, times: RecentMedians | None,
               lean: bool = False) -> float | None:
    """The measured seconds (`call_s`) of one prefill call of `reqs`: their row bucket, `group_width`."""
    return call_s(times, row_bucket(len(reqs), buckets), group_width(reqs, prefill_chunk), lean)


def cheapest_part(group: list[Request], buckets: tuple[int, ...], prefill_chunk: int,
                  times: RecentMedians | None, lean: bool = False) -> list[Request]:
    """The oldest requests of `group` to prefill first: the count whose row bucket's measured call time
    per request (`call_s`, lean when the group's prefill is) is lowest, among the group's own count and
    the smaller buckets (a larger count unless a smaller one is `SPLIT_MARGIN` cheaper); the whole group
    while a time it needs is unmeasured. Where a call's time grows with its rows (a CPU), 2 requests in
    an 8-row bucket cost 4x their share and go as two 1-row calls; where it does not (an accelerator's
    small batches), the group stays whole.

    Example:
        >>> t = RecentMedians(); t.add((1, 64, False), 0.01); t.add((8, 64, False), 0.08)
        >>> reqs = [Request([1] * 10, 4) for _ in range(3)]
        >>> len(cheapest_part(reqs, (1, 8), 512, t)), len(cheapest_part(reqs, (1, 8), 512, None))
        (1, 3)
        >>> t = RecentMedians(); t.add((1, 64, False), 0.01); t.add((8, 64, False), 0.12)
        >>> t.add((1, 64, True), 0.009); t.add((8, 64, True), 0.06)    # lean: 8 rows cost less than 8 x 1
        >>> eight = [Request([1] * 10, 4) for _ in range(8)]
        >>> len(cheapest_part(eight, (1, 8), 512, t)), len(cheapest_part(eight, (1, 8), 512, t, lean=True))
        (1, 8)
    """
    if len(group) < 2:
        return group            # nothing to split
    best, best_cost = group, None
    for n in sorted({len(group)} | {b for b in buckets if b < len(group)}, reverse=True):
        part = group[:n]
        seconds = one_call_s(part, buckets, prefill_chunk, times, lean)
        if seconds is None:
            return group
        if best_cost is None or seconds / n < (1 - SPLIT_MARGIN) * best_cost:
            best, best_cost = part, seconds / n
    return best


def prefill_s(reqs: list[Request], buckets: tuple[int, ...], prefill_chunk: int, times: RecentMedians | None,
              lean: bool = False) -> float | None:
    """The measured seconds (`call_s`) of prefilling `reqs` in order as successive `cheapest_part`
    groups, each as wide as its widest prompt; None while a time it needs is unmeasured.

    Example:
        >>> t = RecentMedians(); t.add((1, 64, False), 0.01); t.add((8, 64, False), 0.04); t.add((8, 128, False), 0.1)
        >>> prefill_s([Request([1] * 10, 4)] * 6, (1, 8), 512, t), prefill_s([Request([1] * 100, 4)], (1, 8), 512, t)
        (0.04, None)
    """
    total = 0.0
    while reqs:
        part = cheapest_part(reqs, buckets, prefill_chunk, times, lean)
        seconds = one_call_s(part, buckets, prefill_chunk, times, lean)
        if seconds is None:
            return None
        total, reqs = total + seconds, reqs[len(part):]
    return total


def width_part(group: list[Request], buckets: tuple[int, ...], prefill_chunk: int,
               times: RecentMedians | None, lean: bool = False) -> list[Request]:
    """The requests of `group` (oldest first) to prefill before the others: split at a chunk width
    `w`, the side of the oldest request (prompts at most `w` wide, or wider), at the `w` for which
    prefilling the two sides one after the other takes the least measured time (`prefill_s`); the
    whole group unless that is `SPLIT_MARGIN` faster than prefilling it as it is, or while a time
    it needs is unmeasured. A short prompt padded to a long one's width costs that width: a burst of
    short prompts with two long ones goes as the short ones and the long ones apart, not all as wide
    as a static batch would.

    Example:
        >>> t = RecentMedians(); t.add((1, 64, False), 0.01); t.add((1, 128, False), 0.02)
        >>> t.add((8, 64, False), 0.04); t.add((8, 128, False), 0.1)
        >>> burst = [Request([1] * n, 4) for n in (10, 100, 10, 10, 10, 100, 10, 10)]
        >>> [len(r.prompt_ids) for r in width_part(burst, (1, 8), 512, t)]
        [10, 10, 10, 10, 10, 10]
        >>> [len(r.prompt_ids) for r in width_part(burst[1:], (1, 8), 512, t)]
        [100, 100]
        >>> len(width_part(burst, (1, 8), 512, None))
        8
    """
    widths = [group_width([r], prefill_chunk) for r in group]
    best, best_s = group, prefill_s(group, buckets, prefill_chunk, times, lean)
    if best_s is None:
        return group
    for w in sorted(set(widths))[:-1]:
        sides = ([r for r, x in zip(group, widths) if x <= w], [r for r, x in zip(group, widths) if x > w])
        seconds = [prefill_s(side, buckets, prefill_chunk, times, lean) for side in sides]
        if None not in seconds and sum(seconds) < (1 - SPLIT_MARGIN) * best_s:
            best, best_s = sides[widths[0] > w], sum(seconds)
    return best


def form_group(waiting, free: int, buckets: tuple[int, ...], budget: int, prefill_chunk: int,
               solo: set, cache=None, times: RecentMedians | None = None, lean: bool = False) -> list[Request]:
    """The requests to prefill together next (oldest first; empty when none can start): the oldest
    admissible request, then others while row bucket x the chunk width of the group's longest prompt
    bucket stays within `budget` tokens (a burst of arrivals is one prefill, as a static batch's, short
    prompts padded to the longest), cut by the prefill `times` (`lean`: of lean calls, where measured)
    to the prompts of the oldest's width side (`width_part`) and then to its `cheapest_part`, the
    choices of one request kept together (`keep_choices`). A request in `solo` or starting from a
    stored state goes alone."""
    group: list[Request] = []
    for req in waiting:
        if len(group) >= free:
            break
        alone = req.id in solo or start_of(req, cache)[0] is not None
        if group:
            if alone or row_bucket(len(group) + 1, buckets) * group_width(group + [req], prefill_chunk) > budget:
                continue
        group.append(req)
        if alone:
            break
    if len(group) < 2:
        return group
    return keep_choices(cheapest_part(width_part(group, buckets, prefill_chunk, times, lean), buckets,
                                      prefill_chunk, times, lean), group)


def keep_choices(part: list[Request], group: list[Request]) -> list[Request]:
    """`part` of `group` and the other choices of its requests' (`Request.choices_of`: one prompt, so
    one width), in `group`'s order: a request's `n` choices share one prefill call, never split by the
    measured times (they fit the group's rows and budget, so their part does).

    Example:
        >>> a, b, c = Request([1], 4, choices_of=7), Request([2], 4), Request([1], 4, choices_of=7)
        >>> [r is x for r, x in zip(keep_choices([a], [a, b, c]), (a, c))]
        [True, True]
    """
    parents = {r.choices_of for r in part} - {None}
    if not parents:
        return part
    return [r for r in group if r in part or r.choices_of in parents]


@dataclasses.dataclass
class PrefillGroup:
    """The prefill of `reqs` in progress: `step()` runs one chunk and returns True once all ran; then
    `state` holds their rows (0..len-1) and `first` their first tokens; `owned`: `state` is the
    group's own (not a prefix cache entry's), so the engine may adopt it as its running state;
    `lean`: the prefill defers the drafting caches (`RoundBank.lean_prefill`); a fresh group's state then
    has none (`RoundBank.new_state`)."""
    reqs: list[Request]
    rows: int
    width: int
    state: object
    chunks: list
    lengths_b: np.ndarray
    key: jax.Array
    top_k_cap: int = 0
    first: list[int] | None = None
    owned: bool = True
    calls: int = 0          # prefill calls the group runs in all
    lean: bool = False
    logprobs: list | None = None    # per row, the first token's `TokenLogprobs` on the host (None: not run)
    _ending: list = dataclasses.field(default_factory=list)   # (rows ending in a call, its TokenLogprobs)

    @classmethod
    def start(cls, bank, reqs: list[Request], rows: int, max_len: int, vocab_size: int, top_k_cap: int = 0,
              cache=None, lean: bool = False):
        """The group's padded prompts and its starting state (`start_of`); `lean`: prefill lean where the
        bank can (plain rounds serve, so the drafting caches may wait)."""
        batch = pad_prompts([r.prompt_ids for r in reqs], 1, vocab_size, batch_bucket=rows)
        row_state, start = start_of(reqs[0], cache, take=True)
        if row_state is None:
            state, tokens_bt = None, batch.tokens_bt
        else:
            rows, state, suffix = 1, row_state, reqs[0].prompt_ids[start:]
            tokens_bt = resume_tokens(suffix) if suffix else np.zeros((1, 0), np.int32)
            if suffix:          # a prefill reads the drafting caches: the snapshot's plain rounds first
                state = bank.caught_up(state)
        chunks = [(np.int32(s + start), c, n)
                  for s, c, n in (prefill_chunks(tokens_bt, bank.prefill_chunk) if tokens_bt.shape[1] else ())]
        width = chunks[0][1].shape[1] if chunks else 0
        lean = lean and bank.lean_prefill(width, len(chunks))
        if state is None:       # a fresh lean group's state leaves out the drafting caches it would not write
            state = bank.new_state(rows, max_len, lean=lean)
        # a lone request's seed seeds its first token; a group draws with its oldest request's
        key = jax.random.fold_in(jax.random.key(reqs[0].seed), 0)
        return cls(list(reqs), rows, width, state, chunks, batch.lengths_b[:rows], key, top_k_cap,
                   owned=row_state is None or bool(chunks), calls=len(chunks),   # a prefill's output is new
                   lean=lean)

    def step(self, bank) -> bool:
        if self.chunks:
            start, chunk_bt, next_b = self.chunks.pop(0)
            sp, _ = row_sampling(self.reqs, self.rows, self.top_k_cap, sampled_form=True)    # one program
            self.state, lp = bank.prefill_step(bank.model_states(), chunk_bt, next_b, start, self.lengths_b,
                                               self.state, sp, self.key, greedy=False, defer=self.lean)
            if any(r.logprobs is not None for r in self.reqs):
                last = np.asarray(self.lengths_b) - 1
                self._ending.append(((last >= start) & (last < start + chunk_bt.shape[1]), lp))
        if self.chunks:
            return False
        self.first = [int(t) for t in to_host(self.state.pending_b)[:len(self.reqs)]]
        self.logprobs = first_logprobs(self._ending, len(self.reqs))
        return True


def first_logprobs(ending: list, rows: int) -> list | None:
    """Per row, its first token's `TokenLogprobs` (host arrays) from the prefill call its prompt ended in
    (`ending`: `(ends [B], TokenLogprobs [B])` per call); None without any."""
    if not ending:
        return None
    out: list = [None] * rows
    for ends, lp in to_host(ending):
        for row in np.flatnonzero(ends[:rows]):
            out[row] = jax.tree.map(lambda x, r=row: x[r:r + 1], lp)
    return out
