"""Token selection: greedy, temperature, top-k and top-p, as one filtered distribution.

`filtered_probs` is the distribution every sampler and verifier uses (target's and drafter's).
Temperature 0 is greedy (one-hot argmax). Which filters run is static (`top_p_on`, `top_k_cap`,
part of the `SamplingParams` pytree structure); their values are traced scalars or `[B]` arrays,
so greedy and sampled rows share a batch and changing a value never recompiles. A filter that is
off costs nothing, and `top_p = 1` is exactly no filter."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.decode.batch import RequestError
from dmtp_jax.layers.rows import per_row


TOP_K_MAX = 2**31 - 1       # a larger k keeps every token, as any k >= the vocabulary does


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
    """Sampling parameters; build them with `make` or `rows` (they validate and set the static fields).
    `temperature`, `top_p`, `top_k` are traced (f32, f32, i32; scalars or `[B]`); `top_p_on` and
    `top_k_cap` are static."""
    temperature: jax.Array   # f32 scalar or [B] (one per row); 0 = greedy
    top_p: jax.Array         # f32 scalar or [B]; filters only when `top_p_on` (a row's 1 keeps all)
    top_k: jax.Array = 0     # i32 scalar or [B], each <= top_k_cap; a row's 0 keeps all
    top_p_on: bool = dataclasses.field(default=False, metadata=dict(static=True))    # some top_p < 1
    top_k_cap: int = dataclasses.field(default=0, metadata=dict(static=True))        # 0: top-k off
    top_p_in_top_k: bool = dataclasses.field(default=False, metadata=dict(static=True))  # no top-p row without k

    @classmethod
    def make(cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> "SamplingParams":
        """Validated parameters, one top-k for every row (the cap: a compile per k)."""
        check(temperature, top_p, top_k)
        k = min(int(top_k), TOP_K_MAX)
        return cls(jnp.float32(temperature), jnp.float32(top_p), jnp.int32(k), bool(top_p < 1), k, k > 0)

    @classmethod
    def rows(cls, temperature_b, top_p_b, top_k_b=0, top_k_cap: int | None = None,
             top_p_on: bool | None = None) -> "SamplingParams":
        """One temperature, top-p and top-k per row (`[B]`; scalars count as one row). Top-k searches the
        `top_k_cap` largest values (default: the largest k); top_p 1 and top_k 0 keep every token.
        `top_p_on=True` runs top-p whatever the values (the server's one sampled form).

        Example:
            >>> sp = SamplingParams.rows([0.0, 1.0], [1.0, 0.5], [0, 20], top_k_cap=64)
            >>> sp.is_greedy, sp.top_p_on, sp.top_k_cap, sp.top_k.tolist()
            (False, True, 64, [0, 20])
        """
        temperature_b = np.atleast_1d(np.asarray(temperature_b, np.float32))
        top_p_b = np.atleast_1d(np.asarray(top_p_b, np.float32))
        top_k_b = np.atleast_1d(np.minimum(np.asarray(top_k_b, np.int64), TOP_K_MAX).astype(np.int32))
        cap = int(top_k_b.max(initial=0)) if top_k_cap is None else int(top_k_cap)
        if (top_k_b > cap).any():
            raise ValueError(f"top_k {top_k_b.max()} exceeds top_k_cap {cap}")
        top_p_b, top_k_b = np.broadcast_arrays(top_p_b, top_k_b)
        if top_p_on:
            return cls(temperature_b, top_p_b, top_k_b, True, cap, False)
        within = bool(cap > 0 and (top_k_b[top_p_b < 1] > 0).all())
        return cls(temperature_b, top_p_b, top_k_b, bool((top_p_b < 1).any()), cap, within)

    @property
    def is_greedy(self) -> bool:
        return bool(np.all(np.asarray(self.temperature) == 0.0))


def check(temperature: float, top_p: float, top_k: int) -> None:
    """Raises `RequestError` for values no sampler takes (NaN and infinities included)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RequestError(f"temperature must be a finite number >= 0, got {temperature}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k}")


def filtered_probs(logits_bv: jax.Array, sp: SamplingParams) -> jax.Array:
    """`[..., V]` fp32 probabilities after temperature, then top-k, then top-p (HF order). Top-k keeps
    ties with the k-th; top-p keeps the smallest prefix by descending probability whose mass reaches
    `top_p` (at least one token).

    Example:
        >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
        >>> [round(float(p), 3) for p in filtered_probs(logits, SamplingParams.make(1.0, top_p=0.7))[0]]
        [0.625, 0.375, 0.0, 0.0]
    """
    logits = logits_bv.astype(jnp.float32)
    v = logits.shape[-1]
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    temperature = per_row(sp.temperature, logits)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    cap = sp.top_k_cap if 0 < sp.top_k_cap < v else 0        # a cap >= V never filters
    if cap:
        top_values, top_index = jax.lax.top_k(scaled, cap)      # sorted, descending
        k = per_row(sp.top_k, logits)
        kth_index = jnp.broadcast_to(jnp.clip(k, 1, cap) - 1, scaled.shape[:-1] + (1,)).astype(jnp.int32)
        kth = jnp.take_along_axis(top_values, kth_index, axis=-1)
        kth = jnp.where((k > 0) & (k < v), kth, -jnp.inf)      # a row's 0 (or k >= V) keeps all
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if sp.top_p_on:
        # probabilities in descending order: top-k's values when every top-p row keeps at most those,
        # else the whole vocabulary sorted (rows without top-k need all of it)
        within = bool(cap) and sp.top_p_in_top_k
        sorted_p = jnp.take_along_axis(probs, top_index, axis=-1) if within else -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        top_p = per_row(sp.top_p, logits)
        kept = (mass_before < top_p) | (top_p >= 1)     # a row's top_p 1 is no filter (no rounding)
        threshold = jnp.min(jnp.where(kept, sorted_p, jnp.inf), axis=-1, keepdims=True)
        threshold = jnp.where(top_p >= 1, 0.0, threshold)   # (top-k's values alone would cut a top_p 1 row)
        probs = jnp.where(probs >= threshold, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return jnp.where(temperature > 0, probs, greedy)


def sample_from_probs(probs: jax.Array, key: jax.Array) -> jax.Array:
    """One draw per row of `probs [..., V]` (zeros never drawn)."""
    return jax.random.categorical(key, jnp.log(jnp.maximum(probs, 0.0)), axis=-1).astype(jnp.int32)


def sample_tokens(logits_bv: jax.Array, sp: SamplingParams, key: jax.Array) -> jax.Array:
    """Next tokens `[B]`: the argmax when greedy, else a draw from `filtered_probs`.

    Example:
        >>> int(sample_tokens(jnp.array([[0.1, 2.0, 0.3]]), SamplingParams.make(1.0, top_k=1), jax.random.key(0))[0])
        1
    """
    sampled = sample_from_probs(filtered_probs(logits_bv, sp), key)
    return jnp.where(per_row(sp.temperature, sampled) > 0, sampled, jnp.argmax(logits_bv, axis=-1).astype(jnp.int32))


def pick_tokens(logits_bv: jax.Array, sp: SamplingParams, key: jax.Array, greedy: bool) -> jax.Array:
    """`sample_tokens`, or with the static `greedy` flag only the argmax, so a greedy compile never
    traces the sampling filters."""
    if greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return sample_tokens(logits_bv, sp, key)
