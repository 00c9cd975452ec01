"""The speculative round as named, pure phase functions over explicit state (`SpecState`):
propose, verify_forward, accept, commit (its drafting caches' side: `decode/drafting.py`)
(docs/ARCHITECTURE.md).
`spec_round` composes them; `prefill_step` is the state's prefill chunk. Models come in as a
`RoundModels` and every knob as an argument, so the decoder, `bench/phases.py` and the exactness
probe jit the same functions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.decode.caches import target_cache_shardings
from dmtp_jax.decode.draft_model import prefill_draft_cache
from dmtp_jax.decode.drafting import (DeferredRows, VerifyForward, advance_drafting, defer_chunk, defer_rows,
                                      gather_rows, write_context)
from dmtp_jax.decode.logprobs import token_logprobs
from dmtp_jax.decode.prefill import target_chunk
from dmtp_jax.decode.sampling import filtered_probs
from dmtp_jax.decode.verify import verify_block, verify_greedy, verify_rejection, verify_target_only
from dmtp_jax.layers.kv_cache import KVCache, TargetCache
from dmtp_jax.models.draft_head import draft_scores
from dmtp_jax.sharding import kv_cache_sharding, replicated

NO_CAP = 2 ** 30        # a commit cap (`RoundKnobs.commit_cap`) that cuts nothing

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    target_cache: TargetCache   # K/V and, for hybrid targets, DeltaNet states (one protocol)
    ctx_cache: KVCache | None   # drafter context K/V, [draft_layers, B, S, kv, D] (EAGLE-3: its own K/V)
    mtp_cache: KVCache | None   # MTP private K/V, [cache_layers (1, or 0: none), B, S, kv, D]
    mtp_h_bh: jax.Array | None  # MTP (or EAGLE-3) pre-norm hidden that predicts the next T1
    lengths_b: jax.Array        # committed tokens in the target KV == position of the pending token
    pending_b: jax.Array        # last committed token (A), not yet run by the target
    tokens_bs: jax.Array | None = None          # the row's tokens at slot == position, A at L (int32; None: unread)
    draft_cache: TargetCache | None = None      # a draft model's own cache (`decode/draft_model.py`)
    deferred: DeferredRows | None = None        # plain rounds' rows not yet in the drafting caches


@dataclasses.dataclass(frozen=True)
class RoundModels:
    """The merged modules a round runs (`None` where the method uses none; `draft_head` None: the full
    LM head drafts)."""
    target: nnx.Module
    drafter: nnx.Module | None = None
    mtp: nnx.Module | None = None
    fusion: nnx.Module | None = None
    draft_head: nnx.Module | None = None
    draft_model: nnx.Module | None = None

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """The drafting side's fp32 logits of post-norm hidden states (`draft_head.draft_scores`)."""
        return draft_scores(self.target, self.draft_head, hidden).logits

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs feed the drafter's context (none without a drafter)."""
        return self.drafter.cfg.target_layer_ids if self.drafter is not None else ()


