"""Proposers: one object per drafting mode, behind one interface,
`proposal = proposer.propose(models, state, sp, key, greedy, limits_b, knobs)` -> `round.Proposal`.
`propose` is `draft(first(...))` (MTP's T1, then the rest of the block; the table of methods:
docs/ARCHITECTURE.md). Drafts are scored by the drafting side's head, verification always by the
full head; run-time knobs are traced (`RoundKnobs`), so changing them never recompiles.

Example:
    >>> make_proposer("dmtp", slots=8, context_window=4096).needs
    {'drafter': True, 'mtp': True, 'fusion': True, 'draft_model': False}
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.decode.draft_model import draft_chain
from dmtp_jax.decode.lookup import lookup_drafts
from dmtp_jax.decode.round import NO_CAP, Proposal, RoundModels, SpecState, context_window
from dmtp_jax.decode.sampling import filtered_probs, sample_from_probs
from dmtp_jax.decode.verify import candidate_probs_to_dense
from dmtp_jax.methods import ADAPTIVE, METHODS
from dmtp_jax.models.fusion import block_layout, draft_block_embeds, mtp_first_candidate
from dmtp_jax.options import method_needs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundKnobs:
    """Traced run-time knobs of a round: `adaptive_threshold` (f32 scalar, dmtp-adaptive only) and
    `commit_cap` (i32 scalar: a row commits at most `commit_cap + 1` tokens, `round.cap_accepted`;
    `round.NO_CAP` by default)."""
    adaptive_threshold: jax.Array
    commit_cap: jax.Array

    @classmethod
    def make(cls, adaptive_threshold: float | None = None, commit_cap: int | None = None) -> "RoundKnobs":
        """Host-side knobs (numpy scalar leaves, so every choice runs the same compile)."""
        return cls(np.float32(0.0 if adaptive_threshold is None else adaptive_threshold),
                   np.int32(NO_CAP if commit_cap is None else commit_cap))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FirstCandidate:
    """MTP's first candidate: the token, its probabilities (None when greedy), the MTP's post-norm output
    `y` (the chain continues from it) and its confidence."""
    t1_b: jax.Array
    q1_bv: jax.Array | None
    y_bh: jax.Array
    confidence_b: jax.Array


def pick(logits_bkv: jax.Array, sp, key: jax.Array, greedy: bool):
    """`(tokens, probabilities or None)`: the argmax when greedy, else a draw from `filtered_probs`.

    Example:
        >>> pick(jnp.array([[0.1, 3.0, 0.2]]), None, None, True)[0].tolist()
        [1]
    """
    if greedy:
        return jnp.argmax(logits_bkv, axis=-1).astype(jnp.int32), None
    q = filtered_probs(logits_bkv, sp)
    return sample_from_probs(q, key), q


def mtp_first(models: RoundModels, state: SpecState, sp, key: jax.Array, greedy: bool) -> FirstCandidate:
    """T1 = head(mtp.norm(h)) from the state's MTP hidden (`fusion.mtp_first_candidate`)."""
    y, logits, confidence = mtp_first_candidate(models.target, models.mtp, state.mtp_h_bh, models.draft_head)
    t1, q1 = pick(logits, sp, key, greedy)
    return FirstCandidate(t1, q1, y, confidence)


def drafter_hidden(method: str, slots: int, window: int, models: RoundModels, state: SpecState, t1_b, t1_from_mtp_b,
                   limits_b) -> jax.Array:
    """The drafter's block over its cached context window: the drafting rows' hidden `[B, n-1, H]`.
    Rows past a row's token budget `limits_b` are hidden."""
    target, drafter = models.target, models.drafter
    offsets, first_row = block_layout(method, slots)
    positions = state.lengths_b[:, None] + jnp.asarray(offsets)
    mtp_feature = state.mtp_h_bh if models.mtp is None else models.mtp.feature(state.mtp_h_bh)
    embeds = draft_block_embeds(method, slots, target.embed, drafter.cfg, models.fusion, state.pending_b, t1_b,
                                mtp_feature, t1_from_mtp_b)
    ctx_k, ctx_pos = context_window(state.ctx_cache.k_lbskd, state.lengths_b, window)
    ctx_v, _ = context_window(state.ctx_cache.v_lbskd, state.lengths_b, window)
    block_valid = positions < jnp.maximum(limits_b, state.lengths_b + 1)[:, None]
    return drafter(embeds, positions, ctx_k, ctx_v, ctx_pos, ctx_pos < state.lengths_b[:, None],
                   block_valid_bt=block_valid)[:, first_row:]


def drafter_tokens(models: RoundModels, hidden_bkh: jax.Array, predecessor_b: jax.Array, sp, key: jax.Array,
                   greedy: bool):
    """`(tokens [B, k], probabilities [B, k, V] or None)` from the drafter's rows: DFlash's draft logits,
    or DFlash2's selector (chained from `predecessor_b`)."""
    target, drafter = models.target, models.drafter
    if drafter.cfg.version == 2:
        sel = drafter.propose(hidden_bkh, predecessor_b, models.draft_logits, 0.0 if greedy else sp.temperature,
                              key)
        q = None if greedy else candidate_probs_to_dense(sel.candidates_blk, sel.probs_blk, target.cfg.vocab_size)
        return sel.tokens_bl.astype(jnp.int32), q
    return pick(drafter.draft_logits(hidden_bkh, models.draft_logits), sp, key, greedy)


