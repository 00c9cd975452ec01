"""`export`: a run's checkpoint -> an HF-format drafter directory (`save_drafter`'s `config.json`
with `dflash_config` + safetensors), loadable by `infer.py --draft` and `dflash`."""

from __future__ import annotations

import json
import os

from dmtp_jax.checkpoint.dflash_ckpt import LoadedDrafter, save_drafter
from dmtp_jax.checkpoint.dmtp_ckpt import save_dmtp_drafter
from dmtp_jax.checkpoint.hf import LoadedModel
from dmtp_jax.errors import InputError
from dmtp_jax.methods import EAGLE3
from dmtp_jax.models.dflash_config import DFlashConfig
from dmtp_jax.sharding import make_mesh
from dmtp_jax.train.checkpoints import restore_params
from dmtp_jax.train.eagle3 import abstract_eagle3_params, export_eagle3
from dmtp_jax.train.loop import RUN_CONFIG
from dmtp_jax.train.step import StepConfig, abstract_params


def read_run_config(run_dir: str) -> dict:
    path = os.path.join(run_dir, RUN_CONFIG)
    if not os.path.isfile(path):
        raise InputError(f"{run_dir} is not a training run directory (no {RUN_CONFIG})")
    with open(path) as fh:
        return json.load(fh)


def export_run(run_dir: str, out_dir: str, step: int | None = None, dtype: str | None = None) -> dict:
    """Writes the drafter of `run_dir` at `step` (default: latest) to `out_dir` in `dtype` (default
    float32, the master params): `{"step", "out"}`."""
    run = read_run_config(run_dir)
    if run["train"].get("method") == EAGLE3:
        params, got_step = restore_params(run_dir, None, step, abstract=abstract_eagle3_params(run))
        export_eagle3(run_dir, run, params, out_dir, dtype=dtype)
        return {"step": int(got_step), "out": out_dir}
    dcfg = DFlashConfig.from_hf_dict(run["drafter"])
    method, rank = run["train"].get("method", "dflash"), int(run["train"].get("fusion_rank") or 0)
    params, got_step = restore_params(run_dir, dcfg, step, method, rank)
    graphdefs, _ = abstract_params(dcfg, StepConfig(method=method, fusion_rank=rank))
    mesh = make_mesh()
    drafter = LoadedDrafter(dcfg, graphdefs["drafter"], params["drafter"], mesh)
    if "fusion" in params:
        fusion = LoadedModel({"method": method, "rank": rank}, graphdefs["fusion"], params["fusion"], mesh)
        save_dmtp_drafter(drafter, fusion, out_dir, dtype=dtype)
    else:
        save_drafter(drafter, out_dir, dtype=dtype)
    return {"step": int(got_step), "out": out_dir}
