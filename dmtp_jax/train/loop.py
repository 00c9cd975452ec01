"""The one training loop (`run_loop`): orbax checkpoints, metrics, progress bar, resilience, for
every trainer -- the drafter (`run_training`: `TrainConfig`, `setup`, `train.step.Trainer`) and the
demo's target pretraining and MTP distillation (`demo.pretrain.Pretrainer` / `MtpDistiller`).

Run directory layout (`--out DIR`):

* `run_config.json` -- the run's config (a drafter run: the `TrainConfig` and the drafter's HF
  config, what `export` needs);
* `checkpoints/<step>/` -- orbax: `params` (drafter, fp32), `opt` (optimizer state), `meta` (step,
  data iterator state, non-finite counts); written every `checkpoint_every` steps and at exit
  (async, atomic: a run killed with SIGKILL resumes from the last complete one and loses only the
  steps after it);
* `metrics.jsonl` -- one line per step (process 0): loss, acceptance proxy, tokens/s, lr, ...; the
  line of a step is written before that step's checkpoint, so after `--resume` it holds every step
  exactly once.

`resume=True` restores params, optimizer, step and the data iterator, so the loss sequence equals
an uninterrupted run's bit for bit (the step is a pure function of state, batch and step).

Interference (`resilience.py`): SIGTERM / SIGINT finish the step, write its metrics and a
checkpoint and return (`summary["stopped_by"]`); a checkpoint cut off mid-write or unreadable is
skipped on resume with a warning; a non-finite loss skips its update and `max_nonfinite` of them
in a row stop the run (`TrainingStopped`); a full disk stops it with one line, the previous
checkpoint intact.

Example:
    >>> cfg = TrainConfig(target="/tmp/tiny", data="d.jsonl", out="/tmp/run", steps=20,
    ...                   batch_size=4, seq_len=64)
    >>> summary = run_training(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Protocol

import jax
import numpy as np

from dmtp_jax.config import check_config_keys
from dmtp_jax.errors import InputError
from dmtp_jax.options import TRAIN_METHODS, check_block_size, check_method
from dmtp_jax.train import resilience
from dmtp_jax.train.metrics import TensorboardLog, step_record

log = logging.getLogger(__name__)
RUN_CONFIG = "run_config.json"


def default_gamma(block_size: int) -> float:
    """SpecForge's loss decay per block size (7 / 5 / 4 for 16 / 10 / 8), else `7 * block / 16`.

    Example:
        >>> default_gamma(8), default_gamma(32)
        (4.0, 14.0)
    """
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7 / 16))


@dataclasses.dataclass
class TrainConfig:
    """Everything a run needs (CLI flags and `configs/*.py` `get_config()` fill it)."""
    target: str = ""
    data: str = ""
    out: str = ""
    method: str = "dflash"
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 512
    init_from: str | None = None
    resume: bool = False
    # drafter (fresh init): layer shapes follow the target unless set
    draft_layers: int = 1
    block_size: int = 8
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    draft_intermediate_size: int | None = None
    # objective
    num_anchors: int = 16
    gamma: float | None = None          # None: SpecForge's per-block-size default (7 / 5 / 4)
    fusion_rank: int = 0                # dmtp-lowrank (0: the module's default)
    mtp: str | None = None              # DMTP methods: directory of the frozen MTP head (default: target)
    # optimisation
    lr: float = 6e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    grad_accum: int = 1
    compute_dtype: str = "bfloat16"
    target_dtype: str | None = None     # default: compute_dtype (the frozen target is stored so)
    # memory (same values computed): see step.StepConfig
    ce_chunk: int = 512                 # block rows per sequence whose vocab logits are live at once; 0: all
    remat: str = "full"                 # drafter layers in the backward pass: off | full | dots
    # run
    mesh: str | None = None
    seed: int = 0
    checkpoint_every: int = 100
    stop_at: int | None = None          # stop (with a checkpoint) after this step; schedule spans `steps`
    keep_checkpoints: int = 3
    max_nonfinite: int = 10             # stop after this many consecutive non-finite steps
    progress: bool = True

    def resolved_gamma(self) -> float:
        return float(self.gamma) if self.gamma is not None else default_gamma(self.block_size)

    def run_options(self) -> "RunOptions":
        """What the loop needs of this config."""
        return RunOptions(out=self.out, steps=self.steps, resume=self.resume, stop_at=self.stop_at,
                          checkpoint_every=self.checkpoint_every, keep_checkpoints=self.keep_checkpoints,
                          max_nonfinite=self.max_nonfinite, progress=self.progress,
                          tokens_per_step=self.batch_size * self.seq_len)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids) if self.target_layer_ids else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        check_config_keys(cls, d, "training")
        d = dict(d)
        if d.get("target_layer_ids") is not None:
            d["target_layer_ids"] = tuple(int(i) for i in d["target_layer_ids"])
        return cls(**d)

    def validate(self) -> None:
        for name in ("target", "data", "out"):
            if not getattr(self, name):
                raise InputError(f"--{name} is required")
        for name in ("steps", "batch_size", "seq_len", "draft_layers", "num_anchors", "grad_accum",
                     "max_nonfinite"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        # the decoders' rules (`dmtp_jax/options.py`): a drafter trained here can be decoded with
        check_method(self.method, TRAIN_METHODS, InputError, "training method")
        check_block_size(self.block_size, InputError)
        if self.seq_len < self.block_size + 1:
            raise InputError(f"--seq-len {self.seq_len} is shorter than a block ({self.block_size}) + 1")
        if self.batch_size % self.grad_accum:
            raise InputError(f"--batch-size {self.batch_size} is not a multiple of --grad-accum {self.grad_accum}")
        if self.lr <= 0:
            raise InputError(f"--lr must be positive, got {self.lr}")
        if self.ce_chunk < 0:
            raise InputError(f"--ce-chunk must be >= 0 (0: no chunking), got {self.ce_chunk}")
        if self.remat not in ("off", "full", "dots"):
            raise InputError(f"--remat must be off, full or dots, got '{self.remat}'")


def fresh_drafter_config(cfg: TrainConfig, target_cfg, tokenizer=None):
    """The drafter a run starts from without `--init-from`: `default_drafter_config` with the
    run's layers, block, intermediate size, capture layers and mask token (the tokenizer's mask
    token when it has one).

    Example:
        >>> dcfg = fresh_drafter_config(TrainConfig(draft_layers=2), target.cfg)  # doctest: +SKIP
    """
    from dmtp_jax.models.drafter_shape import default_drafter_config
    mask = cfg.mask_token_id
    if mask is None and tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        mask = int(tokenizer.mask_token_id)
    return default_drafter_config(target_cfg, cfg.draft_layers, cfg.block_size,
                                  intermediate_size=cfg.draft_intermediate_size,
                                  target_layer_ids=cfg.target_layer_ids, mask_token_id=mask)


# ---- checkpoints --------------------------------------------------------------------------------
def checkpoint_manager(out_dir: str, keep: int):
    import orbax.checkpoint as ocp
    return ocp.CheckpointManager(
        os.path.abspath(os.path.join(out_dir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("params", "opt", "meta"))


def save_checkpoint(mngr, state, meta: dict) -> None:
    import orbax.checkpoint as ocp
    step = int(meta["step"])
    mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(jax.tree.leaves(state.params)),
        opt=ocp.args.StandardSave(jax.tree.leaves((state.opt_state, state.step))),
        meta=ocp.args.JsonSave(meta)), force=True)


def restore_checkpoint(mngr, trainer, step: int | None = None):
    """`(TrainState, meta)` of checkpoint `step` (default: the latest)."""
    import orbax.checkpoint as ocp
    from dmtp_jax.train.optim import TrainState
    step = mngr.latest_step() if step is None else step
    abstract = trainer.abstract_state()
    p_leaves, p_def = jax.tree.flatten(abstract.params)
    o_leaves, o_def = jax.tree.flatten((abstract.opt_state, abstract.step))
    got = mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(p_leaves), opt=ocp.args.StandardRestore(o_leaves),
        meta=ocp.args.JsonRestore()))
    opt_state, step_arr = jax.tree.unflatten(o_def, list(got["opt"]))
    return TrainState(jax.tree.unflatten(p_def, list(got["params"])), opt_state, step_arr), got["meta"]


def restore_params(run_dir: str, dcfg, step: int | None = None, method: str = "dflash", fusion_rank: int = 0):
    """The trained params `{"drafter": nnx.State[, "fusion": nnx.State]}` (fp32) of a run's
    checkpoint (default: the latest), and the step."""
    import orbax.checkpoint as ocp
    from dmtp_jax.train.step import StepConfig, abstract_params
    mngr = checkpoint_manager(run_dir, 1000)
    step = mngr.latest_step() if step is None else step
    if step is None:
        from dmtp_jax.checkpoint.safetensors_io import CheckpointError
        raise CheckpointError(f"{run_dir} has no checkpoint")
    _, abstract = abstract_params(dcfg, StepConfig(method=method, fusion_rank=fusion_rank))
    leaves, treedef = jax.tree.flatten(abstract)
    rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(
        [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep) for x in leaves])))
    return jax.tree.unflatten(treedef, list(got["params"])), step


# ---- the run ------------------------------------------------------------------------------------
def setup(cfg: TrainConfig):
    """`(target, params, trainer, batches)`: the loaded target, the drafter's starting params,
    the `Trainer` and its `DrafterBatches`."""
    import jax.numpy as jnp
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter, load_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer
    from dmtp_jax.train.data import BatchIterator, TokenDataset, process_rows
    from dmtp_jax.train.optim import optim_config
    from dmtp_jax.train.step import StepConfig, Trainer

    cfg.validate()
    from dmtp_jax.config import load_target_config
    from dmtp_jax.train.loss import method_layout, uses_mtp
    method_layout(cfg.method, cfg.block_size)           # unknown methods end here
    # cheap checks before any model is loaded: the target's config, the mesh, the data file
    target_cfg = load_target_config(cfg.target)
    mesh = make_mesh(cfg.mesh)
    tokenizer = load_tokenizer(cfg.target)
    dataset = TokenDataset.from_file(cfg.data, cfg.seq_len, tokenizer, target_cfg.vocab_size)
    target = load_target(cfg.target, dtype=cfg.target_dtype or cfg.compute_dtype, mesh=mesh)
    fusion = mtp = None
    if uses_mtp(cfg.method):
        from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
        mtp = load_mtp(cfg.mtp or cfg.target, target.cfg, cfg.target_dtype or cfg.compute_dtype, mesh)
    if cfg.init_from and uses_mtp(cfg.method):
        # a DMTP directory continues with its fusion; a plain DFlash directory starts at zero fusion
        from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
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
        from dmtp_jax.checkpoint.dmtp_ckpt import init_fusion
        fusion = init_fusion(cfg.method, dcfg.hidden_size, dcfg.rms_norm_eps, "float32", mesh,
                             rank=cfg.fusion_rank, seed=cfg.seed)
    scfg = StepConfig(method=cfg.method, block_size=cfg.block_size, num_anchors=cfg.num_anchors,
                      gamma=cfg.resolved_gamma(), grad_accum=cfg.grad_accum,
                      compute_dtype=cfg.compute_dtype, seed=cfg.seed, fusion_rank=cfg.fusion_rank,
                      ce_chunk=cfg.ce_chunk, remat=cfg.remat)
    ocfg = optim_config(cfg)
    trainer = Trainer(target, dcfg, scfg, ocfg, mesh, mtp=mtp)
    shape = (cfg.batch_size, cfg.seq_len)
    batches = DrafterBatches(BatchIterator(dataset, cfg.batch_size, process_rows(trainer.batch_sharding(shape), shape),
                                           seed=cfg.seed), trainer, shape)
    del jnp
    params = {"drafter": drafter.state, **({"fusion": fusion.state} if fusion is not None else {})}
    return target, params, trainer, batches


class DrafterBatches:
    """The drafter's batch source for `run_loop`: this process's `BatchIterator` rows as global
    `[B, L]` arrays (`{"tokens_bt", "loss_mask_bt", "malformed"}`, what `Trainer.step` takes);
    `get_state` / `set_state` are the iterator's (checkpointed with every step).

    Example:
        >>> batch = DrafterBatches(iterator, trainer, (8, 512)).next()  # doctest: +SKIP
    """

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


class TrainerInterface(Protocol):
    """What `run_loop` needs of a trainer; `train.step.Trainer` (drafters) and the demo's
    `train.window.WindowTrainer` (`Pretrainer`, `MtpDistiller`, `FactorDistiller`) implement it."""
    BAR: dict                                    # progress-bar label -> metrics-line field

    def init_state(self, start): ...             # step 0 from `start` (the drafter's params, a seed)
    def abstract_state(self): ...                # ShapeDtypeStructs of the state (checkpoint restores)
    def step(self, state, batch: dict): ...      # -> (state, device metrics); `state` donated
    def evaluate(self, params, batches) -> dict: ...     # held-out metrics, no update
    def record_fields(self, metrics: dict) -> dict: ...  # derived metrics-line fields (host metrics)
    def compile_count(self) -> int: ...


class BatchSource(Protocol):
    """What `run_loop` needs of the data: `DrafterBatches`, `train.window.WindowBatches`."""
    def next(self) -> dict: ...                  # one batch as `step` takes it ("malformed": counted)
    def get_state(self): ...                     # JSON: the position, saved with each checkpoint
    def set_state(self, state) -> None: ...


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What `run_loop` needs of a run, whatever it trains (`TrainConfig.run_options`; the demo's
    `PretrainConfig` / `DistilConfig` fill it too). `tokens_per_step` feeds `tokens_per_s`."""
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
    """`(mngr, state, meta)`: `trainer.init_state(start)` (`meta` None), or with `run.resume` the
    newest checkpoint that restores (and `batches` at its position). Cut-off saves and unreadable
    checkpoints are skipped with a warning (see `resilience`); `metrics.jsonl` is cut back to the
    restored step (a line cut off by a kill dropped)."""
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
    """THE training loop, for every trainer (the drafter's `train.step.Trainer`, the demo's
    `Pretrainer` / `MtpDistiller`): resume or `trainer.init_state(start)`, `run_config.json`,
    then `state, metrics = trainer.step(state, batches.next())` until `run.steps` (or `run.stop_at`),
    one `metrics.jsonl` line per step (`step_record`), checkpoints every `run.checkpoint_every`
    steps and at the end (params, optimizer, step, `batches.get_state()`, non-finite counts), with
    the interference of `resilience` handled: SIGTERM / SIGINT finish the step, checkpoint and
    return (`stopped_by`); a non-finite loss skips its update, `max_nonfinite` in a row raise
    `TrainingStopped` after a checkpoint; a full disk is one `TrainingStopped` line.

    `trainer` implements `TrainerInterface`, `batches` `BatchSource`.

    Returns `(state, summary)`: `first_loss`, `last_loss`, `losses`, `records`, `last` (record), `steps_run`,
    `start_step`, `step` (the last one), `compile_count`, `last_checkpoint`, `tokens_per_s`
    (median, first step left out), `train_seconds`, `nonfinite_steps`, `stopped_by` (the signal,
    or None), `exit_status` (128 + signal, else 0).

    Example:
        >>> run = RunOptions(out="/tmp/run", steps=10)
        >>> state, summary = run_loop(run, trainer, params, batches, {})  # doctest: +SKIP
    """
    from tqdm.auto import tqdm
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
        """The metrics of step `at` are written first (every step once, whatever kills the run)."""
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
                raise resilience.disk_full_error(f"checkpoint {failed}", _latest_complete(run.out)) from None
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


