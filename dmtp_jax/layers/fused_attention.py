"""Fused attention kernels of a backend, for a causal `self_keys` rule (keys are the queries' own
tokens, a right-padded prefix valid):

* `cudnn_attention` (GPU): `jax.nn.dot_product_attention(implementation="cudnn")` with
  `key_value_seq_lengths` and a left window; None when cuDNN refuses (the caller falls back).
* `pallas_tpu_attention` (TPU): the Pallas TPU flash kernel, validity as segment ids, K/V heads
  repeated for GQA; no window, T a multiple of `PALLAS_BLOCK`.

Rows with no allowed key are set to zero, as every other form returns."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax.layers.attention_mask import MaskRule

PALLAS_BLOCK = 128


def cudnn_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, rule: MaskRule) -> jax.Array | None:
    """cuDNN flash attention under a causal `self_keys` rule; None when cuDNN refuses the shapes
    (then the caller takes another form)."""
    if not (rule.self_keys and rule.causal is True):
        raise ValueError("cudnn_attention needs a causal self_keys MaskRule")
    window = (rule.window - 1, 0) if rule.window else None
    lengths_b = rule.valid_counts() if rule.k_valid_bs is not None else None
    try:
        out = jax.nn.dot_product_attention(q_bthd, k_bskd, v_bskd, is_causal=True,
                                           key_value_seq_lengths=lengths_b, local_window_size=window,
                                           implementation="cudnn")
    except (NotImplementedError, RuntimeError):
        return None
    return jnp.where(rule.rows_with_keys()[:, :, None, None], out, 0).astype(v_bskd.dtype)


def pallas_tpu_attention(q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, rule: MaskRule) -> jax.Array:
    """The Pallas TPU flash kernel under a causal `self_keys` rule without a window (T a multiple of
    `PALLAS_BLOCK`); runs on CPU inside `pltpu.force_tpu_interpret_mode()`."""
    from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds, flash_attention  # lazy: TPU-only ops
    if not (rule.self_keys and rule.causal is True and not rule.window):
        raise ValueError("pallas_tpu_attention needs a causal self_keys MaskRule without a window")
    b, t, h, d = q_bthd.shape
    groups = h // k_bskd.shape[2]
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    k, v = (heads_first(jnp.repeat(x, groups, axis=2)) if groups > 1 else heads_first(x) for x in (k_bskd, v_bskd))
    segments = None if rule.k_valid_bs is None else SegmentIds(
        q=jnp.ones((b, t), jnp.int32), kv=rule.k_valid_bs.astype(jnp.int32))
    out = heads_first(flash_attention(heads_first(q_bthd), k.astype(q_bthd.dtype), v.astype(q_bthd.dtype),
                                      segment_ids=segments, causal=True, sm_scale=d ** -0.5))
    return jnp.where(rule.rows_with_keys()[:, :, None, None], out, 0).astype(v_bskd.dtype)
