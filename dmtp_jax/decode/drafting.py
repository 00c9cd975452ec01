"""The drafting caches' side of a round: once the target has verified, the committed rows go into
the MTP head's cache (`mtp_advance`), the drafter's context (`write_context`) or a chained drafter's
cache (`chained_advance`) and a draft model's cache, all through `advance_drafting`.

A state that carries `DeferredRows` lets plain rounds skip that work: each plain round's verified
row (token, target hidden, captured features) waits in a per-row buffer (`defer_rows`), and
`catch_up` runs the waiting rows through `advance_drafting` in blocks of `CATCH_UP_CHUNK`, on verify
forwards synthesized from the buffer, before anything reads those caches (a speculative round, a
prefill on a resumed state) or the buffer would overflow (`serve/rounds.py:RoundBank.caught_up`).
The caches then equal round-by-round advancing up to float rounding; they only shape drafts, and
verification decides every token, so outputs are unchanged. A lean prefill
(`defer_chunk`) puts a prompt's rows there too, so a request that ends while plain rounds serve
never runs the drafting models at all."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.decode.draft_model import commit_draft_cache
from dmtp_jax.layers.kv_cache import KVCache, write_layer
from dmtp_jax.models import TargetOutput
from dmtp_jax.sharding import replicated

DEFER_WINDOW = 256      # positions a row may buffer (its prompt, when prefilled lean, and its plain rounds)
                        # before its drafting caches catch up: a row that ends within them never pays the upkeep
CATCH_UP_CHUNK = 16     # positions per catch-up block: a catch-up runs ceil(longest lag / 16) blocks
DRAFTING_CACHES = ("ctx_cache", "mtp_cache", "mtp_h_bh", "draft_cache")     # SpecState fields advance_drafting returns


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyForward:
    """The target's verify forward: inputs `[A, drafts]`, their positions and embeddings, the
    `TargetOutput` and logits."""
    tokens_bn: jax.Array
    positions_bn: jax.Array
    embeds_bnh: jax.Array
    out: object
    logits_bnv: jax.Array | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeferredRows:
    """Plain rounds' rows not yet in the drafting caches: row b's slot w holds position
    `lengths_b - lag_b + w` (w < lag_b)."""
    lag_b: jax.Array                    # [B] int32: plain rounds since the row's caches last advanced
    tokens_bw: jax.Array                # [B, W] the token verified at each position (then pending)
    hidden_bwh: jax.Array               # [B, W, H] the target's post-norm hidden there
    captured_bwf: jax.Array | None      # [B, W, F] the captured layers' outputs, concatenated (None: none)

    @property
    def window(self) -> int:
        return self.tokens_bw.shape[1]


def deferred_widths(target_cfg, drafter_cfg) -> tuple[int, int]:
    """`(hidden, captured width)` of a buffered row: the target's hidden size, and the captured layers'
    features the drafter's context reads (0 without a drafter)."""
    hidden = target_cfg.hidden_size
    return hidden, 0 if drafter_cfg is None else len(drafter_cfg.target_layer_ids) * hidden


def deferred_nbytes(batch: int, window: int, hidden_size: int, captured_width: int, dtype) -> int:
    """Bytes of a `new_deferred` buffer (int32 tokens and lags, rows in `dtype`).

    Example:
        >>> deferred_nbytes(2, 16, 8, 16, "bfloat16")
        1672
    """
    return batch * (4 + window * (4 + (hidden_size + captured_width) * jnp.dtype(dtype).itemsize))


def new_deferred(mesh, batch: int, window: int, hidden_size: int, captured_width: int, dtype) -> DeferredRows:
    """An empty buffer of `window` rows per row, replicated on `mesh`. `window` is at most
    `CATCH_UP_CHUNK` or a multiple of it (catch-up blocks tile the buffer)."""
    if window > CATCH_UP_CHUNK and window % CATCH_UP_CHUNK:
        raise ValueError(f"a defer window of {window} rows does not tile into catch-up blocks of {CATCH_UP_CHUNK}")
    rep = replicated(mesh)
    zeros = lambda *shape, dt=dtype: jax.device_put(np.zeros((batch, *shape), dt), rep)  # noqa: E731
    return DeferredRows(zeros(dt=np.int32), zeros(window, dt=np.int32), zeros(window, hidden_size),
                        zeros(window, captured_width) if captured_width else None)


def gather_rows(x_bt_: jax.Array, index_b: jax.Array) -> jax.Array:
    """`x[b, index[b]]` for every row."""
    return jnp.take_along_axis(x_bt_, index_b.reshape((-1,) + (1,) * (x_bt_.ndim - 1)), axis=1)[:, 0]


