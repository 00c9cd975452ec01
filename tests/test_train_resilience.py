"""Training under interference (`train/resilience.py`, `train/loop.py`): SIGTERM / SIGINT, a
checkpoint cut off mid-write or corrupt, non-finite losses, a full disk, malformed data; and the
metrics file holding every step exactly once. Fast tests inject the faults in process; the slow
ones send real signals to `train.py` and SIGKILL it while it saves."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train_fixtures import sigterm_on_call, tiny_train_config, write_random_data

HERE = os.path.dirname(os.path.abspath(__file__))
POISON = 119          # a batch whose first token is POISON gets a NaN loss (see `poisoned_loss`)


def metric_steps(run_dir) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line)["step"] for line in fh]


def metric_losses(run_dir) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh]


@pytest.fixture
def poisoned_loss(monkeypatch):
    """The train step's loss is NaN for micro-batches whose first token is POISON."""
    from dmtp_jax.train import step as step_mod
    real = step_mod.loss_sums

    def loss_sums(params, graphdefs, tgd, ts, mgd, ms, tokens_bt, *rest):
        num, sums = real(params, graphdefs, tgd, ts, mgd, ms, tokens_bt, *rest)
        scale = jnp.where(tokens_bt[0, 0] == POISON, jnp.nan, 1.0)
        return num * scale, {**sums, "loss_sum": sums["loss_sum"] * scale}

    monkeypatch.setattr(step_mod, "loss_sums", loss_sums)


# ---- pure pieces -------------------------------------------------------------------------------
def test_truncate_metrics_keeps_each_step_once_and_drops_a_cut_line(tmp_path):
    from dmtp_jax.train.resilience import truncate_metrics
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": s / 10}) for s in (1, 2, 3, 4, 3, 4, 5)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "lo')          # a kill cut the last line
    truncate_metrics(str(path), 4)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_disk_full_is_recognised_in_every_form():
    from dmtp_jax.train.resilience import disk_full
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    wrapped = ValueError("RESOURCE_EXHAUSTED: Failed to write 172143 bytes to file 4 [os_error_code='28']")
    assert disk_full(wrapped)
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as chained:
        assert disk_full(chained)
    assert not disk_full(OSError(errno.EACCES, "Permission denied")) and not disk_full(ValueError("boom"))


def test_nonfinite_guard_stops_after_the_limit_in_a_row():
    from dmtp_jax.train.resilience import NonFiniteGuard
    guard = NonFiniteGuard(limit=3)
    stops = [guard.update(s, finite) for s, finite in enumerate([0, 0, 1, 0, 0, 0], start=1)]
    assert stops == [False, False, False, False, False, True]
    assert (guard.total, guard.streak, guard.first_of_streak) == (5, 3, 4)
    assert "not finite for 3 steps in a row (steps 4-6, 5 in all)" in str(guard.error(6))


def test_restore_falls_back_to_the_newest_good_checkpoint():
    from dmtp_jax.checkpoint.safetensors_io import CheckpointError
    from dmtp_jax.train.resilience import restore_latest_good

    def restore(step):
        if step > 4:
            raise ValueError(f"checkpoint {step} is truncated")
        return f"state{step}"

    moved = []
    assert restore_latest_good([2, 4, 6, 8], restore, moved.append) == (4, "state4")
    assert moved == [8, 6]
    moved.clear()
    with pytest.raises(CheckpointError, match="checkpoint 8: ValueError"):
        restore_latest_good([6, 8], restore, moved.append)
    assert moved == []          # nothing restorable (e.g. a config change): nothing is moved


