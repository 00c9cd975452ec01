"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) in its absorbed form, over a latent cache.

Per token, MLA keeps one latent `c = [RMS(kv_a(x))[:r] ; rope(k_rot)]` (`r = kv_lora_rank` plus the
decoupled rotary key of `qk_rope_head_dim`, shared by every head): that is all the cache holds. The
expanded keys and values would be `k_h = [c[:r] @ W_uk_h ; k_rot]`, `v_h = c[:r] @ W_uv_h` (`kv_b_proj`
split per head); the absorbed form never builds them:

    q_lat_h = q_nope_h @ W_uk_h^T                  [r]      (W_uk folded into the query)
    score   = (q_lat_h . c[:r] + q_rot_h . c[r:]) * scale
    o_h     = (softmax(score) @ c[:r]) @ W_uv_h     [v_head_dim]

which is the expanded attention exactly (a reordering of the same sums). So the latent is one
K/V "head" of dim `r + rope` read by every query head: `grouped_attention` (all its kernels) runs it
as multi-query attention with keys = values = the latent, the query `[q_lat ; q_rot]` pre-scaled so
that its own `1/sqrt(dim)` gives `scale`, and the output's first `r` dims kept.

DeepSeek's checkpoints lay the rotary dims out in interleaved pairs; `deinterleave` reorders them
to the half-split layout `layers/rope.py` rotates (the same rotation, transformers'
`apply_rotary_pos_emb_interleave`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax.layers.attention import MaskRule, grouped_attention


def deinterleave(x: jax.Array) -> jax.Array:
    """`[..., d]` pairs `(x0, x1), (x2, x3), ...` -> `[x0, x2, ..., x1, x3, ...]`.

    Example:
        >>> deinterleave(jnp.arange(4)).tolist()
        [0, 2, 1, 3]
    """
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def split_kv_b(kv_b_rf: jax.Array, heads: int, nope: int) -> tuple[jax.Array, jax.Array]:
    """`kv_b_proj [r, heads * (nope + v)]` -> `(W_uk [r, heads, nope], W_uv [r, heads, v])`."""
    w = kv_b_rf.reshape(kv_b_rf.shape[0], heads, -1)
    return w[..., :nope], w[..., nope:]


def absorbed_query(q_nope_bthn: jax.Array, q_rot_bthd: jax.Array, w_uk_rhn: jax.Array, scale: float) -> jax.Array:
    """`[q_nope @ W_uk^T ; q_rot]` `[B, T, heads, r + rope]`, scaled so that `grouped_attention`'s
    `1/sqrt(r + rope)` makes the softmax scale `scale`."""
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope_bthn, w_uk_rhn)
    q = jnp.concatenate([q_lat, q_rot_bthd.astype(q_lat.dtype)], axis=-1)
    return q * jnp.asarray(scale * q.shape[-1] ** 0.5, q.dtype)


def latent_attention(q_bthl: jax.Array, latent_bs1l: jax.Array, w_uv_rhv: jax.Array, rule: MaskRule) -> jax.Array:
    """Heads' outputs `[B, T, heads, v]` of absorbed queries `[B, T, heads, r + rope]` over latents
    `[B, S, 1, r + rope]` under `rule`."""
    r = w_uv_rhv.shape[0]
    out_lat = grouped_attention(q_bthl, latent_bs1l, latent_bs1l, rule)[..., :r]
    return jnp.einsum("bthr,rhv->bthv", out_lat, w_uv_rhv)