def _joined(first_b, first_q, tokens_bk, q_bkv):
    drafts = jnp.concatenate([first_b[:, None], tokens_bk], axis=1)
    q = None if first_q is None else jnp.concatenate([first_q[:, None], q_bkv], axis=1)
    return drafts, q


@dataclasses.dataclass(frozen=True)
class Proposer:
    """A drafting mode for `slots` verify slots (pending token + `slots - 1` drafts), the drafter
    attending to the last `window` context positions. Subclasses implement `draft` (and `first`)."""
    method: str
    slots: int
    window: int = 4096
    ADAPTIVE = False        # reports per-round first-candidate sources (dmtp-adaptive)
    READS_TOKENS = False    # reads the state's token buffer (`SpecState.tokens_bs`; lookup)

    @property
    def needs(self) -> dict[str, bool]:
        """The models this proposer runs: `options.method_needs(method)`, the one rule."""
        return method_needs(self.method)

    def first(self, models: RoundModels, state: SpecState, sp, key: jax.Array, greedy: bool) -> FirstCandidate | None:
        """MTP's first candidate (None for a proposer without MTP); `key` is `propose`'s key."""
        return None

    def draft(self, models: RoundModels, state: SpecState, first: FirstCandidate | None, sp, key: jax.Array,
              greedy: bool, limits_b, knobs: RoundKnobs) -> Proposal:
        """The whole proposal given `first`; `key` is `propose`'s key."""
        raise NotImplementedError

    def propose(self, models: RoundModels, state: SpecState, sp, key: jax.Array, greedy: bool, limits_b,
                knobs: RoundKnobs) -> Proposal:
        """`draft(first(...))`: a `round.Proposal`."""
        return self.draft(models, state, self.first(models, state, sp, key, greedy), sp, key, greedy, limits_b,
                          knobs)

    def _keys(self, key):
        return jax.random.split(key, self.slots)


class _MtpFirst(Proposer):
    def first(self, models, state, sp, key, greedy):
        return mtp_first(models, state, sp, self._keys(key)[0], greedy)


class MtpChainProposer(_MtpFirst):
    """`mtp`: T1 from the MTP, then T2.. by chaining the MTP through its own cache (and the target's
    committed K/V, for a head that reads them)."""

    def draft(self, models, state, first, sp, key, greedy, limits_b, knobs):
        target, mtp = models.target, models.mtp
        keys = self._keys(key)
        drafts, qs, y, mtp_cache = [first.t1_b], [first.q1_bv], first.y_bh, state.mtp_cache
        for j in range(2, self.slots):
            pos = mtp.chain_position(state.lengths_b, j)[:, None]
            h, mtp_cache = mtp(target.embed(drafts[-1][:, None]), y[:, None], pos, mtp_cache,
                               target_kv=state.target_cache.kv)
            y = mtp.post_norm(h[:, 0])
            token, q = pick(mtp.scores(target, models.draft_head, y).logits, sp, keys[j - 1], greedy)
            drafts.append(token)
            qs.append(q)
        q_all = None if greedy else jnp.stack(qs, axis=1)
        return Proposal(jnp.stack(drafts, axis=1), q_all, mtp_cache, jnp.ones(first.t1_b.shape, bool))


class DFlashProposer(Proposer):
    """`dflash`: the drafter's block `[A, MASK..]` drafts every candidate (DFlash2: its selector)."""

    def draft(self, models, state, first, sp, key, greedy, limits_b, knobs):
        hidden = drafter_hidden(self.method, self.slots, self.window, models, state, None, None, limits_b)
        tokens, q = drafter_tokens(models, hidden, state.pending_b, sp, self._keys(key)[-1], greedy)
        return Proposal(tokens, q, state.mtp_cache, jnp.zeros(state.pending_b.shape, bool))


class DmtpProposer(_MtpFirst):
    """`dmtp` and its block variants: MTP's T1, then the drafter's block with T1 fused in
    (`models/fusion.py`)."""

    def draft(self, models, state, first, sp, key, greedy, limits_b, knobs):
        hidden = drafter_hidden(self.method, self.slots, self.window, models, state, first.t1_b, None, limits_b)
        tokens, q = drafter_tokens(models, hidden, first.t1_b, sp, self._keys(key)[-1], greedy)
        drafts, q_all = _joined(first.t1_b, first.q1_bv, tokens, q)
        return Proposal(drafts, q_all, state.mtp_cache, jnp.ones(first.t1_b.shape, bool))


