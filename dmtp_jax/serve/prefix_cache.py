"""An exact prefix cache for the serving engine: 1-row decode states keyed by the `L + 1` tokens they
hold (L consumed, one pending), on the device under a byte budget, least recently used evicted
first. A prompt resumes from the longest key that is its prefix, or (greedy) reuses a state as is;
outputs equal a full prefill's (docs/serving.md#prefix-cache).

Example:
    >>> cache = PrefixCache(1 << 20)
    >>> cache.offer((1, 2, 3, 9), {"k": jnp.zeros((1, 4))}, greedy=True)
    True
    >>> hit = cache.lookup([1, 2, 3, 9, 5], greedy=False)
    >>> hit.start, hit.ready
    (3, False)
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.decode.batch import RequestError


def prefix_cache_bytes(gb: float) -> int:
    """`--prefix-cache-gb` in bytes (GiB, 2**30); raises `RequestError` when negative."""
    if not gb >= 0:
        raise RequestError(f"--prefix-cache-gb must be >= 0, got {gb}")
    return int(gb * (1 << 30))


def prefix_key(tokens) -> tuple[int, bytes]:
    """`(length, hash of the token ids)`: the key of a snapshot holding exactly `tokens`.

    Example:
        >>> prefix_key([1, 2])[0], prefix_key([1, 2]) == prefix_key((1, 2)), prefix_key([1, 2]) == prefix_key([2, 1])
        (2, True, False)
    """
    ids = np.asarray(tokens, np.int32)
    return len(ids), hashlib.blake2b(ids.tobytes(), digest_size=16).digest()


def state_nbytes(state) -> int:
    """Bytes of every leaf of a state or of its shapes (global sizes)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def copy_state(state):
    """A copy of every leaf (a stored snapshot stays valid when its copy is donated to a prefill)."""
    return jax.tree.map(jnp.copy, state)


@dataclasses.dataclass(eq=False)
class Snapshot:
    """A stored 1-row state: `tokens` consumed but the last, which is pending."""
    tokens: tuple[int, ...]
    state: object
    greedy: bool            # the pending token is the greedy pick after tokens[:-1]
    nbytes: int


@dataclasses.dataclass
class Hit:
    """What a lookup found: resume the prefill at `start` from a copy of the snapshot's state, or
    (`ready`, a greedy repeat) use the state as is, its pending token the first token."""
    snapshot: Snapshot
    start: int
    ready: bool

    @property
    def tokens(self) -> int:
        """Prompt tokens not prefilled thanks to the hit."""
        return self.start