def test_malformed_records_count_once_and_a_file_of_garbage_is_an_error(tmp_path):
    from dmtp_jax.errors import DataError
    from dmtp_jax.train.data import BatchIterator, TokenDataset
    ds = TokenDataset.from_records(['{"input_ids": [1, 2]}', "garbage", '{"input_ids": [3]}'], 4)
    it = BatchIterator(ds, 4, (0, 4))
    per_step = [it.next()["malformed"] for _ in range(3)]     # 3 records, 4 rows a batch: one repeats
    assert sum(per_step) > 3 and ds.malformed == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('garbage\n{"foo": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"none of its 3 records is valid \(record 1: bad JSON"):
        TokenDataset.from_file(str(bad), 8)


# ---- the run -----------------------------------------------------------------------------------
def test_sigterm_checkpoints_and_resume_logs_every_step_once(tiny_qwen3_dir, tmp_path, monkeypatch):
    from dmtp_jax.train import data as data_mod
    from dmtp_jax.train.checkpoints import checkpoint_manager
    from dmtp_jax.train.run import run_training
    data = write_random_data(str(tmp_path / "d.jsonl"), n=12, length=48)
    common = dict(steps=8, batch_size=4, seq_len=48, checkpoint_every=3)
    real_next = sigterm_on_call(monkeypatch, data_mod.BatchIterator, 5)   # preempted while step 5's batch is read
    run = str(tmp_path / "run")
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    first = run_training(tiny_train_config(tiny_qwen3_dir, data, run, **common))
    assert (first["stopped_by"], first["exit_status"], first["last_checkpoint"]) == ("SIGTERM", 143, 5)
    assert metric_steps(run) == [1, 2, 3, 4, 5]
    assert checkpoint_manager(run, 3).all_steps() == [3, 5]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers   # restored
    monkeypatch.setattr(data_mod.BatchIterator, "next", real_next)
    second = run_training(tiny_train_config(tiny_qwen3_dir, data, run, resume=True, **common))
    assert (second["start_step"], second["steps_run"], second["stopped_by"]) == (5, 3, None)
    assert metric_steps(run) == list(range(1, 9))
    assert metric_losses(run) == first["losses"] + second["losses"]


def test_cut_off_and_corrupt_checkpoints_fall_back_with_a_warning(tiny_qwen3_dir, tmp_path, caplog):
    from dmtp_jax.train.checkpoints import checkpoint_manager, save_checkpoint
    from dmtp_jax.train.loop import resume_or_init
    from dmtp_jax.train.run import setup
    data = write_random_data(str(tmp_path / "d.jsonl"), n=8, length=48)
    run = tmp_path / "run"
    cfg = tiny_train_config(tiny_qwen3_dir, data, str(run), steps=8, batch_size=4, seq_len=48, resume=True,
                            keep_checkpoints=5)
    target, params, trainer, batches = setup(cfg)
    state = trainer.init_state(params)
    mngr = checkpoint_manager(str(run), 5)
    for step in (2, 4):
        save_checkpoint(mngr, state, {"step": step, "data": batches.get_state()})
        mngr.wait_until_finished()
    mngr.close()
    for root, _, files in os.walk(run / "checkpoints" / "4" / "params"):      # 4: truncated files
        for name in files:
            open(os.path.join(root, name), "w").close()
    (run / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()                 # 6: a save cut off by a kill
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)))
    caplog.set_level(logging.WARNING)
    mngr, restored, meta = resume_or_init(cfg.run_options(), trainer, params, batches)
    mngr.close()
    assert meta["step"] == 2 and int(restored.step) == 0
    assert "checkpoint 6 was cut off mid-write" in caplog.text
    assert "checkpoint 4 is incomplete or corrupt; using checkpoint 2" in caplog.text
    assert sorted(os.listdir(run / "checkpoints")) == ["2"]
    assert [p.split("-")[0] for p in os.listdir(run / "corrupt_checkpoints")] == ["4"]
    assert metric_steps(run) == [1, 2]


def test_full_disk_is_one_clear_error_and_keeps_the_previous_checkpoint(tiny_qwen3_dir, tmp_path, monkeypatch):
    from dmtp_jax.errors import TrainingStopped, format_user_error
    from dmtp_jax.train import loop
    from dmtp_jax.train.checkpoints import checkpoint_manager
    from dmtp_jax.train.run import run_training
    data = write_random_data(str(tmp_path / "d.jsonl"), n=8, length=48)
    real_save, saves = loop.save_checkpoint, []

    def save_until_full(mngr, state, meta):
        saves.append(meta["step"])
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(mngr, state, meta)

    monkeypatch.setattr(loop, "save_checkpoint", save_until_full)
    run = str(tmp_path / "run")
    with pytest.raises(TrainingStopped) as err:
        run_training(tiny_train_config(tiny_qwen3_dir, data, run, steps=6, batch_size=4, seq_len=48,
                                       checkpoint_every=2))
    lines = format_user_error(err.value).splitlines()
    assert lines[0] == "error: could not write checkpoint 4: no space left on device; checkpoint 2 is intact"
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert checkpoint_manager(run, 3).all_steps() == [2] and metric_steps(run) == [1, 2, 3, 4]


