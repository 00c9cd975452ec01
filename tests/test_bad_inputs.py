"""Every bad input of the table in docs/errors.md: exit status 2, one `error:` line (plus at most one `hint:`
line), nothing on stdout; the cheap ones before any model is loaded. And the other side: an
exception that is not one of our error types keeps its traceback."""

import json
import os
import shutil
import sys

import pytest

import infer
import train
from dmtp_jax.checkpoint.hf import load_target as real_load_target

LOADS_A_MODEL = "loads"       # rows whose error can only come from reading the weights

# (id, argv with {tiny} / {tmp} / {mtp} placeholders, text of the error line, has a hint line, flags)
BAD_INPUTS = [
    ("non-integer prompt id", "infer generate --prompt-ids 1,a",
     "error: argument --prompt-ids: expected comma-separated integers, got '1,a'", True),
    ("unknown flag", "infer generate --bogus", "error: unrecognized arguments: --bogus", True),
    ("bad choice", "infer generate --dtype fp8", "error: argument --dtype: invalid choice: 'fp8'", True),
    ("zero new tokens", "infer generate --target {tiny} --prompt hi --max-new-tokens 0",
     "error: --max-new-tokens must be >= 1, got 0", False),
    ("missing target", "infer generate --target /does-not-exist --prompt hi",
     "error: model directory not found: /does-not-exist", False),
    ("text prompt, no tokenizer", "infer generate --target {tiny} --prompt hi",
     "has no tokenizer; pass --prompt-ids instead of --prompt", False),
    ("id outside the vocabulary", "infer generate --target {tiny} --prompt-ids 1,500",
     "error: prompt 0 has token ids outside the vocabulary [0, 128): [500]", False),
    ("prompt too long", "infer generate --target {tiny} --prompt-ids {long} --max-new-tokens 64",
     "exceeds the model's max_position_embeddings (512)", False),
    ("top-p 0", "infer generate --target {tiny} --prompt-ids 1 --top-p 0", "error: top_p must be in (0, 1], got 0.0",
     False),
    ("negative temperature", "infer generate --target {tiny} --prompt-ids 1 --temperature -1",
     "error: temperature must be a finite number >= 0, got -1.0", False),
    ("batch size 0", "infer generate --target {tiny} --prompt-ids 1 --batch-size 0",
     "error: --batch-size must be >= 1, got 0", False),
    ("mesh too large", "infer generate --target {tiny} --prompt-ids 1 --mesh tensor=64", "needs 64 devices", False),
    ("unknown mesh axis", "infer generate --target {tiny} --prompt-ids 1 --mesh model=2",
     "error: unknown mesh axis 'model'", False),
    ("drafter method, no drafter", "infer generate --target {tiny} --prompt-ids 1 --method dflash",
     "error: method 'dflash' needs a DFlash drafter (--draft DIR)", False),
    ("missing drafter", "infer generate --target {tiny} --prompt-ids 1 --draft /nope",
     "error: drafter directory not found: /nope", False),
    ("MTP method, no MTP head", "infer generate --target {tiny} --prompt-ids 1 --method mtp",
     "has no native MTP head (no 'mtp.*' tensors)", False),
    ("MTP steps 0", "infer generate --target {tiny} --prompt-ids 1 --method mtp --mtp-steps 0",
     "error: --mtp-steps must be in [1, 15], got 0", False),
    ("block size 2", "infer generate --target {tiny} --prompt-ids 1 --block-size 2",
     "error: --block-size must be in [3, 64], got 2", False),
    ("adaptive threshold 1.5", "infer generate --target {tiny} --prompt-ids 1 --adaptive-threshold 1.5",
     "error: --adaptive-threshold must be in [0, 1.01] (1.01: never MTP's T1), got 1.5", False),
    ("drafter's own block size 2", "infer generate --target {tiny} --prompt-ids 1 --draft {tmp}/d2",
     "error: the drafter's block_size (set --block-size) must be in [3, 64], got 2", False),
    ("rounds per dispatch 0", "infer bench --target {tiny} --rounds-per-dispatch 0",
     "error: --rounds-per-dispatch must be an integer >= 1, got 0", False),
    ("prefill chunk 0", "infer generate --target {tiny} --prompt-ids 1 --prefill-chunk 0",
     "error: --prefill-chunk must be an integer >= 1, got 0", False),
    ("draft head rank 0", "infer generate --target {tiny} --prompt-ids 1 --draft-head efficient --draft-head-rank 0",
     "error: --draft-head-rank must be >= 1, got 0", False),
    ("serve: draft head shortlist 0", "infer serve --target {tiny} --draft-head efficient --draft-head-shortlist 0",
     "error: --draft-head-shortlist must be >= 1, got 0", False),
    ("draft head vocab 0", "infer generate --target {tiny} --prompt-ids 1 --draft-head efficient --draft-head-vocab 0",
     "error: --draft-head-vocab must be >= 1, got 0", False),
    ("draft head vocab, full head", "infer bench --target {tiny} --draft-head-vocab 8",
     "error: --draft-head-vocab is an option of --draft-head efficient", False),
    ("missing token counts", "infer generate --target {tiny} --prompt-ids 1 --draft-head efficient "
     "--draft-head-vocab 8 --draft-head-counts {tmp}/none.npy", "error: no token counts at ", True),
    ("plan: draft head vocab 0", "infer plan --target {tiny} --draft-head efficient --draft-head-vocab 0",
     "error: --draft-head-vocab must be >= 1, got 0", False),
    ("serve: no token counts in the directory", "infer serve --target {tiny} --draft-head efficient "
     "--draft-head-vocab 8 --draft-head-counts {tmp}", "/token_counts.npy", True),
    ("draft head factor, full head", "infer generate --target {tiny} --prompt-ids 1 --draft-head-factor {tmp}",
     "error: --draft-head-factor is an option of --draft-head efficient", False),
    ("missing head factor", "infer generate --target {tiny} --prompt-ids 1 --draft-head efficient "
     "--draft-head-factor {tmp}", "error: no trained head factor at ", True),
    ("head factor: missing data", "train head-factor --target {tiny} --data {tmp}/none.jsonl --out {tmp}/hf",
     "error: data file not found: ", False),
    ("head factor: negative chunk", "train head-factor --target {tiny} --data {tmp}/none.jsonl --out {tmp}/hf "
     "--ce-chunk -1", "error: --ce-chunk must be >= 0 (0: no chunking), got -1", False),
    ("head factor: bad mesh", "train head-factor --target {tiny} --data {tmp}/none.jsonl --out {tmp}/hf "
     "--mesh tensor=64", "error: mesh ", False),
    ("token counts: missing data", "train token-counts --target {tiny} --data {tmp}/none.jsonl --out {tmp}/c",
     "error: data file not found: ", False),
    ("truncated weights", "infer generate --target {broken} --prompt-ids 1", "error: ", False, LOADS_A_MODEL),
    ("unknown bench method", "infer bench --target {tiny} --methods ar,nope", "error: unknown method(s) ['nope']",
     False),
    ("bad workload line", "infer bench --target {tiny} --workload {tmp}/bad.jsonl",
     "bad.jsonl:2: not valid JSON", False),
    ("named workload, empty data dir", "infer bench --target {tiny} --workload gsm8k --data-dir {tmp}",
     "/gsm8k/test.jsonl, which does not exist (--data-dir is ", True),
    ("compare: missing target", "infer compare --target /does-not-exist",
     "error: model directory not found: /does-not-exist", False),
    ("train: data with no valid record", "train train --target {tiny} --data {tmp}/garbage.jsonl --out {tmp}/r",
     "garbage.jsonl: none of its 3 records is valid (record 1: bad JSON", True),
    ("train: missing data", "train train --target {tiny} --data {tmp}/none.jsonl --out {tmp}/r",
     "error: data file not found: ", False),
    ("train: steps 0", "train train --target {tiny} --data {tmp}/garbage.jsonl --out {tmp}/r --steps 0",
     "error: --steps must be >= 1, got 0", False),
    ("train: missing config", "train train --config {tmp}/none.py", "error: config file not found: ", False),
    ("train: run already there", "train train --target {tiny} --data {tmp}/ok.jsonl --out {tmp}/done",
     "already has checkpoints; pass --resume to continue or use a new --out", False),
    ("train: block size 2", "train train --target {tiny} --data {tmp}/ok.jsonl --out {tmp}/r --block-size 2",
     "error: --block-size must be in [3, 64], got 2", False),
    ("train: max-nonfinite 0", "train train --target {tiny} --data {tmp}/ok.jsonl --out {tmp}/r --max-nonfinite 0",
     "error: --max-nonfinite must be >= 1, got 0", False),
    ("export: not a run", "train export --run {tmp} --out {tmp}/x", "is not a training run directory", False),
    ("regen: missing data", "train regen --target {tiny} --data {tmp}/none.jsonl --out {tmp}/o.jsonl",
     "error: data file not found: ", False),
    ("regen: no valid prompt", "train regen --target {tiny} --data {tmp}/garbage.jsonl --out {tmp}/o.jsonl",
     "garbage.jsonl: none of its 3 records is a valid prompt (record 1: bad JSON", False, LOADS_A_MODEL),
]