class AdaptiveProposer(DmtpProposer):
    """`dmtp-adaptive`: rows whose MTP confidence reaches `knobs.adaptive_threshold` take `dmtp`'s block,
    the others DFlash's `[A, MASK..]`, in one drafter pass (DFlash version 1 drafters)."""
    ADAPTIVE = True

    def draft(self, models, state, first, sp, key, greedy, limits_b, knobs):
        from_mtp = first.confidence_b >= knobs.adaptive_threshold
        hidden = drafter_hidden(self.method, self.slots, self.window, models, state, first.t1_b, from_mtp, limits_b)
        own, own_q = drafter_tokens(models, hidden, state.pending_b, sp, self._keys(key)[-1], greedy)
        drafts = own.at[:, 0].set(jnp.where(from_mtp, first.t1_b, own[:, 0]))
        q = None if greedy else own_q.at[:, 0].set(jnp.where(from_mtp[:, None], first.q1_bv, own_q[:, 0]))
        return Proposal(drafts, q, state.mtp_cache, from_mtp)


class LookupProposer(Proposer):
    """`lookup`: prompt lookup over the state's token buffer (`decode/lookup.py`), no model; sampled,
    its proposal probabilities are one-hot (the drafts are deterministic given the history)."""
    READS_TOKENS = True

    def draft(self, models, state, first, sp, key, greedy, limits_b, knobs):
        drafts = lookup_drafts(state.tokens_bs, state.lengths_b, self.slots - 1)
        q = None if greedy else jax.nn.one_hot(drafts, models.target.cfg.vocab_size, dtype=jnp.float32)
        return Proposal(drafts, q, state.mtp_cache, jnp.zeros(state.pending_b.shape, bool))


class DraftModelProposer(Proposer):
    """`draft-model`: a smaller target of the same vocabulary chained `slots - 1` steps through its
    own cache (`decode/draft_model.py`; `round.commit` rolls that cache back to the accepted prefix)."""

    def draft(self, models, state, first, sp, key, greedy, limits_b, knobs):
        keys = self._keys(key)
        drafts, q, cache = draft_chain(models.draft_model, state.draft_cache, state.pending_b, state.lengths_b,
                                       self.slots - 1, lambda logits, j: pick(logits, sp, keys[j], greedy))
        return Proposal(drafts, q, state.mtp_cache, jnp.zeros(state.pending_b.shape, bool), cache)


class Eagle3Proposer(Proposer):
    """`eagle3`: the EAGLE-3 drafter chained k steps. T1 from the hidden its advance left (the target's
    tapped features of the committed tokens); each later step runs its layer on (its own previous
    output, the last drafted token) over a private copy of its cache (the speculative rows are
    dropped: commit writes the accepted ones from the target's features). Draws stay inside its
    draft vocabulary (`Eagle3Drafter.target_logits`)."""

    def draft(self, models, state, first, sp, key, greedy, limits_b, knobs):
        drafter, keys = models.drafter, self._keys(key)
        h, cache = state.mtp_h_bh, state.ctx_cache
        token, q = pick(drafter.target_logits(h), sp, keys[0], greedy)
        drafts, qs = [token], [q]
        for j in range(2, self.slots):
            pos = (state.lengths_b + j - 2)[:, None]
            h, cache = drafter.step(drafter.embed(token[:, None], models.target), h[:, None].astype(cache.k_lbskd.dtype),
                                    pos, cache)
            h = h[:, 0]
            token, q = pick(drafter.target_logits(h), sp, keys[j - 1], greedy)
            drafts.append(token)
            qs.append(q)
        q_all = None if greedy else jnp.stack(qs, axis=1)
        return Proposal(jnp.stack(drafts, axis=1), q_all, state.mtp_cache, jnp.zeros(state.pending_b.shape, bool))


class PlainProposer(Proposer):
    """`ar` on a speculative state: one verify slot, so the round is a plain target step that still
    keeps the MTP and the drafter's context current, or defers them (`decode/drafting.py`), so a
    state can switch between plain and speculative rounds."""

    def draft(self, models, state, first, sp, key, greedy, limits_b, knobs):
        b = state.pending_b.shape[0]
        q = None if greedy else jnp.zeros((b, 0, models.target.cfg.vocab_size), jnp.float32)
        return Proposal(jnp.zeros((b, 0), jnp.int32), q, state.mtp_cache, jnp.zeros((b,), bool))


# proposer kind (`methods.Method.proposer`) -> class
PROPOSERS: dict[str, type[Proposer]] = {"dflash": DFlashProposer, "mtp-chain": MtpChainProposer, "dmtp": DmtpProposer,
                                        ADAPTIVE: AdaptiveProposer, "lookup": LookupProposer,
                                        "draft-model": DraftModelProposer, "eagle3-chain": Eagle3Proposer}


def make_proposer(method: str, slots: int, context_window: int = 4096) -> Proposer:
    """The proposer of `method` (`methods.METHODS[method].proposer`) for `slots` verify slots.

    Example:
        >>> type(make_proposer("dmtp-adaptive", 8)).__name__
        'AdaptiveProposer'
    """
    return PROPOSERS[METHODS[method].proposer](method, slots, context_window)


def round_proposer(method: str, slots: int, context_window: int = 4096) -> Proposer:
    """`make_proposer`, or for `ar` the `PlainProposer` (one slot whatever `slots`).

    Example:
        >>> round_proposer("ar", 8).slots
        1
    """
    return PlainProposer("ar", 1, context_window) if method == "ar" else make_proposer(method, slots, context_window)
