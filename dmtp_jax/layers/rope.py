"""Rotary position embedding (NeoX half rotation), positions absolute per token.

Partial rotary (Qwen3.5 / Qwen3-Next: `partial_rotary_factor` 0.25) rotates the first `rotary_dim`
dims of each head and passes the rest through; the tables' width says how many.
"""

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables `[..., rotary_dim]` for integer `positions [...]`, computed in fp32 like HF.

    Example:
        >>> cos, sin = rope_cos_sin(jnp.arange(4)[None], 8, 10000.0, jnp.float32)
        >>> cos.shape
        (1, 4, 8)
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
    """Rotates the first `R` dims of `x [B, T, heads, D]` with tables `[B, T, R]` (R <= D)."""
    r = cos_btd.shape[-1]
    x_rot, x_pass = x_bthd[..., :r], x_bthd[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]
    return out if r == x_bthd.shape[-1] else jnp.concatenate([out, x_pass], axis=-1)
