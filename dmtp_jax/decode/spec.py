"""The speculative decode engine: one jitted round over fixed buffers, for every drafting method.

State per batch row: the target KV cache, the DFlash context K/V cache and the MTP's private KV
cache (all slot == position), the committed length `L` (tokens in the target KV), the pending token
`A` (last committed, not yet run by the target) and, with MTP, the cached MTP hidden state `h` that
predicts the next first candidate. One round with `n` verify slots:

    propose : T1 = head(mtp.norm(h)) (mtp / dmtp*); mtp chains T2..Tk through its own cache;
              the drafter runs its block (`models/fusion.py`: dflash `[A, MASK..]`, dmtp
              `[A, T1+Δ, MASK..]`, single-anchor `[T1, MASK..]`) over the cached context
              dmtp-adaptive: rows whose MTP top-1 probability >= threshold take `dmtp`'s block,
              the others DFlash's `[A, MASK..]` (the drafter's own T1), in the same drafter pass
    verify  : target on [A, T1..T(n-1)] at positions L.. (writes KV, captures context features)
    accept  : greedy exact match, or lossless sampling (rejection or block verification with the
              proposers' q -- MTP's for T1, DFlash's / the DFlash2 selector's for the rest -- or
              target-only)
    commit  : L += accepted + 1; the target keeps the accepted prefix (`target.commit`: K/V rows
              past L are never read; DeltaNet states advance over the kept tokens only); the
              drafter's context K/V of the verify rows are written at their positions; MTP
              advances over at most n rows (h_{L+j}, next token) with rows past the accepted
              prefix sent to scratch; rows beyond a row's length are never read and get
              overwritten later. Finished rows keep their state.

The round compiles once per (batch bucket, cache length, method, greedy/sampled). With
`rounds_per_dispatch` K > 1, one jitted call runs up to K rounds with on-device stopping
(`decode/multi_round.py`), compiled once per the same key.

Example:
    >>> engine = SpecDecoder(target, drafter)  # doctest: +SKIP
    >>> res = engine.generate([[1, 2, 3]], max_new_tokens=32)  # doctest: +SKIP
    >>> res.stats["per_verify_acceptance_length"]  # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.checkpoint.hf import LoadedModel
from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.decode.ar import GenerationResult, TargetCaches, gather_rows, kv_cache_shape, new_kv_cache
from dmtp_jax.decode.batch import RequestError, StopTracker, pad_prompts
from dmtp_jax.decode.multi_round import feed_rounds, pad_stop_ids, run_rounds
from dmtp_jax.decode.prefill import DEFAULT_PREFILL_CHUNK, prefill_chunks, target_chunk
from dmtp_jax.decode.sampling import SamplingParams, filtered_probs, sample_from_probs
from dmtp_jax.decode.stats import acceptance_stats, first_candidate_by_source
from dmtp_jax.decode.verify import (candidate_probs_to_dense, verify_block, verify_greedy, verify_rejection,
                                    verify_target_only)
from dmtp_jax.layers.kv_cache import KVCache, TargetCache, write_layer
from dmtp_jax.models.fusion import ADAPTIVE, DMTP_METHODS, block_layout, draft_block_embeds
from dmtp_jax.sharding import kv_cache_sharding, replicated

DEFAULT_CONTEXT_WINDOW = 4096
DEFAULT_ADAPTIVE_THRESHOLD = 0.5     # dmtp-adaptive without a calibrated threshold in its drafter
VERIFY_MODES = ("rejection", "target-only", "block")
SPEC_METHODS = ("dflash", "mtp") + tuple(DMTP_METHODS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    target_cache: TargetCache   # K/V and, for hybrid targets, DeltaNet states (one protocol)
    ctx_cache: KVCache | None   # drafter context K/V, [draft_layers, B, S, kv, D]
    mtp_cache: KVCache | None   # MTP private K/V, [1, B, S, kv, D]
    mtp_h_bh: jax.Array | None  # MTP pre-norm hidden that predicts the next T1
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


def _pin(x, sharding):
    return None if x is None else jax.lax.with_sharding_constraint(x, sharding)


class SpecDecoder:
    """Speculative decoding of a target with `method` in `SPEC_METHODS`.

    `drafter` (DFlash / DFlash2) serves dflash and dmtp*; `mtp` (the native MTP head) serves mtp and
    dmtp*; `fusion` (from `checkpoint.dmtp_ckpt`) the dmtp* methods. `verify` chooses sampled
    verification: "rejection" (token by token, with the proposers' probabilities), "block" (block
    verification with the same probabilities, `decode/verify.py:verify_block`) or "target-only"
    (match target samples). Greedy (temperature 0) is always exact match. `strict`: fail with
    `InexactBackendError` when the exactness probe finds this backend inexact (default: decode
    plainly instead). `adaptive_threshold` (dmtp-adaptive): the MTP top-1 probability from which
    a row takes MTP's T1 (default: the drafter's calibrated `dmtp_config.threshold`, else 0.5).
    `rounds_per_dispatch` K > 1 runs up to K rounds per jitted call with on-device
    stopping (`decode/multi_round.py`): the host syncs, and `on_tokens` streams, once per K rounds;
    outputs and statistics are those of K = 1.
    """

    def __init__(self, target: LoadedModel, drafter: LoadedModel | None = None, *, method: str = "dflash",
                 mtp: LoadedModel | None = None, fusion: LoadedModel | None = None,
                 block_size: int | None = None, mtp_steps: int = 4, verify: str = "rejection",
                 context_window: int = DEFAULT_CONTEXT_WINDOW, strict: bool = False,
                 adaptive_threshold: float | None = None, rounds_per_dispatch: int = 1,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got '{verify}'")
        if method not in SPEC_METHODS:
            raise RequestError(f"unknown speculative method '{method}'; known: {', '.join(SPEC_METHODS)}")
        if isinstance(rounds_per_dispatch, bool) or not isinstance(rounds_per_dispatch, (int, np.integer)) \
                or rounds_per_dispatch < 1:
            raise RequestError(f"--rounds-per-dispatch must be an integer >= 1, got {rounds_per_dispatch!r}")
        self.uses_drafter = method != "mtp"
        self.uses_mtp = method != "dflash"
        if self.uses_drafter and drafter is None:
            raise RequestError(f"method '{method}' needs a DFlash drafter (--draft DIR)")
        if self.uses_mtp and mtp is None:
            raise RequestError(f"method '{method}' needs the target's native MTP head")
        if method in DMTP_METHODS and fusion is None:
            raise RequestError(f"method '{method}' needs its fusion (load the drafter with load_dmtp_drafter)")
        if method == "mtp":
            if not 1 <= mtp_steps <= 15:
                raise RequestError(f"--mtp-steps must be in [1, 15], got {mtp_steps}")
            self.slots = mtp_steps + 1
        else:
            self.slots = block_size or drafter.cfg.block_size
            if not 3 <= self.slots <= 64:
                raise RequestError(f"block size must be in [3, 64], got {self.slots}")
        self.block_size = self.slots
        self.adaptive_threshold = None
        if method == ADAPTIVE:
            if drafter.cfg.version != 1:
                raise RequestError("dmtp-adaptive needs a DFlash (version 1) drafter")
            if adaptive_threshold is None:
                adaptive_threshold = fusion.cfg.get("threshold", DEFAULT_ADAPTIVE_THRESHOLD)
            if not 0.0 <= adaptive_threshold <= 1.01:     # 1.01: never MTP's T1 (calibration's "never")
                raise RequestError(f"--adaptive-threshold must be in [0, 1], got {adaptive_threshold}")
            self.adaptive_threshold = float(adaptive_threshold)
        self.target, self.drafter, self.mtp, self.fusion = target, drafter, mtp, fusion
        self.method, self.verify_mode, self.context_window = method, verify, context_window
        self.strict = strict        # exactness probe mismatch: raise instead of plain decoding
        self.caches = TargetCaches(target)
        self.prefill_chunk = int(prefill_chunk)
        self.prefill_step = counted_jit(self._prefill_step, donate_argnames=("state",), static_argnames=("greedy",))
        self.round = counted_jit(self._round, donate_argnames=("state",), static_argnames=("greedy",))
        self.rounds_per_dispatch = int(rounds_per_dispatch)
        self.multi_round = counted_jit(self._multi_round, donate_argnames=("state",), static_argnames=("greedy",))
        self.last_state: SpecState | None = None

    # ---- state -------------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int) -> SpecState:
        rep = replicated(self.target.mesh)    # placed as the jitted calls leave them: one compile
        zeros = lambda: jax.device_put(np.zeros(batch, np.int32), rep)  # noqa: E731  (two buffers: both donated)
        ctx = mtp_cache = mtp_h = None
        if self.uses_drafter:
            d = self.drafter.cfg
            ctx = new_kv_cache(self.target.mesh, kv_cache_shape(d, batch, max_len, self.target.mesh,
                                                                d.num_hidden_layers), self.drafter.state_dtype)
        if self.uses_mtp:
            c = self.target.cfg
            mtp_cache = new_kv_cache(self.target.mesh, kv_cache_shape(c, batch, max_len, self.target.mesh, 1),
                                     self.mtp.state_dtype)
            mtp_h = jax.device_put(np.zeros((batch, c.hidden_size), self.mtp.state_dtype), rep)
        return SpecState(self.caches.new(batch, max_len), ctx, mtp_cache, mtp_h, zeros(), zeros())

    def state_shardings(self, st: SpecState) -> SpecState:
        """The sharding of every array of a state (or of its shapes), as a `SpecState` tree."""
        mesh = self.target.mesh
        rep = replicated(mesh)
        kv = lambda c: None if c is None else KVCache(*(kv_cache_sharding(mesh, c.k_lbskd.shape),) * 2)  # noqa: E731
        return SpecState(self.caches.shardings(st.target_cache), kv(st.ctx_cache), kv(st.mtp_cache),
                         None if st.mtp_h_bh is None else rep, rep, rep)

    def _constrain(self, st: SpecState) -> SpecState:
        return jax.tree.map(jax.lax.with_sharding_constraint, st, self.state_shardings(st))

    def _models(self, states):
        t_state, d_state, m_state, f_state = states
        merge = lambda loaded, s: None if loaded is None else nnx.merge(loaded.graphdef, s)  # noqa: E731
        return (merge(self.target, t_state), merge(self.drafter, d_state), merge(self.mtp, m_state),
                merge(self.fusion, f_state))

    def _states(self):
        pick = lambda loaded: None if loaded is None else loaded.state  # noqa: E731
        return (self.target.state, pick(self.drafter), pick(self.mtp), pick(self.fusion))

    def _write_context(self, drafter, fusion, st_ctx: KVCache, captured, positions_bt, mtp_h_bth) -> KVCache:
        """Context K/V of new target rows; the DMTP context variants mix in the MTP feature of row
        (h_p, x_{p+1}) (`mtp_h_bth`, aligned with position p)."""
        features = jnp.concatenate(captured, axis=-1)
        ctx = (fusion.context(drafter, features, mtp_h_bth) if fusion is not None
               else drafter.project_context(features))
        k, v = drafter.context_kv(ctx, positions_bt)
        return KVCache(write_all_layers(st_ctx.k_lbskd, k, positions_bt),
                       write_all_layers(st_ctx.v_lbskd, v, positions_bt))

    def _capture(self, drafter):
        return drafter.cfg.target_layer_ids if drafter is not None else ()

    # ---- jitted entry points -----------------------------------------------------------------
    def _prefill_step(self, states, tokens_bt, next_b, start, lengths_b, state: SpecState, sp, key,
                      greedy: bool = False):
        """One prefill chunk (`decode/prefill.py`) through the target (K/V, DeltaNet states, context
        features) and the MTP; the first token is picked in the chunk that ends a row's prompt.

        MTP row i pairs h_i with x_{i+1} at position i+1: the next prompt token, `next_b` (the token
        after the chunk) for the chunk's last row, and the first new token for a row's last prompt
        token; rows past the prompt go to scratch. `state.pending_b` / `state.mtp_h_bh` carry the
        first token and the MTP hidden that predicts T1 until a row's prompt ends."""
        target, drafter, mtp, fusion = self._models(states)
        res = target_chunk(target, tokens_bt, start, lengths_b, state.target_cache, state.pending_b, sp, key,
                           greedy, self._capture(drafter))
        out, positions, first = res.out, res.positions_bt, res.first_b
        ctx = mtp_cache = mtp_h = h = None
        if mtp is not None:
            nxt = jnp.concatenate([tokens_bt[:, 1:], next_b[:, None]], axis=1)
            nxt = jnp.where(positions == lengths_b[:, None] - 1, first[:, None], nxt)
            mtp_pos = jnp.where(positions < lengths_b[:, None], positions + 1, state.mtp_cache.max_len)
            h, mtp_cache = mtp(target.embed(nxt), out.hidden_bth, mtp_pos, state.mtp_cache)
            mtp_h = jnp.where(res.ends_b[:, None], gather_rows(h, res.last_b), state.mtp_h_bh)
        if drafter is not None:      # MTP row i (h_i, x_{i+1}) is aligned with context position i
            ctx = self._write_context(drafter, fusion, state.ctx_cache, out.captured, positions, h)
        return self._constrain(SpecState(out.cache, ctx, mtp_cache, mtp_h, lengths_b.astype(jnp.int32), first))

    def prefill(self, states, tokens_bt, lengths_b, state: SpecState, sp, key, greedy: bool = False) -> SpecState:
        """The padded prompts through target, MTP and drafter context, chunk by chunk; returns the
        state (donated) with each row's first token pending."""
        for start, chunk_bt, next_b in prefill_chunks(tokens_bt, self.prefill_chunk):
            state = self.prefill_step(states, chunk_bt, next_b, start, lengths_b, state, sp, key, greedy=greedy)
        return state

    def _mtp_first(self, target, mtp, st: SpecState, sp, key, greedy):
        """T1 (and its q when sampling) from the cached MTP hidden, the normed hidden `y` and the
        MTP's top-1 probability `[B]` (softmax at temperature 1: dmtp-adaptive's confidence)."""
        y = mtp.post_norm(st.mtp_h_bh)
        logits = target.logits(y).astype(jnp.float32)
        top_p = 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None, y, top_p
        q = filtered_probs(logits, sp)
        return sample_from_probs(q, key), q, y, top_p

    def _propose(self, models, st: SpecState, sp, key, greedy: bool, limits_b):
        """Drafts `[B, n-1]`, their probabilities `[B, n-1, V]` when sampling, the MTP cache
        (chained mtp steps write speculative rows into it) and which rows' first candidate is
        MTP's (bool `[B]`: all for mtp / dmtp*, none for dflash, per row for dmtp-adaptive)."""
        target, drafter, mtp, fusion = models
        keys = jax.random.split(key, self.slots)
        drafts, qs, mtp_cache = [], [], st.mtp_cache
        b = st.pending_b.shape[0]
        t1_from_mtp = jnp.full((b,), mtp is not None)
        if mtp is not None:
            t1, q1, y, top_p = self._mtp_first(target, mtp, st, sp, keys[0], greedy)
            drafts.append(t1)
            qs.append(q1)
            if self.method == ADAPTIVE:
                t1_from_mtp = top_p >= self.adaptive_threshold
        if self.method == "mtp":
            for j in range(2, self.slots):
                pos = (st.lengths_b + j - 1)[:, None]
                h, mtp_cache = mtp(target.embed(drafts[-1][:, None]), y[:, None], pos, mtp_cache)
                y = mtp.post_norm(h[:, 0])
                logits = target.logits(y)
                if greedy:
                    drafts.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
                else:
                    qs.append(filtered_probs(logits, sp))
                    drafts.append(sample_from_probs(qs[-1], keys[j - 1]))
        else:
            offsets, first_row = block_layout(self.method, self.slots)
            positions = st.lengths_b[:, None] + jnp.asarray(offsets)
            embeds = draft_block_embeds(self.method, self.slots, target.embed, drafter.cfg, fusion,
                                        st.pending_b, drafts[0] if drafts else None, st.mtp_h_bh,
                                        t1_from_mtp if self.method == ADAPTIVE else None)
            ctx_k, ctx_pos = context_window(st.ctx_cache.k_lbskd, st.lengths_b, self.context_window)
            ctx_v, _ = context_window(st.ctx_cache.v_lbskd, st.lengths_b, self.context_window)
            # rows past the token budget are hidden, as the reference shortens its last blocks
            block_valid = positions < jnp.maximum(limits_b, st.lengths_b + 1)[:, None]
            hidden = drafter(embeds, positions, ctx_k, ctx_v, ctx_pos, ctx_pos < st.lengths_b[:, None],
                             block_valid_bt=block_valid)[:, first_row:]
            predecessor = drafts[0] if drafts else st.pending_b
            if self.method == ADAPTIVE:     # the drafter's row 1 is T1 where MTP's is not used
                own = drafter.draft_logits(hidden, target.logits)
                if greedy:
                    own_tokens = jnp.argmax(own, axis=-1).astype(jnp.int32)
                else:
                    own_q = filtered_probs(own, sp)
                    own_tokens = sample_from_probs(own_q, keys[-1])
                    qs = [jnp.where(t1_from_mtp[:, None], qs[0], own_q[:, 0])] + list(jnp.moveaxis(own_q[:, 1:], 1, 0))
                drafts = [jnp.where(t1_from_mtp, drafts[0], own_tokens[:, 0])] + list(
                    jnp.moveaxis(own_tokens[:, 1:], 1, 0))
            elif drafter.cfg.version == 2:
                sel = drafter.propose(hidden, predecessor, target.logits, 0.0 if greedy else sp.temperature,
                                      keys[-1])
                drafts += list(jnp.moveaxis(sel.tokens_bl.astype(jnp.int32), 1, 0))
                if not greedy:
                    q = candidate_probs_to_dense(sel.candidates_blk, sel.probs_blk, target.cfg.vocab_size)
                    qs += list(jnp.moveaxis(q, 1, 0))
            else:
                logits = drafter.draft_logits(hidden, target.logits)
                if greedy:
                    drafts += list(jnp.moveaxis(jnp.argmax(logits, axis=-1).astype(jnp.int32), 1, 0))
                else:
                    q = filtered_probs(logits, sp)
                    drafts += list(jnp.moveaxis(sample_from_probs(q, keys[-1]), 1, 0))
                    qs += list(jnp.moveaxis(q, 1, 0))
        q_all = None if greedy else jnp.stack(qs, axis=1)
        return jnp.stack(drafts, axis=1), q_all, mtp_cache, t1_from_mtp

    def _mtp_advance(self, target, mtp, fusion, st: SpecState, mtp_cache, verify_tokens, hidden_bnh, acc, bonus,
                     active_b):
        """MTP over rows (h_{L+j}, next committed token) at L+j+1 for j <= accepted; the rest go
        to scratch. Returns the cache, the hidden that predicts the next T1, and (for the DMTP
        context variants, which feed every row to the drafter's context; else None) every row's
        hidden (row j is aligned with context position L+j). Without the context variants only the
        last accepted row runs the whole layer; the others only write their keys and values."""
        n = verify_tokens.shape[1]
        j = jnp.arange(n)[None]
        shifted = jnp.concatenate([verify_tokens[:, 1:], verify_tokens[:, :1]], axis=1)
        nxt = jnp.where(j < acc[:, None], shifted, bonus[:, None])
        valid = (j <= acc[:, None]) & active_b[:, None]
        pos = jnp.where(valid, st.lengths_b[:, None] + j + 1, mtp_cache.max_len)
        if fusion is not None and fusion.uses_mtp_context:
            rows, mtp_cache = mtp(target.embed(nxt), hidden_bnh, pos, mtp_cache)
            last = gather_rows(rows, acc)
        else:
            (last, mtp_cache), rows = mtp.advance(target.embed(nxt), hidden_bnh, pos, mtp_cache, acc), None
        return mtp_cache, jnp.where(active_b[:, None], last, st.mtp_h_bh), rows

    def _round(self, states, state: SpecState, active_b, limits_b, sp, key, greedy: bool):
        """One propose / verify / accept / commit round. Returns `(state, tokens [B, n], accepted [B],
        t1_from_mtp [B])` where a row's committed tokens are `tokens[:accepted + 1]` (the bonus sits at
        `accepted`) and `t1_from_mtp` says whose first candidate the row verified (MTP's or the
        drafter's)."""
        models = self._models(states)
        target, drafter, mtp, fusion = models
        k_draft, k_verify = jax.random.split(key)
        drafts, q, mtp_cache, t1_from_mtp = self._propose(models, state, sp, k_draft, greedy, limits_b)
        n = self.slots
        positions = state.lengths_b[:, None] + jnp.arange(n)
        verify_tokens = jnp.concatenate([state.pending_b[:, None], drafts], axis=1)
        out = target(verify_tokens, positions, state.target_cache, capture_layers=self._capture(drafter),
                     speculative=True)
        logits = target.logits(out.hidden_bth)
        if greedy:
            acc, bonus = verify_greedy(logits, drafts)
        elif self.verify_mode == "target-only":
            acc, bonus = verify_target_only(filtered_probs(logits, sp), drafts, k_verify)
        elif self.verify_mode == "block":
            acc, bonus = verify_block(filtered_probs(logits, sp), q, drafts, k_verify)
        else:
            acc, bonus = verify_rejection(filtered_probs(logits, sp), q, drafts, k_verify)
        ctx, mtp_h, mtp_rows = state.ctx_cache, state.mtp_h_bh, None
        if mtp is not None:
            mtp_cache, mtp_h, mtp_rows = self._mtp_advance(target, mtp, fusion, state, mtp_cache, verify_tokens,
                                                           out.hidden_bth, acc, bonus, active_b)
        if drafter is not None:
            ctx = self._write_context(drafter, fusion, ctx, out.captured, positions, mtp_rows)
        slot = jnp.arange(n)[None]
        tokens = jnp.where(slot < acc[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                           bonus[:, None])
        target_cache = target.commit(out.cache, out.pending, jnp.where(active_b, acc + 1, 0))
        new = SpecState(target_cache, ctx, mtp_cache, mtp_h,
                        jnp.where(active_b, state.lengths_b + acc + 1, state.lengths_b),
                        jnp.where(active_b, bonus, state.pending_b))
        rep = replicated(self.target.mesh)
        return self._constrain(new), _pin(tokens, rep), _pin(acc, rep), _pin(t1_from_mtp, rep)

    def _multi_round(self, states, state: SpecState, active_b, limits_b, sp, base_key, first_round, stop_ids_s,
                     greedy: bool):
        """Up to `rounds_per_dispatch` rounds on device (`multi_round.run_rounds` around `_round`)."""
        return run_rounds(functools.partial(self._round, states), state, active_b, limits_b, sp, base_key,
                          first_round, stop_ids_s, rounds=self.rounds_per_dispatch, slots=self.slots,
                          greedy=greedy)

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
                            slack=self.slots)
        from dmtp_jax.decode.probe import exactness_gate   # block == chain on this backend? (once per decoder)
        probing = None
        if "_exactness_gate" in self.__dict__:
            gate = exactness_gate(self)
            if not gate.engaged:
                return gate.plain_generate(prompts, max_new_tokens, sampling, seed, stop_ids, on_tokens)
        else:   # first request: the probe compiles and runs in a thread while this one compiles prefill and round
            probing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dmtp-probe")
            gate_future = probing.submit(exactness_gate, self)
        rows = batch.tokens_bt.shape[0]
        tracker = StopTracker(batch.num_rows, max_new_tokens, stop_ids)
        base_key = jax.random.key(seed)
        acceptance: list[list[int]] = [[] for _ in range(batch.num_rows)]
        first_source: list[list[bool]] = [[] for _ in range(batch.num_rows)]    # T1 from MTP, per round
        limits = (batch.lengths_b + max_new_tokens).astype(np.int32)
        stop_ids_s = pad_stop_ids(stop_ids)

        t0 = time.perf_counter()
        states = self._states()
        state = self.prefill(states, batch.tokens_bt, batch.lengths_b, self.new_state(rows, batch.max_len),
                             sp, jax.random.fold_in(base_key, 0), greedy=greedy)
        first = np.asarray(state.pending_b)
        ttft = time.perf_counter() - t0
        if probing is not None:         # nothing is committed (or streamed) before the probe's verdict
            try:
                if max_new_tokens > 1 and self.rounds_per_dispatch > 1:   # the same for the K-round loop
                    self.multi_round.lower(states, state, np.zeros(rows, bool), limits, sp, base_key, np.int32(1),
                                           stop_ids_s, greedy=greedy).compile()
                elif max_new_tokens > 1:  # compiled now, reused by the first round (not counted until it runs)
                    self.round.lower(states, state, np.zeros(rows, bool), limits, sp, jax.random.fold_in(base_key, 1),
                                     greedy=greedy).compile()
                gate = gate_future.result()
            finally:
                probing.shutdown(wait=True)
            if not gate.engaged:
                return gate.plain_generate(prompts, max_new_tokens, sampling, seed, stop_ids, on_tokens)
        for row in range(batch.num_rows):
            kept = tracker.add(row, [first[row]])
            if kept and on_tokens:
                on_tokens(row, kept)
        rounds = 0
        t1 = time.perf_counter()
        while not tracker.all_done:
            active = np.zeros(rows, bool)
            active[:batch.num_rows] = ~tracker.done
            if self.rounds_per_dispatch == 1:       # one round per dispatch: the host streams every round
                state, tokens_bn, acc_b, from_mtp_b = self.round(
                    states, state, active, limits, sp, jax.random.fold_in(base_key, rounds + 1), greedy=greedy)
                out = (np.asarray(tokens_bn)[:, None], np.asarray(acc_b)[:, None], np.asarray(from_mtp_b)[:, None],
                       active[:, None], 1)
            else:                                   # up to K rounds per call, stopping on device
                state, *out = self.multi_round(states, state, active, limits, sp, base_key, np.int32(rounds + 1),
                                               stop_ids_s, greedy=greedy)
                out = [np.asarray(x) for x in out[:-1]] + [int(out[-1])]
            feed_rounds(tracker, acceptance, first_source, *out, on_tokens)
            rounds += out[-1]
        decode_s = time.perf_counter() - t1
        self.last_state = state
        new_tokens = sum(len(o) for o in tracker.outputs)
        name = self.method
        if name == "dflash" and self.drafter.cfg.version == 2:
            name = "dflash2"
        stats = {
            "method": name, "ttft_s": ttft, "decode_s": decode_s, "target_forwards": rounds + 1,
            "new_tokens": new_tokens,
            "decode_tokens_per_s": (new_tokens - batch.num_rows) / decode_s if decode_s > 0 else 0.0,
            "batch_bucket": rows, "max_len": batch.max_len, "block_size": self.slots,
            "rounds_per_dispatch": self.rounds_per_dispatch,
            "acceptance_lengths": acceptance,
            "exactness_probe": gate.summary(),
            **acceptance_stats(acceptance, self.slots),
        }
        if self.method == ADAPTIVE:
            stats["adaptive_threshold"] = self.adaptive_threshold
            stats["t1_from_mtp"] = first_source
            stats.update(first_candidate_by_source(acceptance, first_source))
        return GenerationResult([list(map(int, p)) for p in prompts], tracker.outputs, stats)

    def compile_counts(self) -> dict[str, int]:
        counts = {"prefill": self.prefill_step.compiles, "round": self.round.compiles}
        if self.rounds_per_dispatch > 1:
            counts["multi_round"] = self.multi_round.compiles
        return counts