def run_training(cfg: TrainConfig) -> dict:
    """Trains a drafter `cfg.steps` optimizer steps through `run_loop` (resuming when asked);
    returns its summary (without the state) plus `malformed`. Raises `TrainingStopped` after
    `max_nonfinite` non-finite steps in a row (after writing a checkpoint) or on a full disk.

    Example:
        >>> run_training(TrainConfig(target=t, data=d, out=o, steps=10, batch_size=4, seq_len=64))  # doctest: +SKIP
    """
    if not cfg.resume and _latest_complete(cfg.out) is not None:       # before any model is loaded
        raise InputError(f"{cfg.out} already has checkpoints; pass --resume to continue or use a new --out")
    _, params, trainer, batches = setup(cfg)
    _, summary = run_loop(cfg.run_options(), trainer, params, batches,
                          {"train": cfg.to_json(), "drafter": trainer.dcfg.to_hf_dict()})
    malformed = batches.dataset.malformed
    if malformed:
        log.warning("%d malformed records were skipped", malformed)
    return {**summary, "malformed": malformed}


def _latest_complete(run_dir: str) -> int | None:
    """The newest finalized checkpoint on disk (a fresh look, not the manager's cache)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    steps = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()] if os.path.isdir(ckpt_dir) else []
    return max(steps) if steps else None