class PrefixCache:
    """Snapshots under a byte budget, least recently used evicted first. `extract(state, row)` and
    `copy(state)`: the engine's jitted row programs; `row_bytes`: a 1-row state's bytes."""

    def __init__(self, budget_bytes: int, *, extract=None, copy=None, row_bytes: int = 0):
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = int(budget_bytes)
        self.extract, self.copy, self.row_bytes = extract, copy, int(row_bytes)
        self.counters = collections.Counter()   # lookups, hits, hit_tokens, stored, evicted
        self.clear()

    @classmethod
    def for_rows(cls, budget_bytes: int, moves, one_row_state) -> "PrefixCache | None":
        """The cache of an engine whose row moves are `moves` (`rows.RowMoves`, its row extraction) and
        whose 1-row state is `one_row_state` (the copy's layout, the bytes a row holds); None when
        `budget_bytes` is 0."""
        if not budget_bytes:
            return None
        return cls(budget_bytes, extract=moves.extract, row_bytes=state_nbytes(one_row_state),
                   copy=counted_jit(copy_state, out_shardings=jax.tree.map(lambda x: x.sharding, one_row_state)))

    def clear(self) -> None:
        """Drops every snapshot (the row programs stay)."""
        self.entries: collections.OrderedDict[tuple, Snapshot] = collections.OrderedDict()
        self.heads: dict[tuple, tuple] = {}         # key of tokens[:-1] -> key, greedy snapshots
        self.lengths: collections.Counter = collections.Counter()    # key lengths held
        self.bytes = 0
        self._near_end: set[int] = set()            # requests offered by `before_round`

    # ---- the store ---------------------------------------------------------------------------
    def lookup(self, prompt_ids, greedy: bool, peek: bool = False) -> Hit | None:
        """The longest reusable snapshot for a prompt (a greedy repeat first), marked used and counted unless
        `peek`; None without one."""
        prompt = tuple(int(t) for t in prompt_ids)
        hit = None
        if greedy:
            snap = self._get(self.heads.get(prefix_key(prompt)))
            if snap is not None and snap.tokens[:-1] == prompt:
                hit = Hit(snap, len(prompt), True)
        for m in sorted((m for m in self.lengths if m <= len(prompt)), reverse=True):
            if hit is not None:
                break
            snap = self._get(prefix_key(prompt[:m]))
            if snap is not None and snap.tokens == prompt[:m]:
                hit = Hit(snap, m - 1, False)
        if peek:
            return hit
        self.counters["lookups"] += 1
        if hit is not None:
            self.entries.move_to_end(prefix_key(hit.snapshot.tokens))
            self.counters["hits"] += 1
            self.counters["hit_tokens"] += hit.tokens
        return hit
    def _get(self, key) -> Snapshot | None:
        return None if key is None else self.entries.get(key)

    def offer(self, tokens, state, greedy: bool) -> bool:
        """Stores `state` as the snapshot of `tokens`, evicting the least recently used past the budget;
        returns whether it is stored (a known key is only marked used; one larger than the budget is not)."""
        tokens = tuple(int(t) for t in tokens)
        key = prefix_key(tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        nbytes = state_nbytes(state)
        if nbytes > self.budget:
            return False
        while self.bytes + nbytes > self.budget:
            self._evict()
        self.entries[key] = Snapshot(tokens, state, bool(greedy), nbytes)
        self.lengths[len(tokens)] += 1
        if greedy:
            self.heads[prefix_key(tokens[:-1])] = key
        self.bytes += nbytes
        self.counters["stored"] += 1
        return True

    def _evict(self) -> None:
        key, snap = self.entries.popitem(last=False)
        self.lengths[len(snap.tokens)] -= 1
        if not self.lengths[len(snap.tokens)]:
            del self.lengths[len(snap.tokens)]
        head = prefix_key(snap.tokens[:-1])
        if self.heads.get(head) == key:
            del self.heads[head]
        self.bytes -= snap.nbytes
        self.counters["evicted"] += 1

    # ---- the engine's hooks ---------------------------------------------------------------------
    def before_round(self, state, running, reach: int) -> None:
        """Before a speculative dispatch that may commit up to `reach` tokens per row: offers once the rows
        whose budget it may reach (row i runs `running[i]`), so a next turn resumes near the answer's end."""
        self._near_end &= {req.id for req in running if req is not None}
        for row, req in enumerate(running):
            if req is not None and req.id not in self._near_end and req.max_tokens - len(req.output_ids) <= reach:
                self._near_end.add(req.id)
                self.offer_row(state, row, req.prompt_ids + req.output_ids, req.greedy)

    def offer_row(self, state, row: int, tokens, greedy: bool) -> bool:
        """A row of the running `state` offered as the snapshot of `tokens` (prompt + output), extracted
        only when new and within the budget."""
        key = prefix_key(tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return False
        if self.row_bytes > self.budget:
            return False
        return self.offer(tokens, self.extract(state, np.int32(row)), greedy)

    def compile_counts(self) -> dict[str, int]:
        """The row extraction's (one per row bucket) and the row copy's (one) compiles."""
        programs = (("extract_row", self.extract), ("copy_row", self.copy))
        return {name: getattr(fn, "compiles", 0) for name, fn in programs}

    def metrics(self) -> dict[str, int]:
        """What `/metrics` shows: lookups, hits, hit tokens, snapshots held, their bytes, the budget."""
        c = self.counters
        return {"lookups": c["lookups"], "hits": c["hits"], "hit_tokens": c["hit_tokens"], "stored": c["stored"],
                "evicted": c["evicted"], "entries": len(self.entries), "bytes": self.bytes,
                "budget_bytes": self.budget}
