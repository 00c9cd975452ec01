"""Token selection: greedy, temperature, top-k and top-p, as one filtered distribution.

`filtered_probs` is the distribution every sampler and verifier uses (the target's and, in
speculative decoding, the drafter's), so temperature / top-p / top-k reach both alike. Temperature 0
means greedy: the distribution is one-hot on the argmax.

Which filters are on is static (`top_k_on`, `top_p_on`: part of the `SamplingParams` pytree
structure, so a jitted round compiles once per on/off combination): a filter that is off costs
nothing -- no vocabulary sort -- and `top_p = 1` is exactly no filter (no cumulative sum that float
rounding could push past 1 and so drop a tail token). The values are traced arrays: temperature,
`top_p` and `top_k` are scalars, or `[B]` arrays of one value per row (broadcast over the leading
batch axis: `per_row`), so changing them never recompiles, and greedy rows (temperature 0: one-hot)
and sampled rows with their own temperature / top-p / top-k share a batch (the server's). Top-k
sorts the vocabulary once and keeps the tokens at least as large as each row's k-th value (a row's
k of 0, or >= the vocabulary, keeps all); top-p reuses that sort, or sorts once alone.

Example:
    >>> sp = SamplingParams.make(temperature=0.0)
    >>> int(sample_tokens(jnp.array([[0.1, 2.0, 0.3]]), sp, jax.random.key(0))[0])
    1
    >>> probs = filtered_probs(jnp.log(jnp.array([[0.5, 0.3, 0.2]])), SamplingParams.make(1.0, top_k=2))
    >>> [round(float(p), 3) for p in probs[0]]
    [0.625, 0.375, 0.0]
"""

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
    """Sampling parameters; build them with `make` or `rows` (they validate and set the static flags).

    `temperature`, `top_p` and `top_k` are traced (f32, f32, i32; scalars or `[B]`); `top_p_on`
    and `top_k_on` (static) say whether each filter runs at all.

    Example:
        >>> sp = SamplingParams.make(temperature=0.7, top_p=0.9)
        >>> sp.top_p_on, sp.top_k_on, int(sp.top_k), sp.is_greedy
        (True, False, 0, False)
    """
    temperature: jax.Array   # f32 scalar or [B] (one per row); 0 = greedy
    top_p: jax.Array         # f32 scalar or [B]; filters only when `top_p_on` (a row's 1 keeps all)
    top_k: jax.Array = 0     # i32 scalar or [B]; filters only when `top_k_on` (a row's 0 keeps all)
    top_p_on: bool = dataclasses.field(default=False, metadata=dict(static=True))    # some top_p < 1
    top_k_on: bool = dataclasses.field(default=False, metadata=dict(static=True))    # some top_k > 0

    @classmethod
    def make(cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> "SamplingParams":
        """Validated parameters. Example: `SamplingParams.make(temperature=0.7, top_p=0.9)`."""
        check(temperature, top_p, top_k)
        return cls(jnp.float32(temperature), jnp.float32(top_p), jnp.int32(min(int(top_k), TOP_K_MAX)),
                   bool(top_p < 1), bool(top_k > 0))

    @classmethod
    def rows(cls, temperature_b, top_p_b, top_k_b=0, filters_on: bool = False) -> "SamplingParams":
        """One temperature, top-p and top-k per row (`[B]`, values checked by `check` per request;
        `top_k_b` may be one shared value). A filter runs when any row uses it, or always with
        `filters_on` (one compile whatever the rows ask: the server's sampled rounds); a row with
        top_p 1 and top_k 0 keeps every token.

        Example:
            >>> sp = SamplingParams.rows([0.0, 1.0], [1.0, 0.5], [0, 20])
            >>> sp.is_greedy, sp.top_p_on, sp.top_k_on, sp.top_k.tolist()
            (False, True, True, [0, 20])
        """
        temperature_b, top_p_b = np.asarray(temperature_b, np.float32), np.asarray(top_p_b, np.float32)
        top_k_b = np.minimum(np.asarray(top_k_b, np.int64), TOP_K_MAX).astype(np.int32)
        return cls(temperature_b, top_p_b, top_k_b, bool(filters_on or (top_p_b < 1).any()),
                   bool(filters_on or (top_k_b > 0).any()))

    @property
    def is_greedy(self) -> bool:
        return bool(np.all(np.asarray(self.temperature) == 0.0))


def check(temperature: float, top_p: float, top_k: int) -> None:
    """Raises `RequestError` for values no sampler takes (NaN and infinities included).

    Example:
        >>> check(0.7, 0.9, 40)
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RequestError(f"temperature must be a finite number >= 0, got {temperature}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k}")


def filtered_probs(logits_bv: jax.Array, sp: SamplingParams) -> jax.Array:
    """`[..., V]` probabilities after temperature, then top-k, then top-p (HF order); fp32.

    Greedy (temperature 0) gives the one-hot argmax. Top-k keeps the tokens whose scaled logit is
    at least the k-th largest (ties with it included). Top-p keeps the smallest prefix of tokens, by
    descending probability, whose mass reaches `top_p` (always at least one token).

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
    order = None
    if sp.top_k_on:
        # one descending sort (with its order when top-p reuses it); each row's k-th value is its cut
        iota = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, scaled.ndim - 1)
        neg_sorted, order = jax.lax.sort((-scaled, iota), dimension=scaled.ndim - 1, num_keys=1)
        k = per_row(sp.top_k, logits)
        kth_index = jnp.where((k > 0) & (k < v), k, v) - 1
        kth_index = jnp.broadcast_to(kth_index, scaled.shape[:-1] + (1,)).astype(jnp.int32)
        kth = -jnp.take_along_axis(neg_sorted, kth_index, axis=-1)
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if sp.top_p_on:
        # probabilities in descending order: top-k's order, else one sort of the whole vocabulary
        sorted_p = jnp.take_along_axis(probs, order, axis=-1) if order is not None else -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        top_p = per_row(sp.top_p, logits)
        kept = (mass_before < top_p) | (top_p >= 1)     # a row's top_p 1 is no filter (no rounding)
        threshold = jnp.min(jnp.where(kept, sorted_p, jnp.inf), axis=-1, keepdims=True)
        probs = jnp.where(probs >= threshold, probs, 0.0)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return jnp.where(temperature > 0, probs, greedy)


def sample_from_probs(probs: jax.Array, key: jax.Array) -> jax.Array:
    """One draw per row of `probs [..., V]` (zeros never drawn).

    Example:
        >>> int(sample_from_probs(jnp.array([[0.0, 1.0, 0.0]]), jax.random.key(0))[0])
        1
    """
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
    """`sample_tokens`, or with the static `greedy` flag only the argmax (the same tokens as
    `sample_tokens` at temperature 0), so a greedy compile never traces the sampling filters.

    Example:
        >>> int(pick_tokens(jnp.array([[0.1, 2.0, 0.3]]), SamplingParams.make(), jax.random.key(0), True)[0])
        1
    """
    if greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return sample_tokens(logits_bv, sp, key)
