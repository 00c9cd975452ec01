"""DFlash / DFlash2 block drafter (z-lab `dflash` 0.1.0 semantics) as a pure NNX module: block rows
are target embedding rows, logits come from the target's LM head, context K/V are computed once per
position (`context_kv`) and cached by the caller. DFlash2 adds a dynamic conv and a selector.
Attention rules: docs/models-detail.md.

Example:
    >>> dcfg = DFlashConfig.from_hf_dict({"architectures": ["DFlashDraftModel"], "hidden_size": 32,
    ...     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128,
    ...     "dflash_config": {"block_size": 8, "mask_token_id": 120, "target_layer_ids": [0, 1]}})
    >>> drafter = DFlashDrafter(dcfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> ctx = drafter.project_context(jnp.zeros((1, 5, 64)))
    >>> k, v = drafter.context_kv(ctx, jnp.arange(5)[None])
    >>> hidden = drafter(jnp.zeros((1, 8, 32)), 5 + jnp.arange(8)[None], k, v, jnp.arange(5)[None],
    ...                  jnp.ones((1, 5), bool))
    >>> hidden.shape
    (1, 8, 32)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.models.dflash_config import DFlashConfig
from dmtp_jax.layers import params
from dmtp_jax.layers.attention import attention_mask, grouped_attention
from dmtp_jax.layers.dynamic_conv import grouped_dynamic_conv
from dmtp_jax.layers.kv_cache import repeat_kv_heads
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.layers.rope import rope_cos_sin
from dmtp_jax.layers.rows import per_row
from dmtp_jax.models.qwen3 import Attention, DenseMLP

def context_features(target_out, dcfg: DFlashConfig, num_target_layers: int) -> jax.Array:
    """Concatenated target features `[B, T, n_ctx*H]` as `dflash` builds them from HF
    `hidden_states[k+1]` (layer k's raw output; the target's last layer post-final-norm) from the
    target's output for `capture_layers=dcfg.target_layer_ids`."""
    parts = [target_out.hidden_bth if k == num_target_layers - 1 else x
             for k, x in zip(dcfg.target_layer_ids, target_out.captured)]
    return jnp.concatenate(parts, axis=-1)


def make_block_tokens(anchor_b: jax.Array, dcfg: DFlashConfig, block_size: int | None = None) -> jax.Array:
    """Block input ids `[B, block]`: the anchor (last committed token) then `mask_token_id`."""
    n = dcfg.block_size if block_size is None else block_size
    tokens = jnp.full((anchor_b.shape[0], n), dcfg.mask_token_id, anchor_b.dtype)
    return tokens.at[:, 0].set(anchor_b)


def block_embeddings(target_embed_fn: Callable[[jax.Array], jax.Array], block_tokens_bt: jax.Array,
                     dcfg: DFlashConfig) -> jax.Array:
    """Raw target embedding rows of the block tokens times `input_embedding_scale`."""
    return target_embed_fn(block_tokens_bt) * dcfg.input_embedding_scale


def transform_draft_logits(logits: jax.Array, dcfg: DFlashConfig) -> jax.Array:
    """`output_multiplier`, then `tanh(x / c) * c` when `final_logit_softcapping` c is set."""
    logits = logits * dcfg.output_multiplier
    if dcfg.final_logit_softcapping is not None:
        c = dcfg.final_logit_softcapping
        logits = jnp.tanh(logits / c) * c
    return logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SelectorOutput:
    """DFlash2 proposal: tokens `[B, L]`, candidate ids `[B, L, k]`, probabilities over the
    candidates `[B, L, k]` (None for greedy)."""
    tokens_bl: jax.Array
    candidates_blk: jax.Array
    probs_blk: jax.Array | None


