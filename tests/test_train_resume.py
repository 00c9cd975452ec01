"""Resume equality: 2k steps straight == k steps, checkpoint (orbax: params, optimizer, step, data
iterator), restore, k more -- the same loss sequence bit for bit. The fast test drives one
`Trainer` (one compile); the slow one runs `run_training` three times (`--stop-at` then `--resume`).
A SIGKILL mid-run (resume from the last complete checkpoint, the same losses) is
`test_train_resilience.py::test_signals_stop_cleanly_and_a_sigkill_mid_save_resumes_from_a_complete_checkpoint`."""

import json

import jax
import numpy as np
import pytest

from train_fixtures import tiny_train_config, write_random_data


@pytest.mark.parametrize("method,target_fixture", [("dflash", "tiny_qwen3_dir"), ("dmtp", "mtp_target_dir")])
def test_checkpoint_roundtrip_resumes_bit_for_bit(method, target_fixture, request, tmp_path):
    from dmtp_jax.train.checkpoints import checkpoint_manager, restore_checkpoint, save_checkpoint
    from dmtp_jax.train.run import setup
    data = write_random_data(str(tmp_path / "d.jsonl"), n=10, length=48)
    cfg = tiny_train_config(request.getfixturevalue(target_fixture), data, str(tmp_path / "run"), steps=8,
                            batch_size=4, seq_len=48, method=method)
    target, params, trainer, batches = setup(cfg)

    def run(state, n):
        losses = []
        for _ in range(n):
            state, m = trainer.step(state, batches.next())
            losses.append(float(m["loss"]))
        return state, losses

    data0 = batches.get_state()
    _, straight = run(trainer.init_state(params), 6)
    batches.set_state(data0)
    state, first = run(trainer.init_state(params), 3)
    mngr = checkpoint_manager(cfg.out, 2)
    save_checkpoint(mngr, state, {"step": 3, "data": batches.get_state()})
    mngr.wait_until_finished()
    batches.next()                       # move the iterator on: the restore must bring it back
    restored, meta = restore_checkpoint(checkpoint_manager(cfg.out, 2), trainer)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batches.set_state(meta["data"])
    assert meta["step"] == 3 and int(restored.step) == 3
    _, second = run(restored, 3)
    assert straight == first + second    # exact
    assert trainer.compile_count() == 1


@pytest.mark.heavy
def test_run_training_stop_and_resume(tiny_qwen3_dir, tmp_path):
    from dmtp_jax.train.run import run_training
    data = write_random_data(str(tmp_path / "d.jsonl"), n=12, length=48)
    common = dict(steps=8, batch_size=4, seq_len=48, checkpoint_every=3)
    straight = run_training(tiny_train_config(tiny_qwen3_dir, data, str(tmp_path / "a"), **common))
    first = run_training(tiny_train_config(tiny_qwen3_dir, data, str(tmp_path / "b"), stop_at=4, **common))
    assert first["steps_run"] == 4 and first["last_checkpoint"] == 4
    second = run_training(tiny_train_config(tiny_qwen3_dir, data, str(tmp_path / "b"), resume=True, **common))
    assert second["start_step"] == 4 and second["steps_run"] == 4
    assert straight["losses"] == first["losses"] + second["losses"]
    with open(tmp_path / "a" / "metrics.jsonl") as fa, open(tmp_path / "b" / "metrics.jsonl") as fb:
        assert [json.loads(x)["loss"] for x in fa] == [json.loads(x)["loss"] for x in fb]
    with pytest.raises(ValueError, match="--resume"):      # an existing run is never overwritten
        run_training(tiny_train_config(tiny_qwen3_dir, data, str(tmp_path / "a"), **common))
