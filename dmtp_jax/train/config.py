"""A drafter training run's configuration (`TrainConfig`, validated once with the decoders' rules)
and the fresh drafter it starts from."""

from __future__ import annotations

import dataclasses

from dmtp_jax.config import check_config_keys
from dmtp_jax.errors import InputError
from dmtp_jax.models.drafter_shape import default_drafter_config
from dmtp_jax.options import TRAIN_METHODS, check_block_size, check_method
from dmtp_jax.train.loop import RunOptions


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
    """The drafter a run starts from without `--init-from`: `default_drafter_config` with the run's
    layers, block, intermediate size, capture layers and mask token."""
    mask = cfg.mask_token_id
    if mask is None and tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        mask = int(tokenizer.mask_token_id)
    return default_drafter_config(target_cfg, cfg.draft_layers, cfg.block_size,
                                  intermediate_size=cfg.draft_intermediate_size,
                                  target_layer_ids=cfg.target_layer_ids, mask_token_id=mask)