class GroupedDynamicCausalConv(nnx.Module):
    """DFlash2 conv: `base_kernel [2, K, H]` (input side, output side) and `kernel_projection
    [H, 2*K*G]` predicting both dynamic kernels from the normed input."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int, dtype, rngs: nnx.Rngs):
        self.kernel_size, self.group_size = kernel_size, group_size
        groups = hidden // group_size
        base = jnp.zeros((2, kernel_size, hidden), dtype).at[:, 0].set(1)   # identity at init
        self.base_kernel = nnx.Param(base, logical_axes=(None, None, "embed"))
        self.kernel_projection = params.zeros((hidden, 2 * kernel_size * groups), ("embed", None), dtype)

    def prepare(self, h_bth: jax.Array, block_len: int | None = None):
        """Input-side conv of `h`, and the output-side dynamic kernel `[B, T, K, G]` for `finish`."""
        b, t, h = h_bth.shape
        dyn = (h_bth @ self.kernel_projection[...]).reshape(b, t, 2, self.kernel_size, -1)
        base = self.base_kernel[...]
        return (grouped_dynamic_conv(h_bth, dyn[:, :, 0], base[0], self.group_size, block_len),
                dyn[:, :, 1])

    def finish(self, y_bth: jax.Array, dyn_btkg: jax.Array, block_len: int | None = None):
        return grouped_dynamic_conv(y_bth, dyn_btkg, self.base_kernel[...][1], self.group_size, block_len)


class CandidateSelector(nnx.Module):
    """DFlash2 selector params: codebooks `[V, r]` and `hidden_projection [H, r]`."""

    def __init__(self, dcfg: DFlashConfig, dtype, rngs: nnx.Rngs):
        v, r = dcfg.vocab_size, dcfg.selector_rank
        self.predecessor_codebook = params.weight(rngs, (v, r), ("vocab", None), dtype)
        self.successor_codebook = params.zeros((v, r), ("vocab", None), dtype)
        self.hidden_projection = params.weight(rngs, (dcfg.hidden_size, r), ("embed", None), dtype)


# `remat` of the drafter's training forward: what each layer keeps for the backward pass
REMAT_POLICIES = {"off": None, "full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class DFlashLayer(nnx.Module):
    """One drafter decoder layer (params named as in HF; DFlash2 adds `attention_conv` / `mlp_conv`)."""

    def __init__(self, dcfg: DFlashConfig, layer: int, dtype, rngs: nnx.Rngs):
        h = dcfg.hidden_size
        self.eps, self.version = dcfg.rms_norm_eps, dcfg.version
        self.input_layernorm = params.ones((h,), (None,), dtype)
        self.post_attention_layernorm = params.ones((h,), (None,), dtype)
        self.self_attn = Attention(dcfg, layer, dtype, rngs)
        self.mlp = DenseMLP(h, dcfg.intermediate_size, dtype, rngs)
        if dcfg.version == 2:
            self.attention_conv = GroupedDynamicCausalConv(h, dcfg.conv_kernel_size,
                                                           dcfg.conv_group_size, dtype, rngs)
            self.mlp_conv = GroupedDynamicCausalConv(h, dcfg.conv_kernel_size,
                                                     dcfg.conv_group_size, dtype, rngs)

    def __call__(self, x_bth, cos, sin, ctx_k_bskd, ctx_v_bskd, mask_bts, block_len=None):
        """`x + attn(...)`, then `+ mlp(...)`: block rows attend to [context ; block] keys."""
        conv = self.version == 2
        h = rms_norm(x_bth, self.input_layernorm[...], self.eps)
        if conv:
            h, attn_dyn = self.attention_conv.prepare(h, block_len)
        q, k, v = self.self_attn.qkv(h, cos, sin)
        heads = ctx_k_bskd.shape[2]         # the context cache may repeat KV heads (cache_kv_heads)
        keys = jnp.concatenate([ctx_k_bskd.astype(k.dtype), repeat_kv_heads(k, heads)], axis=1)
        values = jnp.concatenate([ctx_v_bskd.astype(v.dtype), repeat_kv_heads(v, heads)], axis=1)
        y = self.self_attn.out(grouped_attention(q, keys, values, mask_bts))
        x = x_bth + (self.attention_conv.finish(y, attn_dyn, block_len) if conv else y)
        h = rms_norm(x, self.post_attention_layernorm[...], self.eps)
        if conv:
            h, mlp_dyn = self.mlp_conv.prepare(h, block_len)
        y = self.mlp(h)
        return x + (self.mlp_conv.finish(y, mlp_dyn, block_len) if conv else y)

    def remat_call(self, policy: str, *args, block_len=None):
        """`__call__` under `jax.checkpoint` with `REMAT_POLICIES[policy]` ("off": the plain call)."""
        if REMAT_POLICIES[policy] is None:
            return self(*args, block_len)
        graphdef, state = nnx.split(self)
        run = lambda st, *a: nnx.merge(graphdef, st)(*a, block_len)  # noqa: E731
        return jax.checkpoint(run, policy=REMAT_POLICIES[policy])(state, *args)


class DFlashDrafter(nnx.Module):
    """The DFlash / DFlash2 drafter; every method is a pure function of params and inputs."""
    chained = False     # its context rows are target features only (`decode/round.py:commit`)

    def __init__(self, dcfg: DFlashConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = dcfg
        h = dcfg.hidden_size
        self.fc = params.weight(rngs, (dcfg.num_context_features, h), ("features", "embed"), dtype)
        self.hidden_norm = params.ones((h,), (None,), dtype)
        self.layers = nnx.List([DFlashLayer(dcfg, i, dtype, rngs) for i in range(dcfg.num_hidden_layers)])
        self.norm = params.ones((h,), (None,), dtype)
        if dcfg.version == 2:
            self.candidate_selector = CandidateSelector(dcfg, dtype, rngs)

    @jax.named_scope("drafter")
    def project_context(self, features_btf: jax.Array) -> jax.Array:
        """`hidden_norm(fc(features))` for concatenated target layer outputs `[B, T, n_ctx*H]`."""
        return rms_norm(features_btf @ self.fc[...], self.hidden_norm[...], self.cfg.rms_norm_eps)

    @jax.named_scope("drafter")
    def context_kv(self, ctx_bth: jax.Array, positions_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-layer K/V `[L, B, T, kv, D]` of context rows at absolute `positions` (k_norm + RoPE)."""
        cos, sin = rope_cos_sin(positions_bt, self.cfg.head_dim, self.cfg.rope_theta, ctx_bth.dtype)
        ks, vs = [], []
        for layer in self.layers:
            k, v = layer.self_attn.kv(ctx_bth, cos, sin)
            ks.append(k)
            vs.append(v)
        return jnp.stack(ks), jnp.stack(vs)

    def _masks(self, block_positions_bt, ctx_pos_bs, ctx_valid, block_len, block_valid_bt=None):
        """One `[B, T, S+T]` mask per distinct (causal, window) pair among the layers."""
        b, t = block_positions_bt.shape
        k_pos = jnp.concatenate([ctx_pos_bs, block_positions_bt], axis=1)
        per_query_ctx = ctx_valid.ndim == 3
        block_keys = jnp.ones((b, t), bool) if block_valid_bt is None else block_valid_bt
        key_valid = jnp.concatenate(
            [jnp.ones(ctx_pos_bs.shape, bool) if per_query_ctx else ctx_valid, block_keys], 1)
        extra = None
        if per_query_ctx or block_len:
            idx = jnp.arange(t)
            same_block = (idx[:, None] // block_len == idx[None, :] // block_len) if block_len else (
                jnp.ones((t, t), bool))
            ctx_part = ctx_valid if per_query_ctx else jnp.ones((b, t, ctx_pos_bs.shape[1]), bool)
            extra = jnp.concatenate([ctx_part, jnp.broadcast_to(same_block, (b, t, t))], axis=2)
        masks = {}
        for i in range(self.cfg.num_hidden_layers):
            key = (self.cfg.layer_is_causal(i), self.cfg.layer_window(i))
            if key not in masks:
                m = attention_mask(block_positions_bt, k_pos, key_valid, key[0], key[1])
                masks[key] = m if extra is None else m & extra
        return masks

    @jax.named_scope("drafter")
    def __call__(self, block_embeds_bth: jax.Array, block_positions_bt: jax.Array,
                 ctx_k_lbskd: jax.Array, ctx_v_lbskd: jax.Array, ctx_pos_bs: jax.Array,
                 ctx_valid_bs: jax.Array, *, block_len: int | None = None,
                 block_valid_bt: jax.Array | None = None, remat: str = "off") -> jax.Array:
        """Drafter layers over block rows, then the final norm: hidden `[B, T, H]`.

        Keys: the context rows (`ctx_k/v [L, B, S, kv, D]` at `ctx_pos`, masked by `ctx_valid [B, S]` or
        `[B, T, S]`), then the block rows. `block_len`: the T rows are independent blocks of that length
        (training); default one block. `block_valid [B, T]` hides block rows as keys (a block cut to the
        token budget). `remat`: a `REMAT_POLICIES` name (training; values unchanged)."""
        cfg = self.cfg
        x = block_embeds_bth
        cos, sin = rope_cos_sin(block_positions_bt, cfg.head_dim, cfg.rope_theta, x.dtype)
        masks = self._masks(block_positions_bt, ctx_pos_bs, ctx_valid_bs, block_len, block_valid_bt)
        for i, layer in enumerate(self.layers):
            mask = masks[(cfg.layer_is_causal(i), cfg.layer_window(i))]
            x = layer.remat_call(remat, x, cos, sin, ctx_k_lbskd[i], ctx_v_lbskd[i], mask, block_len=block_len)
        return rms_norm(x, self.norm[...], cfg.rms_norm_eps)

    def draft_logits(self, hidden_bth: jax.Array, target_logits_fn: Callable[[jax.Array], jax.Array]):
        """Target LM head on drafter hidden states, then `output_multiplier` and softcap."""
        return transform_draft_logits(target_logits_fn(hidden_bth), self.cfg)

    def _selector_inputs(self, hidden_bth, logits_btv):
        if self.cfg.version != 2:
            raise ValueError("the candidate selector needs a DFlash2 drafter")
        sel = self.candidate_selector
        unary_btk, cand_btk = jax.lax.top_k(logits_btv, self.cfg.selector_top_k)
        return unary_btk, cand_btk, hidden_bth @ sel.hidden_projection[...]

    def _pair_scores(self, pred_b, proj_br, cand_bk):
        sel = self.candidate_selector
        return jnp.einsum("br,bkr->bk", jnp.take(sel.predecessor_codebook[...], pred_b, axis=0) * proj_br,
                          jnp.take(sel.successor_codebook[...], cand_bk, axis=0))

    def selector_scores(self, hidden_bth: jax.Array, logits_btv: jax.Array,
                        predecessors_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """DFlash2 candidate scores and ids `[B, L, k]` for given predecessor tokens (teacher forcing), all
        slots in parallel: slot j scores its unary top-k as `u + <P[pred_j] * (h_j @ W), S[cand]>`."""
        unary_btk, cand_btk, proj_btr = self._selector_inputs(hidden_bth, logits_btv)
        b, t, k = cand_btk.shape
        pair = self._pair_scores(predecessors_bt.reshape(-1), proj_btr.reshape(b * t, -1),
                                 cand_btk.reshape(b * t, k))
        return unary_btk + pair.reshape(b, t, k), cand_btk

    def select_tokens(self, hidden_bth: jax.Array, logits_btv: jax.Array, anchor_b: jax.Array,
                      temperature: float | jax.Array = 0.0, key: jax.Array | None = None) -> SelectorOutput:
        """DFlash2's selector walked left to right over the proposal slots (`lax.scan`), each slot's
        predecessor the token chosen before it (the first's `anchor_b`). `temperature` <= 0 (Python):
        argmax, no probabilities; else `key` is required and each slot samples `softmax(scores /
        temperature)` over its k candidates."""
        unary_btk, cand_btk, proj_btr = self._selector_inputs(hidden_bth, logits_btv)
        greedy = isinstance(temperature, (int, float)) and temperature <= 0
        if not greedy and key is None:
            raise ValueError("sampling (temperature > 0) needs a PRNG key")
        n_slots = hidden_bth.shape[1]
        keys = jax.random.split(key, n_slots) if not greedy else jnp.zeros((n_slots,), jnp.uint32)

        def step(pred_b, slot):
            unary_bk, cand_bk, proj_br, slot_key = slot
            scores = unary_bk + self._pair_scores(pred_b, proj_br, cand_bk)
            if greedy:
                index, probs = jnp.argmax(scores, axis=-1), jnp.zeros(scores.shape, jnp.float32)
            else:
                # a [B] temperature (one per row, the server's batches) broadcasts over the candidates
                scaled = scores.astype(jnp.float32) / jnp.maximum(per_row(temperature, scores), 1e-6)
                probs = jax.nn.softmax(scaled, axis=-1)
                index = jax.random.categorical(slot_key, scaled, axis=-1)
            token = jnp.take_along_axis(cand_bk, index[:, None], axis=-1)[:, 0]
            return token, (token, probs)

        slots = (jnp.moveaxis(unary_btk, 1, 0), jnp.moveaxis(cand_btk, 1, 0),
                 jnp.moveaxis(proj_btr, 1, 0), keys)
        _, (tokens_lb, probs_lbk) = jax.lax.scan(step, anchor_b.astype(cand_btk.dtype), slots)
        return SelectorOutput(jnp.moveaxis(tokens_lb, 0, 1), cand_btk,
                              None if greedy else jnp.moveaxis(probs_lbk, 0, 1))

    def propose(self, hidden_bth: jax.Array, anchor_b: jax.Array,
                target_logits_fn: Callable[[jax.Array], jax.Array],
                temperature: float | jax.Array = 0.0, key: jax.Array | None = None) -> SelectorOutput:
        """`select_tokens` on `draft_logits(hidden)`, as `DFlash2DraftModel.propose` does."""
        return self.select_tokens(hidden_bth, self.draft_logits(hidden_bth, target_logits_fn),
                                  anchor_b, temperature, key)
