"""Chunked prefill, shared by every decoder: the padded prompt runs in fixed token chunks.

A prompt bucket of P tokens runs in `ceil(P / prefill_chunk)` calls (one when it fits), so the
prefill's activations are one chunk's whatever the prompt length. Each call runs the target on the
chunk at positions `start..start+C-1` with the cache, continuing from the K/V and DeltaNet states
the earlier chunks left (`kv_valid_bt` keeps padding out). A row's first new token is picked in the
chunk holding its last prompt token; the same PRNG key in every call makes a sampled first token
the one a single call would draw.

Example:
    >>> [(int(s), t.shape, n.shape) for s, t, n in prefill_chunks(np.zeros((2, 100), np.int32), 64)]
    [(0, (2, 64), (2,)), (64, (2, 64), (2,))]
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.decode.sampling import SamplingParams, pick_tokens

DEFAULT_PREFILL_CHUNK = 512


def chunk_length(prompt_len: int, prefill_chunk: int) -> int:
    """Tokens per prefill call: the whole bucket when it fits one chunk."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    return min(prompt_len, prefill_chunk)


def prefill_chunks(tokens_bt: np.ndarray, prefill_chunk: int) -> Iterator[tuple[np.int32, np.ndarray, np.ndarray]]:
    """`(start, tokens [B, C], next_b [B])` per call: the chunk and the token right after it (0 past
    the bucket; the MTP pairs a chunk's last hidden with it). The last chunk is padded with zeros."""
    b, p = tokens_bt.shape
    c = chunk_length(p, prefill_chunk)
    n = -(-p // c)
    padded = np.zeros((b, n * c + 1), np.int32)
    padded[:, :p] = tokens_bt
    for i in range(n):
        yield np.int32(i * c), padded[:, i * c:(i + 1) * c], padded[:, (i + 1) * c]


@dataclasses.dataclass
class ChunkOutput:
    out: object                 # the target's TargetOutput over the chunk
    positions_bt: jax.Array     # the chunk's positions
    first_b: jax.Array          # first new token (picked here for rows ending here, else carried)
    last_b: jax.Array           # index in the chunk of the row's last prompt token (clipped)
    ends_b: jax.Array           # whether the row's last prompt token is in this chunk
    logits_bv: jax.Array | None = None    # the target's logits at the row's last prompt token in the chunk


def target_chunk(model, tokens_bt: jax.Array, start: jax.Array, lengths_b: jax.Array, cache, first_b: jax.Array,
                 sp: SamplingParams, key: jax.Array, greedy: bool, capture_layers: tuple[int, ...] = ()) -> ChunkOutput:
    """The target over one prefill chunk (positions `start + arange(C)`, real where `< lengths_b`) with
    `cache`, and the first new token of the rows whose prompt ends in it."""
    c = tokens_bt.shape[1]
    positions = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), tokens_bt.shape)
    out = model(tokens_bt, positions, cache, capture_layers=capture_layers,
                kv_valid_bt=positions < lengths_b[:, None])
    last = jnp.clip(lengths_b - 1 - start, 0, c - 1)
    ends = (lengths_b - 1 >= start) & (lengths_b - 1 < start + c)
    hidden_bh = jnp.take_along_axis(out.hidden_bth, last[:, None, None], axis=1)[:, 0]
    logits = model.logits(hidden_bh)
    picked = pick_tokens(logits, sp, key, greedy)
    return ChunkOutput(out, positions, jnp.where(ends, picked, first_b), last, ends, logits)