def test_nonfinite_losses_skip_their_updates_and_stop_the_run(tiny_qwen3_dir, tmp_path, poisoned_loss):
    """Every batch's loss is NaN: each update is skipped (checkpoint 3 holds exactly the initial
    params and optimizer state, at step 3), and the run stops after 3 in a row."""
    from dmtp_jax.errors import TrainingStopped
    from dmtp_jax.train.checkpoints import checkpoint_manager, restore_checkpoint
    from dmtp_jax.train.run import run_training, setup
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [POISON] + [5] * 47}) + "\n" for _ in range(8)))
    run = str(tmp_path / "run")
    cfg = tiny_train_config(tiny_qwen3_dir, str(path), run, steps=10, batch_size=4, seq_len=48, max_nonfinite=3)
    with pytest.raises(TrainingStopped, match=r"not finite for 3 steps in a row \(steps 1-3, 3 in all\).*"
                                              r"checkpoint 3 holds the last finite weights"):
        run_training(cfg)
    with open(os.path.join(run, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    assert [(r["step"], r["loss"], r["nonfinite"]) for r in recs] == [(1, None, 1), (2, None, 1), (3, None, 1)]
    _, params, trainer, _ = setup(cfg)
    initial = jax.device_get(trainer.init_state(params))
    saved, meta = restore_checkpoint(checkpoint_manager(run, 3), trainer, 3)
    assert meta["nonfinite"] == {"total": 3, "streak": 3, "first_of_streak": 1} and int(saved.step) == 3
    for a, b in zip(jax.tree.leaves((initial.params, initial.opt_state)),
                    jax.tree.leaves(jax.device_get((saved.params, saved.opt_state)))):
        np.testing.assert_array_equal(a, b)


# ---- real signals and kills (slow) -------------------------------------------------------------
TRAIN_FLAGS = ["--batch-size", "4", "--seq-len", "48", "--draft-layers", "1", "--block-size", "8",
               "--num-anchors", "8", "--lr", "3e-3", "--warmup-steps", "5", "--compute-dtype", "float32",
               "--mask-token-id", "120", "--target-layer-ids", "0,1", "--keep-checkpoints", "2", "--no-progress"]


def train_cli(target, data, out, steps, every, *extra):
    return [sys.executable, os.path.join(os.path.dirname(HERE), "train.py"), "train", "--target", target,
            "--data", data, "--out", out, "--steps", str(steps), "--checkpoint-every", str(every),
            *TRAIN_FLAGS, *extra]


def wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def lines_in(path) -> int:
    return sum(1 for _ in open(path)) if os.path.isfile(path) else 0


@pytest.mark.heavy
def test_signals_stop_cleanly_and_a_sigkill_mid_save_resumes_from_a_complete_checkpoint(tiny_qwen3_dir, tmp_path):
    """One run, interrupted four times, then finished; it equals an uninterrupted run step for step.
    SIGTERM, then SIGINT: each stops cleanly (exit 143 / 130, one line, no traceback) after a final
    checkpoint, and the metrics hold each step once. Then SIGKILL as soon as a save's temporary
    directory appears (a checkpoint cut off mid-write), twice: each resume warns and starts at the
    last complete checkpoint, so a kill loses only the steps after it."""
    from dmtp_jax.train.run import run_training
    data = write_random_data(str(tmp_path / "d.jsonl"), n=12, length=48)
    steps = 32
    # the uninterrupted reference saves once: saving never changes a loss (what the test asserts)
    straight = run_training(tiny_train_config(tiny_qwen3_dir, data, str(tmp_path / "a"), steps=steps,
                                              batch_size=4, seq_len=48, checkpoint_every=steps))
    run = str(tmp_path / "b")
    metrics, ckpts = os.path.join(run, "metrics.jsonl"), os.path.join(run, "checkpoints")

    def start():
        return subprocess.Popen(train_cli(tiny_qwen3_dir, data, run, steps, 1, *(["--resume"] * os.path.isdir(run))),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    for sig, status, after in ((signal.SIGTERM, 143, 5), (signal.SIGINT, 130, 10)):
        proc = start()
        assert wait_for(lambda: lines_in(metrics) >= after, proc), "the run ended before the signal"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == status, err
        assert f"training stopped by {sig.name}" in err and "Traceback" not in err
        assert json.loads(out.strip().splitlines()[-1])["stopped_by"] == sig.name
        last = json.loads(out.strip().splitlines()[-1])["last_checkpoint"]
        assert metric_steps(run) == list(range(1, last + 1))
    for _ in range(2):
        done_before = max(int(n) for n in os.listdir(ckpts) if n.isdigit())
        proc = start()

        def saving_a_later_step():
            return any(".orbax-checkpoint-tmp" in n and int(n.split(".")[0]) > done_before + 2
                       for n in os.listdir(ckpts))

        assert wait_for(saving_a_later_step, proc, timeout=300), "no save to interrupt"
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(ckpts))       # the last kill cut a save
    last_complete = max(int(n) for n in os.listdir(ckpts) if n.isdigit())
    assert 0 < last_complete < steps
    final = subprocess.run(train_cli(tiny_qwen3_dir, data, run, steps, 1, "--resume"), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert "cut off mid-write" in final.stderr
    assert json.loads(final.stdout.strip().splitlines()[-1])["start_step"] == last_complete
    assert metric_steps(run) == list(range(1, steps + 1))
    assert metric_losses(run) == straight["losses"]