def write_all_layers(cache_lbskd: jax.Array, new_lbtkd: jax.Array, positions_bt: jax.Array) -> jax.Array:
    """`write_layer` for every layer of a stacked cache."""
    for i in range(cache_lbskd.shape[0]):
        cache_lbskd = write_layer(cache_lbskd, i, new_lbtkd[i], positions_bt)
    return cache_lbskd


def mtp_advance(models, state, mtp_cache: KVCache, fwd: VerifyForward, acc_b, bonus_b, active_b):
    """MTP over rows `(h_{L+j}, next committed token)` at `L+j+1` for `j <= accepted`; the rest go to
    scratch. Returns `(cache, hidden predicting the next T1, every row's hidden or None)`; the last
    is only for the DMTP context variants (row j aligned with context position `L+j`)."""
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
    target_kv = fwd.out.cache.kv        # the verify rows' K/V are written: row j reads positions <= L + j
    if fusion is not None and fusion.uses_mtp_context:
        rows, mtp_cache = mtp(nxt_bnh, hidden_bnh, pos, mtp_cache, target_kv=target_kv)
        last = gather_rows(rows, acc_b)
        rows = mtp.feature(rows)
    else:
        (last, mtp_cache), rows = mtp.advance(nxt_bnh, hidden_bnh, pos, mtp_cache, acc_b, target_kv=target_kv), None
    return mtp_cache, jnp.where(active_b[:, None], last, state.mtp_h_bh), rows


def write_context(drafter, fusion, ctx_cache: KVCache, captured, positions_bt: jax.Array, mtp_h_bth) -> KVCache:
    """Context K/V of new target rows (captured features at `positions_bt`); the DMTP context variants
    mix in the MTP feature `mtp_h_bth` (aligned with p)."""
    features = jnp.concatenate(captured, axis=-1)
    ctx = (fusion.context(drafter, features, mtp_h_bth) if fusion is not None
           else drafter.project_context(features))
    k, v = drafter.context_kv(ctx, positions_bt)
    return KVCache(write_all_layers(ctx_cache.k_lbskd, k, positions_bt),
                   write_all_layers(ctx_cache.v_lbskd, v, positions_bt))


def chained_advance(models, state, fwd: VerifyForward, acc_b, bonus_b, active_b):
    """A chained drafter's (EAGLE-3's) advance: its cache rows `(features of verify row j, next
    committed token)` at positions L+j for j <= accepted (the rest go to scratch), and the output of
    the last accepted row, which predicts the next first candidate. Returns `(cache, hidden [B, H])`."""
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


def advance_drafting(models, state, mtp_cache: KVCache | None, fwd: VerifyForward, acc_b, bonus_b, active_b,
                     draft_start=None) -> dict:
    """The drafting caches after a row commits verify rows `0..accepted` of `fwd` and `bonus` (inactive
    rows keep theirs): `{ctx_cache, mtp_cache, mtp_h_bh, draft_cache}` for `dataclasses.replace` on the
    state. `mtp_cache`: the MTP cache the round starts from (a proposer's chain may have written it);
    `draft_start`: a draft model's cache to commit from (None: the state's)."""
    ctx, mtp_h, mtp_rows = state.ctx_cache, state.mtp_h_bh, None
    if models.mtp is not None:
        mtp_cache, mtp_h, mtp_rows = mtp_advance(models, state, mtp_cache, fwd, acc_b, bonus_b, active_b)
    drafter = models.drafter
    if drafter is not None and drafter.chained:    # EAGLE-3: rows (features, next token), as the MTP's
        ctx, mtp_h = chained_advance(models, state, fwd, acc_b, bonus_b, active_b)
    elif drafter is not None:
        ctx = write_context(drafter, models.fusion, ctx, fwd.out.captured, fwd.positions_bn, mtp_rows)
    draft_cache = state.draft_cache
    if models.draft_model is not None:
        start = state.draft_cache if draft_start is None else draft_start
        draft_cache = commit_draft_cache(models.draft_model, start, fwd.tokens_bn, fwd.positions_bn,
                                         jnp.where(active_b, acc_b + 1, 0))
    return dict(zip(DRAFTING_CACHES, (ctx, mtp_cache, mtp_h, draft_cache)))


def write_slots(deferred: DeferredRows, lag_b: jax.Array, slot_bt: jax.Array, tokens_bt: jax.Array,
                out: TargetOutput) -> DeferredRows:
    """`deferred` with lags `lag_b` and row b's `tokens_bt[b, t]`, `out`'s hidden and captured features
    there written at slot `slot_bt[b, t]` (a slot past the window is dropped)."""
    rows_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[0])[:, None], tokens_bt.shape)

    def put(buf, rows):
        return buf.at[rows_bt, slot_bt].set(rows.astype(buf.dtype), mode="drop")
    captured = deferred.captured_bwf
    if captured is not None:
        captured = put(captured, jnp.concatenate(out.captured, axis=-1))
    tokens, hidden = put(deferred.tokens_bw, tokens_bt), put(deferred.hidden_bwh, out.hidden_bth)
    return DeferredRows(lag_b.astype(jnp.int32), tokens, hidden, captured)


