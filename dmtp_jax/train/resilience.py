"""What keeps a training run whole (docs/training.md#interruptions): stop signals (`StopSignals`),
checkpoints cut off mid-write or unreadable (`cut_off_saves`, `restore_latest_good`), non-finite
steps (`NonFiniteGuard`), a full disk (`disk_full`), and a metrics file holding every step once
(`append_metrics`, `truncate_metrics`).

Example:
    >>> guard = NonFiniteGuard(limit=2)
    >>> guard.update(5, finite=False), guard.update(6, finite=True), guard.total
    (False, False, 1)
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from dmtp_jax.checkpoint.safetensors_io import CheckpointError
from dmtp_jax.errors import TrainingStopped

log = logging.getLogger(__name__)
ORBAX_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os_error_code='28'", "os_error_code='122'")


# ---- signals -----------------------------------------------------------------------------------
class StopSignals:
    """Context manager: SIGTERM / SIGINT set `requested` (the signal's name) instead of killing the
    process; a second one raises KeyboardInterrupt; handlers restored on exit; a no-op outside the
    main thread.

    Example:
        >>> with StopSignals() as stop:
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     stop.requested
        'SIGTERM'
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._saved: dict = {}

    def _handle(self, signum, frame):
        if self.requested is not None:
            self._restore()
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
        self.requested = signal.Signals(signum).name

    def _restore(self):
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        self._restore()
        return False

    @property
    def exit_status(self) -> int:
        """The shell's status for a process ended by the signal (128 + number), 0 when none came."""
        return 128 + int(getattr(signal, self.requested)) if self.requested else 0


def agreed(flag: bool) -> bool:
    """`flag` of any process (an all-gather with several processes), so all stop at the same step."""
    if jax.process_count() == 1:
        return flag
    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


# ---- non-finite losses -------------------------------------------------------------------------
@dataclasses.dataclass
class NonFiniteGuard:
    """Counts steps whose update was skipped for a non-finite loss / gradient; `update` returns
    True when `limit` of them came in a row (the run should stop)."""
    limit: int = 10
    total: int = 0
    streak: int = 0
    first_of_streak: int | None = None

    def update(self, step: int, finite: bool) -> bool:
        if finite:
            self.streak, self.first_of_streak = 0, None
            return False
        self.total += 1
        self.streak += 1
        self.first_of_streak = step if self.first_of_streak is None else self.first_of_streak
        return self.streak >= self.limit

    def error(self, checkpoint: int | None) -> TrainingStopped:
        """The one-line error for a run stopped by the guard."""
        kept = f"; checkpoint {checkpoint} holds the last finite weights" if checkpoint is not None else ""
        return TrainingStopped(
            f"the loss was not finite for {self.streak} steps in a row (steps {self.first_of_streak}-"
            f"{self.first_of_streak + self.streak - 1}, {self.total} in all); their updates were skipped{kept}",
            hint="lower --lr, train in --compute-dtype float32, check the data, or raise --max-nonfinite")


def finite_record(rec: dict) -> dict:
    """A metrics record with non-finite floats as null (strict JSON)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


# ---- disk full ---------------------------------------------------------------------------------
def disk_full(error: BaseException | None) -> bool:
    """Whether `error` (or anything in its cause / context chain) says the disk or quota is full
    (ENOSPC / EDQUOT, also as tensorstore reports it).

    Example:
        >>> disk_full(ValueError("RESOURCE_EXHAUSTED: ... [os_error_code='28']"))
        True
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(error) for text in DISK_FULL_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def disk_full_error(what: str, last_good: int | None) -> TrainingStopped:
    """The one-line error for a write that failed on a full disk."""
    kept = (f"checkpoint {last_good} is intact" if last_good is not None else "no complete checkpoint was written")
    return TrainingStopped(f"could not write {what}: no space left on device; {kept}",
                           hint="free some space (or lower --keep-checkpoints), then continue with --resume")


class QuietDiskFull(logging.Filter):
    """Drops log records that only repeat a full-disk error (the run reports it once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return not any(t in text for t in DISK_FULL_TEXT)


class DropTracebacks:
    """Context: `sys.stderr` passes text through except Python tracebacks whose last line contains
    `pattern` (held back per thread until that line decides)."""

    HEADER = "Traceback (most recent call last):"

    def __init__(self, pattern: str = "Event loop is closed"):
        self.pattern = pattern
        self._held: dict[int, str] = {}       # per thread: a traceback being written, until its error line
        self._lock = threading.RLock()

    def write(self, text: str) -> int:
        with self._lock:
            me = threading.get_ident()
            if me not in self._held and not text.startswith(self.HEADER):
                self._real.write(text)
                return len(text)
            held = self._held.pop(me, "") + text
            lines = held.split("\n")
            for i in range(1, len(lines) - 1):          # complete lines after the header
                if lines[i] and lines[i][:1] not in (" ", "\t"):         # the error line ends it
                    if self.pattern not in lines[i]:
                        self._real.write("\n".join(lines[:i + 1]) + "\n")
                    rest = "\n".join(lines[i + 1:])
                    if rest:
                        self.write(rest)
                    return len(text)
            self._held[me] = held
        return len(text)

    def flush(self):
        self._real.flush()

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        self._real, sys.stderr = sys.stderr, self
        return self

    def __exit__(self, *exc):
        sys.stderr = self._real
        for held in self._held.values():
            self._real.write(held)
        return False


# ---- metrics -----------------------------------------------------------------------------------
def append_metrics(path: str, rec: dict) -> None:
    """Appends one JSON line (flushed to the OS before returning)."""
    with open(path, "a") as fh:
        fh.write(json.dumps(finite_record(rec)) + "\n")


def truncate_metrics(path: str, last_step: int) -> None:
    """Keeps the lines of steps <= `last_step`, each step once (its last line); drops later lines and
    any line a kill cut off."""
    if not os.path.isfile(path):
        return
    by_step: dict[int, str] = {}
    with open(path) as fh:
        for line in fh:
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue                     # a line cut off mid-write
            if step <= last_step:
                by_step[step] = line if line.endswith("\n") else line + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.writelines(by_step[s] for s in sorted(by_step))
    os.replace(tmp, path)


# ---- checkpoints -------------------------------------------------------------------------------
def cut_off_saves(ckpt_dir: str) -> list[tuple[int, str]]:
    """`(step, path)` of the saves a kill interrupted (orbax's `<step>.orbax-checkpoint-tmp*` dirs)."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        m = ORBAX_TMP.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(out)


def discard_cut_off_saves(ckpt_dir: str) -> list[int]:
    """Warns about each interrupted save, removes its temporary directory; returns their steps."""
    steps = []
    for step, path in cut_off_saves(ckpt_dir):
        log.warning("checkpoint %d was cut off mid-write (the run was stopped while saving); ignoring it", step)
        shutil.rmtree(path, ignore_errors=True)
        steps.append(step)
    return steps


def restore_latest_good(steps, restore, quarantine):
    """`(step, restored)` of the newest of `steps` whose `restore(step)` succeeds; failures are logged
    and, once one restores, the newer failed ones passed to `quarantine`. None restorable:
    `CheckpointError` naming the newest failure, nothing moved.

    Example:
        >>> restore_latest_good([1, 2], lambda s: {"s": s}, print)
        (2, {'s': 2})
    """
    failed = []
    for step in sorted(steps, reverse=True):
        try:
            restored = restore(step)
        except Exception as e:          # noqa: BLE001 -- any unreadable checkpoint: try an older one
            failed.append((step, e))
            log.warning("checkpoint %d cannot be restored (%s: %s); trying an older one", step,
                        type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            continue
        for bad, _ in failed:
            log.warning("checkpoint %d is incomplete or corrupt; using checkpoint %d", bad, step)
            quarantine(bad)
        return step, restored
    step, e = failed[0]
    raise CheckpointError(f"no checkpoint of this run can be restored (checkpoint {step}: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from e


def quarantine_checkpoint(run_dir: str, step: int) -> str:
    """Moves `<run>/checkpoints/<step>` to `<run>/corrupt_checkpoints/<step>-<time>`: the new path."""
    dest_dir = os.path.join(run_dir, "corrupt_checkpoints")
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, f"{step}-{int(time.time())}")
    shutil.move(os.path.join(run_dir, "checkpoints", str(step)), dest)
    return dest
