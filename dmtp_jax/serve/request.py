"""What the engine serves: a `Request` (prompt, sampling, limits and, as it runs, its output), the
`Event`s a step emits, and `row_sampling`, the one builder of a batch's per-row sampling.

Example:
    >>> Request([1, 2, 3], max_tokens=4).greedy
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from dmtp_jax.decode.batch import RequestError, StopTracker, pad_prompts
from dmtp_jax.decode.sampling import SamplingParams, check as check_sampling

_IDS = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and, as it runs, its output (`output_ids`, `finish_reason`)."""
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None          # default: the engine's (the model's EOS ids)
    id: int = dataclasses.field(default_factory=lambda: next(_IDS))
    output_ids: list[int] = dataclasses.field(default_factory=list)
    acceptance: list[int] = dataclasses.field(default_factory=list)    # tokens committed per round
    finish_reason: str | None = None                 # "stop", "length", "cancelled" or "error"
    arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finished_s: float | None = None
    cancelled: bool = False
    cancel_reason: str = "cancelled"
    tracker: StopTracker | None = None
    logprobs: int | None = None                      # top logprobs per token to return (None: no logprobs)
    token_logprobs: list = dataclasses.field(default_factory=list)   # per output token (`serve/logprobs.py`)
    choices_of: int | None = None                    # one of an n > 1 request's choices: its first's id (`serve/choices.py`)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def acceptance_stats(self) -> dict:
        """This request's rounds and tokens per round (accepted drafts + bonus), for `usage`."""
        return acceptance_stats(self.acceptance)


def acceptance_stats(acceptance: list[int]) -> dict:
    """Verify rounds, mean tokens per round and first-candidate acceptance of rounds that committed
    `acceptance` tokens each."""
    rounds = len(acceptance)
    return {"verify_rounds": rounds, "mean_acceptance_length": sum(acceptance) / rounds if rounds else 0.0,
            "first_candidate_acceptance": sum(a > 1 for a in acceptance) / rounds if rounds else 0.0}


def check_request(req: Request, *, vocab_size: int, max_model_len: int, max_top_k: int) -> Request:
    """Validates a request against a server's limits (raises `RequestError` naming the problem).

    Example:
        >>> check_request(Request([1, 2], max_tokens=0), vocab_size=64, max_model_len=32, max_top_k=8)
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.RequestError: max_tokens must be >= 1, got 0
    """
    if req.max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {req.max_tokens}")
    check_sampling(req.temperature, req.top_p, req.top_k)
    if not -2**63 <= req.seed < 2**63:
        raise RequestError(f"seed must be a 64-bit integer, got {req.seed}")
    if max_top_k < req.top_k < vocab_size:
        raise RequestError(f"top_k must be <= {max_top_k} (--max-top-k), or 0 / >= the vocabulary "
                           f"({vocab_size}) for none, got {req.top_k}")
    total = len(req.prompt_ids) + req.max_tokens
    if total > max_model_len:
        raise RequestError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) = {total} "
                           f"exceeds --max-model-len {max_model_len}")
    pad_prompts([req.prompt_ids], req.max_tokens, vocab_size, max_model_len, batch_bucket=1)
    return req


@dataclasses.dataclass
class Event:
    """What a step committed for a request: its new tokens (cut at a stop token / the budget) and
    whether it finished."""
    request: Request
    tokens: list[int]
    finished: bool


def merge_events(events: list[Event]) -> list[Event]:
    """One event per request, in the order of their first events: its tokens joined, finished if
    any was.

    Example:
        >>> a, b = Request([1], 4), Request([2], 4)
        >>> [(e.request is a, e.tokens, e.finished) for e in
        ...  merge_events([Event(a, [5], False), Event(b, [6], False), Event(a, [7], True)])]
        [(True, [5, 7], True), (False, [6], False)]
    """
    merged: dict[int, Event] = {}
    for ev in events:
        if ev.request.id in merged:
            first = merged[ev.request.id]
            first.tokens = first.tokens + list(ev.tokens)
            first.finished = first.finished or ev.finished
        else:
            merged[ev.request.id] = Event(ev.request, list(ev.tokens), ev.finished)
    return list(merged.values())


def row_sampling(reqs, rows: int, top_k_cap: int = 0, sampled_form: bool = False) -> tuple[SamplingParams, bool]:
    """`(SamplingParams.rows over `rows` rows, greedy)` for `reqs` in rows 0..len-1 (the rest, and greedy
    rows, temperature 0), in ONE form whatever the requests ask (top-k searching `top_k_cap`, top-p
    on), so no request's values compile anything. A top_k above the cap keeps every token. All rows
    greedy: the greedy form (`greedy` True), unless `sampled_form` (a call whose sampling costs
    little beside its work, as a prefill's first token, runs one program for both; a greedy row's
    token there is its argmax all the same).

    Example:
        >>> sp, greedy = row_sampling([Request([1], 2), Request([1], 2, temperature=0.5, top_k=9)], 4, 8)
        >>> sp.temperature.tolist(), sp.top_k.tolist(), sp.top_k_cap, greedy
        ([0.0, 0.5, 0.0, 0.0], [0, 0, 0, 0], 8, False)
    """
    temperature = np.zeros(rows, np.float32)
    top_p = np.ones(rows, np.float32)
    top_k = np.zeros(rows, np.int64)
    for i, r in enumerate(reqs):
        if not r.greedy:         # a greedy row's values change nothing
            temperature[i], top_p[i], top_k[i] = r.temperature, r.top_p, r.top_k if r.top_k <= top_k_cap else 0
    greedy = all(r.greedy for r in reqs)
    if greedy and not sampled_form:
        return SamplingParams.rows(temperature, top_p, top_k, top_k_cap=0), True
    return SamplingParams.rows(temperature, top_p, top_k, top_k_cap=top_k_cap, top_p_on=True), False
