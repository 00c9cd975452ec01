"""Our JAX target vs transformers on tiny random Qwen3 / Qwen3-MoE checkpoints (fixtures in conftest)."""

import doctest
import shutil

import pytest

from dmtp_jax import compare
from dmtp_jax.compare import compare_target, format_table

EXPECTED_CHECKS = ["logits", "argmax_agreement", "hidden_layer_0", "hidden_layer_1", "cached_decode",
                   "greedy_continuation"]


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def test_matches_transformers_fp32(fixture, request):
    report = compare_target(request.getfixturevalue(fixture), dtype="float32", mesh_spec="tensor=1")
    table = format_table(report)
    assert [c["name"] for c in report["checks"]] == EXPECTED_CHECKS, table
    assert report["ok"], table
    assert table.splitlines()[-1] == "OK"
    assert report["argmax_agreement"] == 1.0
    assert max(report["prompt_lengths"]) >= 300          # far positions: RoPE
    assert report["greedy"]["ours"] == report["greedy"]["hf"]
    assert all(len(g) == 8 for g in report["greedy"]["hf"])   # HF did not stop on EOS
    for c in report["checks"]:
        if c["name"] not in ("argmax_agreement", "greedy_continuation"):
            assert 0 < c["tolerance"] <= 1e-3, c           # fp32: 1e-4 x magnitude of order 1


def test_tampered_weight_fails(tiny_qwen3_dir, tmp_path):
    """One perturbed LM-head row on our side only: `logits` must fail while every hidden state passes."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "tampered"
    shutil.copytree(tiny_qwen3_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["lm_head.weight"][5] += 0.5
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})

    report = compare_target(str(bad), dtype="float32", reference_dir=tiny_qwen3_dir, num_new_tokens=2)
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    assert not report["ok"]
    assert "logits" in failed
    assert not [n for n in failed if n.startswith("hidden_layer") or n == "cached_decode"], failed
    logits = next(c for c in report["checks"] if c["name"] == "logits")
    assert logits["max_abs_diff"] > 100 * logits["tolerance"]
    last = format_table(report).splitlines()[-1]
    assert last.startswith("FAILED: ") and "logits" in last


def test_pure_helpers():
    assert doctest.testmod(compare, raise_on_error=False).failed == 0
    assert compare.max_abs_diff([[0.0, 1.0], [2.0, 3.0]], [[0.0, 1.5], [2.0, 3.0]]) == 0.5
    assert compare.max_abs_diff([1.0, 2.0], [1.0]) == float("inf")
    assert compare.max_abs_diff([[0.0], [0.0], [9.0]] * 100, [[0.0]] * 300, quantile=0.5) == 0.0
    assert compare.scaled_tolerance(1e-4, [[-30.0, 2.0]]) == pytest.approx(3e-3)
    assert not compare.check("x", float("nan"), 1.0)["ok"]
    prompts = compare.make_prompts(1000, 64, seed=3, reserve=8)
    assert [len(p) for p in prompts] == [7, 33, 56] and all(0 <= t < 1000 for p in prompts for t in p)
