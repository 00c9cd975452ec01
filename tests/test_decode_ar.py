"""Plain decoding: greedy equals transformers token for token, per-row stopping, one compile per
bucket, and sampling that follows the filtered distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.sampling import SamplingParams, filtered_probs, sample_tokens

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17]]


def hf_greedy(model_dir, prompts, n):
    """transformers' greedy continuation of each prompt, one at a time (no padding), one model load."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = [model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0) for prompt in prompts]
    return [out[0, len(prompt):].tolist() for prompt, out in zip(prompts, outs)]


@pytest.fixture(scope="module", params=["tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def target_and_dir(request):
    d = request.getfixturevalue(request.param)
    return load_target(d), d


def test_greedy_batch_equals_transformers_generate(target_and_dir):
    target, d = target_and_dir
    dec = ARDecoder(target)
    result = dec.generate(PROMPTS, max_new_tokens=12, stop_ids=[])
    assert result.output_ids == hf_greedy(d, PROMPTS, 12)
    # a second request in the same buckets reuses both executables
    dec.generate([p[::-1] for p in PROMPTS], max_new_tokens=12, stop_ids=[])
    assert dec.compile_counts() == {"prefill": 1, "decode_step": 1}


def test_rows_stop_on_their_own_stop_token(tiny_qwen3_dir):
    dec = ARDecoder(load_target(tiny_qwen3_dir))
    free = dec.generate(PROMPTS, max_new_tokens=10, stop_ids=[]).output_ids
    stop = free[0][3]
    first = free[0].index(stop)
    stopped = dec.generate(PROMPTS, max_new_tokens=10, stop_ids=[stop]).output_ids
    assert stopped[0] == free[0][:first + 1]
    for row in range(1, len(PROMPTS)):
        cut = free[row].index(stop) + 1 if stop in free[row] else 10
        assert stopped[row] == free[row][:cut]


def test_sampling_is_seeded_and_respects_top_k(tiny_qwen3_dir):
    dec = ARDecoder(load_target(tiny_qwen3_dir))
    sp = SamplingParams.make(temperature=1.0, top_k=3)
    a = dec.generate(PROMPTS, 8, sp, seed=7, stop_ids=[]).output_ids
    b = dec.generate(PROMPTS, 8, sp, seed=7, stop_ids=[]).output_ids
    c = dec.generate(PROMPTS, 8, sp, seed=8, stop_ids=[]).output_ids
    assert a == b and a != c
    assert dec.compile_counts() == {"prefill": 1, "decode_step": 1}


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6)])
def test_filtered_probs_match_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    logits = np.random.RandomState(0).randn(3, 50).astype(np.float32) * 3
    scores = torch.tensor(logits)
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = torch.softmax(scores, -1).numpy()
    got = np.asarray(filtered_probs(jnp.asarray(logits), SamplingParams.make(temperature, top_p, top_k)))
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_samples_follow_the_filtered_distribution():
    """Chi-square goodness of fit of 40k draws (p-value bound, fixed seed)."""
    from scipy.stats import chisquare
    logits = jnp.asarray(np.random.RandomState(1).randn(1, 12).astype(np.float32))
    sp = SamplingParams.make(temperature=0.8, top_p=0.9)
    probs = np.asarray(filtered_probs(logits, sp))[0]
    n = 40_000
    draws = np.asarray(jax.vmap(lambda k: sample_tokens(logits, sp, k)[0])(
        jax.random.split(jax.random.key(0), n)))
    counts = np.bincount(draws, minlength=12)
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    p64 = probs[keep].astype(np.float64)
    expected = p64 / p64.sum() * n
    assert chisquare(counts[keep], expected).pvalue > 1e-3
    # and a clearly different distribution is rejected by the same test
    assert chisquare(counts[keep], np.roll(expected, 1)).pvalue < 1e-6
