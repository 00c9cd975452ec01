"""A drafter training run (`train.py train`): the target, the drafter's starting params, the
`train.step.Trainer` and its batches (`setup`), driven by `train.loop.run_loop`."""

from __future__ import annotations

import dataclasses
import logging

from dmtp_jax.checkpoint.dflash_ckpt import init_drafter, load_drafter
from dmtp_jax.checkpoint.dmtp_ckpt import init_fusion, load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.config import load_target_config
from dmtp_jax.errors import InputError
from dmtp_jax.methods import EAGLE3
from dmtp_jax.sharding import make_mesh
from dmtp_jax.tokenizer import load_tokenizer
from dmtp_jax.train.checkpoints import latest_complete
from dmtp_jax.train.config import TrainConfig, fresh_drafter_config
from dmtp_jax.train.eagle3 import eagle3_setup, run_drafter_config
from dmtp_jax.train.data import BatchIterator, TokenDataset, process_rows
from dmtp_jax.train.loop import run_loop
from dmtp_jax.train.loss import method_layout, uses_mtp
from dmtp_jax.train.optim import optim_config
from dmtp_jax.train.step import StepConfig, Trainer

log = logging.getLogger(__name__)


def setup(cfg: TrainConfig):
    """`(target, params, trainer, batches)`: the loaded target, the drafter's starting params,
    the `Trainer` and its `DrafterBatches`."""
    if cfg.method == EAGLE3:
        target, trainer, dataset = eagle3_setup(cfg)
        return target, trainer.initial_params(cfg.seed), trainer, drafter_batches(cfg, trainer, dataset)
    cfg.validate()
    method_layout(cfg.method, cfg.block_size)           # unknown methods end here
    # cheap checks before any model is loaded: the target's config, the mesh, the data file
    target_cfg = load_target_config(cfg.target)
    mesh = make_mesh(cfg.mesh)
    tokenizer = load_tokenizer(cfg.target)
    dataset = TokenDataset.from_file(cfg.data, cfg.seq_len, tokenizer, target_cfg.vocab_size)
    target = load_target(cfg.target, dtype=cfg.target_dtype or cfg.compute_dtype, mesh=mesh)
    fusion = mtp = None
    if uses_mtp(cfg.method):
        mtp = load_mtp(cfg.mtp or cfg.target, target.cfg, cfg.target_dtype or cfg.compute_dtype, mesh)
    if cfg.init_from and uses_mtp(cfg.method):
        # a DMTP directory continues with its fusion; a plain DFlash directory starts at zero fusion
        drafter, fusion = load_dmtp_drafter(cfg.init_from, target.cfg, cfg.method, "float32", mesh,
                                            same_layout=True)     # e.g. dmtp-adaptive from a dmtp drafter
    elif cfg.init_from:
        drafter = load_drafter(cfg.init_from, target.cfg, "float32", mesh)
    else:
        dcfg = fresh_drafter_config(cfg, target.cfg, tokenizer)
        drafter = init_drafter(dcfg, "float32", mesh, seed=cfg.seed)
    dcfg = drafter.cfg
    if dcfg.block_size != cfg.block_size:
        dcfg = dataclasses.replace(dcfg, block_size=cfg.block_size)
        drafter = dataclasses.replace(drafter, cfg=dcfg)
    if uses_mtp(cfg.method) and fusion is None:
        fusion = init_fusion(cfg.method, dcfg.hidden_size, dcfg.rms_norm_eps, "float32", mesh,
                             rank=cfg.fusion_rank, seed=cfg.seed)
    scfg = StepConfig(method=cfg.method, block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                      gamma=cfg.resolved_gamma(), grad_accum=cfg.grad_accum,
                      compute_dtype=cfg.compute_dtype, seed=cfg.seed, fusion_rank=cfg.fusion_rank,
                      ce_chunk=cfg.ce_chunk, remat=cfg.remat)
    ocfg = optim_config(cfg)
    trainer = Trainer(target, dcfg, scfg, ocfg, mesh, mtp=mtp)
    params = {"drafter": drafter.state, **({"fusion": fusion.state} if fusion is not None else {})}
    return target, params, trainer, drafter_batches(cfg, trainer, dataset)


def drafter_batches(cfg: TrainConfig, trainer, dataset) -> "DrafterBatches":
    """The run's `DrafterBatches` over `dataset` (global `[batch_size, seq_len]`, at the trainer's
    batch sharding)."""
    shape = (cfg.batch_size, cfg.seq_len)
    return DrafterBatches(BatchIterator(dataset, cfg.batch_size, process_rows(trainer.batch_sharding(shape), shape),
                                        seed=cfg.seed), trainer, shape)


class DrafterBatches:
    """`run_loop`'s batch source for drafters: this process's `BatchIterator` rows as global `[B, L]`
    arrays (`{"tokens_bt", "loss_mask_bt", "malformed"}`); state: the iterator's."""

    def __init__(self, iterator, trainer, global_shape):
        self.iterator, self.trainer, self.global_shape = iterator, trainer, tuple(global_shape)
        self.dataset = iterator.dataset

    def next(self) -> dict:
        local = self.iterator.next()
        tokens_bt, loss_mask_bt = self.trainer.global_batch(local, self.global_shape)
        return {"tokens_bt": tokens_bt, "loss_mask_bt": loss_mask_bt, "malformed": local["malformed"]}

    def get_state(self):
        return self.iterator.get_state()

    def set_state(self, state) -> None:
        self.iterator.set_state(state)


def run_training(cfg: TrainConfig) -> dict:
    """Trains a drafter `cfg.steps` optimizer steps through `run_loop`: its summary (without the state)
    plus `malformed`. Raises `TrainingStopped` as `run_loop` does."""
    if not cfg.resume and latest_complete(cfg.out) is not None:       # before any model is loaded
        raise InputError(f"{cfg.out} already has checkpoints; pass --resume to continue or use a new --out")
    _, params, trainer, batches = setup(cfg)
    drafter = run_drafter_config(trainer, cfg.out) if cfg.method == EAGLE3 else trainer.dcfg.to_hf_dict()
    _, summary = run_loop(cfg.run_options(), trainer, params, batches, {"train": cfg.to_json(), "drafter": drafter})
    malformed = batches.dataset.malformed
    if malformed:
        log.warning("%d malformed records were skipped", malformed)
    return {**summary, "malformed": malformed}
