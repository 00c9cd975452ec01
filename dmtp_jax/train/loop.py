"""The training loop: config, drafter set-up, orbax checkpoints, metrics, progress bar.

Run directory layout (`--out DIR`):

* `run_config.json` -- the `TrainConfig` and the drafter's HF config (what `export` needs);
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

import jax
import numpy as np

from dmtp_jax.errors import InputError
from dmtp_jax.options import TRAIN_METHODS, check_block_size, check_method
from dmtp_jax.train import resilience

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

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids) if self.target_layer_ids else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        from dmtp_jax.cli import check_config_keys
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
    from dmtp_jax.train.step import TrainState
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


# ---- metrics ------------------------------------------------------------------------------------
def step_record(step: int, metrics: dict, tokens: int, seconds: float, malformed: int, known: int = 1,
                base: int | None = None) -> dict:
    """The metrics line of one step (host values)."""
    from dmtp_jax.train.loss import acceptance_proxy
    acc_k, acc, accept_len = acceptance_proxy(np.asarray(metrics["correct_k"]).tolist(),
                                              np.asarray(metrics["count_k"]).tolist(), known, base)
    return {"step": step, "loss": float(metrics["loss"]), "acc": acc, "acc_k": acc_k,
            "accept_len_proxy": accept_len, "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]), "weight_sum": float(metrics["weight_sum"]),
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "step_s": seconds,
            "malformed": malformed, "nonfinite": int(metrics.get("nonfinite", 0))}


class _Tensorboard:
    def __init__(self, out_dir: str, enabled: bool):
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(os.path.join(out_dir, "tb"))
            except Exception:   # tensorboard not installed: JSONL only
                self.writer = None

    def add(self, rec: dict) -> None:
        if self.writer is not None:
            for k in ("loss", "acc", "accept_len_proxy", "grad_norm", "lr", "tokens_per_s"):
                self.writer.add_scalar(k, rec[k], rec["step"])

    def close(self):
        if self.writer is not None:
            self.writer.close()


# ---- the run ------------------------------------------------------------------------------------
def setup(cfg: TrainConfig):
    """Loads the target, builds the drafter config, the trainer and the data iterator."""
    import jax.numpy as jnp
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter, load_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.sharding import make_mesh
    from dmtp_jax.tokenizer import load_tokenizer
    from dmtp_jax.train.data import BatchIterator, TokenDataset, process_rows
    from dmtp_jax.train.step import OptimConfig, StepConfig, Trainer

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
        drafter, fusion = load_dmtp_drafter(cfg.init_from, target.cfg, cfg.method, "float32", mesh)
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
    ocfg = OptimConfig(lr=cfg.lr, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                       min_lr_ratio=cfg.min_lr_ratio, weight_decay=cfg.weight_decay,
                       max_grad_norm=cfg.max_grad_norm)
    trainer = Trainer(target, dcfg, scfg, ocfg, mesh, mtp=mtp)
    shape = (cfg.batch_size, cfg.seq_len)
    batches = BatchIterator(dataset, cfg.batch_size, process_rows(trainer.batch_sharding(shape), shape),
                            seed=cfg.seed)
    del jnp
    params = {"drafter": drafter.state, **({"fusion": fusion.state} if fusion is not None else {})}
    return target, params, trainer, batches


def write_run_config(cfg: TrainConfig, dcfg) -> None:
    if jax.process_index() != 0:
        return
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, RUN_CONFIG), "w") as fh:
        json.dump({"train": cfg.to_json(), "drafter": dcfg.to_hf_dict()}, fh, indent=2)


def resume_or_init(cfg: TrainConfig, trainer, params, batches):
    """`(mngr, state, meta)`: a fresh state (`meta` None), or with `cfg.resume` the newest
    checkpoint that restores. Cut-off saves and unreadable checkpoints are skipped with a warning
    (see `resilience`); `metrics.jsonl` is cut back to the restored step."""
    lead = jax.process_index() == 0
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    mngr = checkpoint_manager(cfg.out, cfg.keep_checkpoints)
    steps = list(mngr.all_steps())
    if steps and not cfg.resume:
        raise InputError(f"{cfg.out} already has checkpoints; pass --resume to continue or use a new --out")
    if not cfg.resume or not (steps or resilience.cut_off_saves(ckpt_dir)):
        if lead and os.path.isfile(metrics_path):
            os.remove(metrics_path)
        return mngr, trainer.init_state(params), None
    if lead:
        resilience.discard_cut_off_saves(ckpt_dir)
    if not steps:
        log.warning("no complete checkpoint to resume from: starting at step 0")
        if lead and os.path.isfile(metrics_path):
            os.remove(metrics_path)
        return mngr, trainer.init_state(params), None

    def restore(step):
        state, meta = restore_checkpoint(mngr, trainer, step)
        if int(meta["step"]) != step:
            raise ValueError(f"meta says step {meta['step']}")
        return state, meta

    def quarantine(step):
        if lead:
            log.warning("moved checkpoint %d to %s", step, resilience.quarantine_checkpoint(cfg.out, step))

    step, (state, meta) = resilience.restore_latest_good(steps, restore, quarantine)
    log.info("resuming from checkpoint %d", step)
    if step != max(steps):             # the manager must forget the moved checkpoints
        mngr.close()
        mngr = checkpoint_manager(cfg.out, cfg.keep_checkpoints)
    batches.set_state(meta["data"])
    if lead:
        resilience.truncate_metrics(metrics_path, step)
    return mngr, state, meta


def run_training(cfg: TrainConfig) -> dict:
    """Trains `cfg.steps` optimizer steps (resuming when asked); returns a summary dict
    (`first_loss`, `last_loss`, `steps_run`, `compile_count`, `tokens_per_s`, `last_checkpoint`,
    `stopped_by` (the signal that stopped the run, or None), `exit_status` (128 + signal, else 0),
    `nonfinite_steps`). Raises `TrainingStopped` after `max_nonfinite` non-finite steps in a row
    (after writing a checkpoint) or on a full disk.

    Example:
        >>> run_training(TrainConfig(target=t, data=d, out=o, steps=10, batch_size=4, seq_len=64))  # doctest: +SKIP
    """
    from tqdm.auto import tqdm
    if not cfg.resume and _latest_complete(cfg.out) is not None:       # before any model is loaded
        raise InputError(f"{cfg.out} already has checkpoints; pass --resume to continue or use a new --out")
    target, params, trainer, batches = setup(cfg)
    mngr, state, meta = resume_or_init(cfg, trainer, params, batches)
    start = int(meta["step"]) if meta else 0
    guard = resilience.NonFiniteGuard(cfg.max_nonfinite, **(meta or {}).get("nonfinite", {}))
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    lead = jax.process_index() == 0
    write_run_config(cfg, trainer.dcfg)
    del params
    shape = (cfg.batch_size, cfg.seq_len)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    from dmtp_jax.train.loss import method_layout, uses_mtp
    # (known slots, base): DMTP counts MTP's T1 as given; dmtp-adaptive's proxy is its DFlash mode
    proxy_layout = (method_layout(cfg.method, cfg.block_size)[1],
                    2 if uses_mtp(cfg.method) and cfg.method != "dmtp-adaptive" else 1)
    tb = _Tensorboard(cfg.out, lead)
    bar = tqdm(total=cfg.steps, initial=start, disable=not (cfg.progress and lead), unit="step",
               dynamic_ncols=True)
    records, last_saved, step = [], start, start
    pending = None          # (step, metrics, malformed): logged one step behind
    t_prev = time.perf_counter()
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
        rec = step_record(s, metrics, tokens_per_step, now - t_prev, malformed, *proxy_layout)
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
        too_many_nonfinite |= guard.update(s, finite=not rec["nonfinite"])
        pending = None
        bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['acc']:.3f}",
                        tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
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
                cut = [s for s, _ in resilience.cut_off_saves(os.path.join(cfg.out, "checkpoints"))]
                failed = min(cut) if cut else at             # an async save fails at the next call
                raise resilience.disk_full_error(f"checkpoint {failed}", _latest_complete(cfg.out)) from None
            raise
        last_saved = at

    with resilience.DropTracebacks("Event loop is closed"):   # orbax's teardown after a failed save
        try:
            with resilience.StopSignals() as signals:
                end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
                while step < end:
                    local = batches.next()
                    tokens_bt, loss_mask_bt = trainer.global_batch(local, shape)
                    state, metrics = trainer.step(state, target.state, tokens_bt, loss_mask_bt)
                    step += 1
                    data_state = batches.get_state()        # the iterator position that matches `state`
                    if pending is not None:
                        flush()                              # the previous step's line
                    pending = (step, metrics, local["malformed"])
                    if guard.streak >= guard.limit - 1:
                        flush()                              # this step may complete the limit: check it now
                    stop = resilience.agreed(signals.requested is not None or too_many_nonfinite)
                    if stop or step == end:
                        break
                    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
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
    malformed_total = batches.dataset.malformed
    if malformed_total:
        log.warning("%d malformed records were skipped", malformed_total)
    timed = [r["tokens_per_s"] for r in records[1:]] or [r["tokens_per_s"] for r in records]
    return {"first_loss": records[0]["loss"] if records else None,
            "last_loss": records[-1]["loss"] if records else None,
            "losses": [r["loss"] for r in records], "steps_run": len(records), "start_step": start,
            "compile_count": trainer.compile_count(), "last_checkpoint": last_saved,
            "tokens_per_s": float(np.median(timed)) if timed else 0.0, "malformed": malformed_total,
            "nonfinite_steps": guard.total, "stopped_by": stopped_by, "exit_status": signals.exit_status,
            "records": records}


def _latest_complete(run_dir: str) -> int | None:
    """The newest finalized checkpoint on disk (a fresh look, not the manager's cache)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    steps = [int(n) for n in os.listdir(ckpt_dir) if n.isdigit()] if os.path.isdir(ckpt_dir) else []
    return max(steps) if steps else None
