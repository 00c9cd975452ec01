"""The optimiser every trainer shares: AdamW with linear warmup and cosine decay, global-norm
clipping, the train state, and the update that skips non-finite steps (`apply_gradients`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + linear warmup + cosine decay to `lr * min_lr_ratio`, global-norm clipping."""
    lr: float = 6e-4
    total_steps: int = 1000
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    max_grad_norm: float = 1.0


def optim_config(cfg) -> OptimConfig:
    """The `OptimConfig` of a run's config (`TrainConfig`, `PretrainConfig`, any `WindowRunConfig`)."""
    return OptimConfig(lr=cfg.lr, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio,
                       weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)


def lr_schedule(ocfg: OptimConfig) -> optax.Schedule:
    """Warmup (at most the run length) then cosine."""
    warmup = min(ocfg.warmup_steps, max(ocfg.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, ocfg.lr, warmup, max(ocfg.total_steps, warmup + 1),
                                              ocfg.lr * ocfg.min_lr_ratio)


def make_optimizer(ocfg: OptimConfig) -> optax.GradientTransformation:
    """`clip_by_global_norm` then AdamW on the schedule."""
    return optax.chain(optax.clip_by_global_norm(ocfg.max_grad_norm),
                       optax.adamw(lr_schedule(ocfg), b1=ocfg.b1, b2=ocfg.b2, weight_decay=ocfg.weight_decay))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: nnx.State         # drafter params, fp32 master copy
    opt_state: optax.OptState
    step: jax.Array           # int32 scalar: optimizer steps done


def new_state(tx: optax.GradientTransformation, params) -> TrainState:
    """Step 0: `params`, `tx`'s fresh optimizer state, a zero step counter."""
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def apply_gradients(tx: optax.GradientTransformation, ocfg: OptimConfig, state: TrainState, grads,
                    loss) -> tuple[TrainState, dict]:
    """`tx` on `grads`, except that a non-finite loss or gradient norm keeps the params and optimizer
    state (`jnp.where`: no recompile); the step counter always advances. Metrics: `grad_norm`, `lr`,
    `nonfinite` (1: skipped).

    Example:
        >>> tx, ocfg = make_optimizer(OptimConfig(lr=0.1)), OptimConfig(lr=0.1)
        >>> state = new_state(tx, {"w": jnp.ones(2)})
        >>> new, m = apply_gradients(tx, ocfg, state, {"w": jnp.full(2, jnp.nan)}, jnp.float32(1.0))
        >>> int(new.step), int(m["nonfinite"]), new.params["w"].tolist()
        (1, 1, [1.0, 1.0])
    """
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
    metrics = {"grad_norm": grad_norm, "lr": lr_schedule(ocfg)(state.step),
               "nonfinite": jnp.logical_not(finite).astype(jnp.int32)}
    return TrainState(params, opt_state, state.step + 1), metrics
