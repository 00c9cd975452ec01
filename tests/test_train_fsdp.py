"""The train step on `fsdp` meshes equals one device, and gathers the drafter's weights (not the
activations) over `fsdp`: `Trainer.compute_shardings`. The head-factor step
(`train.head_factor.FactorDistiller`, scores chunked) on `tensor=2` (the target and the vocabulary
split) and `data=2` (the batch split) equals one device, and its chunked loss equals the unchunked.

Several host devices need `--xla_force_host_platform_device_count` before jax is imported, so the
test runs this file as a script in a subprocess (`python tests/test_train_fsdp.py TARGET DATA`),
which prints JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

MESHES = (None, "fsdp=2")


def _run(target_dir: str, data: str, out: str) -> dict:
    import re

    import jax

    from train_fixtures import tiny_train_config
    from dmtp_jax.train.run import setup

    res = {}
    for mesh in MESHES:
        cfg = tiny_train_config(target_dir, data, os.path.join(out, str(mesh)), batch_size=4, seq_len=32,
                                method="dmtp", mesh=mesh)
        _, params, trainer, batches = setup(cfg)
        state = trainer.init_state(params)
        losses = []
        for _ in range(2):
            batch = batches.next()
            state, m = trainer.step(state, batch)
            losses.append(float(m["loss"]))
        gathered = None
        if trainer.compute_shardings is not None:
            specs = [s.spec for s in jax.tree.leaves(trainer.compute_shardings)]
            assert all("fsdp" not in str(spec) for spec in specs), specs
            hlo = trainer.lower_step(*batch["tokens_bt"].shape).compile().as_text()
            shape = ",".join(str(d) for d in state.params["drafter"]["fc"].shape)
            gathered = bool(re.search(r"= f32\[" + shape + r"\]\{[^}]*\} all-gather\(", hlo))
        res[str(mesh)] = {"losses": losses, "gathered_fc": gathered,
                          "params": [np.asarray(x).ravel()[:64].tolist() for x in jax.tree.leaves(state.params)]}
    return res


FACTOR_RUNS = ((None, 0), (None, 5), ("tensor=2", 5), ("data=2", 5))       # (mesh, ce_chunk)


def _factor_run(target_dir: str) -> dict:
    import jax

    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    from dmtp_jax.checkpoint.draft_head_ckpt import make_efficient_head
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.train.head_factor import FactorDistiller
    from dmtp_jax.train.optim import OptimConfig

    res = {}
    for mesh, chunk in FACTOR_RUNS:
        target = load_target(target_dir, "float32", mesh=make_mesh(mesh))
        mtp = load_mtp(target_dir, target.cfg, "float32", target.mesh)
        tokens_bt = np.random.default_rng(0).integers(0, target.cfg.vocab_size, (2, 17))
        distiller = FactorDistiller(target, mtp, make_efficient_head(target, rank=2, shortlist=8),
                                    OptimConfig(lr=1e-2, total_steps=2, warmup_steps=0), chunk)
        state, metrics = distiller.init_state(0), []
        for _ in range(2):
            state, m = distiller.step(state, {"tokens_bt": tokens_bt})
            metrics.append({k: float(m[k]) for k in ("loss", "kl", "agree", "recall")})
        res[f"{mesh}/{chunk}"] = {"metrics": metrics, "params": [np.asarray(x).ravel()[:64].tolist()
                                                                for x in jax.tree.leaves(state.params)]}
    return res


@pytest.mark.heavy
def test_fsdp_steps_equal_one_device(mtp_target_dir, tmp_path):
    """Two dmtp train steps (drafter + fusion trained, target and MTP frozen) on `fsdp=2` give the
    losses and parameters of one device (fp32), with the drafter's context projection gathered
    whole over fsdp at its use."""
    from train_fixtures import write_random_data
    data = write_random_data(str(tmp_path / "d.jsonl"), n=8, length=32)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), mtp_target_dir, data, str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    one = res["None"]
    assert one["losses"][0] > 0
    for mesh in MESHES[1:]:
        got = res[mesh]
        np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-5, err_msg=mesh)
        for a, b in zip(got["params"], one["params"]):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=mesh)
        assert got["gathered_fc"], mesh
    factor = res["factor"]
    one = factor["None/0"]
    assert one["metrics"][1]["kl"] < one["metrics"][0]["kl"]         # the step trains
    for run in list(factor)[1:]:
        for a, b in zip(factor[run]["metrics"], one["metrics"]):
            for k in a:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=f"{run} {k}")
        for a, b in zip(factor[run]["params"], one["params"]):
            np.testing.assert_allclose(a, b, atol=2e-5, err_msg=run)


if __name__ == "__main__":
    print(json.dumps({**_run(*sys.argv[1:4]), "factor": _factor_run(sys.argv[1])}))