@pytest.fixture(scope="module")
def places(tiny_qwen3_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "bad.jsonl").write_text('{"prompt_ids": [1]}\n{"prompt_ids": [1\n')
    (tmp / "garbage.jsonl").write_text('garbage\n{"foo": 1}\n[1, 2]\n')
    (tmp / "ok.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    (tmp / "done" / "checkpoints" / "4").mkdir(parents=True)
    (tmp / "d2").mkdir()
    (tmp / "d2" / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "head_dim": 16, "vocab_size": 320,
        "dflash_config": {"block_size": 2, "mask_token_id": 3, "target_layer_ids": [0]}}))
    broken = tmp / "broken"
    shutil.copytree(tiny_qwen3_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    return {"tiny": tiny_qwen3_dir, "tmp": str(tmp), "broken": str(broken), "long": ",".join(["1"] * 500)}


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[r[0] for r in BAD_INPUTS])
def test_bad_input_is_one_error_line(row, places, capsys, monkeypatch):
    _, command, text, has_hint, *flags = row

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")
    if LOADS_A_MODEL not in flags:
        monkeypatch.setattr("dmtp_jax.checkpoint.hf.load_target", no_load)
    tool, *argv = command.format(**places).split()
    try:
        rc = {"infer": infer.main, "train": train.main}[tool](argv)
    except SystemExit as e:            # argparse
        rc = e.code
    finally:    # a module the command imported meanwhile bound the guard by name: give it the real loader
        for module in list(sys.modules.values()):
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is no_load:
                    setattr(module, name, real_load_target)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and captured.out == ""
    assert lines[0].startswith("error: ") and text in lines[0], captured.err
    assert len(lines) == (2 if has_hint else 1) and (not has_hint or lines[1].startswith("hint: ")), captured.err


