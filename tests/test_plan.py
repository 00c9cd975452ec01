"""`plan`: a dry run compiles the very functions a run compiles. On `cpu:N` the planned numbers
must be those of a real compile-and-run of the same function; the verdict, the exit status and the
JSON keys are the contract of `infer.py plan`.

The TPU / GPU compilers are optional extras; `benchmarks/plan_sizing.py` runs the real configs on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def planned_dmtp(tiny_qwen3_5_dir):
    from dmtp_jax.plan import plan_inference
    return plan_inference(tiny_qwen3_5_dir, method="dmtp", topology="cpu:1", batch_size=2, prompt_len=20,
                          max_new_tokens=16, dtype="float32")


def test_plan_matches_a_real_compile_and_run(tiny_qwen3_5_dir, planned_dmtp):
    """The planned round has the FLOPs and the memory of the round compiled from real weights and a
    real prefilled state, which then runs."""
    from dmtp_jax.checkpoint.dmtp_ckpt import init_fusion
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.decode.batch import pad_prompts
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.models.drafter_shape import default_drafter_config
    from dmtp_jax.plan.compile import cost_of

    target = load_target(tiny_qwen3_5_dir, "float32")
    dcfg = default_drafter_config(target.cfg)
    drafter = init_drafter(dcfg, "float32")
    decoder = make_decoder("dmtp", target, drafter, mtp=load_mtp(tiny_qwen3_5_dir, target.cfg, "float32"),
                           fusion=init_fusion("dmtp", dcfg.hidden_size, dcfg.rms_norm_eps, "float32"))
    batch = pad_prompts([[1] * 20, [2] * 20], 16, target.cfg.vocab_size, slack=decoder.slots)
    sp, key = SamplingParams.make(), jax.random.key(0)
    state = decoder.prefill(decoder.model_states(), batch.tokens_bt, batch.lengths_b,
                            decoder.new_state(2, batch.max_len), sp, key, greedy=True)
    active, limits = np.ones(2, bool), np.full(2, 40, np.int32)
    knobs = decoder.knobs()
    compiled = decoder.round.lower(decoder.model_states(), state, active, limits, sp, key, np.int32(1), knobs,
                                   greedy=True).compile()
    real_mem, real_cost = compiled.memory_analysis(), cost_of(compiled)
    planned = {f.name: f for f in planned_dmtp.functions}["round"]
    assert planned.flops == real_cost["flops"]
    assert planned.bytes_accessed == real_cost["bytes accessed"]
    assert planned.argument_bytes == real_mem.argument_size_in_bytes
    assert planned.temp_bytes == real_mem.temp_size_in_bytes
    assert planned.alias_bytes == real_mem.alias_size_in_bytes
    tokens = compiled(decoder.model_states(), state, active, limits, sp, key, np.int32(1), knobs)[1]
    assert np.asarray(tokens).shape == (2, decoder.slots)


def test_plan_accounts_weights_and_caches(planned_dmtp):
    """Per-device weights are the models' bytes; the minimum of a round is weights + caches."""
    p = planned_dmtp
    assert set(p.weight_bytes) == {"target", "drafter", "mtp", "fusion"}
    assert set(p.state_bytes) == {"target_cache", "mtp_cache", "ctx_cache"}
    rnd = {f.name: f for f in p.functions}["round"]
    # the drafter's context cache counts whole in memory; the cache here is shorter than its window
    assert rnd.min_bytes == pytest.approx(sum(p.weight_bytes.values()) + sum(p.state_bytes.values()), abs=1)
    assert rnd.argument_bytes >= sum(p.weight_bytes.values())
    assert p.fits and p.per_device_peak_bytes == max(f.peak_bytes for f in p.functions)
    assert rnd.calls == 16          # without --accept-len: one token per round, the upper bound


def test_plan_notes_the_deferred_rows_of_serve_auto(tiny_qwen3_5_dir, planned_dmtp):
    """The note's size (`deferred_nbytes`) is the bytes of the buffer `serve --method auto` builds over
    this method."""
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode.drafting import DEFER_WINDOW, deferred_nbytes, deferred_widths, new_deferred
    from dmtp_jax.models.drafter_shape import default_drafter_config
    from dmtp_jax.sharding import make_mesh
    cfg = load_target(tiny_qwen3_5_dir, "float32").cfg
    widths = deferred_widths(cfg, default_drafter_config(cfg))
    buffer = new_deferred(make_mesh(None), 2, DEFER_WINDOW, *widths, np.float32)
    assert deferred_nbytes(2, DEFER_WINDOW, *widths, "float32") == sum(x.nbytes for x in jax.tree.leaves(buffer))
    assert any(f"of deferred rows per device ({DEFER_WINDOW} positions per row" in note for note in planned_dmtp.notes)
