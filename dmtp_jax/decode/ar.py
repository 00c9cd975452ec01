"""Plain autoregressive decoding (greedy or sampled): the baseline and the oracle for every method.

Two jitted functions over fixed shapes: `prefill_step` (one prefill chunk, `decode/prefill.py`; one
compile per batch / chunk / cache bucket) and `decode_step` (one compile per batch / cache bucket),
each donating the KV cache. The Python loop only feeds the prompt's chunks, then moves one token per
row per step and checks stopping.

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
from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.decode.batch import StopTracker, pad_prompts
from dmtp_jax.decode.prefill import DEFAULT_PREFILL_CHUNK, prefill_chunks, target_chunk
from dmtp_jax.decode.sampling import SamplingParams, pick_tokens
from dmtp_jax.layers.kv_cache import KVCache, TargetCache
from dmtp_jax.sharding import cache_kv_heads, kv_cache_sharding, recurrent_state_sharding, replicated


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


@functools.lru_cache(maxsize=None)
def _zeros_maker(mesh, shape, dtype):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=recurrent_state_sharding(mesh, shape))


def kv_cache_shape(cfg, batch: int, max_len: int, mesh=None, layers: int | None = None) -> tuple[int, ...]:
    """`[attention layers (or layers), B, S, kv_heads, head_dim]`, the KV heads as laid out on
    `mesh` (`sharding.cache_kv_heads`; the model's own without one)."""
    heads = cache_kv_heads(cfg.num_key_value_heads, cfg.num_attention_heads, mesh)
    return (len(cfg.attention_layers) if layers is None else layers, batch, max_len, heads, cfg.head_dim)


def recurrent_state_shapes(cfg, batch: int):
    """`(conv [Ll, B, K-1, C], ssm [Ll, B, nv, dk, dv])` of the DeltaNet layers, or None."""
    n = len(cfg.linear_layers)
    if not n:
        return None
    return ((n, batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim),
            (n, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def state_bytes_per_row(cfg, max_len: int, dtype_bytes: int = 2, verify_slots: int = 8) -> dict[str, int]:
    """Bytes one row holds across rounds -- `kv` (K/V of the attention layers at `max_len` slots),
    `conv` and `ssm` (fp32) of the DeltaNet layers -- and `verify_transient`: the per-token DeltaNet
    inputs a verify round of `verify_slots` keeps for its commit (released after the round).
    DeltaNet states are committed by replaying the accepted prefix, so no per-slot snapshots exist.

    Example:
        >>> state_bytes_per_row(cfg, 32768)["ssm"]  # doctest: +SKIP
    """
    out = {"kv": 2 * int(np.prod(kv_cache_shape(cfg, 1, max_len))) * dtype_bytes, "conv": 0, "ssm": 0,
           "verify_transient": 0}
    shapes = recurrent_state_shapes(cfg, 1)
    if shapes:
        conv, ssm = shapes
        out["conv"] = int(np.prod(conv)) * dtype_bytes
        out["ssm"] = int(np.prod(ssm)) * 4
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        per_token = cfg.linear_conv_dim * dtype_bytes + 4 * (nv * dk + nv * dv + 2 * nv)
        out["verify_transient"] = conv[0] * verify_slots * per_token
    return out


class TargetCaches:
    """The target's `TargetCache` (attention K/V, DeltaNet conv windows and states): created and
    pinned at their mesh sharding (sizes: `state_bytes_per_row`)."""

    def __init__(self, target: LoadedTarget):
        self.target = target

    def shape(self, batch: int, max_len: int):
        return kv_cache_shape(self.target.cfg, batch, max_len, self.target.mesh)

    def shardings(self, cache: TargetCache) -> TargetCache:
        """The sharding of every array of a cache (or of its shapes), as a `TargetCache` tree."""
        mesh = self.target.mesh
        state = lambda x: None if x is None else recurrent_state_sharding(mesh, x.shape)  # noqa: E731
        kv = kv_cache_sharding(mesh, cache.kv.k_lbskd.shape)
        return TargetCache(KVCache(kv, kv), state(cache.conv_lbwc), state(cache.ssm_lbhkv))

    def constrain(self, cache: TargetCache) -> TargetCache:
        return jax.tree.map(jax.lax.with_sharding_constraint, cache, self.shardings(cache))

    def new(self, batch: int, max_len: int) -> TargetCache:
        mesh = self.target.mesh
        kv = new_kv_cache(mesh, self.shape(batch, max_len), self.target.state_dtype)
        shapes = recurrent_state_shapes(self.target.cfg, batch)
        if shapes is None:
            return TargetCache(kv)
        conv_shape, ssm_shape = shapes
        return TargetCache(kv, _zeros_maker(mesh, conv_shape, jnp.dtype(self.target.state_dtype))(),
                           _zeros_maker(mesh, ssm_shape, jnp.dtype(jnp.float32))())


class ARDecoder:
    """Batched greedy / sampled generation with EOS, stop tokens and max_new_tokens. Prompts longer
    than `prefill_chunk` tokens are prefilled in chunks of that many (`decode/prefill.py`)."""

    def __init__(self, target: LoadedTarget, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.target = target
        self.caches = TargetCaches(target)
        self.prefill_chunk = int(prefill_chunk)
        self.prefill_step = counted_jit(self._prefill_step, donate_argnames=("cache",), static_argnames=("greedy",))
        self.decode_step = counted_jit(self._decode_step, donate_argnames=("cache",), static_argnames=("greedy",))

    def _model(self, state):
        return nnx.merge(self.target.graphdef, state)

    def _prefill_step(self, state, tokens_bt, start, lengths_b, cache, first_b, sp, key, greedy: bool = False):
        """One prefill chunk; returns the first new token per row (carried for rows whose prompt
        ends in a later chunk) and the cache."""
        res = target_chunk(self._model(state), tokens_bt, start, lengths_b, cache, first_b, sp, key, greedy)
        first = jax.lax.with_sharding_constraint(res.first_b, replicated(self.target.mesh))
        return first, self.caches.constrain(res.out.cache)

    def prefill(self, state, tokens_bt, lengths_b, cache, sp, key, greedy: bool = False):
        """Runs the padded prompts chunk by chunk; returns the first new token per row and the
        filled cache (donated)."""
        first = jax.device_put(np.zeros(tokens_bt.shape[0], np.int32), replicated(self.target.mesh))
        for start, chunk_bt, _ in prefill_chunks(tokens_bt, self.prefill_chunk):
            first, cache = self.prefill_step(state, chunk_bt, start, lengths_b, cache, first, sp, key, greedy=greedy)
        return first, cache

    def _decode_step(self, state, tokens_b, positions_b, cache, sp, key, greedy: bool = False):
        """Feeds one token per row at its position; returns the next token per row."""
        model = self._model(state)
        out = model(tokens_b[:, None], positions_b[:, None], cache)
        logits = model.logits(out.hidden_bth[:, 0])
        nxt = jax.lax.with_sharding_constraint(pick_tokens(logits, sp, key, greedy), replicated(self.target.mesh))
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
