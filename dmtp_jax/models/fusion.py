"""DMTP's first-candidate fusion: how MTP's T1 and the MTP hidden that predicted it enter the DFlash
block, one variant per DMTP method (the table of block rows and T1 inputs: docs/models-detail.md). Zero
inits make a DFlash checkpoint continue training from exactly its own behaviour.

Example:
    >>> fusion = T1Fusion("dmtp", hidden=32, rank=0, eps=1e-6, dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> e = jnp.ones((2, 32)); fusion.t1_input(e, e).shape
    (2, 32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.layers import params
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.methods import ADAPTIVE, DMTP_METHODS, METHODS

CONTEXT_VARIANTS = ("ctx-fusion", "ctx-mtp")
DEFAULT_LOWRANK = 64


class T1Fusion(nnx.Module):
    """Params by variant: `norm_embedding`, `norm_hidden`, `proj [2H, H]` (t1-residual, t1-replace);
    `norm_hidden`, `down [H, r]`, `up [r, H]` (t1-lowrank); `norm_hidden`, `proj [H, H]`
    (mask-residual, ctx-fusion, ctx-mtp); none for candidate-only."""

    def __init__(self, method: str, *, hidden: int, rank: int, eps: float, dtype, rngs: nnx.Rngs):
        if method not in DMTP_METHODS:
            raise ValueError(f"unknown DMTP method '{method}'; known: {', '.join(DMTP_METHODS)}")
        self.method, self.eps = method, eps
        self.anchors, self.variant = METHODS[method].anchors, METHODS[method].variant
        if self.variant is None:
            return
        self.norm_hidden = params.ones((hidden,), (None,), dtype)
        if self.variant in ("t1-residual", "t1-replace"):
            self.norm_embedding = params.ones((hidden,), (None,), dtype)
            proj = jnp.zeros((2 * hidden, hidden), dtype)
            if self.variant == "t1-replace":
                proj = proj.at[:hidden].set(jnp.eye(hidden, dtype=dtype))
            self.proj = nnx.Param(proj, logical_axes=("features", "embed"))
        elif self.variant == "t1-lowrank":
            self.down = params.weight(rngs, (hidden, rank or DEFAULT_LOWRANK), ("embed", None), dtype)
            self.up = params.zeros((rank or DEFAULT_LOWRANK, hidden), (None, "embed"), dtype)
        elif self.variant == "ctx-mtp":
            self.proj = nnx.Param(jnp.eye(hidden, dtype=dtype), logical_axes=("features", "embed"))
        else:
            self.proj = params.zeros((hidden, hidden), ("features", "embed"), dtype)

    @property
    def uses_mtp_context(self) -> bool:
        return self.variant in CONTEXT_VARIANTS

    def context(self, drafter, features_btf: jax.Array, mtp_ctx_bth: jax.Array | None) -> jax.Array:
        """The drafter's context rows: `drafter.project_context(features)`, with the aligned MTP features
        mixed in by the context variants."""
        if not self.uses_mtp_context:
            return drafter.project_context(features_btf)
        mtp_part = self._hidden(mtp_ctx_bth).astype(features_btf.dtype) @ self.proj[...]
        pre = mtp_part if self.variant == "ctx-mtp" else features_btf @ drafter.fc[...] + mtp_part
        return rms_norm(pre, drafter.hidden_norm[...], drafter.cfg.rms_norm_eps)

    def _hidden(self, mtp_h):
        return rms_norm(jax.lax.stop_gradient(mtp_h), self.norm_hidden[...], self.eps)

    def t1_input(self, t1_embed_bh: jax.Array, mtp_h_bh: jax.Array) -> jax.Array:
        """The block input of the T1 slot (`E(T1)` for the candidate-only and context variants)."""
        if self.variant in ("t1-residual", "t1-replace"):
            fused = jnp.concatenate([rms_norm(t1_embed_bh, self.norm_embedding[...], self.eps),
                                     self._hidden(mtp_h_bh)], axis=-1) @ self.proj[...]
            return t1_embed_bh + fused if self.variant == "t1-residual" else fused
        if self.variant == "t1-lowrank":
            return t1_embed_bh + (self._hidden(mtp_h_bh) @ self.down[...]) @ self.up[...]
        return t1_embed_bh

    def mask_residual(self, mtp_h_bh: jax.Array) -> jax.Array | None:
        """What every MASK row adds (mask-residual only), else None."""
        if self.variant != "mask-residual":
            return None
        return self._hidden(mtp_h_bh) @ self.proj[...]


def mtp_first_candidate(target, mtp, mtp_h_bh: jax.Array, head=None):
    """MTP's first candidate from its pre-norm hidden `h`: `(y = mtp.post_norm(h), fp32 logits of T1,
    confidence)`, the confidence being the top-1 probability at temperature 1. `head`: the drafting
    side's efficient head (None: full LM head; with it, logits are -inf outside its shortlist and the
    partition adds the low-rank mass outside). The one definition of dmtp-adaptive's confidence, for
    decoding and calibration alike."""
    y = mtp.post_norm(mtp_h_bh)
    scores = mtp.scores(target, head, y)
    return y, scores.logits, mtp_confidence(scores.logits, scores.rest_lse)


def mtp_confidence(logits_bv: jax.Array, rest_lse_b: jax.Array | None = None) -> jax.Array:
    """The fp32 top-1 probability of `softmax(logits)`; `rest_lse_b`: log of mass outside `logits` that
    the partition also counts.

    Example:
        >>> round(float(mtp_confidence(jnp.log(jnp.array([0.7, 0.2, 0.1])))), 4)
        0.7
    """
    logits = logits_bv.astype(jnp.float32)
    top = jnp.max(logits, axis=-1)
    partition = jnp.sum(jnp.exp(logits - top[..., None]), axis=-1)
    if rest_lse_b is not None:
        partition = partition + jnp.exp(rest_lse_b.astype(jnp.float32) - top)
    return 1.0 / partition


def block_layout(method: str, slots: int) -> tuple[tuple[int, ...], int]:
    """`(position offsets of the block rows from the pending token's L, index of the first drafting
    row)`; `slots` = verify slots.

    Example:
        >>> block_layout("dflash", 8)
        ((0, 1, 2, 3, 4, 5, 6, 7), 1)
        >>> block_layout("dmtp", 8)[1], block_layout("dmtp-single", 8)
        (2, ((1, 2, 3, 4, 5, 6, 7), 1))
    """
    if method in ("dflash", ADAPTIVE):
        return tuple(range(slots)), 1
    anchors = METHODS[method].anchors
    if anchors == 2:
        return tuple(range(slots)), 2
    return tuple(range(1, slots)), 1


def draft_block_embeds(method: str, slots: int, embed_fn, dcfg, fusion: T1Fusion | None,
                       pending_b: jax.Array, t1_b: jax.Array | None, mtp_h_bh: jax.Array | None,
                       t1_from_mtp_b: jax.Array | None = None) -> jax.Array:
    """The drafter's block input `[B, rows, H]` for `method` (the module table), shared by the decode
    round and the trainer. Rows are scaled by `input_embedding_scale` before the fusion acts on T1;
    `t1_from_mtp_b` (dmtp-adaptive): rows that take MTP's T1."""
    if (method == ADAPTIVE) != (t1_from_mtp_b is not None):
        raise ValueError("t1_from_mtp_b is given for dmtp-adaptive and only for it")
    b = pending_b.shape[0]
    offsets, _ = block_layout(method, slots)
    tokens = jnp.full((b, len(offsets)), dcfg.mask_token_id, jnp.int32)
    if method == "dflash":
        tokens = tokens.at[:, 0].set(pending_b)
        return embed_fn(tokens) * dcfg.input_embedding_scale
    t1_row = 1 if fusion.anchors == 2 else 0
    if fusion.anchors == 2:
        tokens = tokens.at[:, 0].set(pending_b)
    tokens = tokens.at[:, t1_row].set(t1_b)
    embeds = embed_fn(tokens) * dcfg.input_embedding_scale
    fused = fusion.t1_input(embeds[:, t1_row], mtp_h_bh).astype(embeds.dtype)
    if t1_from_mtp_b is not None:
        masked = embed_fn(jnp.full((b,), dcfg.mask_token_id, jnp.int32)) * dcfg.input_embedding_scale
        fused = jnp.where(t1_from_mtp_b[:, None], fused, masked.astype(embeds.dtype))
    embeds = embeds.at[:, t1_row].set(fused)
    residual = fusion.mask_residual(mtp_h_bh)
    if residual is not None:
        embeds = embeds.at[:, t1_row + 1:].add(residual[:, None].astype(embeds.dtype))
    return embeds
