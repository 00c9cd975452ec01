"""The drafting side's vocabulary projection: the full LM head, or a cheaper head for drafting only:
`EfficientHead` (a rank-r factor shortlists K ids, rescored exactly with their LM-head rows, -inf
elsewhere; optionally over a vocabulary subset) or `Int8Head` (the head in int8, one scale per
entry). Every head returns dense fp32 `[..., V]` logits, so verification (always the full head)
stays token-exact and lossless. Design and measurements: docs/drafting-head.md.

Example:
    >>> head = EfficientHead(hidden=8, vocab=32, rank=8, shortlist=4, dtype=jnp.float32)
    >>> w = jax.random.normal(jax.random.key(0), (8, 32))
    >>> head = factor_head(head, w)
    >>> h = jax.random.normal(jax.random.key(1), (2, 8))
    >>> bool(jnp.all(jnp.argmax(head.scores(h).logits, -1) == jnp.argmax(h @ w, -1)))  # full rank: exact
    True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.errors import InputError
from dmtp_jax.layers import params
from dmtp_jax.layers.shortlist import shortlist_logits
from dmtp_jax.sharding import MeshRules

DRAFT_HEADS = ("full", "efficient", "int8")
DEFAULT_RANK = 256          # at most; H // 4 for narrow models (`head_shape`)
DEFAULT_SHORTLIST = 1024    # at most; V // 16 for small vocabularies


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftScores:
    """Drafting-side logits `[..., V]` (fp32) and the log of the probability mass the head left out
    of them (`[...]`, -inf for the full head): the low-rank scores' logsumexp outside the shortlist."""
    logits: jax.Array
    rest_lse: jax.Array


