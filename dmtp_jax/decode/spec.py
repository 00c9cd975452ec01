"""The speculative decode engine: one jitted round over fixed buffers (DFlash / DFlash2 drafters).

State per batch row: the target KV cache and the drafter's context K/V cache (both slot ==
position), the committed length `L` (tokens in the target KV) and the pending token `A` (the last
committed token, not yet run by the target). One round:

    propose  : drafter on [A, MASK x (n-1)] at positions L.. with the cached context -> n-1 drafts
    verify   : target on [A, d1..d(n-1)] at positions L.. (writes KV, captures context features)
    accept   : greedy exact match, or lossless sampling (rejection with q, or target-only)
    commit   : L += accepted + 1; the context K/V of the verify rows are written at their
               positions (rows past the accepted prefix stay beyond L: never read, overwritten
               later); the bonus becomes the next A. Finished rows keep their state.

The round compiles once per (batch bucket, cache length, block size, verification mode).

Example:
    >>> engine = SpecDecoder(target, drafter)  # doctest: +SKIP
    >>> res = engine.generate([[1, 2, 3]], max_new_tokens=32)  # doctest: +SKIP
    >>> res.stats["per_verify_acceptance_length"]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.checkpoint.dflash_ckpt import LoadedDrafter
from dmtp_jax.checkpoint.hf import LoadedTarget
from dmtp_jax.decode.ar import GenerationResult, TargetCaches, gather_rows
from dmtp_jax.decode.batch import RequestError, StopTracker, pad_prompts
from dmtp_jax.decode.sampling import SamplingParams, filtered_probs, sample_from_probs, sample_tokens
from dmtp_jax.decode.stats import acceptance_stats
from dmtp_jax.decode.verify import (candidate_probs_to_dense, verify_greedy, verify_rejection,
                                    verify_target_only)
from dmtp_jax.layers.kv_cache import KVCache, write_layer
from dmtp_jax.models.dflash import block_embeddings, make_block_tokens
from dmtp_jax.sharding import kv_cache_sharding, replicated

DEFAULT_CONTEXT_WINDOW = 4096
VERIFY_MODES = ("rejection", "target-only")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    target_cache: KVCache
    ctx_cache: KVCache          # drafter context K/V, [draft_layers, B, S, kv, D]
    lengths_b: jax.Array        # committed tokens in the target KV == position of the pending token
    pending_b: jax.Array        # last committed token (A), not yet run by the target


def write_all_layers(cache_lbskd: jax.Array, new_lbtkd: jax.Array, positions_bt: jax.Array) -> jax.Array:
    """`write_layer` for every layer of a stacked cache."""
    for i in range(cache_lbskd.shape[0]):
        cache_lbskd = write_layer(cache_lbskd, i, new_lbtkd[i], positions_bt)
    return cache_lbskd


def context_window(cache_lbskd: jax.Array, lengths_b: jax.Array, window: int):
    """The last `window` slots before each row's length: `([L, B, W, kv, D], positions [B, W])`."""
    s = cache_lbskd.shape[2]
    w = min(window, s)
    start_b = jnp.clip(lengths_b - w, 0, s - w)
    rows = jax.vmap(lambda c, st: jax.lax.dynamic_slice_in_dim(c, st, w, axis=1), in_axes=(1, 0), out_axes=1)
    return rows(cache_lbskd, start_b), start_b[:, None] + jnp.arange(w)


