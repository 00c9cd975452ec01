"""The dense gated MLP: SwiGLU, or another gate activation (the sparse MoE block is `layers/moe.py`).

Example:
    >>> import jax.numpy as jnp
    >>> gated_mlp(jnp.ones((2, 4)), jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((8, 4))).shape
    (2, 4)
"""

from __future__ import annotations

import jax


def gated_mlp(x: jax.Array, gate_hi: jax.Array, up_hi: jax.Array, down_ih: jax.Array, act=jax.nn.silu) -> jax.Array:
    """`down(act(gate(x)) * up(x))` with kernels stored `[in, out]` (SwiGLU: `act` silu)."""
    return (act(x @ gate_hi) * (x @ up_hi)) @ down_ih
