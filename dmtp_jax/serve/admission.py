"""Batched admission: waiting prompts of one prompt-length bucket prefilled together.

`form_group` takes the oldest waiting request and the next ones whose prompts fit its prompt bucket
(padded to it), as many as fit the free rows and the step's prefill budget (row bucket x chunk width
tokens per call; a lone request always fits); `PrefillGroup` runs their prefill chunk by chunk on a state of a compiled row
bucket, and its finished rows go into the running state in one scatter (`rows.put_rows`). A request
whose prefill failed in a group is prefilled alone afterwards (`solo`), so a fault is pinned on the
request that causes it.

`start_of` is the one place where a request's starting state and position are chosen: today a fresh
state at position 0 (a prefix cache would return its stored 1-row state and prefix length there;
such a request is prefilled alone).

Example:
    >>> group = form_group(waiting, free=4, buckets=(1, 2, 4), budget=512, prefill_chunk=512,
    ...                    solo=set())  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dmtp_jax.decode.batch import PROMPT_BUCKET_FLOOR, next_pow2, pad_prompts
from dmtp_jax.decode.prefill import chunk_length, prefill_chunks
from dmtp_jax.decode.spec import to_host
from dmtp_jax.serve.request import Request, row_sampling


def prompt_bucket(req: Request) -> int:
    """The compiled prompt length a request's prefill runs at."""
    return next_pow2(len(req.prompt_ids), PROMPT_BUCKET_FLOOR)


def row_bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest compiled row bucket holding `n` rows.

    Example:
        >>> row_bucket(3, (1, 2, 4, 8))
        4
    """
    return next(b for b in buckets if b >= n)


def row_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The compiled row counts of the running state: powers of two below `max_batch_size`, and it.

    Example:
        >>> row_buckets(12)
        (1, 2, 4, 8, 12)
    """
    out = [1]
    while out[-1] * 2 < max_batch_size:
        out.append(out[-1] * 2)
    return tuple(sorted(set(out + [max_batch_size])))


def start_of(req: Request):
    """`(1-row starting state or None for a fresh one, start position)` of a request's prefill."""
    return None, 0


def form_group(waiting, free: int, buckets: tuple[int, ...], budget: int, prefill_chunk: int,
               solo: set) -> list[Request]:
    """The requests to prefill together next (oldest first; empty when none can start): the oldest
    admissible waiting request, then others whose prompt bucket is at most its own while the row
    bucket times the chunk width stays within `budget` tokens. A request in `solo`, or one starting
    from a stored state, goes alone.
    """
    group: list[Request] = []
    for req in waiting:
        if len(group) >= free:
            break
        alone = req.id in solo or start_of(req)[0] is not None
        if group:
            width = chunk_length(max(prompt_bucket(r) for r in group + [req]), prefill_chunk)
            if (alone or prompt_bucket(req) > prompt_bucket(group[0])
                    or row_bucket(len(group) + 1, buckets) * width > budget):
                continue
        group.append(req)
        if alone:
            break
    return group


@dataclasses.dataclass
class PrefillGroup:
    """The prefill of `reqs` in progress: `step()` runs one chunk and returns True once every chunk
    ran; then `state` holds their rows (0..len-1; the rest padding) and `first` their first tokens."""
    reqs: list[Request]
    rows: int
    width: int
    state: object
    chunks: list
    lengths_b: np.ndarray
    key: jax.Array
    top_k_cap: int = 0
    first: list[int] | None = None

    @classmethod
    def start(cls, bank, reqs: list[Request], rows: int, max_len: int, vocab_size: int, top_k_cap: int = 0):
        """The group's padded prompts (validated; each request's length was checked on arrival) and
        its starting state (`start_of`)."""
        batch = pad_prompts([r.prompt_ids for r in reqs], 1, vocab_size, batch_bucket=rows)
        row_state, start = start_of(reqs[0])
        state = bank.new_state(rows, max_len) if row_state is None else row_state
        chunks = [(np.int32(s + start), c, n) for s, c, n in prefill_chunks(batch.tokens_bt[:, start:],
                                                                           bank.prefill_chunk)]
        # a lone request's seed seeds its first token; a group draws with its oldest request's
        key = jax.random.fold_in(jax.random.key(reqs[0].seed), 0)
        return cls(list(reqs), rows, chunks[0][1].shape[1], state, chunks, batch.lengths_b, key, top_k_cap)

    def step(self, bank) -> bool:
        start, chunk_bt, next_b = self.chunks.pop(0)
        sp, greedy = row_sampling(self.reqs, self.rows, self.top_k_cap)
        self.state = bank.prefill_step(bank.model_states(), chunk_bt, next_b, start, self.lengths_b, self.state,
                                       sp, self.key, greedy=greedy)
        if self.chunks:
            return False
        self.first = [int(t) for t in to_host(self.state.pending_b)[:len(self.reqs)]]
        return True
