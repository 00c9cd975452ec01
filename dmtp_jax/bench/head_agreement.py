"""How often the drafting side's efficient or int8 head picks the full head's T1: at every position a
round drafts from, MTP's first candidate is scored from the same MTP hidden (one causal target and
MTP pass, `train/features.py:mtp_hidden`) with both heads, and the argmaxes compared."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.decode.batch import next_pow2
from dmtp_jax.models.fusion import mtp_first_candidate
from dmtp_jax.options import check_draft_head_applies
from dmtp_jax.train.features import mtp_hidden


def agreement_counts(target, mtp, head, tokens_bt: jax.Array, valid_bt: jax.Array,
                     counted_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(positions where the drafting head's T1 equals the full head's, positions compared)` over the
    `counted_bt` positions of `tokens_bt` (`valid_bt`: real tokens); pure, on merged modules."""
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    hidden = target(tokens_bt, positions, None, kv_valid_bt=valid_bt).hidden_bth
    h = mtp_hidden(mtp, target, tokens_bt, hidden)[:, 1:]           # position 0 has no MTP row
    _, full, _ = mtp_first_candidate(target, mtp, h)
    _, efficient, _ = mtp_first_candidate(target, mtp, h, head)
    valid = counted_bt[:, 1:] & valid_bt[:, 1:]
    same = (jnp.argmax(full, -1) == jnp.argmax(efficient, -1)) & valid
    return same.sum(), valid.sum()


def t1_agreement(decoder, sequences: list[list[int]], prompt_lens: list[int] | None = None) -> float | None:
    """The fraction of positions of `sequences` where the drafting head's T1 equals the full head's;
    None when the decoder drafts with the full head or has no MTP; `RequestError` for an MTP head that
    scores with its own head (`options.check_draft_head_applies`). `prompt_lens`: count from each
    sequence's last prompt token on."""
    head = getattr(decoder, "draft_head", None)
    if head is None or not decoder.proposer.needs["mtp"] or not sequences:
        return None
    check_draft_head_applies("draft-head T1 agreement", decoder.mtp.cfg)
    length = next_pow2(max(2, max(len(s) for s in sequences)))
    tokens = np.zeros((len(sequences), length), np.int32)
    valid = np.zeros(tokens.shape, bool)
    counted = np.zeros(tokens.shape, bool)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)], valid[i, :len(s)] = s, True
        counted[i, max(0, (prompt_lens[i] if prompt_lens else 1) - 1):len(s)] = True
    graphdefs = (decoder.target.graphdef, decoder.mtp.graphdef, head.graphdef)

    @jax.jit
    def counts(states, tokens_bt, valid_bt, counted_bt):
        return agreement_counts(*(nnx.merge(g, s) for g, s in zip(graphdefs, states)), tokens_bt, valid_bt,
                                counted_bt)

    same = total = 0
    for start in range(0, len(sequences), 8):           # 8 rows per call: one compile, bounded memory
        rows = slice(start, start + 8)
        t, v, c = (np.pad(a[rows], ((0, 8 - a[rows].shape[0]), (0, 0))) for a in (tokens, valid, counted))
        s, n = jax.device_get(counts((decoder.target.state, decoder.mtp.state, head.state), t, v, c))
        same, total = same + int(s), total + int(n)
    return same / total if total else None
