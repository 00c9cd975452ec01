"""The drafting side's vocabulary projection: the full LM head, or an efficient head that shortlists
candidates with a low-rank factor of the LM head and rescores the shortlist exactly.

    full        logits = h W                                  (the target's own head, V columns)
    efficient   shortlist = top-K of (h A) B                  A [H, r], B [r, V]: W ~= A B
                (XLA's `approx_max_k`: on TPU an approximate top-K, recall >= 0.95 of it; elsewhere
                the exact top-K. Any shortlist keeps decoding exact / lossless, see below.)
                logits[v] = h W[:, v] for v in the shortlist, -inf elsewhere

On a mesh that splits the vocabulary over S shards, each shard shortlists its own top K / S ids and
rescores them from the rows it holds (`shortlist_logits`): the rows never cross devices.

    int8        logits = (h Q) * s                           Q int8 [H, V], s [V]: W ~= Q diag(s)
                (per vocabulary entry, symmetric: s_v = max_h |W[h, v]| / 127; half the bytes of a
                bf16 head, every column scored)

The factor is the rank-r truncated SVD of the LM head, made once at load time
(`make_efficient_head`): with `W W^T = U S^2 U^T`, `A = U_r` and `B = U_r^T W`, the best rank-r
approximation of `W`. It is model state (`down`, `up`; `up` sharded like the head's vocabulary
axis), so it travels into the jitted round as an argument and is never baked into the program.

The efficient head's output is the same dense fp32 `[..., V]` as the full head's, with the exact
values on the shortlist and -inf elsewhere, so `pick`, `filtered_probs`, DFlash2's selector and
verification are unchanged: greedy verification stays token-exact, and sampled verification stays
lossless because the proposal q it receives is exactly the distribution the draft was sampled from
(zero outside the shortlist). Only the drafting side uses it (MTP's T1 and chain steps, the
drafter's positions); the target's verify logits always come from the full head.

dmtp-adaptive's confidence (the MTP's top-1 probability) over the shortlist alone would overstate
it (the mass outside the shortlist is missing), so the partition adds the low-rank scores' mass
outside the shortlist (`DraftScores.rest_lse`, see `fusion.mtp_confidence`).

Example:
    >>> head = EfficientHead(hidden=8, vocab=32, rank=8, shortlist=4, dtype=jnp.float32)
    >>> w = jax.random.normal(jax.random.key(0), (8, 32))
    >>> head = factor_head(head, w)
    >>> h = jax.random.normal(jax.random.key(1), (2, 8))
    >>> scores = head.scores(h)
    >>> bool(jnp.all(jnp.argmax(scores.logits, -1) == jnp.argmax(h @ w, -1)))  # full rank: exact argmax
    True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from dmtp_jax.errors import InputError
from dmtp_jax.layers import params

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
    """How an untied head's rows store one row of `hidden` values: `(H / 128, 128)`, so that a
    gathered row is whole 128-lane tiles on TPU (XLA's TPU cost model charges a gather of `[V, H]`
    rows at about ten times the rows it reads, of `[V, H / 128, 128]` rows at three times), or
    `(1, H)` when H is not a multiple of 128.

    Example:
        >>> row_layout(5120), row_layout(48)
        ((40, 128), (1, 48))
    """
    return (hidden // 128, 128) if hidden % 128 == 0 else (1, hidden)


class EfficientHead(nnx.Module):
    """Low-rank shortlist + exact rescoring. Params: `down` A `[H, r]`, `up` B `[r, V]` (vocab axis
    sharded like the LM head's) and, for an untied LM head, `rows`: the head transposed, `[V, *row_layout(H)]`,
    so that the shortlist's exact rescoring reads K contiguous rows (a tied head's rows are the
    target's `embed_tokens`, not copied). `shortlist` K and `tied` are static."""

    def __init__(self, *, hidden: int, vocab: int, rank: int, shortlist: int, dtype, tied: bool = False):
        self.rank, self.shortlist, self.tied = int(rank), int(shortlist), bool(tied)
        self.down = params.zeros((hidden, rank), ("embed", None), dtype)
        self.up = params.zeros((rank, vocab), (None, "vocab"), dtype)
        if not tied:
            self.rows = params.zeros((vocab, *row_layout(hidden)), ("vocab", "embed", None), dtype)

    def scores(self, hidden: jax.Array, embed_vh: jax.Array | None = None) -> DraftScores:
        """`hidden [..., H]`: exact fp32 logits on the top-`shortlist` of the low-rank scores, -inf
        elsewhere, and the low-rank scores' logsumexp outside the shortlist. `embed_vh`: the
        target's `embed_tokens` when the head is tied (the rows rescored), else unused."""
        lead, h = hidden.shape[:-1], hidden.shape[-1]
        rows = embed_vh if self.tied else self.rows[...]
        logits, rest = shortlist_logits(hidden.reshape(-1, h), self.down[...], self.up[...], rows, self.shortlist)
        return DraftScores(logits.reshape(*lead, logits.shape[-1]), rest.reshape(lead))


def shortlist_logits(x_nh: jax.Array, down_hr: jax.Array, up_rv: jax.Array, rows: jax.Array,
                     shortlist: int) -> tuple[jax.Array, jax.Array]:
    """`(logits [N, V] fp32, rest_lse [N])`: `x_n . rows[v]` on the shortlist (the top of the low-rank
    scores `(x A) B`), -inf elsewhere; and the low-rank scores' logsumexp outside the shortlist.
    `rows`: `[V, H]` or `[V, *row_layout(H)]`.

    On a mesh that splits the vocabulary over S shards, each shard shortlists its own top
    `shortlist // S` ids and rescores them from the rows it holds: no row, and no `[N, V]` array,
    crosses devices; only the `[N, r]` low-rank projection and the partial scores are summed over
    the shards that split H, and the `[N]` logsumexp over the vocabulary shards. The shortlist then
    depends on the mesh; any shortlist keeps decoding exact (see the module docstring).

    Example:
        >>> rows = jnp.arange(12.0).reshape(4, 3)
        >>> logits, rest = shortlist_logits(jnp.ones((1, 3)), jnp.eye(3), rows.T, rows, 2)
        >>> logits.tolist(), round(float(rest[0]), 3)
        ([[-inf, -inf, 21.0, 30.0]], 12.0)
    """
    from dmtp_jax.layers.mlp import _axes, weights_mesh
    from dmtp_jax.sharding import DEFAULT_RULES, spec_for

    def local(x, down, up, rows, k, embed_axes=(), vocab_axes=()):
        z = jnp.dot(x, down, preferred_element_type=jnp.float32)
        z = (jax.lax.psum(z, embed_axes) if embed_axes else z).astype(x.dtype)
        approx = jnp.dot(z, up, preferred_element_type=jnp.float32)                   # [N, V_local]
        _, idx = jax.lax.approx_max_k(approx, k)                   # [N, k]; exact top-k off TPU
        picked = jnp.take(rows, idx, axis=0)                        # [N, k, *row]
        exact = jnp.einsum("n...,nk...->nk", x.reshape(x.shape[0], *rows.shape[1:]), picked,
                           preferred_element_type=jnp.float32)
        exact = jax.lax.psum(exact, embed_axes) if embed_axes else exact
        n = jnp.arange(x.shape[0])[:, None]
        logits = jnp.full(approx.shape, -jnp.inf, jnp.float32).at[n, idx].set(exact)
        rest = jax.nn.logsumexp(approx.at[n, idx].set(-jnp.inf), axis=-1)
        if vocab_axes:                                              # logsumexp over the shards
            top = jax.lax.pmax(rest, vocab_axes)
            top = jnp.where(jnp.isfinite(top), top, 0.0)
            rest = top + jnp.log(jax.lax.psum(jnp.exp(rest - top), vocab_axes))
        return logits, rest

    vocab = rows.shape[0]
    mesh = weights_mesh(rows)
    if mesh is None:
        return local(x_nh, down_hr, up_rv, rows, min(shortlist, vocab))
    # the rows' own split (vocab, embed) and, for the N axis, the batch axes they leave free
    spec = tuple(spec_for(("vocab", "embed", "batch") if rows.ndim == 2 else ("vocab", "embed", None, "batch"),
                          (*rows.shape, x_nh.shape[0]), mesh, DEFAULT_RULES))
    spec += (None,) * (rows.ndim + 1 - len(spec))
    vocab_axes, embed_axes = _axes(spec[0]), _axes(spec[1])
    shards = int(np.prod([mesh.shape[a] for a in vocab_axes]))
    k = max(1, min(shortlist // shards, vocab // shards))
    v_ax, e_ax, n_ax = spec[0], spec[1], spec[-1]       # spec_for gives None for an unsplit dim
    fn = jax.shard_map(lambda x, d, u, r: local(x, d, u, r, k, embed_axes, vocab_axes), mesh=mesh,
                       in_specs=(P(n_ax, e_ax), P(e_ax, None), P(None, v_ax), P(*spec[:-1])),
                       out_specs=(P(n_ax, v_ax), P(n_ax)))
    return fn(x_nh, down_hr, up_rv, rows)


def factor_head(head: EfficientHead, weight) -> EfficientHead:
    """`head` with its factor set to the rank-r truncated SVD of the LM head `weight` (`[H, V]`, or
    `[V, H]` when `head.tied`): `A = U_r`, `B = U_r^T W` from the eigenvectors of `W W^T` (an `[H, H]`
    product, so the `[H, V]` matrix is never decomposed), and an untied head's rows `W^T`. Runs
    once, at load time.

    Example: see the module docstring.
    """
    w = jnp.asarray(weight)
    w_hv = w.T if head.tied else w
    gram = np.asarray(jax.jit(lambda m: jnp.dot(m, m.T, preferred_element_type=jnp.float32))(w_hv), np.float64)
    _, vectors = np.linalg.eigh(gram)                       # ascending eigenvalues
    u = jnp.asarray(vectors[:, ::-1][:, :head.rank], jnp.float32)
    b = jax.jit(lambda m, u: jnp.dot(u.T, m.astype(jnp.float32)))(w_hv, u)
    head.down[...] = u.astype(head.down.dtype)
    head.up[...] = b.astype(head.up.dtype)
    if not head.tied:
        head.rows[...] = w_hv.T.reshape(head.rows.shape).astype(head.rows.dtype)
    return head


class Int8Head(nnx.Module):
    """The LM head quantized to int8 per vocabulary entry. Params: `weight` int8 `[H, V]` (sharded
    like an untied LM head, whether or not the target ties it) and `scale` `[V]`. Its logits are a
    proper distribution over the whole vocabulary, so nothing else changes downstream.

    Example:
        >>> w = jax.random.normal(jax.random.key(0), (8, 32))
        >>> head = quantize_head(Int8Head(hidden=8, vocab=32), w)
        >>> h = jax.random.normal(jax.random.key(1), (2, 8))
        >>> float(jnp.max(jnp.abs(head.scores(h).logits - h @ w))) < 0.1
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
    """`head` holding the LM head `weight` (`[H, V]`, or `[V, H]` when `tied`) in int8 with one scale per
    vocabulary entry (symmetric, round to nearest). Runs once, at load time.

    Example: see `Int8Head`.
    """
    @jax.jit
    def quantize(w):            # fused: no fp32 copy of the head
        w_hv = (w.T if tied else w).astype(jnp.float32)
        scale = jnp.maximum(jnp.max(jnp.abs(w_hv), axis=0), 1e-30) / 127.0
        return jnp.clip(jnp.round(w_hv / scale), -127, 127).astype(jnp.int8), scale

    head.weight[...], head.scale[...] = quantize(jnp.asarray(weight))
    return head


def draft_scores(target, head: EfficientHead | Int8Head | None, hidden: jax.Array) -> DraftScores:
    """The drafting side's scores of post-norm hidden states: the target's full LM head when `head`
    is None, else the efficient head's shortlist or the int8 head's scores (the one place the choice
    is read).

    Example:
        >>> draft_scores(target, None, y).logits.shape  # doctest: +SKIP
        (1, 248320)
    """
    if head is None:
        logits = target.logits(hidden)
        return DraftScores(logits, jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32))
    return head.scores(hidden, target.embed_tokens[...] if head.tied else None)


def head_name(head_cfg) -> str:
    """The draft head as the stats report it.

    Example:
        >>> head_name(None), head_name({"rank": 64, "shortlist": 256}), head_name({"kind": "int8"})
        ('full', 'efficient(rank=64,shortlist=256)', 'int8')
    """
    if head_cfg is None:
        return "full"
    if head_cfg.get("kind") == "int8":
        return "int8"
    return f"efficient(rank={head_cfg['rank']},shortlist={head_cfg['shortlist']})"


def abstract_efficient_head(target_cfg, dtype, rank: int | None = None, shortlist: int | None = None):
    """`(cfg, graphdef, abstract state)` of an efficient head for a target config (nothing allocated)."""
    rank, shortlist = head_shape(target_cfg.hidden_size, target_cfg.vocab_size, rank, shortlist)
    head = nnx.eval_shape(lambda: EfficientHead(hidden=target_cfg.hidden_size, vocab=target_cfg.vocab_size,
                                                rank=rank, shortlist=shortlist, dtype=jnp.dtype(dtype),
                                                tied=target_cfg.tie_word_embeddings))
    return {"rank": rank, "shortlist": shortlist}, *nnx.split(head)


def make_efficient_head(target, rank: int | None = None, shortlist: int | None = None):
    """A `LoadedModel` holding the efficient head of a loaded target (`factor_head` of its LM head),
    its params at their mesh shardings.

    Example:
        >>> head = make_efficient_head(target, rank=64, shortlist=256)  # doctest: +SKIP
        >>> head.cfg  # doctest: +SKIP
        {'rank': 64, 'shortlist': 256}
    """
    cfg = target.cfg
    dtype = target.state_dtype
    rank, shortlist = head_shape(cfg.hidden_size, cfg.vocab_size, rank, shortlist)
    model = nnx.merge(target.graphdef, target.state)
    head = EfficientHead(hidden=cfg.hidden_size, vocab=cfg.vocab_size, rank=rank, shortlist=shortlist, dtype=dtype,
                         tied=cfg.tie_word_embeddings)
    return _loaded(target, {"rank": rank, "shortlist": shortlist}, factor_head(head, model.head_weight()))


def _loaded(target, head_cfg: dict, head):
    """A made head as a `LoadedModel`, its params at their shardings on the target's mesh."""
    from dmtp_jax.checkpoint.hf import LoadedModel
    from dmtp_jax.sharding import state_shardings

    graphdef, state = nnx.split(head)
    state = jax.device_put(state, state_shardings(state, target.mesh))
    return LoadedModel(head_cfg, graphdef, state, target.mesh, None)


def abstract_draft_head(kind: str, target_cfg, dtype, rank: int | None = None, shortlist: int | None = None):
    """`(cfg, graphdef, abstract state)` of a drafting head of `kind` ("efficient" or "int8") for a
    target config, nothing allocated (`plan`)."""
    if kind == "efficient":
        return abstract_efficient_head(target_cfg, dtype, rank, shortlist)
    if kind != "int8":
        raise InputError(f"unknown draft head '{kind}'; use {', '.join(DRAFT_HEADS)}")
    head = nnx.eval_shape(lambda: Int8Head(hidden=target_cfg.hidden_size, vocab=target_cfg.vocab_size))
    return {"kind": "int8"}, *nnx.split(head)


def make_draft_head(target, kind: str, rank: int | None = None, shortlist: int | None = None):
    """A `LoadedModel` holding the drafting head of `kind` ("efficient": `make_efficient_head`; "int8":
    `quantize_head` of the target's LM head), its params at their mesh shardings.

    Example:
        >>> make_draft_head(target, "int8").cfg  # doctest: +SKIP
        {'kind': 'int8'}
    """
    if kind == "efficient":
        return make_efficient_head(target, rank, shortlist)
    if kind != "int8":
        raise InputError(f"unknown draft head '{kind}'; use {', '.join(DRAFT_HEADS)}")
    cfg = target.cfg
    model = nnx.merge(target.graphdef, target.state)
    return _loaded(target, {"kind": "int8"}, quantize_head(Int8Head(hidden=cfg.hidden_size, vocab=cfg.vocab_size),
                                                           model.head_weight(), tied=cfg.tie_word_embeddings))
