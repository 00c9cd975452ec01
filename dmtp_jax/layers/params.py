"""Parameter creation with logical axis names (mapped to the mesh by `dmtp_jax.sharding`)."""

import jax
import jax.numpy as jnp
from flax import nnx


def weight(rngs: nnx.Rngs, shape, axes, dtype, std: float = 0.02) -> nnx.Param:
    """A normal(0, std) parameter tagged with `logical_axes` (one name or None per dim)."""
    assert len(shape) == len(axes), (shape, axes)
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


def ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=tuple(axes))


def zeros(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), logical_axes=tuple(axes))
