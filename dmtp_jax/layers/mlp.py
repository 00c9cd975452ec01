"""The dense SwiGLU MLP (the sparse MoE block is `layers/moe.py`).

Example:
    >>> import jax.numpy as jnp
    >>> swiglu(jnp.ones((2, 4)), jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((8, 4))).shape
    (2, 4)
"""

from __future__ import annotations

import jax


def swiglu(x: jax.Array, gate_hi: jax.Array, up_hi: jax.Array, down_ih: jax.Array) -> jax.Array:
    """`down(silu(gate(x)) * up(x))` with kernels stored `[in, out]`."""
    return (jax.nn.silu(x @ gate_hi) * (x @ up_hi)) @ down_ih