class SpecDecoder:
    """Speculative decoding of a target with a DFlash / DFlash2 drafter.

    `verify` chooses sampled verification: "rejection" (with the drafter's probabilities) or
    "target-only" (match target samples). Greedy (temperature 0) is always exact match.
    """

    def __init__(self, target: LoadedTarget, drafter: LoadedDrafter, block_size: int | None = None,
                 verify: str = "rejection", context_window: int = DEFAULT_CONTEXT_WINDOW):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got '{verify}'")
        self.block_size = block_size or drafter.cfg.block_size
        if not 2 <= self.block_size <= 64:
            raise RequestError(f"block size must be in [2, 64], got {self.block_size}")
        self.target, self.drafter, self.verify_mode = target, drafter, verify
        self.context_window = context_window
        self.caches = TargetCaches(target)
        self._ctx_makers: dict = {}
        self.prefill = jax.jit(self._prefill, donate_argnames=("state",))
        self.round = jax.jit(self._round, donate_argnames=("state",), static_argnames=("greedy",))

    # ---- state -------------------------------------------------------------------------------
    def _ctx_shape(self, batch, max_len):
        d = self.drafter.cfg
        return (d.num_hidden_layers, batch, max_len, d.num_key_value_heads, d.head_dim)

    def _constrain(self, st: SpecState) -> SpecState:
        mesh = self.target.mesh
        ctx_s = kv_cache_sharding(mesh, st.ctx_cache.k_lbskd.shape)
        ctx = KVCache(jax.lax.with_sharding_constraint(st.ctx_cache.k_lbskd, ctx_s),
                      jax.lax.with_sharding_constraint(st.ctx_cache.v_lbskd, ctx_s))
        rep = replicated(mesh)
        return SpecState(self.caches.constrain(st.target_cache), ctx,
                         jax.lax.with_sharding_constraint(st.lengths_b, rep),
                         jax.lax.with_sharding_constraint(st.pending_b, rep))

    def new_state(self, batch: int, max_len: int) -> SpecState:
        key = (batch, max_len)
        if key not in self._ctx_makers:
            shape = self._ctx_shape(batch, max_len)
            s = kv_cache_sharding(self.target.mesh, shape)
            dtype = self.drafter.state_dtype
            self._ctx_makers[key] = jax.jit(lambda: KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                                            out_shardings=KVCache(s, s))
        zeros = np.zeros(batch, np.int32)
        return SpecState(self.caches.new(batch, max_len), self._ctx_makers[key](), zeros, zeros)

    def _models(self, t_state, d_state):
        return nnx.merge(self.target.graphdef, t_state), nnx.merge(self.drafter.graphdef, d_state)

    def _write_context(self, drafter, st_ctx: KVCache, captured, positions_bt) -> KVCache:
        ctx = drafter.project_context(jnp.concatenate(captured, axis=-1))
        k, v = drafter.context_kv(ctx, positions_bt)
        return KVCache(write_all_layers(st_ctx.k_lbskd, k, positions_bt),
                       write_all_layers(st_ctx.v_lbskd, v, positions_bt))

    # ---- jitted entry points -----------------------------------------------------------------
    def _prefill(self, t_state, d_state, tokens_bt, lengths_b, state: SpecState, sp, key):
        """Prompt through the target (KV + context features); samples the first token."""
        target, drafter = self._models(t_state, d_state)
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        out = target(tokens_bt, positions, state.target_cache, capture_layers=drafter.cfg.target_layer_ids)
        first = sample_tokens(target.logits(gather_rows(out.hidden_bth, lengths_b - 1)), sp, key)
        ctx = self._write_context(drafter, state.ctx_cache, out.captured, positions)
        return self._constrain(SpecState(out.cache, ctx, lengths_b.astype(jnp.int32), first))

    def _propose(self, target, drafter, st: SpecState, limits_b, sp, key, greedy: bool):
        """Drafts `[B, n-1]` and, when sampling, their probabilities `[B, n-1, V]`.

        Like `dflash_generate`, the block is cut to the budget: only its first
        `limits_b - lengths_b` rows (prompt + max_new_tokens - L, at least 1) are keys. Drafts in
        those slots are exactly the reference's (with in-block non-causal attention, the extra MASK
        rows would change them); drafts past the budget are still made but never kept.
        """
        n = self.block_size
        positions = st.lengths_b[:, None] + jnp.arange(n)
        block_valid = jnp.arange(n)[None] < jnp.clip(limits_b - st.lengths_b, 1, n)[:, None]
        embeds = block_embeddings(target.embed, make_block_tokens(st.pending_b, drafter.cfg, n), drafter.cfg)
        ctx_k, ctx_pos = context_window(st.ctx_cache.k_lbskd, st.lengths_b, self.context_window)
        ctx_v, _ = context_window(st.ctx_cache.v_lbskd, st.lengths_b, self.context_window)
        hidden = drafter(embeds, positions, ctx_k, ctx_v, ctx_pos, ctx_pos < st.lengths_b[:, None],
                         block_valid_bt=block_valid)[:, 1:]
        if drafter.cfg.version == 2:
            sel = drafter.propose(hidden, st.pending_b, target.logits, 0.0 if greedy else sp.temperature, key)
            q = None if greedy else candidate_probs_to_dense(sel.candidates_blk, sel.probs_blk,
                                                             target.cfg.vocab_size)
            return sel.tokens_bl.astype(jnp.int32), q
        logits = drafter.draft_logits(hidden, target.logits)
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        q = filtered_probs(logits, sp)
        return sample_from_probs(q, key), q

    def _round(self, t_state, d_state, state: SpecState, active_b, limits_b, sp, key, greedy: bool):
        """One propose / verify / accept / commit round. Returns `(state, tokens [B, n], accepted [B])`
        where a row's committed tokens are `tokens[:accepted + 1]` (the bonus sits at `accepted`).
        `limits_b`: prompt length + max_new_tokens per row (the budget end, see `_propose`)."""
        target, drafter = self._models(t_state, d_state)
        k_draft, k_verify = jax.random.split(key)
        drafts, q = self._propose(target, drafter, state, limits_b, sp, k_draft, greedy)
        n = self.block_size
        positions = state.lengths_b[:, None] + jnp.arange(n)
        verify_tokens = jnp.concatenate([state.pending_b[:, None], drafts], axis=1)
        out = target(verify_tokens, positions, state.target_cache, capture_layers=drafter.cfg.target_layer_ids)
        logits = target.logits(out.hidden_bth)
        if greedy:
            acc, bonus = verify_greedy(logits, drafts)
        elif self.verify_mode == "target-only":
            acc, bonus = verify_target_only(filtered_probs(logits, sp), drafts, k_verify)
        else:
            acc, bonus = verify_rejection(filtered_probs(logits, sp), q, drafts, k_verify)
        ctx = self._write_context(drafter, state.ctx_cache, out.captured, positions)
        slot = jnp.arange(n)[None]
        tokens = jnp.where(slot < acc[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                           bonus[:, None])
        new = SpecState(out.cache, ctx, jnp.where(active_b, state.lengths_b + acc + 1, state.lengths_b),
                        jnp.where(active_b, bonus, state.pending_b))
        rep = replicated(self.target.mesh)
        return (self._constrain(new), jax.lax.with_sharding_constraint(tokens, rep),
                jax.lax.with_sharding_constraint(acc, rep))

    # ---- host loop ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None = None,
                 seed: int = 0, stop_ids=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerationResult:
        """Speculative generation; same contract as `ARDecoder.generate`, plus acceptance stats.

        `stats["acceptance_lengths"]` holds, per row, the tokens committed by each verify round
        (accepted drafts + bonus) while the row was running.
        """
        cfg = self.target.cfg
        sp = sampling or SamplingParams.make()
        greedy = sp.is_greedy
        stop_ids = cfg.eos_token_ids if stop_ids is None else stop_ids
        batch = pad_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings,
                            slack=self.block_size)
        rows = batch.tokens_bt.shape[0]
        tracker = StopTracker(batch.num_rows, max_new_tokens, stop_ids)
        base_key = jax.random.key(seed)
        acceptance: list[list[int]] = [[] for _ in range(batch.num_rows)]

        t0 = time.perf_counter()
        state = self.prefill(self.target.state, self.drafter.state, batch.tokens_bt, batch.lengths_b,
                             self.new_state(rows, batch.max_len), sp, jax.random.fold_in(base_key, 0))
        first = np.asarray(state.pending_b)
        ttft = time.perf_counter() - t0
        for row in range(batch.num_rows):
            kept = tracker.add(row, [first[row]])
            if kept and on_tokens:
                on_tokens(row, kept)
        limits = (np.asarray(batch.lengths_b) + max_new_tokens).astype(np.int32)
        rounds = 0
        t1 = time.perf_counter()
        while not tracker.all_done:
            rounds += 1
            active = np.zeros(rows, bool)
            active[:batch.num_rows] = ~tracker.done
            state, tokens, acc = self.round(self.target.state, self.drafter.state, state, active, limits, sp,
                                            jax.random.fold_in(base_key, rounds), greedy=greedy)
            tokens, acc = np.asarray(tokens), np.asarray(acc)
            for row in range(batch.num_rows):
                if not active[row]:
                    continue
                acceptance[row].append(int(acc[row]) + 1)
                kept = tracker.add(row, tokens[row, :acc[row] + 1])
                if kept and on_tokens:
                    on_tokens(row, kept)
        decode_s = time.perf_counter() - t1
        new_tokens = sum(len(o) for o in tracker.outputs)
        stats = {
            "method": "dflash2" if self.drafter.cfg.version == 2 else "dflash",
            "ttft_s": ttft, "decode_s": decode_s, "target_forwards": rounds + 1, "new_tokens": new_tokens,
            "decode_tokens_per_s": (new_tokens - batch.num_rows) / decode_s if decode_s > 0 else 0.0,
            "batch_bucket": rows, "max_len": batch.max_len, "block_size": self.block_size,
            "acceptance_lengths": acceptance,
            **acceptance_stats(acceptance, self.block_size),
        }
        return GenerationResult([list(map(int, p)) for p in prompts], tracker.outputs, stats)

    def compile_counts(self) -> dict[str, int]:
        return {"prefill": self.prefill._cache_size(), "round": self.round._cache_size()}
