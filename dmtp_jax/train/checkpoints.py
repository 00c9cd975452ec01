"""Training checkpoints (orbax): one manager per run directory, the state saved as params,
optimizer and a JSON meta, restored onto a trainer's abstract state (its shardings), and a run's
trained params read back for export."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from dmtp_jax.checkpoint.safetensors_io import CheckpointError
from dmtp_jax.train.optim import TrainState
from dmtp_jax.train.step import StepConfig, abstract_params


def checkpoint_manager(out_dir: str, keep: int):
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(out_dir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("params", "opt", "meta"))


def save_checkpoint(mngr, state, meta: dict) -> None:
    step = int(meta["step"])
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(jax.tree.leaves(state.params)),
        opt=ocp.args.StandardSave(jax.tree.leaves((state.opt_state, state.step))),
        meta=ocp.args.JsonSave(meta)), force=True)


def restore_checkpoint(mngr, trainer, step: int | None = None):
    """`(TrainState, meta)` of checkpoint `step` (default: the latest)."""
    step = mngr.latest_step() if step is None else step
    abstract = trainer.abstract_state()
    p_leaves, p_def = jax.tree.flatten(abstract.params)
    o_leaves, o_def = jax.tree.flatten((abstract.opt_state, abstract.step))
    got = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(p_leaves), opt=ocp.args.StandardRestore(o_leaves),
        meta=ocp.args.JsonRestore()))
    opt_state, step_arr = jax.tree.unflatten(o_def, list(got["opt"]))
    return TrainState(jax.tree.unflatten(p_def, list(got["params"])), opt_state, step_arr), got["meta"]


def restore_params(run_dir: str, dcfg, step: int | None = None, method: str = "dflash", fusion_rank: int = 0,
                   abstract=None):
    """The trained params `{"drafter": nnx.State[, "fusion": nnx.State]}` (fp32) of a run's
    checkpoint (default: the latest), and the step; `abstract`: the params' tree when it is not a
    DFlash / DMTP drafter's (`dcfg` then unused)."""
    mngr = checkpoint_manager(run_dir, 1000)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"{run_dir} has no checkpoint")
    if abstract is None:
        _, abstract = abstract_params(dcfg, StepConfig(method=method, fusion_rank=fusion_rank))
    leaves, treedef = jax.tree.flatten(abstract)
    rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(
        [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep) for x in leaves])))
    return jax.tree.unflatten(treedef, list(got["params"])), step


def latest_complete(run_dir: str) -> int | None:
    """The newest finalized checkpoint on disk (a fresh look, not the manager's cache)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    steps = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()] if os.path.isdir(ckpt_dir) else []
    return max(steps) if steps else None
