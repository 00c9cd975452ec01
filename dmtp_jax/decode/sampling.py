"""Token selection: greedy, temperature, top-k and top-p, as one filtered distribution.

`filtered_probs` is the distribution every sampler and verifier uses (the target's and, in
speculative decoding, the drafter's), so temperature / top-p / top-k reach both alike. Temperature 0
means greedy: the distribution is one-hot on the argmax. Parameters are traced arrays, so changing
them never recompiles.

Example:
    >>> sp = SamplingParams.make(temperature=0.0)
    >>> int(sample_tokens(jnp.array([[0.1, 2.0, 0.3]]), sp, jax.random.key(0))[0])
    1
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dmtp_jax.decode.batch import RequestError


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
    temperature: jax.Array   # f32 scalar; 0 = greedy
    top_p: jax.Array         # f32 scalar; 1 = off
    top_k: jax.Array         # i32 scalar; 0 = off

    @classmethod
    def make(cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> "SamplingParams":
        """Validated parameters. Example: `SamplingParams.make(temperature=0.7, top_p=0.9)`."""
        if temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {top_k}")
        return cls(jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k))

    @property
    def is_greedy(self) -> bool:
        return float(self.temperature) == 0.0


def filtered_probs(logits_bv: jax.Array, sp: SamplingParams) -> jax.Array:
    """`[..., V]` probabilities after temperature, then top-k, then top-p (HF order); fp32.

    Greedy (temperature 0) gives the one-hot argmax. Top-p keeps the smallest prefix of tokens, by
    descending probability, whose mass reaches `top_p` (always at least one token).
    """
    logits = logits_bv.astype(jnp.float32)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    scaled = logits / jnp.maximum(sp.temperature, 1e-6)
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    v = logits.shape[-1]
    kth = jnp.take(sorted_desc, jnp.clip(sp.top_k - 1, 0, v - 1), axis=-1)[..., None]
    scaled = jnp.where((sp.top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    sorted_p = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    kept = mass_before < sp.top_p
    threshold = jnp.min(jnp.where(kept, sorted_p, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return jnp.where(sp.temperature > 0, probs, greedy)


def sample_from_probs(probs: jax.Array, key: jax.Array) -> jax.Array:
    """One draw per row of `probs [..., V]` (zeros never drawn)."""
    return jax.random.categorical(key, jnp.log(jnp.maximum(probs, 0.0)), axis=-1).astype(jnp.int32)


def sample_tokens(logits_bv: jax.Array, sp: SamplingParams, key: jax.Array) -> jax.Array:
    """Next tokens `[B]`: the argmax when greedy, else a draw from `filtered_probs`."""
    sampled = sample_from_probs(filtered_probs(logits_bv, sp), key)
    return jnp.where(sp.temperature > 0, sampled, jnp.argmax(logits_bv, axis=-1).astype(jnp.int32))


def pick_tokens(logits_bv: jax.Array, sp: SamplingParams, key: jax.Array, greedy: bool) -> jax.Array:
    """`sample_tokens`, or with the static `greedy` flag only the argmax (the same tokens as
    `sample_tokens` at temperature 0), so a greedy compile never traces the sampling sorts."""
    if greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return sample_tokens(logits_bv, sp, key)
