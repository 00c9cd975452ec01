"""Token selection: greedy, temperature, top-k and top-p, as one filtered distribution.

`filtered_probs` is the distribution every sampler and verifier uses (the target's and, in
speculative decoding, the drafter's), so temperature / top-p / top-k reach both alike. Temperature 0
means greedy: the distribution is one-hot on the argmax.

Which filters are on is static (part of the `SamplingParams` pytree structure, so a jitted round
compiles once per on/off combination and per `top_k`): a filter that is off costs nothing -- no
vocabulary sort -- and `top_p = 1` is exactly no filter (no cumulative sum that float rounding
could push past 1 and so drop a tail token). Top-k alone is `lax.top_k` (k static), top-k with
top-p sorts only those k; top-p alone sorts the vocabulary once. Temperature and the value of
`top_p` are traced arrays: changing them never recompiles. They are scalars, or `[B]` arrays of
one value per row (broadcast over the leading batch axis: `per_row`), so greedy rows (temperature
0: one-hot) and sampled rows with their own temperature / top-p share a batch (the server's).

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

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.decode.batch import RequestError
from dmtp_jax.layers.rows import per_row


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
    """Sampling parameters; build them with `make` (it validates and sets the static on/off flag).

    `top_k` (0 = off) is static, `top_p_on` says whether `top_p` filters (static: `make` sets it to
    `top_p < 1`); `temperature` and `top_p` are traced f32 scalars.

    Example:
        >>> sp = SamplingParams.make(temperature=0.7, top_p=0.9)
        >>> sp.top_p_on, sp.top_k, sp.is_greedy
        (True, 0, False)
    """
    temperature: jax.Array   # f32 scalar or [B] (one per row); 0 = greedy
    top_p: jax.Array         # f32 scalar or [B]; filters only when `top_p_on` (a row's 1 keeps all)
    top_k: int = dataclasses.field(default=0, metadata=dict(static=True))            # 0 = off
    top_p_on: bool = dataclasses.field(default=False, metadata=dict(static=True))    # top_p < 1

    @classmethod
    def make(cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> "SamplingParams":
        """Validated parameters. Example: `SamplingParams.make(temperature=0.7, top_p=0.9)`."""
        if temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {top_k}")
        return cls(jnp.float32(temperature), jnp.float32(top_p), int(top_k), bool(top_p < 1))

    @classmethod
    def rows(cls, temperature_b, top_p_b, top_k: int = 0) -> "SamplingParams":
        """One temperature and top-p per row (`[B]`, values checked by `make` per request); top-k is
        shared (static). Top-p filters when any row's top_p < 1; a row with top_p 1 keeps every token.

        Example:
            >>> sp = SamplingParams.rows([0.0, 1.0], [1.0, 0.5])
            >>> sp.is_greedy, sp.top_p_on, sp.temperature.shape
            (False, True, (2,))
        """
        temperature_b, top_p_b = np.asarray(temperature_b, np.float32), np.asarray(top_p_b, np.float32)
        return cls(temperature_b, top_p_b, int(top_k), bool((top_p_b < 1).any()))

    @property
    def is_greedy(self) -> bool:
        return bool(np.all(np.asarray(self.temperature) == 0.0))


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
    top_k = sp.top_k if 0 < sp.top_k < v else 0
    if top_k:
        top_values, top_index = jax.lax.top_k(scaled, top_k)    # sorted, descending
        # the min, not `[..., -1:]`: a slice of the k values stops XLA's CPU rewrite to its TopK kernel
        scaled = jnp.where(scaled < jnp.min(top_values, axis=-1, keepdims=True), -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if sp.top_p_on:
        # probabilities in descending order: the k kept ones (the rest are 0), else the whole sort
        sorted_p = (jnp.take_along_axis(probs, top_index, axis=-1) if top_k else -jnp.sort(-probs, axis=-1))
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
