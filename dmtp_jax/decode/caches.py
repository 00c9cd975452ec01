"""The decode caches, created at their mesh sharding: the target's `TargetCache` (attention K/V,
DeltaNet conv windows and recurrent states) and plain `KVCache`s (drafter context, MTP). The arrays
are `layers/kv_cache.py`'s; each maker here is one jitted function per (mesh, shape, dtype) whose
output sits at the cache's sharding, so a donated cache never recompiles its consumer.

Example:
    >>> from dmtp_jax.sharding import make_mesh
    >>> cache = new_kv_cache(make_mesh("tensor=1"), (1, 2, 16, 1, 4), "float32")
    >>> cache.k_lbskd.shape
    (1, 2, 16, 1, 4)
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.layers.kv_cache import KVCache, TargetCache
from dmtp_jax.sharding import cache_kv_heads, kv_cache_sharding, recurrent_state_sharding

if TYPE_CHECKING:
    from dmtp_jax.checkpoint.hf import LoadedTarget     # annotations only


@functools.lru_cache(maxsize=None)
def _zeros_cache_maker(mesh, shape, dtype, v_shape):
    s = kv_cache_sharding(mesh, shape)
    return jax.jit(lambda: KVCache(jnp.zeros(shape, dtype), jnp.zeros(v_shape, dtype)), out_shardings=KVCache(s, s))


def new_kv_cache(mesh, shape, dtype, value_dim: int | None = None) -> KVCache:
    """A zero KV cache `[layers, B, S, kv, D]` created at its mesh sharding; `value_dim`: the values'
    last dim when it is not the keys' (`kv_cache_value_dim`: 0 for an MLA latent cache)."""
    shape = tuple(shape)
    v_shape = shape if value_dim is None else shape[:-1] + (value_dim,)
    return _zeros_cache_maker(mesh, shape, jnp.dtype(dtype), v_shape)()


@functools.lru_cache(maxsize=None)
def _zeros_maker(mesh, shape, dtype):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=recurrent_state_sharding(mesh, shape))


def kv_cache_shape(cfg, batch: int, max_len: int, mesh=None, layers: int | None = None) -> tuple[int, ...]:
    """`[attention layers (or layers), B, S, kv_heads, head_dim]`, the KV heads as laid out on `mesh`
    (`sharding.cache_kv_heads`; the model's own without one)."""
    kv, q_heads, k_dim, _ = cache_dims(cfg)
    heads = cache_kv_heads(kv, q_heads, mesh)
    return (len(cfg.attention_layers) if layers is None else layers, batch, max_len, heads, k_dim)


def cache_dims(cfg) -> tuple[int, int, int, int]:
    """`(kv heads, query heads, key dim, value dim)` of one layer's cache: the config's
    `kv_cache_dims` (a target's: MLA keeps one latent per token), else per-head K/V (drafters)."""
    dims = getattr(cfg, "kv_cache_dims", None)
    return dims or (cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, cfg.head_dim)


def kv_cache_value_dim(cfg) -> int:
    """The values' last dim of `cfg`'s cache (`cache_dims`), for `new_kv_cache`."""
    return cache_dims(cfg)[3]


def recurrent_state_shapes(cfg, batch: int):
    """`(conv [Ll, B, K-1, C], ssm [Ll, B, nv, dk, dv])` of the DeltaNet layers, or None."""
    n = len(cfg.linear_layers)
    if not n:
        return None
    return ((n, batch, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim),
            (n, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))


def target_cache_spec(cfg, batch: int, max_len: int, dtype, mesh=None) -> TargetCache:
    """A `TargetCache` of `jax.ShapeDtypeStruct`s: the shape and dtype of every array of a zero cache
    (K/V and conv windows in `dtype`, the recurrent state in fp32; KV heads as laid out on `mesh`).

    Example:
        >>> from dmtp_jax.tiny import tiny_target_config
        >>> spec = target_cache_spec(tiny_target_config(), 2, 16, "float32")
        >>> spec.kv.k_lbskd.shape[1:3], spec.conv_lbwc
        ((2, 16), None)
    """
    sds = jax.ShapeDtypeStruct
    k_shape = kv_cache_shape(cfg, batch, max_len, mesh)
    kv = KVCache(sds(k_shape, jnp.dtype(dtype)), sds(k_shape[:-1] + (kv_cache_value_dim(cfg),), jnp.dtype(dtype)))
    shapes = recurrent_state_shapes(cfg, batch)
    if shapes is None:
        return TargetCache(kv)
    return TargetCache(kv, sds(shapes[0], jnp.dtype(dtype)), sds(shapes[1], jnp.dtype(jnp.float32)))


