"""RMSNorm as transformers computes it: statistics in fp32, weight applied in the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, zero_centred: bool = False) -> jax.Array:
    """`weight * x / rms(x)`; with `zero_centred` the stored weight is `w - 1` (Qwen3.5 / Gemma style).

    Example:
        >>> rms_norm(jnp.ones((2, 4)), jnp.ones(4), 1e-6).shape
        (2, 4)
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if zero_centred:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)
