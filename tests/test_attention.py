"""Attention forms agree with the dense one: the XLA blockwise (online-softmax) form within 1e-6 in
fp32 under every mask the rule makes (causal, sliding windows, validity padding, GQA, rows with no
allowed key, a cache longer than the queries, ragged last blocks), and `grouped_attention` picks the
dense form for short query blocks (bit-identical to a materialised mask) and the blockwise one for
long prompts; for GPU / TPU targets (`compiling_for`) a long self-attention picks cuDNN / the Pallas
TPU kernel, the latter equal to the dense form in Pallas' TPU interpreter. Short query blocks over a
cache ("cache_blocks") read it only up to the block of their highest position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dmtp_jax.layers.attention import (CACHE_BLOCKS_FROM, MaskRule, attention_kernel, attention_mask, dense_attention,
                                       grouped_attention)
from dmtp_jax.layers.blockwise_attention import blockwise_attention
from dmtp_jax.platform import compiling_for


def _qkv(seed, b, t, s, heads, kv, d, dtype=jnp.float32):
    kq, kk, kv_ = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, t, heads, d), dtype), jax.random.normal(kk, (b, s, kv, d), dtype),
            jax.random.normal(kv_, (b, s, kv, d), dtype))


CASES = {   # name: (T, S, heads, kv, causal, window, query offset per row, valid keys per row)
    "causal_self": (50, 50, 4, 2, True, None, (0, 0), None),
    "sliding": (61, 61, 4, 1, True, 7, (0, 0), None),
    "padded_gqa": (45, 45, 6, 2, True, None, (0, 0), (45, 17)),
    "sliding_padded": (40, 40, 4, 4, True, 5, (0, 0), (40, 9)),
    "cache_chunk": (24, 97, 4, 2, True, None, (30, 55), None),       # a chunk over a longer cache
    "cache_window": (24, 97, 4, 2, True, 11, (30, 70), (97, 50)),
    "non_causal_window": (33, 70, 4, 2, False, 9, (20, 5), (70, 31)),
    "no_keys": (20, 40, 4, 2, True, None, (0, 10), (0, 5)),          # row 0 sees nothing, row 1 part
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("blocks", [(8, 16), (64, 128)])   # ragged blocks; one block
def test_blockwise_equals_dense_fp32(name, blocks):
    t, s, heads, kv, causal, window, offsets, valid_n = CASES[name]
    q, k, v = _qkv(sorted(CASES).index(name), 2, t, s, heads, kv, 8)
    q_pos = jnp.asarray(offsets)[:, None] + jnp.arange(t)[None]
    k_pos = jnp.broadcast_to(jnp.arange(s), (2, s))
    valid = None if valid_n is None else jnp.arange(s)[None] < jnp.asarray(valid_n)[:, None]
    rule = MaskRule(q_pos, k_pos, valid, causal=causal, window=window)
    want = dense_attention(q, k, v, attention_mask(q_pos, k_pos, valid, causal, window))
    got = blockwise_attention(q, k, v, rule, q_block=blocks[0], k_block=blocks[1])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    if name == "no_keys":
        assert float(jnp.abs(got[0]).max()) == 0.0


def test_kernel_choice_follows_shapes_and_platform():
    pos = jnp.arange(8)[None]
    rule, self_rule = MaskRule(pos, pos), MaskRule(pos, pos, self_keys=True)
    assert attention_kernel(64, 1 << 16, jnp.float32, rule) == "dense"      # verify block over a long cache
    assert attention_kernel(512, 512, jnp.float32, rule) == "dense"         # short prompt
    assert attention_kernel(1024, 2048, jnp.float32, rule) == "blockwise"
    assert attention_kernel(4096, 4096, jnp.bfloat16, None) == "dense"      # a materialised mask
    assert attention_kernel(4096, 4096, jnp.bfloat16, self_rule) == "blockwise"   # CPU
    with compiling_for("gpu"):
        assert attention_kernel(4096, 4096, jnp.bfloat16, self_rule) == "cudnn"
        assert attention_kernel(4096, 4096, jnp.float32, self_rule) == "blockwise"
        assert attention_kernel(4096, 8192, jnp.bfloat16, rule) == "blockwise"  # over a cache
    with compiling_for("tpu", devices=4):       # GSPMD cannot partition a Pallas call
        assert attention_kernel(4096, 4096, jnp.bfloat16, self_rule) == "blockwise"
    with compiling_for("tpu", devices=1):
        assert attention_kernel(4096, 4096, jnp.bfloat16, self_rule) == "pallas"
        assert attention_kernel(4000, 4000, jnp.bfloat16, self_rule) == "blockwise"   # not in 128 blocks
        assert attention_kernel(4096, 4096, jnp.bfloat16, MaskRule(pos, pos, window=8, self_keys=True)) == "blockwise"
        assert attention_kernel(4096, 8192, jnp.bfloat16, rule) == "blockwise"


def test_pallas_tpu_kernel_equals_dense_in_interpret_mode():
    """The TPU kernel (run by Pallas' TPU interpreter on CPU) under a self-keys rule with GQA,
    validity padding and a row without valid keys."""
    from jax.experimental.pallas import tpu as pltpu
    from dmtp_jax.layers.fused_attention import pallas_tpu_attention
    t = 256
    q, k, v = _qkv(7, 2, t, t, 4, 2, 16)
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    rule = MaskRule(pos, pos, pos < jnp.asarray([[200], [0]]), causal=True, self_keys=True)
    with pltpu.force_tpu_interpret_mode():
        got = pallas_tpu_attention(q, k, v, rule)
    want = dense_attention(q, k, v, rule.dense())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    assert float(jnp.abs(got[1]).max()) == 0.0


def test_grouped_attention_dispatch():
    """Short: bit-identical to the materialised mask; long: the blockwise form, close to dense."""
    q, k, v = _qkv(0, 1, 16, 40, 4, 2, 8)
    q_pos, k_pos = 20 + jnp.arange(16)[None], jnp.arange(40)[None]
    rule = MaskRule(q_pos, k_pos, None, causal=True, window=6)
    dense = dense_attention(q, k, v, attention_mask(q_pos, k_pos, None, True, 6))
    assert np.array_equal(np.asarray(grouped_attention(q, k, v, rule)), np.asarray(dense))
    t = 1100
    q, k, v = _qkv(1, 1, t, t, 2, 1, 8)
    pos = jnp.arange(t)[None]
    valid = pos < 1000
    rule = MaskRule(pos, pos, valid, causal=True, self_keys=True)
    got = jax.jit(lambda q, k, v: grouped_attention(q, k, v, rule))(q, k, v)
    want = dense_attention(q, k, v, rule.dense())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("first_key_slot,window", [(0, None), (3, None), (0, 50)])
def test_a_cache_is_read_up_to_the_longest_row(first_key_slot, window):
    """Decode steps and verify blocks over a 600-slot cache: equal to dense attention over all of it
    (1e-6), and no slot past the 128-slot block that holds the highest live position is read (NaN
    values there change nothing); a parked row (positions >= S) does not widen the read. Long
    prompt chunks over a cache (the blockwise form) stop at their own highest position too."""
    s, t = 600, 3
    over = lambda pos: MaskRule.over_slots(pos, s, first_key_slot, window)  # noqa: E731
    assert attention_kernel(t, s, jnp.float32, over(jnp.zeros((1, t), int))) == "cache_blocks"
    for small in (128, CACHE_BLOCKS_FROM):      # at most two blocks: read whole
        assert attention_kernel(t, small, jnp.float32, MaskRule.over_slots(jnp.zeros((1, t), int), small)) == "dense"
    with compiling_for("gpu"):
        assert attention_kernel(t, s, jnp.float32, over(jnp.zeros((1, t), int))) == "dense"
    for top in (10, 127, 128, 400, 599):
        q, k, v = _qkv(top, 3, t, s, 4, 2, 8)
        q_pos = jnp.asarray([[top - 2], [top // 2], [s]]) + jnp.arange(t)[None]   # row 2 is parked
        rule = over(q_pos)
        attend = jax.jit(lambda q, k, v: grouped_attention(q, k, v, rule))
        want = dense_attention(q, k, v, rule.dense())
        np.testing.assert_allclose(np.asarray(attend(q, k, v)[:2]), np.asarray(want[:2]), atol=1e-6, rtol=1e-6)
        read = (top // 128 + 1) * 128
        poisoned = v.at[:, read:].set(jnp.nan)
        assert read >= s or bool(jnp.isnan(dense_attention(q, k, poisoned, rule.dense())[:2]).any())
        np.testing.assert_allclose(np.asarray(attend(q, k, poisoned)[:2]), np.asarray(want[:2]),
                                   atol=1e-6, rtol=1e-6)
    t = 40                                              # a prompt chunk at 100..139, in query blocks of 16
    q, k, v = _qkv(1, 2, t, s, 4, 2, 8)
    rule = over(jnp.broadcast_to(100 + jnp.arange(t), (2, t)))
    want = dense_attention(q, k, v, rule.dense())
    got = blockwise_attention(q, k, v.at[:, 144:].set(jnp.nan), rule, q_block=16, k_block=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