def zero_target_cache(spec: TargetCache) -> TargetCache:
    """Zeros of `target_cache_spec`'s shapes (inside a jitted function: no sharding of their own)."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), spec)


def state_bytes_per_row(cfg, max_len: int, dtype_bytes: int = 2, verify_slots: int = 8) -> dict[str, int]:
    """Bytes one row holds across rounds (`kv`: K/V of the attention layers, MLA: the latent; fp32
    `conv` / `ssm` of the DeltaNet layers) and `verify_transient`: the per-token DeltaNet inputs a
    verify round of `verify_slots` keeps until its commit."""
    k_shape = kv_cache_shape(cfg, 1, max_len)
    per_slot = int(np.prod(k_shape[:-1])) * (k_shape[-1] + kv_cache_value_dim(cfg))
    out = {"kv": per_slot * dtype_bytes, "conv": 0, "ssm": 0,
           "verify_transient": 0}
    shapes = recurrent_state_shapes(cfg, 1)
    if shapes:
        conv, ssm = shapes
        out["conv"] = int(np.prod(conv)) * dtype_bytes
        out["ssm"] = int(np.prod(ssm)) * 4
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        per_token = cfg.linear_conv_dim * dtype_bytes + 4 * (nv * dk + nv * dv + 2 * nv)
        out["verify_transient"] = conv[0] * verify_slots * per_token
    return out


def target_cache_shardings(mesh, cache: TargetCache) -> TargetCache:
    """The sharding of every array of a target cache (or of its shapes) on `mesh`, as a `TargetCache`."""
    state = lambda x: None if x is None else recurrent_state_sharding(mesh, x.shape)  # noqa: E731
    kv = kv_cache_sharding(mesh, cache.kv.k_lbskd.shape)
    return TargetCache(KVCache(kv, kv), state(cache.conv_lbwc), state(cache.ssm_lbhkv))


def constrain_target_cache(mesh, cache: TargetCache) -> TargetCache:
    """`cache` pinned at `target_cache_shardings` (inside a jitted function)."""
    return jax.tree.map(jax.lax.with_sharding_constraint, cache, target_cache_shardings(mesh, cache))


class TargetCaches:
    """The target's `TargetCache`, created and pinned at its mesh sharding."""

    def __init__(self, target: LoadedTarget):
        self.target = target

    def shape(self, batch: int, max_len: int):
        """`kv_cache_shape` of the target's attention layers."""
        return kv_cache_shape(self.target.cfg, batch, max_len, self.target.mesh)

    def shardings(self, cache: TargetCache) -> TargetCache:
        """The sharding of every array of a cache (or of its shapes), as a `TargetCache` tree."""
        return target_cache_shardings(self.target.mesh, cache)

    def constrain(self, cache: TargetCache) -> TargetCache:
        """`cache` pinned at its shardings (inside a jitted function)."""
        return constrain_target_cache(self.target.mesh, cache)

    def new(self, batch: int, max_len: int) -> TargetCache:
        """A zero cache of `batch` rows and `max_len` slots at its sharding."""
        mesh = self.target.mesh
        spec = target_cache_spec(self.target.cfg, batch, max_len, self.target.state_dtype, mesh)
        k, v = spec.kv.k_lbskd, spec.kv.v_lbskd
        kv = _zeros_cache_maker(mesh, k.shape, k.dtype, v.shape)()
        if spec.conv_lbwc is None:
            return TargetCache(kv)
        return TargetCache(kv, *(_zeros_maker(mesh, x.shape, x.dtype)() for x in (spec.conv_lbwc, spec.ssm_lbhkv)))
