"""`train.py plan`: the drafter's train step compiled for the plan's machine on abstract weights,
with the frozen target's and the optimizer's shares shown apart."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from dmtp_jax.plan.report import PlanResult, cost_notes
from dmtp_jax.errors import InputError
from dmtp_jax.models.drafter_shape import default_drafter_config
from dmtp_jax.plan.models import shard_bytes, target_config_of
from dmtp_jax.plan.topology import open_topology
from dmtp_jax.platform import compiling_for
from dmtp_jax.sharding import make_mesh, replicated
from dmtp_jax.train.config import default_gamma
from dmtp_jax.train.loss import uses_mtp
from dmtp_jax.train.optim import OptimConfig
from dmtp_jax.train.step import StepConfig, Trainer, abstract_models
from dmtp_jax.plan.compile import compile_function
from dmtp_jax.checkpoint.hf import LoadedModel
from dmtp_jax.checkpoint.mtp_ckpt import has_mtp
from dmtp_jax.checkpoint.draft_head_ckpt import abstract_efficient_head
from dmtp_jax.train.head_factor import FactorDistiller, check_factor_shape


def plan_training(target: str, *, method: str = "dmtp", mesh: str | None = None, batch_size: int = 8,
                  seq_len: int = 4096, target_dtype: str = "bfloat16", compute_dtype: str = "bfloat16",
                  draft_layers: int = 5, block_size: int = 8, num_anchors: int = 16, grad_accum: int = 1,
                  topology: str = "cpu:1", hbm_gb: float | None = None, exact_cost: bool = False,
                  progress=None) -> PlanResult:
    """Compiles `Trainer.lower_step(batch_size, seq_len)` for a fresh drafter of the target
    (`draft_layers`, `block_size`), the target (and, for DMTP methods, its MTP head) frozen at
    `target_dtype`."""
    for name, value in (("batch-size", batch_size), ("seq-len", seq_len), ("draft-layers", draft_layers),
                        ("num-anchors", num_anchors), ("grad-accum", grad_accum)):
        if value < 1:
            raise InputError(f"--{name} must be >= 1, got {value}")
    if batch_size % grad_accum:
        raise InputError(f"--batch-size {batch_size} is not a multiple of --grad-accum {grad_accum}")
    if seq_len < block_size + 1:
        raise InputError(f"--seq-len {seq_len} is shorter than a block ({block_size}) + 1")
    topo = open_topology(topology)
    device_mesh = make_mesh(mesh, devices=topo.devices)
    cfg = target_config_of(target)
    dcfg = default_drafter_config(cfg, draft_layers, block_size)
    with compiling_for(topo.platform, device_mesh.size):
        target_model, mtp = abstract_models(cfg, target_dtype, device_mesh, with_mtp=uses_mtp(method))
        scfg = StepConfig(method=method, block_size=block_size, num_anchors=num_anchors,
                          gamma=default_gamma(block_size),
                          grad_accum=grad_accum, compute_dtype=compute_dtype)
        trainer = Trainer(target_model, dcfg, scfg, OptimConfig(), device_mesh, mtp=mtp)
        settings = {"method": method, "batch": batch_size, "seq": seq_len, "target dtype": target_dtype,
                    "compute dtype": compute_dtype, "draft layers": draft_layers, "block": block_size,
                    "anchors": num_anchors, **({"grad accum": grad_accum} if grad_accum > 1 else {})}
        note = (f"drafter: a fresh {draft_layers}-layer DFlash drafter of the target's width, context from "
                f"target layers {list(dcfg.target_layer_ids)}; AdamW state in fp32")
        return step_plan("train_step", lambda: trainer.lower_step(batch_size, seq_len), trainer.abstract_state(),
                         "drafter params (fp32)", target_model, mtp, topology, topo, device_mesh, hbm_gb,
                         batch_size * seq_len, settings, note, exact_cost, progress)


def step_plan(name: str, lower, train_state, params_name: str, target_model, mtp, topology: str, topo,
              device_mesh, hbm_gb: float | None, tokens_per_call: int, settings: dict, note: str,
              exact_cost: bool, progress) -> PlanResult:
    """A training plan of one compiled step (`lower()`, inside `compiling_for`): the frozen models and
    the trained state per device, the step's compile, the verdict."""
    weights = {"target (frozen)": shard_bytes(target_model.state)}
    if mtp is not None:
        weights["mtp (frozen)"] = shard_bytes(mtp.state)
    state = {params_name: shard_bytes(train_state.params), "optimizer": shard_bytes(train_state.opt_state)}
    parts = {**{f"weights:{k}": v for k, v in weights.items()}, **{f"state:{k}": v for k, v in state.items()}}
    if progress:
        progress(name)
    fn = compile_function(name, lower, min_bytes=sum(weights.values()) + sum(state.values()),
                          tokens_per_call=tokens_per_call, parts=parts, exact_cost=exact_cost)
    return PlanResult("training", topology, topo.platform, topo.device_kind, device_mesh.size,
                      {k: int(v) for k, v in device_mesh.shape.items()},
                      int(hbm_gb * 2**30) if hbm_gb else topo.hbm_bytes, topo.peak_bytes_per_s, settings, weights,
                      state, [fn], cost_notes([fn], exact_cost) + [note])


