"""The speculative engine with DFlash / DFlash2 drafters: greedy output equals plain greedy decoding
and the `dflash` reference (tokens and acceptance lengths), one compile per bucket, and sampled
decoding that reproduces the target's distribution."""


import pytest
import torch

from dflash_fixtures import build_reference_drafter
from stat_checks import assert_matches_target_joint
from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.decode.spec import SpecDecoder

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17]]
DRAFTERS = {
    "dflash-sliding+full": dict(version=1, layer_types=("sliding_attention", "full_attention"), sliding_window=6),
    "dflash-causal": dict(version=1, is_causal=True),
    "dflash2-noncausal-sliding": dict(version=2, is_causal=False,
                                      layer_types=("sliding_attention", "sliding_attention"), sliding_window=6),
}


_PAIRS = {}


def make_pair(name, target_dir, tmp_path_factory):
    """(target, drafter, reference torch drafter, target dir) for `DRAFTERS[name]`, built once."""
    if name not in _PAIRS:
        d = str(tmp_path_factory.mktemp("drafter") / name)
        ref = build_reference_drafter(d, seed=3, **DRAFTERS[name])
        target = load_target(target_dir)
        _PAIRS[name] = (target, load_drafter(d, target.cfg), ref, target_dir)
    return _PAIRS[name]


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.heavy) if n == "dflash-causal" else n
                                        for n in DRAFTERS])
def pair(request, peaked_target_dir, tmp_path_factory):
    return make_pair(request.param, peaked_target_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def decoders(pair):
    """`(speculative, plain)` decoders on `pair`'s target, shared by the tests of that drafter: their
    requests fall in one bucket, so each compiles prefill and round (decode step) once."""
    target, drafter, _, _ = pair
    return SpecDecoder(target, drafter), ARDecoder(target)


def test_greedy_equals_ar_and_dflash_reference(pair, decoders, monkeypatch):
    import time

    import dflash.model
    from dflash.model import dflash_generate
    from transformers import AutoModelForCausalLM
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)   # its timer syncs CUDA
    target, drafter, ref, target_dir = pair
    engine, plain = decoders
    spec = engine.generate(PROMPTS, max_new_tokens=24, stop_ids=[])
    ar = plain.generate(PROMPTS, max_new_tokens=24, stop_ids=[])
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
    assert spec2.output_ids == plain.generate([p[::-1] for p in PROMPTS], 24, stop_ids=[]).output_ids
    assert engine.compile_counts() == {"prefill": 1, "round": 1}


def test_finished_rows_do_no_harm(decoders):
    engine, plain = decoders
    free = plain.generate(PROMPTS, 20, stop_ids=[]).output_ids
    stop = free[2][4]
    spec = engine.generate(PROMPTS, 20, stop_ids=[stop]).output_ids
    for row in range(len(PROMPTS)):
        cut = free[row].index(stop) + 1 if stop in free[row] else 20
        assert spec[row] == free[row][:cut]


@pytest.mark.parametrize("name,verify", [("dflash-sliding+full", "rejection"),
                                         ("dflash-sliding+full", "target-only"),
                                         pytest.param("dflash2-noncausal-sliding", "rejection",
                                                      marks=pytest.mark.heavy)])
def test_sampled_decoding_reproduces_target_distribution(name, verify, peaked_target_dir, tmp_path_factory):
    """Chi-square of 4096 sampled 3-token continuations against the exact target joint."""
    target, drafter, _, _ = make_pair(name, peaked_target_dir, tmp_path_factory)
    assert_matches_target_joint(SpecDecoder(target, drafter, verify=verify), target, PROMPTS[0],
                                SamplingParams.make(temperature=1.0, top_k=3))


def test_every_method_has_one_proposer_and_the_models_it_needs_are_checked():
    """Every speculative method is a proposer (`decode/proposers.py`); the models it runs are
    `options.method_needs` (the one rule), and `check_spec_options` refuses a decoder without one."""
    from dmtp_jax.decode import METHODS, method_needs
    from dmtp_jax.decode.batch import RequestError
    from dmtp_jax.decode.proposers import PROPOSERS, make_proposer
    from dmtp_jax.decode.spec import SPEC_METHODS, check_spec_options

    from dmtp_jax.methods import METHODS as REGISTRY

    assert set(SPEC_METHODS) == set(METHODS) - {"ar"} == set(REGISTRY) - {"ar"}
    assert {REGISTRY[m].proposer for m in SPEC_METHODS} == set(PROPOSERS)
    for method in SPEC_METHODS:
        needs = make_proposer(method, slots=8).needs
        assert needs == method_needs(method) and (any(needs.values()) or method == "lookup"), method
        for missing in [m for m, needed in needs.items() if needed]:
            given = {m: object() for m in ("drafter", "mtp", "fusion", "draft_model") if m != missing}
            with pytest.raises(RequestError, match="needs"):
                check_spec_options(method, **given)


def test_the_round_has_no_method_branches():
    """`decode/spec.py`, `decode/round.py` and `decode/drafting.py` never ask which method runs:
    proposers do."""
    import inspect
    import re

    from dmtp_jax.decode import drafting, spec
    from dmtp_jax.decode import round as round_mod
    for module in (spec, round_mod, drafting):
        assert not re.search(r"method\s*(==|!=|in)\s", inspect.getsource(module))
