"""The speculative engine with DFlash / DFlash2 drafters: greedy output equals plain greedy decoding
and the `dflash` reference (tokens and acceptance lengths), one compile per bucket, and sampled
decoding that reproduces the target's distribution."""

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_fixtures import build_reference_drafter
from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.safetensors_io import CheckpointReader, write_safetensors
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.sampling import SamplingParams, filtered_probs
from dmtp_jax.decode.spec import SpecDecoder

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17]]
BOOSTED_ROWS = (10, 11, 12, 13, 14, 15)
DRAFTERS = {
    "dflash-sliding+full": dict(version=1, layer_types=("sliding_attention", "full_attention"), sliding_window=6),
    "dflash-causal": dict(version=1, is_causal=True),
    "dflash2-noncausal-sliding": dict(version=2, is_causal=False,
                                      layer_types=("sliding_attention", "sliding_attention"), sliding_window=6),
}


@pytest.fixture(scope="module")
def peaked_target_dir(tiny_qwen3_dir, tmp_path_factory):
    """The tiny target with a few LM-head rows scaled up, so that target and drafters (which share
    the head) often agree: acceptance is partial, neither always 0 nor always full."""
    d = str(tmp_path_factory.mktemp("peaked") / "target")
    shutil.copytree(tiny_qwen3_dir, d)
    reader = CheckpointReader(d)
    tensors = {k: np.array(reader.array(k)) for k in reader.keys()}
    del reader
    tensors["lm_head.weight"][list(BOOSTED_ROWS)] *= 6.0
    write_safetensors(os.path.join(d, "model.safetensors"), tensors)
    return d


_PAIRS = {}


def make_pair(name, target_dir, tmp_path_factory):
    """(target, drafter, reference torch drafter, target dir) for `DRAFTERS[name]`, built once."""
    if name not in _PAIRS:
        d = str(tmp_path_factory.mktemp("drafter") / name)
        ref = build_reference_drafter(d, seed=3, **DRAFTERS[name])
        target = load_target(target_dir)
        _PAIRS[name] = (target, load_drafter(d, target.cfg), ref, target_dir)
    return _PAIRS[name]


@pytest.fixture(scope="module", params=list(DRAFTERS))
def pair(request, peaked_target_dir, tmp_path_factory):
    return make_pair(request.param, peaked_target_dir, tmp_path_factory)


def test_greedy_equals_ar_and_dflash_reference(pair, monkeypatch):
    import time

    import dflash.model
    from dflash.model import dflash_generate
    from transformers import AutoModelForCausalLM
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)   # its timer syncs CUDA
    target, drafter, ref, target_dir = pair
    engine = SpecDecoder(target, drafter)
    spec = engine.generate(PROMPTS, max_new_tokens=24, stop_ids=[])
    ar = ARDecoder(target).generate(PROMPTS, max_new_tokens=24, stop_ids=[])
    assert spec.output_ids == ar.output_ids
    hist = spec.stats["histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, f"acceptance should be partial, got {hist}"

    hf_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for row, prompt in enumerate(PROMPTS):
        out = dflash_generate(ref, hf_target, torch.tensor([prompt]), 24, None, return_stats=True)
        assert spec.output_ids[row] == out.output_ids[0, len(prompt):].tolist()
        # the reference counts the last round after truncation to the budget; we count it whole
        ours = spec.stats["acceptance_lengths"][row]
        assert ours[:-1] == out.acceptance_lengths[:-1] and ours[-1] >= out.acceptance_lengths[-1]

    spec2 = engine.generate([p[::-1] for p in PROMPTS], max_new_tokens=24, stop_ids=[])
    assert spec2.output_ids == ARDecoder(target).generate([p[::-1] for p in PROMPTS], 24, stop_ids=[]).output_ids
    assert engine.compile_counts() == {"prefill": 1, "round": 1}


def test_finished_rows_do_no_harm(pair):
    target, drafter, _, _ = pair
    free = ARDecoder(target).generate(PROMPTS, 20, stop_ids=[]).output_ids
    stop = free[2][4]
    spec = SpecDecoder(target, drafter).generate(PROMPTS, 20, stop_ids=[stop]).output_ids
    for row in range(len(PROMPTS)):
        cut = free[row].index(stop) + 1 if stop in free[row] else 20
        assert spec[row] == free[row][:cut]


def exact_joint(target, prompt, sp, depth=3):
    """Exact target distribution of the first `depth` sampled tokens, by enumerating the support."""
    model = nnx.merge(target.graphdef, target.state)

    def next_probs(seqs):
        ids = jnp.asarray(seqs)
        out = model(ids, jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape))
        return np.asarray(filtered_probs(model.logits(out.hidden_bth[:, -1]), sp), np.float64)

    joint = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        probs = next_probs([prompt + list(p) for p in prefixes])
        joint = {p + (t,): joint[p] * probs[i, t] for i, p in enumerate(prefixes)
                 for t in np.nonzero(probs[i])[0].tolist()}
    return joint


@pytest.mark.parametrize("name,verify", [("dflash-sliding+full", "rejection"),
                                         ("dflash-sliding+full", "target-only"),
                                         ("dflash2-noncausal-sliding", "rejection")])
def test_sampled_decoding_reproduces_target_distribution(name, verify, peaked_target_dir, tmp_path_factory):
    """Chi-square of 4096 sampled 3-token continuations against the exact target joint."""
    from scipy.stats import chisquare
    target, drafter, _, _ = make_pair(name, peaked_target_dir, tmp_path_factory)
    sp = SamplingParams.make(temperature=1.0, top_k=3)
    prompt = PROMPTS[0]
    joint = exact_joint(target, prompt, sp)
    engine = SpecDecoder(target, drafter, verify=verify)
    counts = dict.fromkeys(joint, 0)
    accepted_drafts = 0
    for seed in range(16):
        res = engine.generate([prompt] * 256, max_new_tokens=3, sampling=sp, seed=seed, stop_ids=[])
        for out in res.output_ids:
            counts[tuple(out)] += 1
        accepted_drafts += sum(k * n for k, n in enumerate(res.stats["histogram"]))
    assert accepted_drafts > 0
    keys = sorted(joint, key=lambda k: -joint[k])
    expected = np.array([joint[k] for k in keys]) * 4096
    observed = np.array([counts[k] for k in keys], float)
    big = expected >= 5
    exp_cells = np.append(expected[big], expected[~big].sum())
    obs_cells = np.append(observed[big], observed[~big].sum())
    assert chisquare(obs_cells, exp_cells * obs_cells.sum() / exp_cells.sum()).pvalue > 1e-3
    # the same test rejects a different distribution (a colder target)
    cold = exact_joint(target, prompt, SamplingParams.make(temperature=0.5, top_k=3))
    cold_exp = np.array([cold.get(k, 0.0) for k in keys]) * 4096
    cold_cells = np.append(cold_exp[big], cold_exp[~big].sum()) + 1e-9
    assert chisquare(obs_cells, cold_cells * obs_cells.sum() / cold_cells.sum()).pvalue < 1e-6
