"""Per-row values in a batch: a scalar, or one value per row broadcast over the row's data."""

import jax
import jax.numpy as jnp


def per_row(x: jax.Array, like: jax.Array) -> jax.Array:
    """A scalar, or a `[B]` array reshaped to broadcast over `like`'s leading batch axis.

    Example:
        >>> per_row(jnp.array([1.0, 2.0]), jnp.zeros((2, 3, 4))).shape
        (2, 1, 1)
    """
    x = jnp.asarray(x)
    return x if x.ndim == 0 else x.reshape(x.shape + (1,) * (like.ndim - x.ndim))
