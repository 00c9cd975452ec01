"""Request batches: shape buckets, padding and per-row stopping, shared by every decode method.

Batch and prompt length round up to powers of two (prompt >= `PROMPT_BUCKET_FLOOR`); the cache
length is prompt bucket + max_new_tokens + verify slots, rounded up to a multiple of 128, so one
bucket's prompts share every executable."""

from __future__ import annotations

import dataclasses

import numpy as np

from dmtp_jax.errors import RequestError  # noqa: F401  (re-exported: callers import it from here)

VERIFY_SLOTS = 8  # room kept past max_new_tokens for a speculative round's writes
PROMPT_BUCKET_FLOOR = 64  # shortest prompt bucket: short prompts share one compile (prefill is cheap)


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class PaddedBatch:
    """Prompts right-padded into `[batch_bucket, prompt_bucket]` with real lengths per row."""
    tokens_bt: np.ndarray
    lengths_b: np.ndarray
    num_rows: int           # real rows; the rest are padding rows
    max_len: int            # cache length (slots)


def pad_prompts(prompts: list[list[int]], max_new_tokens: int, vocab_size: int,
                max_positions: int | None = None, batch_bucket: int | None = None,
                slack: int = VERIFY_SLOTS) -> PaddedBatch:
    """Validates and pads prompts; the cache keeps `slack` slots past the budget for verify writes.

    Example:
        >>> b = pad_prompts([[1, 2, 3], [4]], max_new_tokens=5, vocab_size=10)
        >>> b.tokens_bt.shape, b.lengths_b.tolist(), b.max_len
        ((2, 64), [3, 1], 128)
    """
    if not prompts:
        raise RequestError("no prompts given")
    if max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise RequestError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise RequestError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    longest = max(len(p) for p in prompts)
    if max_positions is not None and longest + max_new_tokens > max_positions:
        raise RequestError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                           f"model's max_position_embeddings ({max_positions})")
    rows = batch_bucket or next_pow2(len(prompts))
    if rows < len(prompts):
        raise RequestError(f"{len(prompts)} prompts do not fit a batch of {rows}")
    bucket = next_pow2(longest, PROMPT_BUCKET_FLOOR)
    tokens = np.zeros((rows, bucket), np.int32)
    lengths = np.ones((rows,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
        lengths[i] = len(p)
    # the cache length depends on the bucket only (not the longest prompt): one per bucket
    return PaddedBatch(tokens, lengths, len(prompts), round_up(bucket + max_new_tokens + slack, 128))


class StopTracker:
    """Per-row stopping on EOS / stop tokens and max_new_tokens; keeps each row's new tokens."""

    def __init__(self, num_rows: int, max_new_tokens: int, stop_ids):
        self.max_new = max_new_tokens
        self.stop_ids = set(int(s) for s in stop_ids)
        self.outputs: list[list[int]] = [[] for _ in range(num_rows)]
        self.done = np.zeros(num_rows, bool)

    def add(self, row: int, tokens) -> list[int]:
        """Appends a row's newly committed tokens (truncated at a stop token or the budget);
        returns what was actually kept."""
        kept = []
        for t in tokens:
            if self.done[row]:
                break
            t = int(t)
            self.outputs[row].append(t)
            kept.append(t)
            if t in self.stop_ids or len(self.outputs[row]) >= self.max_new:
                self.done[row] = True
        return kept

    @property
    def all_done(self) -> bool:
        return bool(self.done.all())