def merge_models(graphdefs, states) -> RoundModels:
    """`RoundModels` from `(target, drafter, mtp, fusion, draft_head, draft_model)` graphdefs and their
    states (inside jit; a shorter tuple leaves the rest None)."""
    return RoundModels(*(None if g is None else nnx.merge(g, s) for g, s in zip(graphdefs, states)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    """What a proposer drafts: tokens, their probabilities when sampling (`None` when greedy), the MTP
    cache, whose first candidate each row verifies (`True`: MTP's) and a draft model's cache after its
    chain."""
    drafts_bn: jax.Array
    q_bnv: jax.Array | None
    mtp_cache: KVCache | None
    t1_from_mtp_b: jax.Array
    draft_cache: TargetCache | None = None      # a draft model's cache after its chain (None: the state's)


def write_tokens(tokens_bs: jax.Array | None, new_bt: jax.Array, positions_bt: jax.Array, valid_bt: jax.Array):
    """The token buffer with `new_bt` written at `positions_bt` where `valid_bt` (the rest dropped);
    None stays None.

    Example:
        >>> write_tokens(jnp.zeros((1, 4), jnp.int32), jnp.array([[5, 6]]), jnp.array([[1, 2]]),
        ...              jnp.array([[True, False]])).tolist()
        [[0, 5, 0, 0]]
    """
    if tokens_bs is None:
        return None
    s = tokens_bs.shape[1]
    rows = jnp.broadcast_to(jnp.arange(tokens_bs.shape[0])[:, None], positions_bt.shape)
    return tokens_bs.at[rows, jnp.where(valid_bt, positions_bt, s)].set(new_bt.astype(tokens_bs.dtype), mode="drop")


def context_window(cache_lbskd: jax.Array, lengths_b: jax.Array, window: int):
    """The last `window` slots before each row's length: `([L, B, W, kv, D], positions [B, W])`."""
    s = cache_lbskd.shape[2]
    w = min(window, s)
    start_b = jnp.clip(lengths_b - w, 0, s - w)
    rows = jax.vmap(lambda c, st: jax.lax.dynamic_slice_in_dim(c, st, w, axis=1), in_axes=(1, 0), out_axes=1)
    return rows(cache_lbskd, start_b), start_b[:, None] + jnp.arange(w)


def state_shardings(mesh, st: SpecState) -> SpecState:
    """The sharding of every array of a state (or of its shapes) on `mesh`, as a `SpecState` tree."""
    rep = replicated(mesh)
    kv = lambda c: None if c is None else KVCache(*(kv_cache_sharding(mesh, c.k_lbskd.shape),) * 2)  # noqa: E731
    return SpecState(target_cache_shardings(mesh, st.target_cache), kv(st.ctx_cache), kv(st.mtp_cache),
                     None if st.mtp_h_bh is None else rep, rep, rep, None if st.tokens_bs is None else rep,
                     None if st.draft_cache is None else target_cache_shardings(mesh, st.draft_cache),
                     None if st.deferred is None else jax.tree.map(lambda _: rep, st.deferred))


def constrain_state(mesh, st: SpecState) -> SpecState:
    """`st` pinned at `state_shardings` (inside a jitted function)."""
    return jax.tree.map(jax.lax.with_sharding_constraint, st, state_shardings(mesh, st))


# ---- phases ------------------------------------------------------------------------------------
def verify_forward(target, state: SpecState, drafts_bn: jax.Array,
                   capture_layers: tuple[int, ...] = (), active_b: jax.Array | None = None) -> VerifyForward:
    """The target over `[pending, drafts]` at positions `L..L+n-1` (`speculative=True`: DeltaNet
    states wait for `commit`). With no drafts and `active_b` given (a plain step) the states advance
    in the forward for the active rows only and `commit` has nothing left to do."""
    n = drafts_bn.shape[1] + 1
    positions = state.lengths_b[:, None] + jnp.arange(n)
    tokens = jnp.concatenate([state.pending_b[:, None], drafts_bn], axis=1)
    embeds = target.embed(tokens)
    plain = n == 1 and active_b is not None
    out = target(tokens, positions, state.target_cache, capture_layers=capture_layers, embeds_bth=embeds,
                 speculative=not plain, kv_valid_bt=active_b[:, None] if plain else None)
    return VerifyForward(tokens, positions, embeds, out, target.logits(out.hidden_bth))


def accept(logits_bnv: jax.Array, drafts_bn: jax.Array, q_bnv: jax.Array | None, sp, key: jax.Array, greedy: bool,
           verify_mode: str = "rejection"):
    """`(accepted [B], bonus [B])`: greedy exact match, else the sampled verifier `verify_mode`
    (`spec.VERIFY_MODES`, `decode/verify.py`) with the proposers' probabilities `q_bnv`.

    Example:
        >>> acc, bonus = accept(jnp.eye(4)[None, [1, 2, 3]], jnp.array([[1, 3]]), None, None, None, True)
        >>> acc.tolist(), bonus.tolist()
        ([1], [2])
    """
    if greedy:
        return verify_greedy(logits_bnv, drafts_bn)
    p = filtered_probs(logits_bnv, sp)
    if verify_mode == "target-only":
        return verify_target_only(p, drafts_bn, key)
    if verify_mode == "block":
        return verify_block(p, q_bnv, drafts_bn, key)
    return verify_rejection(p, q_bnv, drafts_bn, key)


def commit(models: RoundModels, state: SpecState, proposal: Proposal, fwd: VerifyForward, acc_b, bonus_b,
           active_b) -> tuple[SpecState, jax.Array]:
    """`(next state, tokens [B, n])`: a row commits `tokens[:accepted + 1]` (bonus at `accepted`) and
    `L += accepted + 1`; the target keeps the accepted prefix, the drafting caches take the committed
    rows (`drafting.advance_drafting`; a plain round on a state with `deferred` buffers its row instead:
    `drafting.defer_rows`) and the token buffer takes the committed tokens. Inactive rows keep their
    state."""
    drafts = proposal.drafts_bn         # [B, n-1]; n = 1 (no drafts) is a plain step
    if drafts.shape[1] == 0 and state.deferred is not None:
        caches = {"deferred": defer_rows(state.deferred, fwd, active_b)}
    else:
        caches = advance_drafting(models, state, proposal.mtp_cache, fwd, acc_b, bonus_b, active_b,
                                  proposal.draft_cache)
    slot = jnp.arange(drafts.shape[1] + 1)[None]
    tokens = jnp.where(slot < acc_b[:, None], jnp.concatenate([drafts, bonus_b[:, None]], axis=1), bonus_b[:, None])
    keep_b = jnp.where(active_b, acc_b + 1, 0)
    target_cache = models.target.commit(fwd.out.cache, fwd.out.pending, keep_b)
    history = write_tokens(state.tokens_bs, tokens, fwd.positions_bn + 1, (slot <= acc_b[:, None]) & active_b[:, None])
    lengths = jnp.where(active_b, state.lengths_b + acc_b + 1, state.lengths_b)
    new = dataclasses.replace(state, target_cache=target_cache, lengths_b=lengths,
                              pending_b=jnp.where(active_b, bonus_b, state.pending_b), tokens_bs=history, **caches)
    return new, tokens


def cap_accepted(drafts_bn: jax.Array, acc_b: jax.Array, bonus_b: jax.Array, cap):
    """`(kept [B], last [B])`: the accepted drafts cut at `cap` and the token committed after them (the
    draft at `cap` where more were accepted, else the verifier's bonus). Lossless for any verifier:
    the committed tokens are the first `kept + 1` of the uncut round's, and the next round goes on
    from them.

    Example:
        >>> kept, last = cap_accepted(jnp.array([[4, 5, 6]]), jnp.array([3]), jnp.array([9]), 1)
        >>> kept.tolist(), last.tolist()
        ([1], [5])
    """
    kept = jnp.minimum(acc_b, cap)
    if drafts_bn.shape[1] == 0:
        return kept, bonus_b
    at = jnp.minimum(kept, drafts_bn.shape[1] - 1)[:, None]
    return kept, jnp.where(acc_b > kept, jnp.take_along_axis(drafts_bn, at, axis=1)[:, 0], bonus_b)


def spec_round(proposer, verify_mode: str, models: RoundModels, state: SpecState, active_b, limits_b, sp,
               key: jax.Array, greedy: bool, knobs, logprobs: bool = False):
    """One propose / verify / accept / commit round: `(state, tokens [B, n], accepted [B],
    t1_from_mtp [B])`. `accepted`: the drafts the target accepted; a row commits
    `tokens[:min(accepted, knobs.commit_cap) + 1]` (`cap_accepted`); `t1_from_mtp` says whose first
    candidate it verified. `limits_b`: each row's token budget (prompt + max_new_tokens); `knobs`:
    `proposers.RoundKnobs`. A state with `deferred` comes caught up to a speculative round and with
    buffer room to a plain one (`RoundBank.caught_up`). `logprobs`: a fifth output, the target's
    `logprobs.TokenLogprobs` of `tokens` (slot j under the verify logits at slot j)."""
    k_draft, k_verify = jax.random.split(key)
    proposal = proposer.propose(models, state, sp, k_draft, greedy, limits_b, knobs)
    fwd = verify_forward(models.target, state, proposal.drafts_bn, models.capture_layers, jnp.asarray(active_b))
    acc, bonus = accept(fwd.logits_bnv, proposal.drafts_bn, proposal.q_bnv, sp, k_verify, greedy, verify_mode)
    kept, last = cap_accepted(proposal.drafts_bn, acc, bonus, knobs.commit_cap)
    new, tokens = commit(models, state, proposal, fwd, kept, last, active_b)
    if logprobs:
        return new, tokens, acc, proposal.t1_from_mtp_b, token_logprobs(fwd.logits_bnv, tokens)
    return new, tokens, acc, proposal.t1_from_mtp_b


def prefill_step(models: RoundModels, tokens_bt, next_b, start, lengths_b, state: SpecState, sp, key,
                 greedy: bool = False, defer: bool = False, logprobs: bool = False):
    """One prefill chunk (`decode/prefill.py`) through the target, the MTP (row i pairs h_i with
    x_{i+1}; rows past the prompt go to scratch) and a draft model; the chunk's tokens go into the
    token buffer. The first token is picked in the chunk that ends a row's prompt and carried in
    `state.pending_b` / `state.mtp_h_bh`. A state with `deferred` comes caught up (a resumed
    snapshot's plain rounds: `RoundBank.caught_up`). `defer` (a lean prefill: such a state, and this
    chunk the prefill's only one): the target alone runs and the chunk's rows wait in the buffer
    (`drafting.defer_chunk`) for the first speculative round, or a full buffer, to catch them up.
    `logprobs`: `(state, TokenLogprobs [B])` of the first tokens picked in this chunk (other rows'
    are meaningless)."""
    target, drafter, mtp = models.target, models.drafter, models.mtp
    res = target_chunk(target, tokens_bt, start, lengths_b, state.target_cache, state.pending_b, sp, key,
                       greedy, models.capture_layers)
    out, positions, first = res.out, res.positions_bt, res.first_b
    with_lp = (lambda st: (st, token_logprobs(res.logits_bv, first))) if logprobs else (lambda st: st)  # noqa: E731
    history = write_tokens(state.tokens_bs, tokens_bt, positions, positions < lengths_b[:, None])
    history = write_tokens(history, first[:, None], lengths_b[:, None], res.ends_b[:, None])
    if defer:
        if state.deferred is None:
            raise ValueError("a lean prefill needs a state that defers its drafting caches")
        return with_lp(dataclasses.replace(state, target_cache=out.cache, lengths_b=lengths_b.astype(jnp.int32),
                                           pending_b=first, tokens_bs=history,
                                           deferred=defer_chunk(state.deferred, out, tokens_bt, positions, start,
                                                                lengths_b)))
    ctx = mtp_cache = mtp_h = h = None
    if mtp is not None:
        nxt = jnp.concatenate([tokens_bt[:, 1:], next_b[:, None]], axis=1)
        nxt = jnp.where(positions == lengths_b[:, None] - 1, first[:, None], nxt)
        mtp_pos = jnp.where(positions < lengths_b[:, None], positions + 1, state.mtp_cache.max_len)
        h, mtp_cache = mtp(target.embed(nxt), out.hidden_bth, mtp_pos, state.mtp_cache, target_kv=out.cache.kv)
        mtp_h = jnp.where(res.ends_b[:, None], gather_rows(h, res.last_b), state.mtp_h_bh)
        h = mtp.feature(h)
    if drafter is not None and drafter.chained:     # row i pairs the features at i with x_{i+1}
        nxt = jnp.concatenate([tokens_bt[:, 1:], next_b[:, None]], axis=1)
        nxt = jnp.where(positions == lengths_b[:, None] - 1, first[:, None], nxt)
        pos = jnp.where(positions < lengths_b[:, None], positions, state.ctx_cache.max_len)
        h_last, ctx = drafter.step(drafter.embed(nxt, target), drafter.fuse(jnp.concatenate(out.captured, -1)), pos,
                                   state.ctx_cache, res.last_b)
        mtp_h = jnp.where(res.ends_b[:, None], h_last.astype(state.mtp_h_bh.dtype), state.mtp_h_bh)
    elif drafter is not None:      # MTP row i (h_i, x_{i+1}) is aligned with context position i
        ctx = write_context(drafter, models.fusion, state.ctx_cache, out.captured, positions, h)
    draft_cache = state.draft_cache
    if models.draft_model is not None:
        draft_cache = prefill_draft_cache(models.draft_model, draft_cache, tokens_bt, positions, lengths_b)
    return with_lp(SpecState(out.cache, ctx, mtp_cache, mtp_h, lengths_b.astype(jnp.int32), first, history,
                             draft_cache, state.deferred))
