"""Our side of the comparison: the target's full forward, and its cached prefill and decode steps
as the decoders run them (`dmtp_jax.compare`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.compare.checks import DECODE_STEPS
from dmtp_jax.decode.ar import step_logits
from dmtp_jax.decode.caches import TargetCaches
from dmtp_jax.decode.prefill import target_chunk
from dmtp_jax.decode.sampling import SamplingParams


# Module-level jits with the graphdef static: repeated comparisons of one architecture compile once.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _full_forward(graphdef, layers, state, tokens_bt):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    out = model(tokens_bt, positions, capture_layers=layers)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return f32(model.logits(out.hidden_bth)), f32(out.hidden_bth), tuple(map(f32, out.captured))


@functools.partial(jax.jit, static_argnums=(0,))
def prefill_logits(graphdef, state, tokens_bt, lengths_b, cache):
    """Our prefill (`decode/prefill.py:target_chunk`, the chunk every decoder's prefill runs; tokens
    at positions `>= lengths_b` are invalid) and fp32 logits at every position: `(logits, cache)`."""
    model = nnx.merge(graphdef, state)
    b = tokens_bt.shape[0]
    res = target_chunk(model, tokens_bt, jnp.int32(0), lengths_b, cache, jnp.zeros(b, jnp.int32),
                       SamplingParams.make(), jax.random.key(0), True)
    return model.logits(res.out.hidden_bth).astype(jnp.float32), res.out.cache


@functools.partial(jax.jit, static_argnums=(0,))
def decode_step_logits(graphdef, state, tokens_b, positions_b, cache):
    """Our single-token decode step (`decode/ar.py:step_logits`, the forward of `decode_step`):
    fp32 `(logits [B, V], cache)`."""
    logits, cache = step_logits(nnx.merge(graphdef, state), tokens_b, positions_b, cache)
    return logits.astype(jnp.float32), cache


def jax_forward(target, tokens_bt) -> dict:
    """Full forward of a right-padded batch: fp32 `logits [B,T,V]`, `final [B,T,H]`, `captured` per layer."""
    layers = tuple(range(target.cfg.num_hidden_layers))
    logits, final, captured = _full_forward(target.graphdef, layers, target.state, tokens_bt)
    return {"logits": np.asarray(logits), "final": np.asarray(final),
            "captured": [np.asarray(c) for c in captured]}


def jax_cached_logits(target, tokens_bt, lengths_b, steps: int = DECODE_STEPS) -> np.ndarray:
    """Logits `[B,T,V]` from a cache prefill of each row's first `len-steps` tokens, then `steps`
    single-token decode steps at per-row positions (the prefill's later tokens are marked invalid:
    their K/V slots are overwritten before being read, and they never enter a DeltaNet state)."""
    b, t = tokens_bt.shape
    cache = TargetCaches(target).new(b, -(-(t + 1) // 128) * 128)
    logits, cache = prefill_logits(target.graphdef, target.state, tokens_bt, (lengths_b - steps).astype(np.int32),
                                   cache)
    logits = np.array(logits)
    rows = np.arange(b)
    for j in range(steps):
        pos = (lengths_b - steps + j).astype(np.int32)
        logits_bv, cache = decode_step_logits(target.graphdef, target.state, tokens_bt[rows, pos], pos, cache)
        logits[rows, pos] = np.asarray(logits_bv)
    return logits
