"""`counted_jit`: `jax.jit` that counts the programs it compiled (public APIs only): JAX traces once
per new signature, so counting traces counts compiles.

Example:
    >>> import jax.numpy as jnp
    >>> double = counted_jit(lambda x: 2 * x)
    >>> _ = double(jnp.ones(3)); _ = double(jnp.zeros(3)); _ = double(jnp.ones(4))
    >>> double.compiles
    2
"""

from __future__ import annotations

import functools
from typing import Callable

import jax


class CountedJit:
    """A `jax.jit`-ed function (`__call__`, `lower`) with `compiles`: the signatures traced so far."""

    def __init__(self, fn: Callable, **jit_kwargs):
        self.compiles = 0

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            self.compiles += 1
            return fn(*args, **kwargs)

        self._jitted = jax.jit(traced, **jit_kwargs)

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*args, **kwargs)


def counted_jit(fn: Callable, **jit_kwargs) -> CountedJit:
    """`jax.jit(fn, **jit_kwargs)` that counts its compiles (`.compiles`)."""
    return CountedJit(fn, **jit_kwargs)
