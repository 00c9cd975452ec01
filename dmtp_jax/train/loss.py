"""Block inputs per method, the drafter's training forward and the position-decayed CE.

For each of the N anchors `a` of a sequence, one block of `block_size` rows at `a .. a+B-1`; the
blocks are independent: a block sees the context features before its anchor and its own rows.
Slot k is labelled with the data token at `a+k`; known slots get no loss, predicted slots
`w_k = exp(-(k-1)/gamma)` times the loss mask. Losses are sums (`loss_sum`, `weight_sum`), so the
train step normalises over the whole optimiser step; `token_ce` never holds `[tokens, V]` logits."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from dmtp_jax.errors import InputError
from dmtp_jax.models.dflash import transform_draft_logits
from dmtp_jax.methods import ADAPTIVE, METHODS
from dmtp_jax.models.fusion import block_layout, draft_block_embeds
from dmtp_jax.options import TRAIN_METHODS, check_method, method_needs
from dmtp_jax.models.qwen3 import lm_head_logits

def method_layout(method: str, slots: int) -> tuple[tuple[int, ...], int]:
    """`(row offsets from the anchor A, first predicted row)`, shared with the decode round
    (`models.fusion.block_layout`); raises for unknown methods."""
    check_method(method, TRAIN_METHODS, InputError, "training method")
    return block_layout(method, slots)


def uses_mtp(method: str) -> bool:
    """Whether training `method` runs the frozen MTP head (`options.method_needs`)."""
    return method_needs(method)["mtp"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockInputs:
    """Per block (`[B, N, K]`): input ids, positions, labels, loss weights (decay x validity) and
    validity of the predicted slots."""
    tokens_bnk: jax.Array
    positions_bnk: jax.Array
    labels_bnk: jax.Array
    weights_bnk: jax.Array
    valid_bnk: jax.Array


def block_inputs(method: str, tokens_bt: jax.Array, loss_mask_bt: jax.Array, anchors_bn: jax.Array,
                 keep_bn: jax.Array, block_size: int, *, mask_token_id: int,
                 gamma: float | None, t1_masked_bn: jax.Array | None = None) -> BlockInputs:
    """The blocks of `method` for these anchors (`block_size` = verify slots). Rows sit at
    `anchor + offsets` (`method_layout`), labelled with the data token there; known rows (A, and T1
    for the DMTP methods) get no loss. `tokens_bnk`: `[A, MASK...]` (dflash), `[A, T1, MASK...]`
    (dmtp), `[T1, MASK...]` (single-anchor variants); padded blocks are all MASK. dmtp-adaptive:
    `t1_masked_bn` anchors get DFlash's block with T1 supervised, the others `dmtp`'s.

    Example:
        >>> b = block_inputs("dmtp", jnp.array([[5, 6, 7, 8, 9]]), jnp.ones((1, 5), jnp.int32),
        ...                  jnp.array([[1]]), jnp.array([[True]]), 4, mask_token_id=0, gamma=None)
        >>> b.tokens_bnk.tolist(), b.labels_bnk.tolist(), b.weights_bnk.tolist()
        ([[[6, 7, 0, 0]]], [[[6, 7, 8, 9]]], [[[0.0, 0.0, 1.0, 1.0]]])
    """
    offsets, known = method_layout(method, block_size)
    if (method == ADAPTIVE) != (t1_masked_bn is not None):
        raise ValueError("t1_masked_bn is given for dmtp-adaptive and only for it")
    b, length = tokens_bt.shape
    n = anchors_bn.shape[1]
    rows = len(offsets)
    k = jnp.arange(rows)
    positions_bnk = anchors_bn[:, :, None] + jnp.asarray(offsets)
    flat = jnp.clip(positions_bnk, 0, length - 1).reshape(b, n * rows)
    labels_bnk = jnp.take_along_axis(tokens_bt, flat, axis=1).reshape(b, n, rows)
    lm_bnk = jnp.take_along_axis(loss_mask_bt, flat, axis=1).reshape(b, n, rows).astype(bool)
    # known (input, unsupervised) slots per anchor: dmtp-adaptive's MTP-mode anchors also know T1
    known_bn1 = jnp.full((b, n, 1), known) if t1_masked_bn is None else jnp.where(t1_masked_bn, 1, 2)[..., None]
    valid_bnk = keep_bn[:, :, None] & (k >= known_bn1) & (positions_bnk < length) & lm_bnk
    decay_bnk = jnp.exp(-(k - known_bn1) / gamma) if gamma else jnp.ones((b, n, rows), jnp.float32)
    weights_bnk = valid_bnk * decay_bnk
    tokens_bnk = jnp.where((k < known_bn1) & keep_bn[:, :, None], labels_bnk, mask_token_id)
    return BlockInputs(tokens_bnk.astype(jnp.int32), positions_bnk.astype(jnp.int32), labels_bnk,
                       weights_bnk, valid_bnk)


def drafter_block_hidden(drafter, target, feats_btf: jax.Array, valid_bt: jax.Array,
                         blocks: BlockInputs, anchors_bn: jax.Array, *, method: str = "dflash",
                         fusion=None, mtp_h_bth: jax.Array | None = None,
                         t1_masked_bn: jax.Array | None = None, remat: str = "off") -> jax.Array:
    """Drafter hidden states `[B, N*R, H]` of all blocks in one drafter call; `remat` checkpoints each
    drafter layer. Block rows of anchor `a` see context rows `< a` (and `valid`) and their block,
    built by `models.fusion.draft_block_embeds` as in decoding; `mtp_h_bth[:, a]` is the frozen MTP
    hidden that predicts T1 = x_{a+1} (DMTP methods)."""
    dcfg = drafter.cfg
    b, n, rows = blocks.tokens_bnk.shape
    length = feats_btf.shape[1]
    dtype = drafter.fc[...].dtype
    if fusion is not None and fusion.uses_mtp_context:
        # context position p pairs with MTP row (h_p, x_{p+1}) = mtp_h_bth[:, p + 1]
        aligned = jnp.concatenate([mtp_h_bth[:, 1:], jnp.zeros_like(mtp_h_bth[:, :1])], axis=1)
        ctx_bth = fusion.context(drafter, feats_btf.astype(dtype), aligned.astype(dtype))
    else:
        ctx_bth = drafter.project_context(feats_btf.astype(dtype))
    ctx_pos_bs = jnp.broadcast_to(jnp.arange(length), (b, length))
    ctx_k, ctx_v = drafter.context_kv(ctx_bth, ctx_pos_bs)
    anchor_bt = jnp.repeat(anchors_bn, rows, axis=1)
    ctx_valid_bts = (jnp.arange(length)[None, None, :] < anchor_bt[:, :, None]) & valid_bt[:, None, :]
    flat_tokens = blocks.tokens_bnk.reshape(b * n, rows)
    mtp_h = None
    two_anchor = method == "dflash" or METHODS[method].anchors == 2     # block rows start at A
    t1_row = 1 if two_anchor else 0
    if mtp_h_bth is not None:
        mtp_h = jnp.take_along_axis(mtp_h_bth, anchors_bn[..., None], axis=1).reshape(b * n, -1).astype(dtype)
    slots = rows if two_anchor else rows + 1
    t1_from_mtp = None if t1_masked_bn is None else ~t1_masked_bn.reshape(b * n)
    embeds = draft_block_embeds(method, slots, lambda t: target.embed(t).astype(dtype), dcfg, fusion,
                                flat_tokens[:, 0], flat_tokens[:, t1_row], mtp_h, t1_from_mtp).astype(dtype)
    return drafter(embeds.reshape(b, n * rows, -1), blocks.positions_bnk.reshape(b, n * rows), ctx_k, ctx_v,
                   ctx_pos_bs, ctx_valid_bts, block_len=rows, remat=remat)


def draft_head(drafter, target) -> tuple[jax.Array, Callable[[jax.Array, jax.Array], jax.Array]]:
    """`(weight, logits_fn)`: the target's LM head weight and `logits_fn(weight, hidden) -> fp32
    [..., V]` (the drafter's logits), the weight an explicit argument for `token_ce`."""
    tied, dcfg = target.cfg.tie_word_embeddings, drafter.cfg

    def logits_fn(weight, hidden):
        return transform_draft_logits(lm_head_logits(hidden.astype(weight.dtype), weight, tied=tied), dcfg)
    return target.head_weight(), logits_fn


def drafter_block_logits(drafter, target, feats_btf: jax.Array, valid_bt: jax.Array,
                         blocks: BlockInputs, anchors_bn: jax.Array, **kwargs) -> jax.Array:
    """fp32 draft logits `[B, N*R, V]` of all blocks at once (evaluation; training uses `token_ce`)."""
    weight, logits_fn = draft_head(drafter, target)
    return logits_fn(weight, drafter_block_hidden(drafter, target, feats_btf, valid_bt, blocks, anchors_bn, **kwargs))


def _ce_top1(logits_btv: jax.Array, labels_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = logits_btv.astype(jnp.float32)
    gold = jnp.take_along_axis(logits, labels_bt[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - gold, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def map_row_chunks(fn: Callable, chunk: int, weight, *rows_bt: jax.Array):
    """`fn(weight, *rows)` over the positions of `[B, T, ...]` arrays: its per-position outputs.
    `chunk` > 0: a `lax.scan` over slices of `chunk` positions (batch axis whole, padding dropped),
    each under `jax.checkpoint`, so at most one slice's intermediates are live; `chunk` = 0: all at
    once. Gradients flow to `weight` and `rows_bt`."""
    if chunk <= 0:
        return fn(weight, *rows_bt)
    b, t = rows_bt[0].shape[:2]
    c = min(chunk, t)
    n = -(-t // c)

    def slices(a):              # [B, T, ...] -> [n, B, c, ...]
        a = jnp.pad(a, ((0, 0), (0, n * c - t)) + ((0, 0),) * (a.ndim - 2))
        return a.reshape(b, n, c, *a.shape[2:]).swapaxes(0, 1)
    body = jax.checkpoint(fn)
    _, out = jax.lax.scan(lambda _, xs: (None, body(weight, *xs)), None, tuple(slices(a) for a in rows_bt))
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(b, n * c, *o.shape[3:])[:, :t], out)


def token_ce(logits_fn: Callable, weight, hidden_bth: jax.Array, labels_bt: jax.Array,
             chunk: int = 0) -> tuple[jax.Array, jax.Array]:
    """Per-token fp32 cross-entropy `[B, T]` and top-1 ids `[B, T]` of `logits_fn(weight, hidden)`
    against `labels_bt`, `chunk` positions at a time (`map_row_chunks`; 0: all at once, same values).

    Example:
        >>> f = lambda w, h: h @ w
        >>> ce, top = token_ce(f, jnp.eye(4), jnp.eye(4)[None, :3], jnp.array([[0, 1, 3]]), chunk=2)
        >>> [round(float(x), 4) for x in ce[0]], top.tolist()
        ([0.7437, 0.7437, 1.7437], [[0, 1, 2]])
    """
    return map_row_chunks(lambda w, x, y: _ce_top1(logits_fn(w, x), y), chunk, weight, hidden_bth, labels_bt)


def ce_sums(ce_bnk: jax.Array, top1_bnk: jax.Array, blocks: BlockInputs) -> dict:
    """`loss_sum` (sum of w*CE), `weight_sum`, and per block slot `correct_k` / `count_k` `[K]` (top-1
    hits and valid predicted slots) from `token_ce`'s outputs."""
    hit = (top1_bnk == blocks.labels_bnk) & blocks.valid_bnk
    return {"loss_sum": jnp.sum(blocks.weights_bnk * ce_bnk), "weight_sum": jnp.sum(blocks.weights_bnk),
            "correct_k": jnp.sum(hit, axis=(0, 1)).astype(jnp.int32),
            "count_k": jnp.sum(blocks.valid_bnk, axis=(0, 1)).astype(jnp.int32)}


def decayed_ce_sums(logits_btv: jax.Array, blocks: BlockInputs) -> dict:
    """`ce_sums` of full logits `[B, N*K, V]` (fp32 reductions)."""
    b, n, kk = blocks.labels_bnk.shape
    ce, top1 = _ce_top1(logits_btv.reshape(b, n, kk, -1), blocks.labels_bnk)
    return ce_sums(ce, top1, blocks)


def acceptance_proxy(correct_k, count_k, known_slots: int = 1, base: int | None = None
                     ) -> tuple[list[float], float, float]:
    """Host-side, from summed counts: per-slot top-1 accuracy of the predicted rows (from `known_slots`
    on), their pooled mean, and the implied acceptance length `base + sum_k prod_{j<=k} acc_j`
    (`base` defaults to `known_slots`).

    Example:
        >>> acceptance_proxy([0, 5, 2], [0, 10, 10])
        ([0.5, 0.2], 0.35, 1.6)
    """
    accs = [c / n if n else 0.0 for c, n in zip(list(correct_k)[known_slots:], list(count_k)[known_slots:])]
    total = sum(count_k[known_slots:])
    mean = float(sum(correct_k[known_slots:]) / total) if total else 0.0
    length, run = float(known_slots if base is None else base), 1.0
    for a in accs:
        run *= a
        length += run
    return [round(float(a), 6) for a in accs], round(mean, 6), round(length, 6)
