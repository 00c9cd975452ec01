"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) in its absorbed form over a latent
cache `c = [RMS(kv_a(x))[:r] ; rope(k_rot)]`: the latent is one K/V head read by every query head
through `grouped_attention`, exactly the expanded attention (derivation: docs/models-detail.md).
`deinterleave` reorders DeepSeek's interleaved rotary dims to `layers/rope.py`'s layout."""

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
