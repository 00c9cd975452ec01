"""The bench's per-phase breakdown (`dmtp_jax/bench/phases.py`) runs for dflash, dmtp and mtp on the
tiny fixtures, gives a positive finite time for every phase the method runs, and leaves the
decoder's state untouched."""

import math

import jax
import numpy as np
import pytest

from dflash_fixtures import build_reference_drafter
from dmtp_jax.bench.phases import PHASES, format_phases, phase_breakdown
from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.batch import pad_prompts
from dmtp_jax.decode.sampling import SamplingParams

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3]]


@pytest.fixture(scope="module")
def models(mtp_target_dir, tmp_path_factory):
    target = load_target(mtp_target_dir)
    d = str(tmp_path_factory.mktemp("dflash") / "d")
    build_reference_drafter(d, seed=3)
    return target, load_mtp(mtp_target_dir, target.cfg), d


def prefilled(decoder):
    b = pad_prompts(PROMPTS, 8, decoder.target.cfg.vocab_size, slack=decoder.slots)
    return decoder.prefill(decoder.model_states(), b.tokens_bt, b.lengths_b,
                           decoder.new_state(len(b.lengths_b), b.max_len), SamplingParams.make(),
                           jax.random.key(0), greedy=True)


@pytest.mark.parametrize("method", ["dflash", "dmtp", "mtp"])
def test_phase_breakdown_times_every_phase(method, models):
    target, mtp, draft_dir = models
    if method == "dflash":
        decoder = make_decoder("dflash", target, load_drafter(draft_dir, target.cfg))
    elif method == "dmtp":
        drafter, fusion = load_dmtp_drafter(draft_dir, target.cfg, "dmtp")
        decoder = make_decoder("dmtp", target, drafter, mtp=mtp, fusion=fusion)
    else:
        decoder = make_decoder("mtp", target, mtp=mtp, mtp_steps=3)
    state = prefilled(decoder)
    before = jax.tree.map(np.asarray, state)
    res = phase_breakdown(decoder, state, repeats=2, warmup=1)
    expected = {"dflash": set(PHASES) - {"propose-mtp"}, "mtp": set(PHASES) - {"propose-drafter"},
                "dmtp": set(PHASES)}[method]
    assert {k for k, v in res["phases_ms"].items() if v is not None} == expected
    for v in [*(res["phases_ms"][k] for k in expected), res["sum_ms"], res["round_ms"]]:
        assert math.isfinite(v) and v > 0
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state))   # not donated
    table = format_phases({method: res})
    assert method in table and "round" in table
