"""Plain autoregressive decoding (greedy or sampled): the baseline and the oracle for every method.

Two jitted functions over fixed shapes, each donating the KV cache: `prefill_step` (one prefill
chunk, `decode/prefill.py`) and `decode_step`; one compile per batch / chunk / cache bucket. The
Python loop feeds the prompt's chunks, then one token per row per step, and checks stopping."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx

from dmtp_jax.checkpoint.hf import LoadedTarget
from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.decode.batch import StopTracker, pad_prompts
from dmtp_jax.decode.prefill import DEFAULT_PREFILL_CHUNK, prefill_chunks, target_chunk
from dmtp_jax.decode.sampling import SamplingParams, pick_tokens
from dmtp_jax.decode.caches import TargetCaches, constrain_target_cache
from dmtp_jax.sharding import replicated


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]          # new tokens only, per row (a stop token is kept)
    stats: dict


def step_logits(model, tokens_b: jax.Array, positions_b: jax.Array, cache):
    """The target on one token per row at its position, with `cache`: `(logits [B, V], cache)`; the
    forward of every single-token step."""
    out = model(tokens_b[:, None], positions_b[:, None], cache)
    return model.logits(out.hidden_bth[:, 0]), out.cache


def prefill_step(graphdef, mesh, state, tokens_bt, start, lengths_b, cache, first_b, sp, key, greedy: bool = False):
    """One prefill chunk (`prefill.target_chunk`): `(first new token [B], cache pinned on mesh)`.
    `graphdef` and `mesh` are static (bound before jitting); the rest is traced."""
    res = target_chunk(nnx.merge(graphdef, state), tokens_bt, start, lengths_b, cache, first_b, sp, key, greedy)
    first = jax.lax.with_sharding_constraint(res.first_b, replicated(mesh))
    return first, constrain_target_cache(mesh, res.out.cache)


def decode_step(graphdef, mesh, state, tokens_b, positions_b, cache, sp, key, greedy: bool = False):
    """One token per row at its position (`step_logits`): `(next token [B], cache)`. The one
    single-token step (`ARDecoder.decode_step`, the exactness probe's chain)."""
    logits, cache = step_logits(nnx.merge(graphdef, state), tokens_b, positions_b, cache)
    nxt = jax.lax.with_sharding_constraint(pick_tokens(logits, sp, key, greedy), replicated(mesh))
    return nxt, constrain_target_cache(mesh, cache)


def run_prefill(step, state, tokens_bt, lengths_b, cache, sp, key, greedy: bool, prefill_chunk: int, mesh):
    """The padded prompts through `step` (a jitted `prefill_step`) chunk by chunk: `(first new token
    [B], filled cache)` (donated)."""
    first = jax.device_put(np.zeros(tokens_bt.shape[0], np.int32), replicated(mesh))
    for start, chunk_bt, _ in prefill_chunks(tokens_bt, prefill_chunk):
        first, cache = step(state, chunk_bt, start, lengths_b, cache, first, sp, key, greedy=greedy)
    return first, cache


class ARDecoder:
    """Batched greedy / sampled generation with EOS, stop tokens and max_new_tokens; prompts longer than
    `prefill_chunk` are prefilled in chunks."""

    def __init__(self, target: LoadedTarget, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.target = target
        self.caches = TargetCaches(target)
        self.prefill_chunk = int(prefill_chunk)
        static = (target.graphdef, target.mesh)
        self.prefill_step = counted_jit(functools.partial(prefill_step, *static), donate_argnames=("cache",),
                                        static_argnames=("greedy",))
        self.decode_step = counted_jit(functools.partial(decode_step, *static), donate_argnames=("cache",),
                                       static_argnames=("greedy",))

    def prefill(self, state, tokens_bt, lengths_b, cache, sp, key, greedy: bool = False):
        """Runs the padded prompts chunk by chunk (`run_prefill`); returns the first new token per
        row and the filled cache (donated)."""
        return run_prefill(self.prefill_step, state, tokens_bt, lengths_b, cache, sp, key, greedy, self.prefill_chunk,
                           self.target.mesh)

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 sampling: SamplingParams | None = None, seed: int = 0, stop_ids=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerationResult:
        """Up to `max_new_tokens` per prompt, each row stopping on its own stop token (`stop_ids`, default
        the config's EOS ids); `on_tokens(row, new_tokens)` streams output."""
        cfg = self.target.cfg
        sp = sampling or SamplingParams.make()
        stop_ids = cfg.eos_token_ids if stop_ids is None else stop_ids
        batch = pad_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings)
        rows = batch.tokens_bt.shape[0]
        tracker = StopTracker(batch.num_rows, max_new_tokens, stop_ids)
        base_key = jax.random.key(seed)
        cache = self.caches.new(rows, batch.max_len)

        t0 = time.perf_counter()
        greedy = sp.is_greedy           # static: a greedy compile never traces the sampling sorts
        tokens, cache = self.prefill(self.target.state, batch.tokens_bt, batch.lengths_b, cache, sp,
                                     jax.random.fold_in(base_key, 0), greedy=greedy)
        tokens = np.asarray(tokens)
        ttft = time.perf_counter() - t0
        positions = batch.lengths_b.copy()
        self._commit(tracker, tokens, on_tokens)
        steps = 0
        t1 = time.perf_counter()
        while not tracker.all_done:
            steps += 1
            tokens, cache = self.decode_step(self.target.state, tokens, np.minimum(positions, batch.max_len),
                                             cache, sp, jax.random.fold_in(base_key, steps), greedy=greedy)
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
        return {"prefill": self.prefill_step.compiles, "decode_step": self.decode_step.compiles}