def defer_rows(deferred: DeferredRows, fwd: VerifyForward, active_b) -> DeferredRows:
    """`deferred` with a plain round's verified row appended for every active row (`fwd` has one row:
    the pending token at L); the caller keeps room (`catch_up` first), a full row's append is dropped."""
    slot_b = jnp.where(active_b, deferred.lag_b, deferred.window)
    return write_slots(deferred, deferred.lag_b + active_b.astype(jnp.int32), slot_b[:, None], fwd.tokens_bn,
                       fwd.out)


def defer_chunk(deferred: DeferredRows, out: TargetOutput, tokens_bt: jax.Array, positions_bt: jax.Array,
                start: jax.Array, lengths_b: jax.Array) -> DeferredRows:
    """`deferred` (empty: every lag 0) holding a lean prefill's only chunk: the rows at positions
    `start <= p < lengths_b` (token, `out`'s hidden and captured features) at slot `p - start`, lag
    `lengths_b - start`; the chunk is at most the window wide (checked). `catch_up` then runs them as
    the prefill would have (row p pairs h_p with the token at p + 1, the last with the pending one)."""
    if tokens_bt.shape[1] > deferred.window:
        raise ValueError(f"a lean prefill chunk of {tokens_bt.shape[1]} tokens does not fit a defer window of "
                         f"{deferred.window}")
    slot_bt = jnp.where(positions_bt < lengths_b[:, None], positions_bt - start, deferred.window)
    return write_slots(deferred, jnp.maximum(lengths_b - start, 0), slot_bt, tokens_bt, out)


def catch_up(models, state):
    """`state` with every row's deferred rows in its drafting caches and its lag 0. The buffer runs
    through `advance_drafting` in verify blocks of `CATCH_UP_CHUNK` positions, as many as the longest
    lag needs (so the cost follows the lag, not the window): block i of row b holds its buffered
    positions from `16 i` on, accepted prefix = the positions left in it minus one, bonus = the next block's
    first token or, in the row's last block, the pending token. No block runs when nothing waits.
    Its own call (`spec.catch_up_entry`), never inside a round or a prefill: a program that reads the
    buffer in a loop and then writes it in place gets the whole buffer copied by XLA every call."""
    deferred = state.deferred
    if deferred is None:
        return state
    width = min(CATCH_UP_CHUNK, deferred.window)
    lag_b = deferred.lag_b
    last_slot = deferred.window - 1

    def advance_block(i, carry):
        st = dataclasses.replace(state, **carry)        # the loop carries the drafting caches only
        d, first = st.deferred, i * width
        left_b = lag_b - first                          # the row's buffered positions from this block on
        j = jnp.arange(width)[None]
        base_b = st.lengths_b - left_b
        positions = jnp.where(j < left_b[:, None], base_b[:, None] + j, st.target_cache.max_len)  # rest dropped
        block = lambda buf: jax.lax.dynamic_slice_in_dim(buf, first, width, axis=1)  # noqa: E731
        tokens = block(d.tokens_bw)
        captured = () if d.captured_bwf is None else (block(d.captured_bwf),)
        out = TargetOutput(block(d.hidden_bwh), captured, st.target_cache)
        fwd = VerifyForward(tokens, positions, models.target.embed(tokens), out, None)
        following_b = jax.lax.dynamic_index_in_dim(d.tokens_bw, jnp.minimum(first + width, last_slot), axis=1,
                                                   keepdims=False)
        bonus_b = jnp.where(left_b > width, following_b, st.pending_b)
        acc_b = jnp.clip(left_b, 1, width) - 1
        caches = advance_drafting(models, dataclasses.replace(st, lengths_b=base_b), st.mtp_cache, fwd, acc_b,
                                  bonus_b, left_b > 0)
        return {k: jax.tree.map(lambda new, old: new.astype(old.dtype), v, carry[k])
                for k, v in caches.items()}         # the loop carry's types must stay the same

    blocks = (jnp.max(lag_b) + width - 1) // width
    caches = jax.lax.fori_loop(0, blocks, advance_block, {k: getattr(state, k) for k in DRAFTING_CACHES})
    return dataclasses.replace(state, **caches, deferred=dataclasses.replace(deferred, lag_b=jnp.zeros_like(lag_b)))
