"""The Gated DeltaNet token mixer of the hybrid Qwen families (`linear_attn.*` in HF checkpoints).

Qwen3.5 / Qwen3.6 store `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next fuses
them per key head as `in_proj_qkvz` and `in_proj_ba`. Both reduce to `(mixed_qkv, z, b, a)`; the
math is `layers/gated_deltanet.py`'s. State per row: conv window and recurrent state. A normal
call advances them over the valid tokens; a speculative call leaves them and returns the block's
per-token inputs, from which `commit_states` advances them over the accepted prefix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.layers import params
from dmtp_jax.layers.gated_deltanet import (causal_conv_silu, conv_window_after, gated_delta_rule,
                                            gated_delta_state_after, gated_rms_norm, gdn_gates, mask_gates,
                                            prepare_qk)
from dmtp_jax.layers.kv_cache import PendingBlock


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.nk, self.nv, self.dk, self.dv = nk, nv, dk, dv
        self.eps = cfg.rms_norm_eps
        self.fused = cfg.model_type == "qwen3_next"
        conv_dim = cfg.linear_conv_dim
        if self.fused:
            r = nv // nk
            self.in_proj_qkvz = params.weight(rngs, (h, nk * (2 * dk + 2 * r * dv)), ("embed", "heads"), dtype)
            self.in_proj_ba = params.weight(rngs, (h, nk * 2 * r), ("embed", None), dtype)
        else:
            # q | k | v columns split over `tensor` like attention heads (the split into q, k, v
            # then reshards when a shard boundary falls inside a segment: correct, not free)
            self.in_proj_qkv = params.weight(rngs, (h, conv_dim), ("embed", "heads"), dtype)
            self.in_proj_z = params.weight(rngs, (h, nv * dv), ("embed", "heads"), dtype)
            self.in_proj_b = params.weight(rngs, (h, nv), ("embed", None), dtype)
            self.in_proj_a = params.weight(rngs, (h, nv), ("embed", None), dtype)
        self.conv1d = params.weight(rngs, (conv_dim, 1, cfg.linear_conv_kernel_dim), ("heads", None, None),
                                    dtype, std=0.3)
        decay = jax.random.uniform(rngs.params(), (nv,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(decay).astype(dtype), logical_axes=(None,))
        self.dt_bias = params.ones((nv,), (None,), dtype)
        self.norm = params.ones((dv,), (None,), dtype)
        self.out_proj = params.weight(rngs, (nv * dv, h), ("heads", "embed"), dtype)

    def projections(self, x_bth):
        """`(mixed_qkv [B, T, C] as q | k | v, z [B, T, nv, dv], b [B, T, nv], a [B, T, nv])`."""
        b_, t, _ = x_bth.shape
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        if not self.fused:
            return (x_bth @ self.in_proj_qkv[...], (x_bth @ self.in_proj_z[...]).reshape(b_, t, nv, dv),
                    x_bth @ self.in_proj_b[...], x_bth @ self.in_proj_a[...])
        r = nv // nk
        qkvz = (x_bth @ self.in_proj_qkvz[...]).reshape(b_, t, nk, 2 * dk + 2 * r * dv)
        ba = (x_bth @ self.in_proj_ba[...]).reshape(b_, t, nk, 2 * r)
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v, z = qkvz[..., 2 * dk:2 * dk + r * dv], qkvz[..., 2 * dk + r * dv:]
        mixed = jnp.concatenate([q.reshape(b_, t, -1), k.reshape(b_, t, -1), v.reshape(b_, t, -1)], axis=-1)
        return mixed, z.reshape(b_, t, nv, dv), ba[..., :r].reshape(b_, t, nv), ba[..., r:].reshape(b_, t, nv)

    def __call__(self, x_bth, conv_bwc, ssm_bhkv, valid_bt, speculative: bool = False):
        """Mixes `x [B, T, H]` from the previous conv window and state (None: a fresh sequence):
        `(y [B, T, H], (conv, ssm), pending)`. `speculative=False`: the state after the valid tokens,
        `pending` None; `speculative=True`: the state unchanged, `pending = (conv_in, k, v, g, beta)`."""
        b_, t, _ = x_bth.shape
        mixed, z, b, a = self.projections(x_bth)
        conv_weight_ck = self.conv1d[...][:, 0, :]
        mixed_conv = causal_conv_silu(mixed, conv_weight_ck, conv_bwc)
        key_dim = self.nk * self.dk
        q = prepare_qk(mixed_conv[..., :key_dim].reshape(b_, t, self.nk, self.dk), self.nv, scale=True)
        k = prepare_qk(mixed_conv[..., key_dim:2 * key_dim].reshape(b_, t, self.nk, self.dk), self.nv, scale=False)
        v = mixed_conv[..., 2 * key_dim:].reshape(b_, t, self.nv, self.dv).astype(jnp.float32)
        g, beta = mask_gates(*gdn_gates(a, b, self.A_log[...], self.dt_bias[...]), valid_bt)
        if ssm_bhkv is None:
            ssm_bhkv = jnp.zeros((b_, self.nv, self.dk, self.dv), jnp.float32)
        o, new_ssm = gated_delta_rule(q, k, v, g, beta, ssm_bhkv)
        y = gated_rms_norm(o.astype(x_bth.dtype), z, self.norm[...], self.eps)
        y = y.reshape(b_, t, -1) @ self.out_proj[...]
        if speculative:
            return y, (conv_bwc, ssm_bhkv), (mixed, k, v, g, beta)
        if conv_bwc is None:
            return y, (None, new_ssm), None
        keep_b = (jnp.full((b_,), t, jnp.int32) if valid_bt is None
                  else jnp.sum(valid_bt, axis=1).astype(jnp.int32))
        return y, (conv_window_after(conv_bwc, mixed, keep_b), new_ssm), None


def commit_states(conv_lbwc: jax.Array, ssm_lbhkv: jax.Array, pending: PendingBlock, keep_b: jax.Array):
    """`(conv, ssm)` of every DeltaNet layer advanced over the first `keep_b` tokens of the pending block
    per row (0: unchanged), the state by one chunk of the chunked form."""
    conv = jax.vmap(conv_window_after, in_axes=(0, 0, None))(conv_lbwc, pending.conv_in_lbtc, keep_b)
    ssm = jax.vmap(gated_delta_state_after, in_axes=(0, 0, 0, 0, 0, None))(
        pending.k_lbthk, pending.v_lbthv, pending.g_lbth, pending.beta_lbth, ssm_lbhkv, keep_b)
    return conv, ssm
