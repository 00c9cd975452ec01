"""Two JAX processes on localhost CPU (gloo collectives, `--mesh data=2`) give the same losses as
one process on the same global batch. Subprocesses run `train.py train`; XLA's backend
optimisation is turned down in them to keep the compiles short on a 2-core machine."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from train_fixtures import LAYER_IDS, MASK_TOKEN_ID, write_random_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _cmd(target, data, out, extra=()):
    return [sys.executable, os.path.join(REPO, "train.py"), "train", "--target", target, "--data", data,
            "--out", out, "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--draft-layers", "1",
            "--block-size", "8", "--num-anchors", "4", "--compute-dtype", "float32", "--lr", "3e-3",
            "--mask-token-id", str(MASK_TOKEN_ID), "--target-layer-ids", ",".join(map(str, LAYER_IDS)),
            "--checkpoint-every", "2", "--no-progress", *extra]


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh]


@pytest.mark.heavy   # ~75 s on 2 cores: three JAX processes compile the step concurrently
def test_two_processes_match_one(tiny_qwen3_dir, tmp_path):
    data = write_random_data(str(tmp_path / "d.jsonl"), n=8, length=32)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    port = _free_port()
    procs = [subprocess.Popen(_cmd(tiny_qwen3_dir, data, str(tmp_path / "two"),
                                   ["--mesh", "data=2", "--coordinator", f"localhost:{port}",
                                    "--num-processes", "2", "--process-id", str(i)]),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    one = subprocess.run(_cmd(tiny_qwen3_dir, data, str(tmp_path / "one")), env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 4
    np.testing.assert_allclose(a, b, rtol=2e-5)
    assert os.path.isdir(tmp_path / "two" / "checkpoints" / "4")     # both processes saved together
