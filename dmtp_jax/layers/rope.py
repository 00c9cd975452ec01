"""Rotary position embedding (NeoX half rotation), positions absolute per token."""

import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables `[..., head_dim]` for integer `positions [...]`, computed in fp32 like HF.

    Example:
        >>> cos, sin = rope_cos_sin(jnp.arange(4)[None], 8, 10000.0, jnp.float32)
        >>> cos.shape
        (1, 4, 8)
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array) -> jax.Array:
    """Rotates `x [B, T, heads, D]` with tables `[B, T, D]`."""
    half = x_bthd.shape[-1] // 2
    rotated = jnp.concatenate([-x_bthd[..., half:], x_bthd[..., :half]], axis=-1)
    return x_bthd * cos_btd[:, :, None, :] + rotated * sin_btd[:, :, None, :]
