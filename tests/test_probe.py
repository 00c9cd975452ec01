"""The exactness probe (`decode/probe.py`): a verify block equals single-token decoding in fp32 on
CPU; an injected mismatch declines to plain decoding (warned once, in the stats) and fails under
`strict` (one error line from the CLI); DMTP_JAX_ALLOW_INEXACT=1 engages anyway."""

import json
import logging

import numpy as np
import pytest

import infer
from dmtp_jax.decode import make_decoder, probe
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.errors import InexactBackendError

PROMPTS = [[1, 2, 3], [7, 8]]


@pytest.fixture
def fresh_probe(monkeypatch):
    """No verdict carried over from another test; chain_and_block's block argmax flipped at
    (input 1, position 2) when `flip` is set."""
    monkeypatch.setattr(probe, "_MEMO", {})
    monkeypatch.setattr(probe, "_WARNED", set())
    real = probe.chain_and_block
    state = {"flip": False}

    def maybe_flipped(target, prompts, width):
        chain, block = real(target, prompts, width)
        if state["flip"]:
            block = block.copy()
            block[1, 2] = (block[1, 2] + 1) % target.cfg.vocab_size
        return chain, block

    monkeypatch.setattr(probe, "chain_and_block", maybe_flipped)
    return state


@pytest.fixture(scope="module")
def mtp_models(mtp_target_dir):
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    target = load_target(mtp_target_dir)
    return target, load_mtp(mtp_target_dir, target.cfg)


def test_compare_block_to_chain_checks_every_position():
    chain = np.array([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert probe.compare_block_to_chain(chain, np.array([[6, 7, 8], [2, 3, 4]])) == (0, None)
    assert probe.compare_block_to_chain(chain, np.array([[6, 7, 0], [9, 3, 4]])) == (2, (0, 2))


def test_verify_block_equals_single_token_decoding_in_fp32(tiny_qwen3_dir, fresh_probe):
    from dmtp_jax.checkpoint.hf import load_target
    target = load_target(tiny_qwen3_dir)
    result = probe.run_probe(target, width=8)
    assert (result.exact, result.mismatches, result.positions) == (True, 0, 24)
    assert (result.backend, result.dtype, result.width) == ("cpu", "float32", 8)
    chain, _ = probe.chain_and_block(target, probe.probe_prompts(128), 8)
    assert chain.tolist() == ARDecoder(target).generate(probe.probe_prompts(128), 9, stop_ids=[]).output_ids


def test_decide_follows_the_verdict():
    exact = probe.ProbeResult(True, 8, 3, 8, 24, 0, None, "cpu", "float32", 0.0)
    inexact = probe.ProbeResult(False, 8, 3, 8, 24, 2, (0, 5), "tpu", "bfloat16", 0.0)
    assert probe.decide(exact, strict=True, allow_inexact=False) == (True, "speculative")
    assert probe.decide(inexact, strict=False, allow_inexact=False) == (False, "plain")
    assert probe.decide(inexact, strict=False, allow_inexact=True) == (True, "speculative (inexact allowed)")
    with pytest.raises(InexactBackendError, match="at 2 of 24 positions .* on tpu in bfloat16"):
        probe.decide(inexact, strict=True, allow_inexact=True)


def test_mismatch_declines_to_plain_decoding_warns_once_and_strict_fails(mtp_models, fresh_probe, caplog):
    target, mtp = mtp_models
    want = ARDecoder(target).generate(PROMPTS, 6).output_ids
    fresh_probe["flip"] = True
    caplog.set_level(logging.WARNING, logger="dmtp_jax.decode.probe")
    decoder = make_decoder("mtp", target, mtp=mtp)
    first, second = decoder.generate(PROMPTS, 6), decoder.generate(PROMPTS, 6)
    assert first.output_ids == second.output_ids == want
    stats = first.stats
    assert (stats["method"], stats["declined_method"]) == ("ar", "mtp")
    assert "acceptance_lengths" not in stats
    assert stats["exactness_probe"]["decision"] == "plain"
    assert (stats["exactness_probe"]["mismatches"], stats["exactness_probe"]["first_mismatch"]) == (1, [1, 2])
    with pytest.raises(InexactBackendError, match="differs from single-token decoding at 1 of 15 positions"):
        make_decoder("mtp", target, mtp=mtp, strict=True).generate(PROMPTS, 6)
    assert caplog.text.count("exactness probe:") == 1          # warned once per (target, width)
    assert decoder.last_state is None                          # the speculative round never ran
    assert decoder.compile_counts()["round"] <= 1              # (compiled ahead while the probe ran)


def test_strict_cli_is_one_error_line_and_json_has_the_probe(mtp_target_dir, fresh_probe, tmp_path, capsys):
    out = tmp_path / "gen.json"
    argv = ["generate", "--target", mtp_target_dir, "--method", "mtp", "--prompt-ids", "1,2,3",
            "--max-new-tokens", "4"]
    assert infer.main([*argv, "--json", str(out)]) == 0
    stats = json.loads(out.read_text())["stats"]
    assert stats["exactness_probe"]["exact"] is True and stats["exactness_probe"]["decision"] == "speculative"
    assert stats["method"] == "mtp" and stats["compiles"]["round"] == 1
    capsys.readouterr()
    fresh_probe["flip"] = True
    probe._MEMO.clear()
    assert infer.main([*argv, "--strict"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 2
    assert lines[0].startswith("error: exactness probe: a 5-token verify block differs")
    assert lines[1].startswith("hint: ")
