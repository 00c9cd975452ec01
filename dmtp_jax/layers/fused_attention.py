"""Fused attention kernels of a backend, for the masks they can express.

`cudnn_attention`: cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`)
for a causal `self_keys` rule -- keys are the queries' own tokens at consecutive positions, a
right-padded prefix of them valid: index causality, a per-row key count (`key_value_seq_lengths`)
and a left window (`local_window_size=(window - 1, 0)`, i.e. `q - k < window`) express the rule
exactly. cuDNN's output for a query with no allowed key is not specified, so such rows are set to
zero, as every other form returns. cuDNN decides the rest (head dim, dtype, compute capability) when
the program is traced; when it refuses, the caller falls back to the XLA blockwise form.

Example:
    >>> with compiling_for("gpu"):  # doctest: +SKIP
    ...     out = cudnn_attention(q_bthd, k_bthd, v_bthd, MaskRule(pos, pos, valid, self_keys=True))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dmtp_jax.layers.attention_mask import MaskRule


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
