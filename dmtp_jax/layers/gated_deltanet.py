"""Gated DeltaNet (Qwen3.5 / Qwen3.6 / Qwen3-Next linear attention) as pure functions: the gated
delta rule over a per-head fp32 state `S [dk, dv]` (docs/models-detail.md), as a token scan
(`gated_delta_recurrent`: decode, verify) or chunked (`gated_delta_chunked`: prefill, training),
picked by `gated_delta_rule`. A token with `g = 0, beta = 0` leaves the state unchanged.

Example:
    >>> b, t, h, dk, dv = 1, 5, 2, 4, 4
    >>> q = k = prepare_qk(jnp.ones((b, t, h, dk)), h, scale=False)
    >>> o, s = gated_delta_rule(q, k, jnp.ones((b, t, h, dv)), jnp.zeros((b, t, h)),
    ...                         jnp.ones((b, t, h)), jnp.zeros((b, h, dk, dv)))
    >>> o.shape, s.shape
    ((1, 5, 2, 4), (1, 2, 4, 4))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CHUNK_SIZE = 64
RECURRENT_MAX_TOKENS = 16   # blocks up to this length use the token scan (decode, verify)


def causal_conv_silu(x_btc: jax.Array, weight_ck: jax.Array, window_bwc: jax.Array | None) -> jax.Array:
    """Depthwise causal conv over time, then SiLU, as transformers' `conv1d` in the weight dtype (fp32
    sums rounded once). `weight_ck [C, K]`; `window_bwc [B, K-1, C]`: previous pre-conv inputs (None:
    zeros). Output `[B, T, C]` in `x`'s dtype."""
    c, k = weight_ck.shape
    b, t, _ = x_btc.shape
    if window_bwc is None:
        window_bwc = jnp.zeros((b, k - 1, c), x_btc.dtype)
    full = jnp.concatenate([window_bwc.astype(weight_ck.dtype), x_btc.astype(weight_ck.dtype)],
                           axis=1).astype(jnp.float32)
    w32 = weight_ck.astype(jnp.float32)
    y = sum(full[:, j:j + t] * w32[:, j] for j in range(k)).astype(weight_ck.dtype)
    return jax.nn.silu(y).astype(x_btc.dtype)


def conv_window_after(window_bwc: jax.Array, x_btc: jax.Array, keep_b: jax.Array) -> jax.Array:
    """The conv window after the first `keep_b` tokens of `x` per row: the last `K-1` pre-conv inputs of
    `[window; x[:keep]]` (`keep_b = 0` keeps the window)."""
    full = jnp.concatenate([window_bwc, x_btc.astype(window_bwc.dtype)], axis=1)
    idx = keep_b[:, None] + jnp.arange(window_bwc.shape[1])[None]
    return jnp.take_along_axis(full, idx[:, :, None], axis=1)


def gdn_gates(a_btv: jax.Array, b_btv: jax.Array, a_log_v: jax.Array, dt_bias_v: jax.Array):
    """`g = -exp(A_log) * softplus(a + dt_bias)` and `beta = sigmoid(b)`, both fp32 `[B, T, nv]`."""
    g = -jnp.exp(a_log_v.astype(jnp.float32)) * jax.nn.softplus(a_btv.astype(jnp.float32)
                                                                + dt_bias_v.astype(jnp.float32))
    return g, jax.nn.sigmoid(b_btv.astype(jnp.float32))


