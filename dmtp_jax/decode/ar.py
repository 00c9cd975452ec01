"""Plain autoregressive decoding (greedy or sampled): the baseline and the oracle for every method.

Two jitted functions over fixed shapes: `prefill` (one compile per batch / prompt / cache bucket)
and `decode_step` (one compile per batch / cache bucket), each donating the KV cache. The Python
loop only moves one token per row per step and checks stopping.

Example:
    >>> from dmtp_jax.checkpoint.hf import load_target
    >>> dec = ARDecoder(load_target("/tmp/tiny-qwen3"))  # doctest: +SKIP
    >>> dec.generate([[1, 2, 3]], max_new_tokens=8).output_ids  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.checkpoint.hf import LoadedTarget
from dmtp_jax.decode.batch import StopTracker, pad_prompts
from dmtp_jax.decode.sampling import SamplingParams, sample_tokens
from dmtp_jax.layers.kv_cache import KVCache
from dmtp_jax.sharding import kv_cache_sharding, replicated


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]          # new tokens only, per row (a stop token is kept)
    stats: dict


def gather_rows(x_bt_: jax.Array, index_b: jax.Array) -> jax.Array:
    """`x[b, index[b]]` for every row."""
    return jnp.take_along_axis(x_bt_, index_b.reshape((-1,) + (1,) * (x_bt_.ndim - 1)), axis=1)[:, 0]


@functools.lru_cache(maxsize=None)
def _zeros_cache_maker(mesh, shape, dtype):
    s = kv_cache_sharding(mesh, shape)
    return jax.jit(lambda: KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)), out_shardings=KVCache(s, s))


def new_kv_cache(mesh, shape, dtype) -> KVCache:
    """A zero KV cache `[layers, B, S, kv, D]` created at its mesh sharding (so donating it never
    recompiles); one jitted maker per (mesh, shape, dtype)."""
    return _zeros_cache_maker(mesh, tuple(shape), jnp.dtype(dtype))()


def pin_kv_cache(mesh, cache: KVCache | None) -> KVCache | None:
    """Pins a cache to its sharding inside a jitted function (None passes through)."""
    if cache is None:
        return None
    s = kv_cache_sharding(mesh, cache.k_lbskd.shape)
    return KVCache(jax.lax.with_sharding_constraint(cache.k_lbskd, s),
                   jax.lax.with_sharding_constraint(cache.v_lbskd, s))


class TargetCaches:
    """The target's KV caches: created and pinned at their mesh sharding."""

    def __init__(self, target: LoadedTarget):
        self.target = target

    def shape(self, batch: int, max_len: int):
        cfg = self.target.cfg
        return (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)

    def constrain(self, cache: KVCache) -> KVCache:
        return pin_kv_cache(self.target.mesh, cache)

    def new(self, batch: int, max_len: int) -> KVCache:
        return new_kv_cache(self.target.mesh, self.shape(batch, max_len), self.target.state_dtype)


class ARDecoder:
    """Batched greedy / sampled generation with EOS, stop tokens and max_new_tokens."""

    def __init__(self, target: LoadedTarget):
        self.target = target
        self.caches = TargetCaches(target)
        self.prefill = jax.jit(self._prefill, donate_argnames=("cache",))
        self.decode_step = jax.jit(self._decode_step, donate_argnames=("cache",))

    def _model(self, state):
        return nnx.merge(self.target.graphdef, state)

    def _prefill(self, state, tokens_bt, lengths_b, cache, sp, key):
        """Runs the prompts; returns the first new token per row and the filled cache."""
        model = self._model(state)
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        out = model(tokens_bt, positions, cache)
        logits = model.logits(gather_rows(out.hidden_bth, lengths_b - 1))
        first = jax.lax.with_sharding_constraint(sample_tokens(logits, sp, key), replicated(self.target.mesh))
        return first, self.caches.constrain(out.cache)

    def _decode_step(self, state, tokens_b, positions_b, cache, sp, key):
        """Feeds one token per row at its position; returns the next token per row."""
        model = self._model(state)
        out = model(tokens_b[:, None], positions_b[:, None], cache)
        logits = model.logits(out.hidden_bth[:, 0])
        nxt = jax.lax.with_sharding_constraint(sample_tokens(logits, sp, key), replicated(self.target.mesh))
        return nxt, self.caches.constrain(out.cache)

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 sampling: SamplingParams | None = None, seed: int = 0, stop_ids=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerationResult:
        """Generates up to `max_new_tokens` per prompt; each row stops on its own stop token.

        `stop_ids` defaults to the config's EOS ids. `on_tokens(row, new_tokens)` streams output.
        """
        cfg = self.target.cfg
        sp = sampling or SamplingParams.make()
        stop_ids = cfg.eos_token_ids if stop_ids is None else stop_ids
        batch = pad_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings)
        rows = batch.tokens_bt.shape[0]
        tracker = StopTracker(batch.num_rows, max_new_tokens, stop_ids)
        base_key = jax.random.key(seed)
        cache = self.caches.new(rows, batch.max_len)

        t0 = time.perf_counter()
        tokens, cache = self.prefill(self.target.state, batch.tokens_bt, batch.lengths_b, cache, sp,
                                     jax.random.fold_in(base_key, 0))
        tokens = np.asarray(tokens)
        ttft = time.perf_counter() - t0
        positions = batch.lengths_b.copy()
        self._commit(tracker, tokens, on_tokens)
        steps = 0
        t1 = time.perf_counter()
        while not tracker.all_done:
            steps += 1
            tokens, cache = self.decode_step(self.target.state, tokens, np.minimum(positions, batch.max_len),
                                             cache, sp, jax.random.fold_in(base_key, steps))
            tokens = np.asarray(tokens)
            positions += 1
            self._commit(tracker, tokens, on_tokens)
        decode_s = time.perf_counter() - t1
        new_tokens = sum(len(o) for o in tracker.outputs)
        stats = {
            "method": "ar", "ttft_s": ttft, "decode_s": decode_s, "target_forwards": steps + 1,
            "new_tokens": new_tokens,
            "decode_tokens_per_s": (new_tokens - batch.num_rows) / decode_s if decode_s > 0 else 0.0,
            "batch_bucket": rows, "max_len": batch.max_len,
        }
        return GenerationResult([list(map(int, p)) for p in prompts], tracker.outputs, stats)

    @staticmethod
    def _commit(tracker: StopTracker, tokens, on_tokens):
        for row in range(len(tracker.outputs)):
            kept = tracker.add(row, [tokens[row]])
            if kept and on_tokens:
                on_tokens(row, kept)

    def compile_counts(self) -> dict[str, int]:
        """How many executables each jitted entry point holds (one per shape bucket)."""
        return {"prefill": self.prefill._cache_size(), "decode_step": self.decode_step._cache_size()}
