"""The one training loop (`run_loop`): orbax checkpoints, metrics, progress bar and resilience, for
every trainer (the drafter's `train.step.Trainer`, the demo's `Pretrainer` / `MtpDistiller`, the
drafting head's factor).

Run directory (`--out DIR`): `run_config.json` (what `export` needs); `checkpoints/<step>/`
(orbax: `params` fp32, `opt`, `meta`: step, data iterator state, non-finite counts; every
`checkpoint_every` steps and at exit, async and atomic); `metrics.jsonl` (one line per step,
written before that step's checkpoint, so every step appears once after `--resume`). A resumed
run's losses equal an uninterrupted run's bit for bit. Interruptions: `resilience.py`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Protocol

import jax
import numpy as np
from tqdm.auto import tqdm

from dmtp_jax.errors import InputError
from dmtp_jax.train import resilience
from dmtp_jax.train.checkpoints import checkpoint_manager, latest_complete, restore_checkpoint, save_checkpoint
from dmtp_jax.train.metrics import TensorboardLog, step_record

log = logging.getLogger(__name__)
RUN_CONFIG = "run_config.json"


class TrainerInterface(Protocol):
    """What `run_loop` needs of a trainer (`train.step.Trainer`, `train.window.WindowTrainer`)."""
    BAR: dict                                    # progress-bar label -> metrics-line field

    def init_state(self, start): ...             # step 0 from `start` (the drafter's params, a seed)
    def abstract_state(self): ...                # ShapeDtypeStructs of the state (checkpoint restores)
    def step(self, state, batch: dict): ...      # -> (state, device metrics); `state` donated
    def evaluate(self, params, batches) -> dict: ...     # held-out metrics, no update
    def record_fields(self, metrics: dict) -> dict: ...  # derived metrics-line fields (host metrics)
    def compile_count(self) -> int: ...


class BatchSource(Protocol):
    """What `run_loop` needs of the data (`DrafterBatches`, `train.window.WindowBatches`)."""
    def next(self) -> dict: ...                  # one batch as `step` takes it ("malformed": counted)
    def get_state(self): ...                     # JSON: the position, saved with each checkpoint
    def set_state(self, state) -> None: ...


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What `run_loop` needs of a run, whatever it trains; `tokens_per_step` feeds `tokens_per_s`."""
    out: str
    steps: int
    resume: bool = False
    stop_at: int | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    max_nonfinite: int = 10
    progress: bool = True
    tokens_per_step: int = 0


def write_run_config(out: str, run_config: dict) -> None:
    """`<out>/run_config.json` (process 0)."""
    if jax.process_index() != 0:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, RUN_CONFIG), "w") as fh:
        json.dump(run_config, fh, indent=2)


def resume_or_init(run: RunOptions, trainer: TrainerInterface, start, batches: BatchSource):
    """`(mngr, state, meta)`: `trainer.init_state(start)` (`meta` None), or with `run.resume` the newest
    checkpoint that restores (and `batches` at its position), `metrics.jsonl` cut back to its step."""
    lead = jax.process_index() == 0
    ckpt_dir = os.path.join(run.out, "checkpoints")
    metrics_path = os.path.join(run.out, "metrics.jsonl")
    mngr = checkpoint_manager(run.out, run.keep_checkpoints)
    steps = list(mngr.all_steps())
    if steps and not run.resume:
        raise InputError(f"{run.out} already has checkpoints; pass --resume to continue, or remove it / "
                         f"use another directory")
    if not run.resume or not (steps or resilience.cut_off_saves(ckpt_dir)):
        if lead and os.path.isfile(metrics_path):
            os.remove(metrics_path)
        return mngr, trainer.init_state(start), None
    if lead:
        resilience.discard_cut_off_saves(ckpt_dir)
    if not steps:
        log.warning("no complete checkpoint to resume from: starting at step 0")
        if lead and os.path.isfile(metrics_path):
            os.remove(metrics_path)
        return mngr, trainer.init_state(start), None

    def restore(step):
        state, meta = restore_checkpoint(mngr, trainer, step)
        if int(meta["step"]) != step:
            raise ValueError(f"meta says step {meta['step']}")
        return state, meta

    def quarantine(step):
        if lead:
            log.warning("moved checkpoint %d to %s", step, resilience.quarantine_checkpoint(run.out, step))

    step, (state, meta) = resilience.restore_latest_good(steps, restore, quarantine)
    log.info("resuming from checkpoint %d", step)
    if step != max(steps):             # the manager must forget the moved checkpoints
        mngr.close()
        mngr = checkpoint_manager(run.out, run.keep_checkpoints)
    batches.set_state(meta["data"])
    if lead:
        resilience.truncate_metrics(metrics_path, step)
    return mngr, state, meta


