"""The metrics line of a training step, for every trainer (`run_loop` writes one per step to
`metrics.jsonl`), and its optional TensorBoard copy."""

from __future__ import annotations

import os

import numpy as np


def step_record(step: int, metrics: dict, derived: dict, tokens: int, seconds: float, malformed: int = 0) -> dict:
    """The metrics line of one step: the step, its scalar metrics (host values, integers as int, vectors
    left out), the trainer's `derived` fields, throughput, step time and malformed records.

    Example:
        >>> step_record(3, {"loss": np.float32(2.5), "nonfinite": np.int32(0), "count_k": np.ones(4)},
        ...             {"acc": 0.5}, tokens=100, seconds=0.5)
        {'step': 3, 'loss': 2.5, 'nonfinite': 0, 'acc': 0.5, 'tokens_per_s': 200.0, 'step_s': 0.5, 'malformed': 0}
    """
    rec = {"step": step}
    for k, v in metrics.items():
        v = np.asarray(v)
        if v.ndim == 0:
            rec[k] = int(v) if np.issubdtype(v.dtype, np.integer) else float(v)
    rec.update(derived)
    rec.update(tokens_per_s=tokens / seconds if seconds > 0 else 0.0, step_s=seconds, malformed=int(malformed))
    return rec


class TensorboardLog:
    """Every float field of each metrics line as a TensorBoard scalar (`<out>/tb`) when enabled and
    `torch.utils.tensorboard` is installed; otherwise a no-op."""

    def __init__(self, out_dir: str, enabled: bool):
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter     # optional: torch + tensorboard
                self.writer = SummaryWriter(os.path.join(out_dir, "tb"))
            except Exception:   # tensorboard not installed: JSONL only
                self.writer = None

    def add(self, rec: dict) -> None:
        if self.writer is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, float):
                    self.writer.add_scalar(k, v, rec["step"])

    def close(self):
        if self.writer is not None:
            self.writer.close()