def head_shape(hidden: int, vocab: int, rank: int | None = None, shortlist: int | None = None) -> tuple[int, int]:
    """`(rank, shortlist)` of an efficient head, defaults filled in and clipped to the model.

    Example:
        >>> head_shape(256, 4096), head_shape(5120, 248320), head_shape(256, 4096, 512, 8192)
        ((64, 256), (256, 1024), (256, 4096))
    """
    for flag, value in (("--draft-head-rank", rank), ("--draft-head-shortlist", shortlist)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    rank = min(DEFAULT_RANK, max(1, hidden // 4)) if rank is None else rank
    shortlist = min(DEFAULT_SHORTLIST, max(1, vocab // 16)) if shortlist is None else shortlist
    return min(rank, hidden), min(shortlist, vocab)


def row_layout(hidden: int) -> tuple[int, int]:
    """How an untied head's rows store one row of `hidden` values: `(H / 128, 128)` (whole 128-lane
    tiles on TPU), or `(1, H)` when H is not a multiple of 128."""
    return (hidden // 128, 128) if hidden % 128 == 0 else (1, hidden)


class EfficientHead(nnx.Module):
    """Low-rank shortlist + exact rescoring. Params: `down` A `[H, r]`, `up` B `[r, V]` (vocab axis
    sharded like the LM head's) and, for an untied LM head, `rows` `[V, *row_layout(H)]` (a tied head
    reads `embed_tokens`). `shortlist` K, `tied` and `mesh_rules` are static. `subset` N > 0: only N
    vocabulary entries are scored: `up` `[r, N]`, `rows` `[N, ...]` and `ids` `[N]` (-1: padding)."""

    def __init__(self, *, hidden: int, vocab: int, rank: int, shortlist: int, dtype, tied: bool = False,
                 subset: int = 0, mesh_rules: MeshRules | None = None):
        self.rank, self.shortlist, self.subset = int(rank), int(shortlist), int(subset)
        self.mesh_rules = mesh_rules
        self.vocab = int(vocab)
        self.tied = bool(tied) and not subset           # rows are the target's embed_tokens
        cols = subset or vocab
        self.down = params.zeros((hidden, rank), ("embed", None), dtype)
        self.up = params.zeros((rank, cols), (None, "vocab"), dtype)
        if not self.tied:
            self.rows = params.zeros((cols, *row_layout(hidden)), ("vocab", "embed", None), dtype)
        if subset:
            self.ids = nnx.Param(jnp.full((subset,), -1, jnp.int32), logical_axes=("vocab",))

    def scores(self, hidden: jax.Array, embed_vh: jax.Array | None = None) -> DraftScores:
        """`hidden [..., H]`: exact fp32 logits on the top-`shortlist` of the low-rank scores, -inf
        elsewhere, and the low-rank scores' logsumexp outside the shortlist. `embed_vh`: the
        target's `embed_tokens` when the head is tied (the rows rescored), else unused."""
        lead, h = hidden.shape[:-1], hidden.shape[-1]
        rows = embed_vh if self.tied else self.rows[...]
        ids = self.ids[...] if self.subset else None
        logits, rest = shortlist_logits(hidden.reshape(-1, h), self.down[...], self.up[...], rows, self.shortlist,
                                        ids, self.vocab, self.mesh_rules)
        return DraftScores(logits.reshape(*lead, logits.shape[-1]), rest.reshape(lead))


def subset_columns(weight, ids, tied: bool) -> jax.Array:
    """`[H, C]`: the LM head `weight` (`[H, V]`, or `[V, H]` when `tied`) as `[H, V]`, or only its
    columns at `ids` (`[C]`, -1: a zero column of padding).

    Example:
        >>> subset_columns(jnp.arange(6.0).reshape(2, 3), jnp.array([2, -1]), tied=False).tolist()
        [[2.0, 0.0], [5.0, 0.0]]
    """
    w_hv = weight.T if tied else weight
    if ids is None:
        return w_hv
    return jnp.where(ids >= 0, jnp.take(w_hv, jnp.maximum(ids, 0), axis=1), 0)


def factor_head(head: EfficientHead, weight, ids=None, tied: bool | None = None, factor=None) -> EfficientHead:
    """`head` with its factor set to the rank-r truncated SVD of the LM head `weight` (`[H, V]`, or
    `[V, H]` when `tied`), computed from `W W^T` `[H, H]`, and an untied head's rows `W^T`; only the
    columns at `ids` for a subset head. `factor`: `(A, B)` to use instead (a trained factor). Runs once,
    at load time (example: the module docstring)."""
    w = jnp.asarray(weight)
    if ids is not None:
        ids = np.asarray(ids, np.int64)
        if not head.subset or len(ids) > head.subset:
            raise InputError(f"{len(ids)} vocabulary ids for an efficient head of subset {head.subset}")
        ids = np.pad(ids, (0, head.subset - len(ids)), constant_values=-1)
        head.ids[...] = jnp.asarray(ids, jnp.int32)
    w_hv = subset_columns(w, None if ids is None else jnp.asarray(ids), head.tied if tied is None else tied)
    if factor is None:
        gram = np.asarray(jax.jit(lambda m: jnp.dot(m, m.T, preferred_element_type=jnp.float32))(w_hv), np.float64)
        _, vectors = np.linalg.eigh(gram)                       # ascending eigenvalues
        u = jnp.asarray(vectors[:, ::-1][:, :head.rank], jnp.float32)
        factor = (u, jax.jit(lambda m, u: jnp.dot(u.T, m.astype(jnp.float32)))(w_hv, u))
    head.down[...] = jnp.asarray(factor[0]).astype(head.down.dtype)
    head.up[...] = jnp.asarray(factor[1]).astype(head.up.dtype)
    if not head.tied:
        head.rows[...] = w_hv.T.reshape(head.rows.shape).astype(head.rows.dtype)
    return head


SUBSET_ALIGN = 1024     # a subset of more ids is padded to a multiple of this (8 shards of 128 lanes)


def subset_size(n: int) -> int:
    """The padded size of a vocabulary subset of `n` ids: a multiple of 1024 (of 8 under 1024 ids).

    Example:
        >>> subset_size(32768), subset_size(30000), subset_size(100)
        (32768, 30720, 104)
    """
    align = SUBSET_ALIGN if n > SUBSET_ALIGN else 8
    return -(-int(n) // align) * align


def frequent_ids(counts, n: int) -> np.ndarray:
    """The `n` vocabulary ids with the highest `counts` (ties: the lower id), in ascending order.

    Example:
        >>> frequent_ids([5, 0, 9, 9, 1], 3).tolist()
        [0, 2, 3]
    """
    counts = np.asarray(counts)
    return np.sort(np.argsort(-counts, kind="stable")[:n])


class Int8Head(nnx.Module):
    """The LM head quantized to int8 per vocabulary entry. Params: `weight` int8 `[H, V]` (sharded
    like an untied LM head) and `scale` `[V]`.

    Example:
        >>> w = jax.random.normal(jax.random.key(0), (8, 32))
        >>> head = quantize_head(Int8Head(hidden=8, vocab=32), w)
        >>> float(jnp.max(jnp.abs(head.scores(jnp.ones((2, 8))).logits - jnp.ones((2, 8)) @ w))) < 0.1
        True
    """

    tied = False            # its own copy of the head: never reads the target's embedding

    def __init__(self, *, hidden: int, vocab: int):
        self.weight = params.zeros((hidden, vocab), ("embed", "vocab"), jnp.int8)
        self.scale = params.zeros((vocab,), ("vocab",), jnp.float32)

    def scores(self, hidden: jax.Array, embed_vh: jax.Array | None = None) -> DraftScores:
        """`hidden [..., H]`: fp32 logits `(h Q) * s` over the whole vocabulary (`embed_vh` unused)."""
        logits = jnp.dot(hidden, self.weight[...].astype(hidden.dtype), preferred_element_type=jnp.float32)
        logits = logits * self.scale[...]
        return DraftScores(logits, jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32))


def quantize_head(head: Int8Head, weight, tied: bool = False) -> Int8Head:
    """`head` holding the LM head `weight` (`[H, V]`, or `[V, H]` when `tied`) in int8 with one scale
    per vocabulary entry (symmetric, round to nearest). Runs once, at load time."""
    @jax.jit
    def quantize(w):            # fused: no fp32 copy of the head
        w_hv = (w.T if tied else w).astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(w_hv), axis=0), 1e-30) / 127.0
        return jnp.clip(jnp.round(w_hv / scale), -127, 127).astype(jnp.int8), scale

    head.weight[...], head.scale[...] = quantize(jnp.asarray(weight))
    return head


def draft_scores(target, head: EfficientHead | Int8Head | None, hidden: jax.Array) -> DraftScores:
    """The drafting side's scores `DraftScores` (fp32 logits `[..., V]`) of post-norm hidden states:
    the target's full LM head when `head` is None, else the efficient or int8 head's."""
    if head is None:
        logits = target.logits(hidden)
        return DraftScores(logits, jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32))
    return head.scores(hidden, target.embed_tokens[...] if head.tied else None)


def head_name(head_cfg) -> str:
    """The draft head as the stats report it.

    Example:
        >>> head_name(None), head_name({"rank": 64, "shortlist": 256, "subset": 32768})
        ('full', 'efficient(rank=64,shortlist=256,vocab=32768)')
    """
    if head_cfg is None:
        return "full"
    if head_cfg.get("kind") == "int8":
        return "int8"
    subset = f",vocab={head_cfg['subset']}" if head_cfg.get("subset") else ""
    trained = ",trained" if head_cfg.get("trained") else ""
    return f"efficient(rank={head_cfg['rank']},shortlist={head_cfg['shortlist']}{subset}{trained})"


def efficient_shape(target_cfg, rank, shortlist, subset) -> tuple[dict, dict]:
    """`(head cfg, EfficientHead keywords)` for a target config; `subset`: ids in the vocabulary
    subset (None / 0: the whole vocabulary)."""
    vocab = target_cfg.vocab_size
    if subset is not None and not 1 <= subset <= vocab:
        raise InputError(f"--draft-head-vocab must be in [1, {vocab}] (the vocabulary), got {subset}")
    rank, shortlist = head_shape(target_cfg.hidden_size, subset or vocab, rank, shortlist)
    cfg = {"rank": rank, "shortlist": shortlist, **({"subset": subset} if subset else {})}
    return cfg, dict(hidden=target_cfg.hidden_size, vocab=vocab, rank=rank, shortlist=shortlist,
                     tied=target_cfg.tie_word_embeddings, subset=subset_size(subset) if subset else 0)
