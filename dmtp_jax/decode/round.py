"""The speculative round as named, pure phase functions over explicit state.

A round from `SpecState` (the caches, each row's committed length `L` and pending token `A`, the MTP
hidden that predicts the next first candidate) with `n` verify slots:

    propose         a proposer (`decode/proposers.py`) drafts `[B, n-1]` tokens (and, sampled,
                    their probabilities): `Proposal`
    verify_forward  the target over `[A, drafts]` at positions `L..L+n-1` (`speculative=True`):
                    K/V written, DeltaNet block inputs kept for commit, drafter features captured
    accept          greedy exact match or a lossless sampled verifier: `(accepted [B], bonus [B])`
    mtp_advance     the MTP over rows `(h_{L+j}, next committed token)`, `j <= accepted`
    write_context   the drafter's context K/V of the verify rows
    commit          all of the above into the next `SpecState` and the round's tokens

`spec_round` composes them; `prefill_step` is the state's prefill chunk. Every function here is
pure: models come in as a `RoundModels` (merged modules), every knob as an argument, so the same
functions are jitted by the decoder (`decode/spec.py`), timed one by one by `bench/phases.py` and
used by the exactness probe (`verify_forward`).

Example:
    >>> models = merge_models(graphdefs, states)  # doctest: +SKIP
    >>> state, tokens_bn, accepted_b, t1_from_mtp_b = spec_round(
    ...     proposer, "rejection", models, state, active_b, limits_b, sp, key, True, knobs)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.decode.caches import target_cache_shardings
from dmtp_jax.decode.prefill import target_chunk
from dmtp_jax.decode.sampling import filtered_probs
from dmtp_jax.decode.verify import verify_block, verify_greedy, verify_rejection, verify_target_only
from dmtp_jax.layers.kv_cache import KVCache, TargetCache, write_layer
from dmtp_jax.models.draft_head import draft_scores
from dmtp_jax.sharding import kv_cache_sharding, replicated

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    target_cache: TargetCache   # K/V and, for hybrid targets, DeltaNet states (one protocol)
    ctx_cache: KVCache | None   # drafter context K/V, [draft_layers, B, S, kv, D] (EAGLE-3: its own K/V)
    mtp_cache: KVCache | None   # MTP private K/V, [1, B, S, kv, D]
    mtp_h_bh: jax.Array | None  # MTP (or EAGLE-3) pre-norm hidden that predicts the next T1
    lengths_b: jax.Array        # committed tokens in the target KV == position of the pending token
    pending_b: jax.Array        # last committed token (A), not yet run by the target


@dataclasses.dataclass(frozen=True)
class RoundModels:
    """The merged modules a round runs (`None` where the method uses none; `draft_head` None: the
    drafting side uses the target's full LM head, `models/draft_head.py`)."""
    target: nnx.Module
    drafter: nnx.Module | None = None
    mtp: nnx.Module | None = None
    fusion: nnx.Module | None = None
    draft_head: nnx.Module | None = None

    def draft_logits(self, hidden: jax.Array) -> jax.Array:
        """The drafting side's fp32 logits of post-norm hidden states (`draft_head.draft_scores`)."""
        return draft_scores(self.target, self.draft_head, hidden).logits

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs feed the drafter's context (none without a drafter)."""
        return self.drafter.cfg.target_layer_ids if self.drafter is not None else ()


def merge_models(graphdefs, states) -> RoundModels:
    """`RoundModels` from `(target, drafter, mtp, fusion, draft_head)` graphdefs and their states
    (inside jit).

    Example:
        >>> models = merge_models((target.graphdef, None, None, None, None),
        ...                       (target.state, None, None, None, None))  # doctest: +SKIP
    """
    return RoundModels(*(None if g is None else nnx.merge(g, s) for g, s in zip(graphdefs, states)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    """What a proposer drafts: tokens, their probabilities when sampling (`None` when greedy), the
    MTP cache (a chained MTP writes speculative rows into it) and whose first candidate each row
    verifies (`True`: MTP's)."""
    drafts_bn: jax.Array
    q_bnv: jax.Array | None
    mtp_cache: KVCache | None
    t1_from_mtp_b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyForward:
    """The target's verify forward: its inputs `[A, drafts]` at their positions and their
    embeddings, its output (`TargetOutput`: hidden, captured features, cache, DeltaNet block inputs)
    and logits."""
    tokens_bn: jax.Array
    positions_bn: jax.Array
    embeds_bnh: jax.Array
    out: object
    logits_bnv: jax.Array


def gather_rows(x_bt_: jax.Array, index_b: jax.Array) -> jax.Array:
    """`x[b, index[b]]` for every row.

    Example:
        >>> gather_rows(jnp.arange(6).reshape(2, 3), jnp.array([2, 0])).tolist()
        [2, 3]
    """
    return jnp.take_along_axis(x_bt_, index_b.reshape((-1,) + (1,) * (x_bt_.ndim - 1)), axis=1)[:, 0]


def write_all_layers(cache_lbskd: jax.Array, new_lbtkd: jax.Array, positions_bt: jax.Array) -> jax.Array:
    """`write_layer` for every layer of a stacked cache.

    Example:
        >>> out = write_all_layers(jnp.zeros((1, 1, 4, 1, 1)), jnp.ones((1, 1, 1, 1, 1)), jnp.array([[2]]))
        >>> out[0, 0, :, 0, 0].tolist()
        [0.0, 0.0, 1.0, 0.0]
    """
    for i in range(cache_lbskd.shape[0]):
        cache_lbskd = write_layer(cache_lbskd, i, new_lbtkd[i], positions_bt)
    return cache_lbskd


def context_window(cache_lbskd: jax.Array, lengths_b: jax.Array, window: int):
    """The last `window` slots before each row's length: `([L, B, W, kv, D], positions [B, W])`.

    Example:
        >>> ctx, pos = context_window(jnp.zeros((1, 1, 8, 1, 1)), jnp.array([6]), 4)
        >>> pos.tolist()
        [[2, 3, 4, 5]]
    """
    s = cache_lbskd.shape[2]
    w = min(window, s)
    start_b = jnp.clip(lengths_b - w, 0, s - w)
    rows = jax.vmap(lambda c, st: jax.lax.dynamic_slice_in_dim(c, st, w, axis=1), in_axes=(1, 0), out_axes=1)
    return rows(cache_lbskd, start_b), start_b[:, None] + jnp.arange(w)


def state_shardings(mesh, st: SpecState) -> SpecState:
    """The sharding of every array of a state (or of its shapes) on `mesh`, as a `SpecState` tree.

    Example:
        >>> state_shardings(target.mesh, state).lengths_b  # doctest: +SKIP
    """
    rep = replicated(mesh)
    kv = lambda c: None if c is None else KVCache(*(kv_cache_sharding(mesh, c.k_lbskd.shape),) * 2)  # noqa: E731
    return SpecState(target_cache_shardings(mesh, st.target_cache), kv(st.ctx_cache), kv(st.mtp_cache),
                     None if st.mtp_h_bh is None else rep, rep, rep)


def constrain_state(mesh, st: SpecState) -> SpecState:
    """`st` pinned at `state_shardings` (inside a jitted function).

    Example:
        >>> state = jax.jit(lambda s: constrain_state(target.mesh, s))(state)  # doctest: +SKIP
    """
    return jax.tree.map(jax.lax.with_sharding_constraint, st, state_shardings(mesh, st))


# ---- phases ------------------------------------------------------------------------------------
def verify_forward(target, state: SpecState, drafts_bn: jax.Array,
                   capture_layers: tuple[int, ...] = (), active_b: jax.Array | None = None) -> VerifyForward:
    """The target over `[pending, drafts]` at positions `L..L+n-1` from `state.target_cache`, as a
    verify round runs it (`speculative=True`: DeltaNet states wait for `commit`). With no drafts and
    `active_b` given (a plain step: its one token is always kept) the states advance in the forward
    for the active rows only, as a decode step's, and `commit` has nothing left to do.

    Example:
        >>> fwd = verify_forward(models.target, state, proposal.drafts_bn, models.capture_layers)  # doctest: +SKIP
        >>> fwd.logits_bnv.shape  # doctest: +SKIP
        (2, 8, 151936)
    """
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


def mtp_advance(models: RoundModels, state: SpecState, mtp_cache: KVCache, fwd: VerifyForward, acc_b, bonus_b,
                active_b):
    """MTP over rows (h_{L+j}, next committed token) at L+j+1 for j <= accepted; the rest go to
    scratch. Returns the cache, the hidden that predicts the next T1, and (for the DMTP context
    variants, which feed every row to the drafter's context; else None) every row's hidden (row j is
    aligned with context position L+j). Without the context variants only the last accepted row
    runs the whole layer; the others only write their keys and values.

    Example:
        >>> mtp_cache, mtp_h_bh, rows = mtp_advance(models, state, proposal.mtp_cache, fwd, acc, bonus,
        ...                                         active_b)  # doctest: +SKIP
    """
    target, mtp, fusion = models.target, models.mtp, models.fusion
    n = fwd.tokens_bn.shape[1]
    j = jnp.arange(n)[None]
    # the next committed token's embedding: row j < accepted takes verify row j + 1's (already looked
    # up by the verify forward), the accepted row the bonus's: one new row per round, not n
    shifted = jnp.concatenate([fwd.embeds_bnh[:, 1:], fwd.embeds_bnh[:, :1]], axis=1)
    nxt_bnh = jnp.where((j < acc_b[:, None])[:, :, None], shifted, target.embed(bonus_b[:, None]))
    valid = (j <= acc_b[:, None]) & active_b[:, None]
    pos = jnp.where(valid, state.lengths_b[:, None] + j + 1, mtp_cache.max_len)
    hidden_bnh = fwd.out.hidden_bth
    if fusion is not None and fusion.uses_mtp_context:
        rows, mtp_cache = mtp(nxt_bnh, hidden_bnh, pos, mtp_cache)
        last = gather_rows(rows, acc_b)
    else:
        (last, mtp_cache), rows = mtp.advance(nxt_bnh, hidden_bnh, pos, mtp_cache, acc_b), None
    return mtp_cache, jnp.where(active_b[:, None], last, state.mtp_h_bh), rows


def write_context(drafter, fusion, ctx_cache: KVCache, captured, positions_bt: jax.Array, mtp_h_bth) -> KVCache:
    """Context K/V of new target rows (the captured target features at `positions_bt`); the DMTP
    context variants mix in the MTP feature of row (h_p, x_{p+1}) (`mtp_h_bth`, aligned with p).

    Example:
        >>> ctx = write_context(models.drafter, models.fusion, state.ctx_cache, fwd.out.captured,
        ...                     fwd.positions_bn, None)  # doctest: +SKIP
    """
    features = jnp.concatenate(captured, axis=-1)
    ctx = (fusion.context(drafter, features, mtp_h_bth) if fusion is not None
           else drafter.project_context(features))
    k, v = drafter.context_kv(ctx, positions_bt)
    return KVCache(write_all_layers(ctx_cache.k_lbskd, k, positions_bt),
                   write_all_layers(ctx_cache.v_lbskd, v, positions_bt))


def chained_advance(models: RoundModels, state: SpecState, fwd: VerifyForward, acc_b, bonus_b, active_b):
    """A chained drafter's (EAGLE-3's) advance: its cache rows `(features of verify row j, next
    committed token)` at positions L+j for j <= accepted (the rest go to scratch), and the output of
    the last accepted row, which predicts the next first candidate. Returns `(cache, hidden [B, H])`.

    Example:
        >>> ctx, h_bh = chained_advance(models, state, fwd, acc, bonus, active_b)  # doctest: +SKIP
    """
    drafter = models.drafter
    n = fwd.tokens_bn.shape[1]
    j = jnp.arange(n)[None]
    shifted = jnp.concatenate([fwd.tokens_bn[:, 1:], fwd.tokens_bn[:, :1]], axis=1)
    nxt = jnp.where(j < acc_b[:, None], shifted, bonus_b[:, None])
    valid = (j <= acc_b[:, None]) & active_b[:, None]
    pos = jnp.where(valid, fwd.positions_bn, state.ctx_cache.max_len)
    h, ctx = drafter.step(drafter.embed(nxt, models.target), drafter.fuse(jnp.concatenate(fwd.out.captured, -1)),
                          pos, state.ctx_cache, acc_b)
    return ctx, jnp.where(active_b[:, None], h.astype(state.mtp_h_bh.dtype), state.mtp_h_bh)


def commit(models: RoundModels, state: SpecState, proposal: Proposal, fwd: VerifyForward, acc_b, bonus_b,
           active_b) -> tuple[SpecState, jax.Array]:
    """The next state and the round's tokens `[B, n]` (a row committed `tokens[:accepted + 1]`, the
    bonus at `accepted`): L += accepted + 1 for active rows; the target keeps the accepted prefix
    (`target.commit`: K/V past L are never read, DeltaNet states advance over the kept tokens only);
    `mtp_advance`; `write_context`. Finished (inactive) rows keep their state.

    Example:
        >>> state, tokens_bn = commit(models, state, proposal, fwd, acc, bonus, active_b)  # doctest: +SKIP
    """
    target, drafter = models.target, models.drafter
    ctx, mtp_cache, mtp_h, mtp_rows = state.ctx_cache, proposal.mtp_cache, state.mtp_h_bh, None
    if models.mtp is not None:
        mtp_cache, mtp_h, mtp_rows = mtp_advance(models, state, mtp_cache, fwd, acc_b, bonus_b, active_b)
    if drafter is not None and drafter.chained:    # EAGLE-3: rows (features, next token), as the MTP's
        ctx, mtp_h = chained_advance(models, state, fwd, acc_b, bonus_b, active_b)
    elif drafter is not None:
        ctx = write_context(drafter, models.fusion, ctx, fwd.out.captured, fwd.positions_bn, mtp_rows)
    drafts = proposal.drafts_bn         # [B, n-1]; n = 1 (no drafts) is a plain step
    slot = jnp.arange(drafts.shape[1] + 1)[None]
    tokens = jnp.where(slot < acc_b[:, None], jnp.concatenate([drafts, bonus_b[:, None]], axis=1), bonus_b[:, None])
    target_cache = target.commit(fwd.out.cache, fwd.out.pending, jnp.where(active_b, acc_b + 1, 0))
    lengths = jnp.where(active_b, state.lengths_b + acc_b + 1, state.lengths_b)
    new = SpecState(target_cache, ctx, mtp_cache, mtp_h, lengths, jnp.where(active_b, bonus_b, state.pending_b))
    return new, tokens


def spec_round(proposer, verify_mode: str, models: RoundModels, state: SpecState, active_b, limits_b, sp,
               key: jax.Array, greedy: bool, knobs):
    """One propose / verify / accept / commit round. Returns `(state, tokens [B, n], accepted [B],
    t1_from_mtp [B])`: a row's committed tokens are `tokens[:accepted + 1]` (the bonus sits at
    `accepted`), `t1_from_mtp` says whose first candidate the row verified (MTP's or the drafter's).
    `limits_b`: each row's token budget (prompt + max_new_tokens; drafter rows past it are hidden);
    `knobs`: the proposers' traced knobs (`proposers.RoundKnobs`).

    Example:
        >>> state, tokens_bn, acc_b, from_mtp_b = jax.jit(spec_round, static_argnums=(0, 1, 8))(
        ...     proposer, "rejection", models, state, active_b, limits_b, sp, key, True, knobs)  # doctest: +SKIP
    """
    k_draft, k_verify = jax.random.split(key)
    proposal = proposer.propose(models, state, sp, k_draft, greedy, limits_b, knobs)
    fwd = verify_forward(models.target, state, proposal.drafts_bn, models.capture_layers, jnp.asarray(active_b))
    acc, bonus = accept(fwd.logits_bnv, proposal.drafts_bn, proposal.q_bnv, sp, k_verify, greedy, verify_mode)
    new, tokens = commit(models, state, proposal, fwd, acc, bonus, active_b)
    return new, tokens, acc, proposal.t1_from_mtp_b


def prefill_step(models: RoundModels, tokens_bt, next_b, start, lengths_b, state: SpecState, sp, key,
                 greedy: bool = False) -> SpecState:
    """One prefill chunk (`decode/prefill.py`) through the target (K/V, DeltaNet states, context
    features) and the MTP; the first token is picked in the chunk that ends a row's prompt.

    MTP row i pairs h_i with x_{i+1} at position i+1: the next prompt token, `next_b` (the token
    after the chunk) for the chunk's last row, and the first new token for a row's last prompt
    token; rows past the prompt go to scratch. `state.pending_b` / `state.mtp_h_bh` carry the
    first token and the MTP hidden that predicts T1 until a row's prompt ends.

    Example:
        >>> state = prefill_step(models, chunk_bt, next_b, np.int32(0), lengths_b, state, sp, key,
        ...                      True)  # doctest: +SKIP
    """
    target, drafter, mtp = models.target, models.drafter, models.mtp
    res = target_chunk(target, tokens_bt, start, lengths_b, state.target_cache, state.pending_b, sp, key,
                       greedy, models.capture_layers)
    out, positions, first = res.out, res.positions_bt, res.first_b
    ctx = mtp_cache = mtp_h = h = None
    if mtp is not None:
        nxt = jnp.concatenate([tokens_bt[:, 1:], next_b[:, None]], axis=1)
        nxt = jnp.where(positions == lengths_b[:, None] - 1, first[:, None], nxt)
        mtp_pos = jnp.where(positions < lengths_b[:, None], positions + 1, state.mtp_cache.max_len)
        h, mtp_cache = mtp(target.embed(nxt), out.hidden_bth, mtp_pos, state.mtp_cache)
        mtp_h = jnp.where(res.ends_b[:, None], gather_rows(h, res.last_b), state.mtp_h_bh)
    if drafter is not None and drafter.chained:     # row i pairs the features at i with x_{i+1}
        nxt = jnp.concatenate([tokens_bt[:, 1:], next_b[:, None]], axis=1)
        nxt = jnp.where(positions == lengths_b[:, None] - 1, first[:, None], nxt)
        pos = jnp.where(positions < lengths_b[:, None], positions, state.ctx_cache.max_len)
        h_last, ctx = drafter.step(drafter.embed(nxt, target), drafter.fuse(jnp.concatenate(out.captured, -1)), pos,
                                   state.ctx_cache, res.last_b)
        mtp_h = jnp.where(res.ends_b[:, None], h_last.astype(state.mtp_h_bh.dtype), state.mtp_h_bh)
    elif drafter is not None:      # MTP row i (h_i, x_{i+1}) is aligned with context position i
        ctx = write_context(drafter, models.fusion, state.ctx_cache, out.captured, positions, h)
    return SpecState(out.cache, ctx, mtp_cache, mtp_h, lengths_b.astype(jnp.int32), first)
