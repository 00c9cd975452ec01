"""The demo recipe's MTP-only phase (`train.py distil-mtp`) on a tiny hybrid target: it keeps the
corpus head once, changes only the `mtp.*` tensors of the target, and moves the head toward its
target (KL falls) on text the target wrote."""

import json
import os
import shutil

import numpy as np
import pytest

from dmtp_jax.checkpoint.safetensors_io import SafetensorsFile
from train_fixtures import sigterm_on_call


def test_distil_mtp_replaces_only_the_head_and_keeps_the_corpus_head(tiny_qwen3_5_dir, tmp_path):
    from dmtp_jax.demo.distil import DistilConfig, run_distil

    target = str(tmp_path / "target")
    shutil.copytree(tiny_qwen3_5_dir, target)
    before = SafetensorsFile(os.path.join(target, "model.safetensors"))
    old = {k: np.array(before.array(k)) for k in before.keys()}
    rng = np.random.default_rng(0)
    data = tmp_path / "regen.jsonl"
    with open(data, "w") as fh:
        for _ in range(12):
            fh.write(json.dumps({"input_ids": rng.integers(1, 120, size=40).tolist()}) + "\n")
    cfg = DistilConfig(target=target, data=str(data), corpus_head_dir=str(tmp_path / "corpus"), val_tokens="",
                       run_dir=str(tmp_path / "run"), seq_len=32, batch_size=4, steps=6, lr=1e-2, warmup_steps=1,
                       checkpoint_every=3, progress=False)
    summary = run_distil(cfg)
    after = SafetensorsFile(os.path.join(target, "model.safetensors"))
    corpus = SafetensorsFile(os.path.join(cfg.corpus_head_dir, "model.safetensors"))
    assert set(after.keys()) == set(old)
    for k in old:
        if k.startswith("mtp."):
            assert np.array_equal(np.array(corpus.array(k)).astype(np.float32), old[k].astype(np.float32)), k
        else:
            assert np.array_equal(np.array(after.array(k)), old[k]), k      # the target itself: byte for byte
    assert any(not np.array_equal(np.array(after.array(k)), old[k]) for k in old if k.startswith("mtp."))
    with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as fh:
        kl = [json.loads(line)["kl"] for line in fh]
    assert summary["steps"] == 6 and len(kl) == 6 and kl[-1] < kl[0]


def tiny_pretrain_config(work_dir: str, **overrides):
    """A seconds-long demo pretraining recipe: 60 kB of stdlib, a 300-token BPE, a 2-layer target."""
    from dmtp_jax.demo.build import PretrainConfig
    base = dict(work_dir=work_dir, export_dir=os.path.join(work_dir, "target"),
                bench_prompts=os.path.join(work_dir, "prompts.jsonl"), corpus_bytes=60_000, vocab_size=300,
                num_bench_prompts=2, num_drafter_prompts=8, num_calibration_prompts=4, num_mtp_prompts=4,
                drafter_prompt_tokens=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                seq_len=32, batch_size=2, steps=6, warmup_steps=1, checkpoint_every=2, eval_batches=1,
                progress=False)
    base.update(overrides)
    return PretrainConfig(**base)


@pytest.mark.heavy
def test_pretrain_stops_on_sigterm_survives_a_cut_metrics_line_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Demo pretraining runs in the drafter's loop: SIGTERM checkpoints and stops (nothing
    exported); a metrics line cut off by a kill is dropped on `--resume`; the resumed run logs
    every step once, with the losses and the exported weights of an uninterrupted run."""
    from dmtp_jax.train.window import WindowBatches
    from dmtp_jax.demo.build import run_pretrain
    from dmtp_jax.train.checkpoints import checkpoint_manager

    straight = run_pretrain(tiny_pretrain_config(str(tmp_path / "a")))
    assert straight["steps"] == 6 and straight["compile_count"] == 1
    shutil.copytree(tmp_path / "a" / "data", tmp_path / "b" / "data")      # the same corpus and tokenizer
    real_next = sigterm_on_call(monkeypatch, WindowBatches, 3)   # preempted while step 3's batch is read
    b = tmp_path / "b"
    stopped = run_pretrain(tiny_pretrain_config(str(b)))
    assert (stopped["stopped_by"], stopped["exit_status"], stopped["last_checkpoint"]) == ("SIGTERM", 143, 3)
    assert checkpoint_manager(str(b / "target_run"), 2).all_steps() == [2, 3]
    assert not (b / "target").exists() and not (b / "target_run" / "summary.json").exists()
    monkeypatch.setattr(WindowBatches, "next", real_next)
    with open(b / "target_run" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "lo')                                         # a kill cut this line off
    resumed = run_pretrain(tiny_pretrain_config(str(b), resume=True))
    assert resumed["start_step"] == 3 and resumed["steps"] == 6

    def metrics(run):
        with open(run / "target_run" / "metrics.jsonl") as fh:
            return [(r["step"], r["loss"], r["mtp_ce"]) for r in map(json.loads, fh)]
    assert [s for s, _, _ in metrics(b)] == list(range(1, 7))
    assert metrics(b) == metrics(tmp_path / "a")
    with open(tmp_path / "a" / "target" / "model.safetensors", "rb") as fa, \
            open(b / "target" / "model.safetensors", "rb") as fb:
        assert fa.read() == fb.read()
