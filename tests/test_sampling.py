"""`decode/sampling.py`: filters that are off cost nothing (no sort in the compiled function), top_p = 1
is exactly no filter on a long-tailed distribution, and top-k / top-p equal a plain numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dmtp_jax.decode.sampling import SamplingParams, filtered_probs


def numpy_filtered(logits, temperature, top_k, top_p):
    """The filters written out plainly in float64: temperature, keep logits >= the k-th largest,
    softmax, keep the smallest prefix (by descending probability) whose mass reaches top_p."""
    scaled = logits.astype(np.float64) / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = np.sort(scaled, axis=-1)[..., -top_k][..., None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if top_p < 1:
        out = np.zeros_like(probs)
        for row, (p, o) in enumerate(zip(probs, out)):
            order = np.argsort(-p, kind="stable")
            n = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1     # first prefix whose mass >= top_p
            o[order[:n]] = p[order[:n]]
        probs = out / out.sum(-1, keepdims=True)
    return probs


def zipf_logits(vocab: int = 50_000, s: float = 1.6) -> jax.Array:
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -s / np.sum(ranks ** -s)
    return jnp.asarray(np.log(p)[np.random.default_rng(0).permutation(vocab)], jnp.float32)[None]


def test_top_p_one_keeps_every_token_of_a_long_tail():
    logits = zipf_logits()
    want = np.asarray(jax.nn.softmax(logits, axis=-1))
    assert want.min() < 1e-7       # tiny tail probabilities (the old cumulative-sum test dropped ~20)
    off = np.asarray(jax.jit(filtered_probs)(logits, SamplingParams.make(1.0)))
    np.testing.assert_allclose(off, want, rtol=1e-6, atol=0)   # the plain softmax (up to fusion rounding)
    for sp in (SamplingParams.make(1.0, top_p=1.0), SamplingParams.make(1.0, top_k=logits.shape[-1]),
               SamplingParams.make(1.0, top_k=10**6)):
        np.testing.assert_array_equal(np.asarray(jax.jit(filtered_probs)(logits, sp)), off)   # exactly
    assert (off > 0).all()                                     # every tail token keeps its mass


def test_filters_that_are_off_trace_no_sort():
    logits = jnp.zeros((2, 64), jnp.float32)

    def ops(sp):
        return str(jax.make_jaxpr(filtered_probs)(logits, sp))

    assert "sort" not in ops(SamplingParams.make(0.7)) and "top_k" not in ops(SamplingParams.make(0.7))
    for sp in (SamplingParams.make(0.7, top_k=5), SamplingParams.rows([0.7, 1.0], [1.0, 1.0], [5, 0], top_k_cap=8)):
        only_k = ops(sp)
        assert "top_k" in only_k and "sort[" not in only_k      # top-k alone: no vocabulary sort
    assert ops(SamplingParams.make(0.7, top_p=0.9)).count("sort[") == 1
    if jax.default_backend() == "cpu":     # and XLA keeps its TopK kernel (a slice of the k values undoes it)
        for sp in (SamplingParams.make(0.7, top_k=5), SamplingParams.make(0.7, top_k=5, top_p=0.9),
                   SamplingParams.rows([0.7, 1.0], [1.0, 1.0], [5, 0], top_k_cap=8)):
            assert "sort(" not in jax.jit(filtered_probs).lower(logits, sp).compile().as_text()


def test_new_top_k_values_do_not_recompile():
    """top_k is traced under a fixed cap: one compile serves every k up to it (and each row's own k)."""
    from dmtp_jax.counted_jit import counted_jit
    fn = counted_jit(filtered_probs)
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, 100)).astype(np.float32))
    for k in (1, 7, 40, 50, 10**9):        # 10**9 >= the vocabulary: keeps all, as 0 does
        got = np.asarray(fn(logits, SamplingParams.rows([1.0] * 3, [1.0] * 3, [min(k, 50) if k < 100 else 0, 0, 3],
                                                        top_k_cap=50)))
        np.testing.assert_array_equal((got > 0).sum(-1), [k if k < 100 else 100, 100, 3])
    assert fn.compiles == 1


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6), (1.0, 3, 0.95), (2.0, 40, 0.3), (1.0, 1, 0.9)])
def test_filters_match_a_numpy_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(top_k * 7 + 1).normal(size=(4, 1000)).astype(np.float32) * 2.5
    got = np.asarray(jax.jit(filtered_probs)(jnp.asarray(logits), SamplingParams.make(temperature, top_p, top_k)))
    want = numpy_filtered(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(got > 0, want > 0)          # the same tokens kept
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


def test_ties_at_the_kth_logit_are_kept_and_greedy_is_one_hot():
    logits = jnp.array([[3.0, 1.0, 1.0, 0.0]])
    got = np.asarray(filtered_probs(logits, SamplingParams.make(1.0, top_k=2)))
    np.testing.assert_array_equal(got > 0, [[True, True, True, False]])
    np.testing.assert_array_equal(np.asarray(filtered_probs(logits, SamplingParams.make(0.0, top_p=0.5, top_k=2))),
                                  [[1.0, 0.0, 0.0, 0.0]])


def test_per_row_parameters_equal_each_row_alone():
    """`SamplingParams.rows` (the server's batches): each row filtered with its own temperature,
    top-p and top-k equals that row filtered alone with scalars; a greedy row is one-hot, a top_p 1 row unfiltered."""
    logits = np.random.default_rng(5).normal(size=(4, 3, 200)).astype(np.float32) * 2.5
    for rows in ([(0.0, 1.0, 50), (0.7, 0.9, 0), (1.3, 1.0, 7), (1.0, 0.5, 50)],   # a top-p row without k
                 [(0.0, 1.0, 0), (0.7, 0.9, 9), (1.3, 1.0, 0), (1.0, 0.5, 50)]):  # top-p within top-k's values
        sp = SamplingParams.rows(*zip(*rows), top_k_cap=60)
        assert sp.top_p_in_top_k == (rows[1][2] > 0)
        got = np.asarray(jax.jit(filtered_probs)(jnp.asarray(logits), sp))
        for b, (t, p, k) in enumerate(rows):
            alone = np.asarray(filtered_probs(jnp.asarray(logits[b]), SamplingParams.make(t, p, k)))
            np.testing.assert_allclose(got[b], alone, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[0].max(-1), 1.0)