def mask_gates(g_btv: jax.Array, beta_btv: jax.Array, valid_bt: jax.Array | None):
    """Zero `g` and `beta` of invalid tokens, so that they leave the recurrent state unchanged."""
    if valid_bt is None:
        return g_btv, beta_btv
    v = valid_bt[:, :, None]
    return jnp.where(v, g_btv, 0.0), jnp.where(v, beta_btv, 0.0)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x * rsqrt(sum(x^2) + eps)` over the last axis in fp32 (the FLA / transformers form)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(x_bthk: jax.Array, num_v_heads: int, scale: bool) -> jax.Array:
    """L2-normalised fp32 `[B, T, nv, dk]`, each key head repeated to its `nv / nk` value heads; with
    `scale`, times `dk^-0.5` (the query)."""
    x = l2_normalize(x_bthk)
    reps = num_v_heads // x.shape[2]
    if reps > 1:
        x = jnp.repeat(x, reps, axis=2)
    return x * (x.shape[-1] ** -0.5) if scale else x


def _delta_update(state_bhkv, k_bhk, v_bhv, g_bh, beta_bh):
    state = state_bhkv * jnp.exp(g_bh)[:, :, None, None]
    predicted = jnp.einsum("bhkv,bhk->bhv", state, k_bhk)
    delta = (v_bhv - predicted) * beta_bh[:, :, None]
    return state + k_bhk[:, :, :, None] * delta[:, :, None, :]


def gated_delta_recurrent(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_bhkv):
    """The token-by-token gated delta rule (`lax.scan`). Returns `(o [B, T, nv, dv] fp32, state)`."""
    def step(state, xs):
        q, k, v, g, beta = xs
        state = _delta_update(state, k, v, g, beta)
        return state, jnp.einsum("bhkv,bhk->bhv", state, q)

    xs = tuple(jnp.moveaxis(a.astype(jnp.float32), 1, 0) for a in (q_bthk, k_bthk, v_bthv, g_bth, beta_bth))
    state, o_tbhv = jax.lax.scan(step, state_bhkv.astype(jnp.float32), xs)
    return jnp.moveaxis(o_tbhv, 0, 1), state


def gated_delta_state_after(k_bthk, v_bthv, g_bth, beta_bth, state_bhkv, keep_b: jax.Array):
    """The state after the first `keep_b` tokens of a block per row (the rest skipped): how a verify
    block commits its accepted prefix. One chunk of the chunked form with the skipped tokens' gates
    zeroed; `keep_b = 0` returns `state` bit for bit; equals the token scan up to fp32 rounding."""
    keep_bt = jnp.arange(k_bthk.shape[1])[None] < keep_b[:, None]
    g_bth, beta_bth = mask_gates(g_bth, beta_bth, keep_bt)
    _, state = gated_delta_chunked(jnp.zeros_like(k_bthk), k_bthk, v_bthv, g_bth, beta_bth, state_bhkv,
                                   chunk_size=k_bthk.shape[1])
    return state


_HIGHEST = jax.lax.Precision.HIGHEST   # keep the chunk matmuls in true fp32 (no TF32 / bf16 passes)


def _segment_log_decays(g_c: jax.Array) -> jax.Array:
    """`out[..., i, j] = sum_{j < t <= i} g[..., t]` for `j < i`, else 0 (`g_c [..., C]`), summed per
    pair (not as a difference of cumsums) for precision."""
    c = g_c.shape[-1]
    strict = np.tri(c, k=-1, dtype=bool)        # static masks: numpy, so they compile to constants
    return jnp.cumsum(jnp.where(strict, g_c[..., :, None], 0.0), axis=-2)


def _unit_lower_inverse(l_cc: jax.Array) -> jax.Array:
    """`(I + L)^-1` for strictly lower triangular `L [..., C, C]`, by doubling inverted diagonal blocks
    (`(B + X)^-1 = B^-1 - B^-1 X B^-1`), log2 C levels of full-size batched matmuls."""
    c = l_cc.shape[-1]
    p = 1 << max(c - 1, 0).bit_length()           # pad to a power of two: identity beyond C
    if p != c:
        l_cc = jnp.pad(l_cc, [(0, 0)] * (l_cc.ndim - 2) + [(0, p - c), (0, p - c)])
    i, j = np.arange(p)[:, None], np.arange(p)[None, :]
    inv = jnp.broadcast_to(jnp.eye(p, dtype=l_cc.dtype), l_cc.shape)
    s = 1
    while s < p:
        lower_left = (i // (2 * s) == j // (2 * s)) & ((i // s) % 2 == 1) & ((j // s) % 2 == 0)
        x = jnp.where(lower_left, l_cc, 0.0)
        inv = inv - jnp.einsum("...ij,...jk,...kl->...il", inv, x, inv, precision=_HIGHEST)
        s *= 2
    return inv[..., :c, :c]


def gated_delta_chunked(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_bhkv, chunk_size: int = CHUNK_SIZE):
    """The chunked (UT-transform) form; `gated_delta_recurrent`'s results up to fp32 rounding.

    `T` is padded to a multiple of `chunk_size` with tokens that leave the state unchanged. Per chunk
    (`D[i, j] = exp(sum_{j<t<=i} g_t)`, `gam_i = exp(sum_{t<=i} g_t)`):
    `[u, w] = (I + strict_tril(beta_i k_i.k_j D_ij))^-1 [beta v, beta gam k]` for all chunks at once,
    then a scan over chunks: `v' = u - w S`, `o = (gam q) S + tril(q_i.k_j D_ij) v'`,
    `S <- gam_C S + (D_Cj k_j)^T v'`."""
    f32 = jnp.float32
    b, t, h, dk = q_bthk.shape
    dv = v_bthv.shape[-1]
    cs = chunk_size
    n = -(-t // cs)
    pad = n * cs - t

    def chunks(x):   # [B, T, H, ...] fp32 -> [N, B, H, C, ...]
        x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((b, n, cs) + x.shape[2:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    q, k, v = chunks(q_bthk), chunks(k_bthk), chunks(v_bthv)        # [N, B, H, C, d]
    g, beta = chunks(g_bth), chunks(beta_bth)                          # [N, B, H, C]

    seg = _segment_log_decays(g)                                       # [N, B, H, C, C], <= 0
    lower, strict = np.tri(cs, dtype=bool), np.tri(cs, k=-1, dtype=bool)
    decay = jnp.where(lower, jnp.exp(seg), 0.0)                        # seg is 0 above the diagonal
    gam = jnp.exp(jnp.cumsum(g, axis=-1))                              # decay from chunk start, [.., C]
    to_end = jnp.exp(seg[..., cs - 1, :])                              # decay from token j to chunk end

    k_beta = k * beta[..., None]
    ut = jnp.einsum("nbhik,nbhjk->nbhij", k_beta, k, precision=_HIGHEST)
    ut = jnp.where(strict, ut * decay, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * gam[..., None]], axis=-1)
    sol = jnp.einsum("nbhij,nbhjd->nbhid", _unit_lower_inverse(ut), rhs, precision=_HIGHEST)
    u, w = sol[..., :dv], sol[..., dv:]                                # [N, B, H, C, dv], [.., dk]

    attn = jnp.einsum("nbhik,nbhjk->nbhij", q, k, precision=_HIGHEST) * decay
    q_dec = q * gam[..., None]
    k_dec = k * to_end[..., None]
    chunk_decay = gam[..., cs - 1]                                     # [N, B, H]

    def step(state, xs):
        u_c, w_c, attn_c, q_c, k_c, dec_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, state, precision=_HIGHEST)
        o = (jnp.einsum("bhck,bhkv->bhcv", q_c, state, precision=_HIGHEST)
             + jnp.einsum("bhij,bhjv->bhiv", attn_c, v_new, precision=_HIGHEST))
        state = (state * dec_c[:, :, None, None]
                 + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new, precision=_HIGHEST))
        return state, o

    xs = (u, w, attn, q_dec, k_dec, chunk_decay)
    if n == 1:   # one chunk (a verify commit, a short prompt): no loop, so no loop-carried state copies
        state, o = step(state_bhkv.astype(f32), tuple(x[0] for x in xs))
        o = o[None]
    else:
        state, o = jax.lax.scan(step, state_bhkv.astype(f32), xs)
    o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(b, n * cs, h, dv)      # [N,B,H,C,dv] -> [B,T',H,dv]
    return o[:, :t], state


def gated_delta_rule(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_bhkv):
    """Dispatches on the (static) block length: token scan for short blocks, chunks for long ones."""
    if q_bthk.shape[1] <= RECURRENT_MAX_TOKENS:
        return gated_delta_recurrent(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_bhkv)
    return gated_delta_chunked(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, state_bhkv)


def gated_rms_norm(x_bthv: jax.Array, z_bthv: jax.Array, weight_v: jax.Array, eps: float) -> jax.Array:
    """Qwen3.5's gated RMSNorm of the DeltaNet output: normalise in fp32, cast to the input dtype, times
    `weight` (plain, not 1+w), times `silu(z)` in fp32, cast back."""
    dtype = x_bthv.dtype
    x32 = x_bthv.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)
    y = (weight_v * normed).astype(jnp.float32) * jax.nn.silu(z_bthv.astype(jnp.float32))
    return y.astype(dtype)
