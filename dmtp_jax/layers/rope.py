"""Rotary position embedding (NeoX half rotation), positions absolute per token.

Partial rotary (Qwen3.5 / Qwen3-Next: `partial_rotary_factor` 0.25) rotates the first `rotary_dim`
dims of each head and passes the rest through; the tables' width says how many. YaRN scaling
(DeepSeek-V3: `scaling`, the config's yarn parameters) blends interpolated and extrapolated
frequencies and scales the tables by its attention factor, as transformers'
`_compute_yarn_parameters` does; `yarn_softmax_scale` is DeepSeek's matching softmax factor.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """`0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(rotary_dim: int, theta: float, scaling: dict) -> tuple[np.ndarray, float]:
    """`(inverse frequencies [rotary_dim / 2] fp32, attention factor)` of YaRN for `scaling`
    (`factor`, `original_max_position_embeddings`, optional `beta_fast` 32, `beta_slow` 1,
    `mscale`, `mscale_all_dim`, `attention_factor`, `truncate` True)."""
    factor = float(scaling["factor"])
    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    orig = scaling["original_max_position_embeddings"]

    def correction_dim(rotations):
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attn)


def yarn_softmax_scale(scaling: dict) -> float:
    """DeepSeek's softmax factor under YaRN: `yarn_mscale(factor, mscale_all_dim) ** 2` (1 without
    `mscale_all_dim` or without scaling)."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, dtype,
                 scaling: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables `[..., rotary_dim]` for integer `positions [...]`, computed in fp32 like HF;
    `scaling`: YaRN parameters (`yarn_inv_freq`), None for plain RoPE.

    Example:
        >>> cos, sin = rope_cos_sin(jnp.arange(4)[None], 8, 10000.0, jnp.float32)
        >>> cos.shape
        (1, 4, 8)
    """
    if scaling:
        inv_np, attn = yarn_inv_freq(rotary_dim, theta, scaling)
        inv_freq = jnp.asarray(inv_np)
    else:
        inv_freq, attn = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)), 1.0
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attn != 1.0:
        cos, sin = cos * attn, sin * attn
    return cos.astype(dtype), sin.astype(dtype)


def proportional_cos_sin(positions: jax.Array, head_dim: int, theta: float, factor: float,
                         dtype) -> tuple[jax.Array, jax.Array]:
    """Gemma 4's proportional RoPE tables `[..., head_dim]`: frequencies `theta^(-2i / head_dim)` for
    the first `int(factor * head_dim / 2)` pairs, zero (identity) for the rest (`factor` 1: plain RoPE).

    Example:
        >>> cos, sin = proportional_cos_sin(jnp.arange(3)[None], 8, 1e4, 0.25, jnp.float32)
        >>> cos.shape, float(cos[0, 2, 1]), float(sin[0, 2, 1])
        ((1, 3, 8), 1.0, 0.0)
    """
    angles = int(factor * head_dim // 2)
    inv = np.zeros(head_dim // 2, np.float32)
    inv[:angles] = 1.0 / (theta ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
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


def rope_tables(cfg, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """`rope_cos_sin` for a target config: its `rotary_dim`, `rope_theta` and YaRN `rope_scaling`
    (a tuple of `(key, value)` pairs, empty for plain RoPE)."""
    scaling = dict(getattr(cfg, "rope_scaling", ()) or ()) or None
    return rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, dtype, scaling)
