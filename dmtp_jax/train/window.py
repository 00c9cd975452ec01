"""Training on random windows of one token stream: the batches (`WindowBatches`, pure in
`(seed, step)`), the run fields (`WindowRunConfig`) and the trainer base (`WindowTrainer`) that
`train.loop.run_loop` drives for the demo's pretraining and distillation and the head factor."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.sharding import batch_sharding, make_mesh, replicated
from dmtp_jax.train.loop import RunOptions
from dmtp_jax.train.optim import OptimConfig, TrainState, apply_gradients, make_optimizer, new_state


def window_batch(stream: np.ndarray, batch_size: int, length: int, seed: int, step: int) -> np.ndarray:
    """Batch `step`: `batch_size` random windows of `length` tokens of `stream`, pure in `(seed, step)`."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - length + 1, size=batch_size)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


class WindowBatches:
    """A `BatchSource`: batch `s` is `{"tokens_bt": window_batch(stream, batch_size, length, seed, s)}`;
    the state is the next batch's index.

    Example:
        >>> batches = WindowBatches(np.arange(100), 2, 5, seed=0)
        >>> batches.next()["tokens_bt"].shape, batches.get_state()
        ((2, 5), {'step': 1})
    """

    def __init__(self, stream: np.ndarray, batch_size: int, length: int, seed: int):
        self.stream, self.batch_size, self.length, self.seed, self.index = stream, batch_size, length, seed, 0

    def batch(self, index: int) -> dict:
        return {"tokens_bt": window_batch(self.stream, self.batch_size, self.length, self.seed, index)}

    def next(self) -> dict:
        self.index += 1
        return self.batch(self.index - 1)

    def get_state(self) -> dict:
        return {"step": self.index}

    def set_state(self, state: dict) -> None:
        self.index = int(state["step"])


@dataclasses.dataclass
class WindowRunConfig:
    """The optimisation and run fields of a `WindowTrainer` job (read by `train.step.optim_config` and
    `window_run_options`)."""
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 300
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    max_nonfinite: int = 10                     # stop after this many non-finite steps in a row
    resume: bool = False
    progress: bool = True


def window_run_options(cfg, out: str):
    """`train.loop.RunOptions` of a window run config writing to `out`."""
    return RunOptions(out=out, steps=cfg.steps, resume=cfg.resume, checkpoint_every=cfg.checkpoint_every,
                      keep_checkpoints=cfg.keep_checkpoints, max_nonfinite=cfg.max_nonfinite, progress=cfg.progress,
                      tokens_per_step=cfg.batch_size * cfg.seq_len)


@dataclasses.dataclass(frozen=True)
class WindowStep:
    """What a `WindowTrainer`'s jitted step and evaluation close over, fixed at construction: the
    optimizer, its config and the pure `loss_fn(params, frozen, tokens_bt) -> (loss, metrics)`."""
    tx: optax.GradientTransformation
    ocfg: OptimConfig
    loss_fn: Callable


def window_step(setup: WindowStep, state: TrainState, frozen, tokens_bt):
    """One optimizer step of `setup.loss_fn` (`apply_gradients`: non-finite steps skip their update)."""
    (loss, metrics), grads = jax.value_and_grad(setup.loss_fn, has_aux=True)(state.params, frozen, tokens_bt)
    state, update = apply_gradients(setup.tx, setup.ocfg, state, grads, loss)
    return state, {**metrics, "loss": loss, **update}


def window_metrics(setup: WindowStep, params, frozen, tokens_bt) -> dict:
    """The metrics of `setup.loss_fn` (no update)."""
    return setup.loss_fn(params, frozen, tokens_bt)[1]


class WindowTrainer:
    """`run_loop`'s trainer interface around a pure `loss_fn(params, frozen, tokens_bt) -> (loss,
    metrics)` on `[B, L+1]` windows. `frozen` (a jit input, never trained) is held by the trainer; the
    step is one donated jit of `window_step` over the frozen `WindowStep` setup. On `mesh` (default one
    device): params and optimizer state replicated, `frozen` at its shardings, batches split over the
    batch axes."""

    BAR = {"loss": "loss"}

    def __init__(self, ocfg: OptimConfig, abstract_params: dict, loss_fn: Callable, frozen=None, mesh=None):
        self.setup = WindowStep(make_optimizer(ocfg), ocfg, loss_fn)
        self.ocfg, self.tx = ocfg, self.setup.tx
        self.abstract_params, self.frozen = abstract_params, frozen
        self.mesh = mesh if mesh is not None else make_mesh()
        self.replicated = replicated(self.mesh)
        self._step = counted_jit(functools.partial(window_step, self.setup), donate_argnums=(0,),
                                 out_shardings=self.replicated)
        self._eval = jax.jit(functools.partial(window_metrics, self.setup), out_shardings=self.replicated)

    def initial_params(self, seed: int) -> dict:
        raise NotImplementedError

    def init_state(self, seed: int) -> TrainState:
        """Step 0 from `initial_params(seed)` (fp32) and a fresh optimizer state."""
        return jax.jit(functools.partial(new_state, self.tx), out_shardings=self.replicated)(self.initial_params(seed))

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs of the state (for `train.loop.restore_checkpoint` and `lower_step`)."""
        shapes = jax.eval_shape(functools.partial(new_state, self.tx), self.abstract_params)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.replicated), shapes)

    def _tokens(self, tokens_bt) -> jax.Array:
        """A batch of windows on the mesh, split over its batch axes."""
        tokens_bt = np.asarray(tokens_bt)
        return jax.device_put(tokens_bt, batch_sharding(self.mesh, tokens_bt.shape))

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """One optimizer step on `batch["tokens_bt"]` (`[B, L+1]` windows); `state` is donated."""
        return self._step(state, self.frozen, self._tokens(batch["tokens_bt"]))

    def lower_step(self, batch_size: int, window: int, frozen) -> jax.stages.Lowered:
        """The step for `[batch_size, window]` windows lowered on abstract inputs: nothing allocated, the
        compile counter untouched."""
        shape = (batch_size, window)
        tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(self.mesh, shape))
        return jax.jit(functools.partial(window_step, self.setup), donate_argnums=(0,),
                       out_shardings=self.replicated).lower(
            self.abstract_state(), frozen, tokens)

    def evaluate(self, params, batches) -> dict:
        """Mean metrics of `params` over `batches` (dicts as `step` takes)."""
        got = [jax.device_get(self._eval(params, self.frozen, self._tokens(b["tokens_bt"]))) for b in batches]
        return {k: float(np.mean([g[k] for g in got])) for k in got[0]} if got else {}

    def record_fields(self, metrics: dict) -> dict:
        """No derived fields: the step's scalar metrics are the metrics line."""
        del metrics
        return {}

    def compile_count(self) -> int:
        """Compiled variants of the train step (1 for a fixed batch shape)."""
        return self._step.compiles