def plan_head_factor(target: str, *, mesh: str | None = None, batch_size: int = 8, seq_len: int = 2048,
                     target_dtype: str = "bfloat16", rank: int | None = None, vocab: int | None = None,
                     ce_chunk: int = 256, topology: str = "cpu:1", hbm_gb: float | None = None,
                     exact_cost: bool = False, progress=None) -> PlanResult:
    """Compiles the `train.py head-factor` step: the efficient head's factor (`rank`, over `vocab` ids or
    all) trained toward the full head, the target (and MTP head) frozen at `target_dtype`,
    `[batch_size, seq_len + 1]` windows, `ce_chunk` rows scored at once."""
    check_factor_shape(batch_size, seq_len, ce_chunk, target_dtype)
    topo = open_topology(topology)
    device_mesh = make_mesh(mesh, devices=topo.devices)
    cfg = target_config_of(target)
    with compiling_for(topo.platform, device_mesh.size):
        with_mtp = cfg.mtp_num_hidden_layers > 0 or (os.path.isdir(target) and has_mtp(target))
        target_model, mtp = abstract_models(cfg, target_dtype, device_mesh, with_mtp=with_mtp)
        head_cfg, graphdef, head_state = abstract_efficient_head(cfg, target_dtype, rank, None, vocab)
        head = LoadedModel(head_cfg, graphdef, head_state, device_mesh)
        distiller = FactorDistiller(target_model, mtp, head, OptimConfig(), ce_chunk)
        ids = distiller.frozen["ids"]
        frozen = {"target": target_model.state, "mtp": None if mtp is None else mtp.state,
                  "ids": None if ids is None else jax.ShapeDtypeStruct(ids.shape, jnp.int32,
                                                                      sharding=replicated(device_mesh))}
        settings = {"job": "head-factor", "batch": batch_size, "seq": seq_len, "target dtype": target_dtype,
                    "rank": head_cfg["rank"], "vocab": vocab or cfg.vocab_size, "ce chunk": ce_chunk}
        down, up = (distiller.start[k].shape for k in ("down", "up"))
        note = f"the factor: down {list(down)} and up {list(up)} in fp32, replicated; AdamW state in fp32"
        return step_plan("head_factor_step", lambda: distiller.lower_step(batch_size, seq_len + 1, frozen),
                         distiller.abstract_state(), "factor (fp32)", target_model, mtp, topology, topo, device_mesh,
                         hbm_gb, batch_size * (seq_len + 1), settings, note, exact_cost, progress)
