"""infer.py end to end, in process: JSON output, defaults, and one-line errors for bad input."""

import json
import os

import numpy as np
import pytest

import infer
from dmtp_jax import compare
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.commands import models
from dmtp_jax.decode.ar import ARDecoder


def test_generate_json_matches_decoder(tiny_qwen3_dir, tmp_path):
    out = tmp_path / "gen.json"
    rc = infer.main(["generate", "--target", tiny_qwen3_dir, "--prompt-ids", "1,2,3", "--prompt-ids", "9,8",
                     "--max-new-tokens", "6", "--stop-token-ids", "1000", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["prompt_ids"] == [[1, 2, 3], [9, 8]]
    want = ARDecoder(load_target(tiny_qwen3_dir)).generate([[1, 2, 3], [9, 8]], 6, stop_ids=[127]).output_ids
    assert data["output_ids"] == want
    assert data["stats"]["compiles"] == {"prefill": 1, "decode_step": 1}


def test_default_checkpoint_streams_text(tmp_path, monkeypatch, capsys):
    """No --target: the shipped demo (demo/target) when present, else the tiny random checkpoint."""
    monkeypatch.setenv("DMTP_JAX_CACHE", str(tmp_path))
    assert infer.main(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def fibonacci(n):")
    if infer.demo_available():
        assert models.resolve_target(None).endswith("target")
        assert not (tmp_path / "tiny-qwen3").exists()
    else:
        assert (tmp_path / "tiny-qwen3" / "tokenizer.json").is_file()


def test_default_tiny_checkpoint_without_demo(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DMTP_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "DEMO_DIR", str(tmp_path / "no-demo"))
    assert infer.main(["generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def fibonacci(n):")
    assert (tmp_path / "tiny-qwen3" / "tokenizer.json").is_file()


@pytest.mark.parametrize("argv,message", [
    (["--prompt", "hi"], "has no tokenizer"),
    (["--prompt-ids", "1,2", "--mesh", "tensor=64"], "needs 64 devices"),
    (["--prompt-ids", "1,2", "--mesh", "model=2"], "unknown mesh axis 'model'"),
    (["--prompt-ids", "1,500"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p must be in"),
    (["--prompt-ids", "1", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["--prompt-ids", "1", "--prompt-ids", "2", "--batch-size", "1"], "smaller than the 2 prompts"),
])
def test_bad_input_is_one_line(tiny_qwen3_dir, capsys, argv, message):
    rc = infer.main(["generate", "--target", tiny_qwen3_dir, *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_generate_dflash_json_has_acceptance(tiny_qwen3_dir, tmp_path, capsys):
    from dflash_fixtures import build_reference_drafter
    draft = str(tmp_path / "draft")
    build_reference_drafter(draft, seed=1)
    out = tmp_path / "spec.json"
    rc = infer.main(["generate", "--target", tiny_qwen3_dir, "--draft", draft, "--prompt-ids", "1,2,3",
                     "--prompt-ids", "7", "--max-new-tokens", "9", "--stop-token-ids", "1000", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    want = ARDecoder(load_target(tiny_qwen3_dir)).generate([[1, 2, 3], [7]], 9, stop_ids=[127]).output_ids
    assert data["output_ids"] == want
    assert [sum(r) >= len(o) - 1 for r, o in zip(data["acceptance_lengths"], data["output_ids"])] == [True, True]
    assert "per-verify" in capsys.readouterr().err
    assert infer.main(["generate", "--target", tiny_qwen3_dir, "--method", "dflash", "--prompt-ids", "1"]) == 2


@pytest.mark.parametrize("version", [1, 2])
def test_compare_with_drafter(tiny_qwen3_dir, tmp_path, version):
    from dflash_fixtures import build_reference_drafter
    draft = str(tmp_path / "draft")
    build_reference_drafter(draft, seed=2, version=version, is_causal=False if version == 2 else None)
    out = tmp_path / "cmp.json"
    assert infer.main(["compare", "--target", tiny_qwen3_dir, "--draft", draft, "--json", str(out)]) == 0
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["draft_hidden"]["ok"] and checks["draft_logits"]["ok"]
    assert checks["draft_logits"]["max_abs_diff"] < 1e-4


@pytest.mark.heavy
def test_generate_dmtp_from_a_plain_dflash_drafter(mtp_target_dir, tmp_path):
    """A DFlash directory loads as a DMTP drafter with a zero fusion; output still equals `ar`."""
    from dflash_fixtures import build_reference_drafter
    draft = str(tmp_path / "draft")
    build_reference_drafter(draft, seed=1)
    outs = {}
    for method in ("ar", "mtp", "dmtp"):
        path = tmp_path / f"{method}.json"
        argv = ["generate", "--target", mtp_target_dir, "--method", method, "--prompt-ids", "1,2,3",
                "--prompt-ids", "7", "--max-new-tokens", "10", "--json", str(path)]
        assert infer.main(argv + (["--draft", draft] if method == "dmtp" else [])) == 0
        outs[method] = json.loads(path.read_text())
    assert outs["mtp"]["output_ids"] == outs["ar"]["output_ids"] == outs["dmtp"]["output_ids"]
    assert len(outs["dmtp"]["acceptance_lengths"]) == 2
    # the efficient head over the 6 most frequent supervised ids of some training data, whose counts
    # `train.py token-counts` writes into the drafter directory
    import train
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1, 2, 3, 3, 5, 9, 9, 9, 40, 41, 42, 7],
                                        "loss_mask": [0] * 4 + [1] * 8}) + "\n" for _ in range(3)))
    assert train.main(["token-counts", "--target", mtp_target_dir, "--data", str(data), "--out", draft,
                       "--no-progress"]) == 0
    counts = np.load(os.path.join(draft, "token_counts.npy"))
    assert counts[9] == 9 and counts[3] == 0 and counts.sum() == 24 and (counts > 0).sum() == 6
    assert infer.main(argv + ["--draft", draft, "--draft-head", "efficient", "--draft-head-vocab", "6"]) == 0
    subset = json.loads(path.read_text())       # argv: the dmtp run's, its --json path
    assert subset["output_ids"] == outs["ar"]["output_ids"]
    assert subset["stats"]["draft_head"] == "efficient(rank=8,shortlist=1,vocab=6)"


def test_compare_keeps_expected_mtp_tensors_out_of_the_load_report(mtp_target_dir):
    """transformers lists a target's `mtp.*` tensors as UNEXPECTED (a coloured table on stderr);
    `compare` loads them knowingly, so its load report leaves them out."""
    import logging

    from transformers import AutoModelForCausalLM

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.text = ""

        def emit(self, record):
            self.text += record.getMessage()

    keep, logger = Keep(), logging.getLogger("transformers.modeling_utils")
    logger.addHandler(keep)
    try:
        with compare.mtp_tensors_expected():
            AutoModelForCausalLM.from_pretrained(mtp_target_dir)
        assert "UNEXPECTED" not in keep.text
        AutoModelForCausalLM.from_pretrained(mtp_target_dir)
        assert "UNEXPECTED" in keep.text and "mtp." in keep.text       # what it prints otherwise
    finally:
        logger.removeHandler(keep)