def test_an_internal_error_keeps_its_traceback(tiny_qwen3_dir, monkeypatch):
    def bug(*args, **kwargs):
        raise ValueError("an internal bug, not bad input")
    monkeypatch.setattr("dmtp_jax.decode.loading.make_decoders", bug)
    with pytest.raises(ValueError, match="internal bug"):
        infer.main(["generate", "--target", tiny_qwen3_dir, "--prompt-ids", "1", "--max-new-tokens", "2"])


def test_demo_argv_runs_the_demo_with_overrides():
    assert infer.demo_argv([]) == infer.DEMO_BENCH_ARGV
    assert infer.demo_argv(["--num-prompts", "2"]) == [*infer.DEMO_BENCH_ARGV, "--num-prompts", "2"]
    assert infer.demo_argv(["--help"]) is None and infer.demo_argv(["bench"]) is None
    assert os.path.basename(infer.DEMO_BENCH_ARGV[infer.DEMO_BENCH_ARGV.index("--plot") + 1]) == "acceptance.png"


@pytest.mark.parametrize("block_size", [2, 3, 64, 65])
def test_preflight_decoder_and_trainer_accept_the_same_block_sizes(block_size):
    """One rule (`dmtp_jax/options.py`): what preflight accepts, the decoder and the trainer accept."""
    from dmtp_jax import options, preflight
    from dmtp_jax.errors import UserError
    from dmtp_jax.train.config import TrainConfig

    def accepted(check):
        try:
            check()
            return True
        except UserError:
            return False

    cfg = TrainConfig(target="t", data="d", out="o", block_size=block_size, seq_len=128)
    verdicts = {accepted(lambda: preflight.check_decode_options(None, block_size, 8)),
                accepted(lambda: options.verify_slots("dflash", mtp_steps=4, block_size=block_size,
                                                      drafter_block_size=16)),
                accepted(cfg.validate)}
    assert verdicts == {3 <= block_size <= 64}


@pytest.mark.parametrize("threshold", [-0.1, 0.0, 1.0, 1.01, 1.5])
def test_preflight_and_decoder_accept_the_same_adaptive_thresholds(threshold):
    """Calibration's "never MTP's T1" (`train.calibrate.GRID`'s 1.01) passes preflight and the decoder."""
    from dmtp_jax import options, preflight
    from dmtp_jax.decode.batch import RequestError
    ok = 0.0 <= threshold <= options.NEVER_MTP_THRESHOLD
    for check in (lambda: preflight.check_decode_options(None, None, 8, adaptive_threshold=threshold),
                  lambda: options.adaptive_threshold_for("dmtp-adaptive", None, threshold)):
        if ok:
            check()
        else:
            with pytest.raises(RequestError, match="--adaptive-threshold must be in"):
                check()