def run_loop(run: RunOptions, trainer: TrainerInterface, start, batches: BatchSource, run_config: dict):
    """The training loop: resume or `trainer.init_state(start)`, write `run_config.json`, then
    `state, metrics = trainer.step(state, batches.next())` until `run.steps` (or `run.stop_at`), one
    `metrics.jsonl` line per step, checkpoints every `run.checkpoint_every` steps and at the end.
    SIGTERM / SIGINT finish the step, checkpoint and return; `max_nonfinite` non-finite steps in a row
    or a full disk raise `TrainingStopped` (after a checkpoint where one can be written).

    Returns `(state, summary)`: `first_loss`, `last_loss`, `losses`, `records`, `last`, `steps_run`,
    `start_step`, `step`, `compile_count`, `last_checkpoint`, `tokens_per_s` (median, first step left
    out), `train_seconds`, `nonfinite_steps`, `stopped_by` (signal or None), `exit_status`."""
    mngr, state, meta = resume_or_init(run, trainer, start, batches)
    del start
    begin = int(meta["step"]) if meta else 0
    guard = resilience.NonFiniteGuard(run.max_nonfinite, **(meta or {}).get("nonfinite", {}))
    metrics_path = os.path.join(run.out, "metrics.jsonl")
    lead = jax.process_index() == 0
    write_run_config(run.out, run_config)
    tb = TensorboardLog(run.out, lead)
    bar = tqdm(total=run.steps, initial=begin, disable=not (run.progress and lead), unit="step",
               dynamic_ncols=True)
    records, last_saved, step = [], begin, begin
    pending = None          # (step, metrics, malformed): logged one step behind
    t_start = t_prev = time.perf_counter()
    data_state = batches.get_state()
    too_many_nonfinite = False
    quiet = resilience.QuietDiskFull()
    logging.getLogger("absl").addFilter(quiet)

    def flush():
        """Writes the metrics line of the pending step (waits for that step only)."""
        nonlocal t_prev, pending, too_many_nonfinite
        s, metrics, malformed = pending
        metrics = jax.device_get(metrics)
        now = time.perf_counter()
        rec = step_record(s, metrics, trainer.record_fields(metrics), run.tokens_per_step, now - t_prev, malformed)
        t_prev = now
        records.append(rec)
        if lead:
            try:
                resilience.append_metrics(metrics_path, rec)
            except OSError as e:
                if resilience.disk_full(e):
                    raise resilience.disk_full_error(metrics_path, mngr.latest_step()) from None
                raise
            tb.add(rec)
        too_many_nonfinite |= guard.update(s, finite=not rec.get("nonfinite", 0))
        pending = None
        bar.set_postfix({label: f"{rec[key]:.4g}" for label, key in trainer.BAR.items()}, refresh=False)
        bar.update(1)

    def checkpoint(at: int, wait: bool = False):
        """Checkpoint of step `at`, its metrics line written first."""
        nonlocal last_saved
        if pending is not None:
            flush()
        try:
            save_checkpoint(mngr, state, {"step": at, "data": data_state,
                                          "nonfinite": {"total": guard.total, "streak": guard.streak,
                                                        "first_of_streak": guard.first_of_streak}})
            if wait:
                mngr.wait_until_finished()
        except Exception as e:     # noqa: BLE001 -- only a full disk is explained; the rest re-raise
            if resilience.disk_full(e):
                try:
                    mngr.wait_until_finished()           # let an earlier save finish before naming it
                except Exception:  # noqa: BLE001 -- it failed too: the listing below tells
                    pass
                cut = [s for s, _ in resilience.cut_off_saves(os.path.join(run.out, "checkpoints"))]
                failed = min(cut) if cut else at             # an async save fails at the next call
                raise resilience.disk_full_error(f"checkpoint {failed}", latest_complete(run.out)) from None
            raise
        last_saved = at

    with resilience.DropTracebacks("Event loop is closed"):   # orbax's teardown after a failed save
        try:
            with resilience.StopSignals() as signals:
                end = min(run.steps, run.stop_at) if run.stop_at else run.steps
                while step < end:
                    batch = batches.next()
                    state, metrics = trainer.step(state, batch)
                    step += 1
                    data_state = batches.get_state()        # the iterator position that matches `state`
                    if pending is not None:
                        flush()                              # the previous step's line
                    pending = (step, metrics, batch.get("malformed", 0))
                    if guard.streak >= guard.limit - 1:
                        flush()                              # this step may complete the limit: check it now
                    stop = resilience.agreed(signals.requested is not None or too_many_nonfinite)
                    if stop or step == end:
                        break
                    if run.checkpoint_every and step % run.checkpoint_every == 0:
                        checkpoint(step)
                if pending is not None:
                    flush()
                too_many_nonfinite = resilience.agreed(too_many_nonfinite)
                if step > last_saved:
                    checkpoint(step, wait=True)
                stopped_by = signals.requested
        finally:
            try:
                mngr.wait_until_finished()
                mngr.close()
            except Exception as e:     # noqa: BLE001 -- already failing: keep the first error
                log.debug("closing the checkpoint manager: %s", e)
            logging.getLogger("absl").removeFilter(quiet)
            bar.close()
            tb.close()
    if too_many_nonfinite:
        raise guard.error(last_saved)
    timed = [r["tokens_per_s"] for r in records[1:]] or [r["tokens_per_s"] for r in records]
    return state, {"first_loss": records[0]["loss"] if records else None,
                   "last_loss": records[-1]["loss"] if records else None,
                   "losses": [r["loss"] for r in records], "last": records[-1] if records else None,
                   "steps_run": len(records), "start_step": begin,
                   "step": step, "compile_count": trainer.compile_count(), "last_checkpoint": last_saved,
                   "tokens_per_s": float(np.median(timed)) if timed else 0.0,
                   "train_seconds": time.perf_counter() - t_start, "nonfinite_steps": guard.total,
                   "stopped_by": stopped_by, "exit_status": signals.exit_status, "records": records}
