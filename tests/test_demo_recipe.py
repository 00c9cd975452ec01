"""The demo recipe's MTP-only phase (`train.py distil-mtp`) on a tiny hybrid target: it keeps the
corpus head once, changes only the `mtp.*` tensors of the target, and moves the head toward its
target (KL falls) on text the target wrote."""

import json
import os
import shutil

import numpy as np

from dmtp_jax.checkpoint.safetensors_io import SafetensorsFile


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
