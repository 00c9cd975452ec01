"""`train.py head-factor`: the efficient drafting head's low-rank factor `A, B`, trained from the
SVD start so that `softmax((x A) B)` matches the full head's `softmax(x W)` on the target's (and
MTP's) post-norm hidden states; writes `DRAFTER_DIR/head_factor.safetensors` (`down [H, r]`,
`up [r, C]`, `ids [C]` for a subset). Usage: docs/training.md."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.train.window import WindowBatches, WindowRunConfig, WindowTrainer, window_run_options
from dmtp_jax.errors import InputError
from dmtp_jax.options import check_ce_chunk, check_draft_head_applies, check_positive_int
from dmtp_jax.checkpoint.draft_head_ckpt import HEAD_FACTOR, make_efficient_head, read_token_counts
from dmtp_jax.models.qwen3 import lm_head_logits
from dmtp_jax.models.draft_head import subset_columns
from dmtp_jax.train.features import mtp_hidden
from dmtp_jax.train.loss import map_row_chunks
from dmtp_jax.checkpoint import hf as hf_checkpoint     # looked up at call time: the no-load guards of the tests patch hf.load_target
from dmtp_jax.checkpoint.mtp_ckpt import has_mtp, load_mtp
from dmtp_jax.checkpoint.safetensors_io import write_safetensors
from dmtp_jax.config import load_target_config
from dmtp_jax.sharding import make_mesh
from dmtp_jax.tokenizer import load_tokenizer
from dmtp_jax.train.data import TokenDataset, token_stream
from dmtp_jax.train.loop import run_loop
from dmtp_jax.train.optim import optim_config


@dataclasses.dataclass
class FactorConfig(WindowRunConfig):
    """`train.py head-factor`'s settings (flags fill it); the optimisation and run fields are
    `WindowRunConfig`'s."""
    target: str = ""
    data: str = ""                      # the drafter's training data (any layout `train/data.py` reads)
    out: str = ""                       # the drafter directory: writes head_factor.safetensors
    mtp: str | None = None              # MTP head directory (default: the target's, if it has one)
    rank: int | None = None             # default: `head_shape`'s
    shortlist: int | None = None        # K of the recall metric (default: `head_shape`'s)
    vocab: int | None = None            # a frequency subset of N ids (token counts needed)
    counts: str | None = None           # default: `out`'s token_counts.npy
    mesh: str | None = None             # e.g. "tensor=4" (default: one device); the batch splits over data / fsdp
    target_dtype: str = "float32"       # the frozen target's and MTP's weights ("bfloat16" at real sizes)
    ce_chunk: int = 256                 # rows per sequence whose vocabulary scores are live at once; 0: all


def check_factor_shape(batch_size: int, seq_len: int, ce_chunk: int, target_dtype: str) -> None:
    """The head-factor step's shape flags (`train.py head-factor` and its `plan`), checked once;
    `InputError` when out of range."""
    if batch_size < 1 or seq_len < 2:
        raise InputError(f"--batch-size must be >= 1 and --seq-len >= 2, got {batch_size}, {seq_len}")
    check_ce_chunk(ce_chunk)
    if target_dtype not in ("float32", "bfloat16", "float16"):
        raise InputError(f"--target-dtype must be float32, bfloat16 or float16, got {target_dtype}")


def factor_rows(params: dict, w_hc: jax.Array, valid_c: jax.Array, x_bch: jax.Array, shortlist: int) -> jax.Array:
    """`[B, c, 4]` per row of `x_bch` (post-norm hidden states, the target's dtype): soft
    cross-entropy, KL, argmax agreement and recall@`shortlist` of the low-rank scores `(x A) B`
    (`params["down"]`, `params["up"]`, fp32) against the full head's `softmax(x W)` (`w_hc`: the
    head's columns, `lm_head_logits`' fp32 accumulation, as inference scores). `valid_c`: the
    columns that are ids (a subset's padding is not). Pure.

    Example:
        >>> p = {"down": jnp.eye(2), "up": jnp.eye(2)}
        >>> r = factor_rows(p, jnp.eye(2), jnp.ones(2, bool), jnp.array([[[3.0, 0.0]]]), 1)
        >>> [round(float(v), 4) for v in r[0, 0]]      # the factor equals the head: CE = entropy, KL 0
        [0.1909, 0.0, 1.0, 1.0]
    """
    teacher = jax.nn.log_softmax(jnp.where(valid_c, lm_head_logits(x_bch, w_hc, tied=False), -jnp.inf), axis=-1)
    low_rank = (x_bch.astype(jnp.float32) @ params["down"]) @ params["up"]
    student = jax.nn.log_softmax(jnp.where(valid_c, low_rank, -jnp.inf), axis=-1)
    p = jnp.exp(teacher)
    soft_ce = -jnp.sum(jnp.where(valid_c, p * student, 0.0), axis=-1)
    kl = jnp.sum(jnp.where(valid_c, p * (teacher - student), 0.0), axis=-1)
    best = jnp.argmax(teacher, -1)
    _, top = jax.lax.top_k(student, min(shortlist, w_hc.shape[1]))
    recall = jnp.any(top == best[..., None], axis=-1)
    agree = jnp.argmax(student, -1) == best
    return jnp.stack([v.astype(jnp.float32) for v in (soft_ce, kl, agree, recall)], axis=-1)


def factor_loss(params: dict, frozen: dict, target_graphdef, mtp_graphdef, tokens_bt: jax.Array, tied: bool,
                shortlist: int, chunk: int = 0) -> tuple[jax.Array, dict]:
    """`(soft cross-entropy, metrics {"agree", "kl", "recall"})` of the low-rank scores `(x A) B`
    against the full head's `softmax(x W)` at every position of `tokens_bt` (`x`: the target's and the
    MTP's post-norm hidden states; `W`: the head's columns at `frozen["ids"]`, or all), means over the
    rows of `factor_rows`. `chunk` > 0: `train.loss.map_row_chunks` (at most one slice's
    `[B, chunk, V]` scores live); 0: all rows at once. Pure."""
    target = nnx.merge(target_graphdef, frozen["target"])
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    hidden = jax.lax.stop_gradient(target(tokens_bt, positions).hidden_bth)
    xs = [hidden]
    if mtp_graphdef is not None:
        mtp = nnx.merge(mtp_graphdef, frozen["mtp"])
        xs.append(jax.lax.stop_gradient(mtp.post_norm(mtp_hidden(mtp, target, tokens_bt, hidden)[:, 1:])))
    x_brh = jnp.concatenate([a.astype(target.dtype) for a in xs], axis=1)      # [B, rows, H]
    w_hc = subset_columns(target.head_weight(), frozen["ids"], tied)
    valid_c = jnp.ones(w_hc.shape[1], bool) if frozen["ids"] is None else frozen["ids"] >= 0
    rows_br4 = map_row_chunks(lambda w, x: factor_rows(*w, x, shortlist), chunk, (params, w_hc, valid_c), x_brh)
    soft_ce, kl, agree, recall = rows_br4.mean(axis=(0, 1))
    return soft_ce, {"kl": kl, "agree": agree, "recall": recall}


def factor_window_loss(target_graphdef, mtp_graphdef, tied: bool, shortlist: int, chunk: int, params, frozen,
                       tokens_bt):
    """`factor_loss` as a `WindowTrainer` loss."""
    return factor_loss(params, frozen, target_graphdef, mtp_graphdef, tokens_bt, tied, shortlist, chunk)


class FactorDistiller(WindowTrainer):
    """`factor_loss` as a `train.loop.run_loop` trainer: params `{"down", "up"}` (fp32, from the given
    efficient head's factor), the target, MTP and subset ids frozen, all on the target's mesh. Works on
    weightless models too (`lower_step` only: `train.py plan --job head-factor`)."""

    BAR = {"kl": "kl", "recall": "recall"}

    def __init__(self, target, mtp, head, ocfg, chunk: int = 0):
        model = nnx.merge(head.graphdef, head.state)
        self.target_graphdef, self.tied = target.graphdef, target.cfg.tie_word_embeddings
        self.mtp_graphdef = None if mtp is None else mtp.graphdef
        self.shortlist, self.chunk = model.shortlist, chunk
        self.start = {k: getattr(model, k).get_value() for k in ("down", "up")}
        frozen = {"target": target.state, "mtp": None if mtp is None else mtp.state,
                  "ids": model.ids.get_value() if model.subset else None}
        loss_fn = functools.partial(factor_window_loss, self.target_graphdef, self.mtp_graphdef, self.tied,
                                    self.shortlist, chunk)
        super().__init__(ocfg, {k: jax.ShapeDtypeStruct(v.shape, jnp.float32) for k, v in self.start.items()},
                         loss_fn, frozen, target.mesh)

    @property
    def initial(self) -> dict:
        """The given head's factor in fp32, replicated on the mesh."""
        return jax.device_put({k: jnp.asarray(v, jnp.float32) for k, v in self.start.items()}, self.replicated)

    def initial_params(self, seed: int) -> dict:
        """The given head's factor (`seed` unused)."""
        del seed
        return self.initial


def train_head_factor(cfg: FactorConfig) -> dict:
    """Trains the factor (`FactorDistiller` in `run_loop`), evaluates the SVD start and the trained
    factor on other random windows of the same data, and writes `<out>/head_factor.safetensors`;
    returns the summary (also `<run>/summary.json`). A run stopped by a signal writes no factor and
    resumes with `resume`."""
    check_factor_shape(cfg.batch_size, cfg.seq_len, cfg.ce_chunk, cfg.target_dtype)
    check_positive_int("--steps", cfg.steps)
    mesh = make_mesh(cfg.mesh)
    tcfg = load_target_config(cfg.target)                   # the data is checked before any weights load
    dataset = TokenDataset.from_file(cfg.data, cfg.seq_len, load_tokenizer(cfg.target), tcfg.vocab_size)
    mtp_dir = cfg.mtp or cfg.target
    mtp = load_mtp(mtp_dir, tcfg, cfg.target_dtype, mesh) if has_mtp(mtp_dir) else None
    check_draft_head_applies(f"head-factor --mtp {mtp_dir}", None if mtp is None else mtp.cfg, InputError)
    target = hf_checkpoint.load_target(cfg.target, cfg.target_dtype, mesh=mesh)
    counts = read_token_counts(cfg.counts or cfg.out, target.cfg.vocab_size) if cfg.vocab else None
    head = make_efficient_head(target, cfg.rank, cfg.shortlist, counts, cfg.vocab)
    stream = token_stream(dataset.records, target.cfg.eos_token_ids[0] if target.cfg.eos_token_ids else 0,
                          dataset.tokenizer, tcfg.vocab_size, cfg.seq_len)
    if len(stream) < cfg.seq_len + 1:
        raise InputError(f"{cfg.data}: {len(stream)} tokens, fewer than one window of --seq-len {cfg.seq_len} + 1")
    ocfg = optim_config(cfg)
    distiller = FactorDistiller(target, mtp, head, ocfg, cfg.ce_chunk)
    run_dir = os.path.join(cfg.out, "head_factor_run")
    state, run = run_loop(window_run_options(cfg, run_dir), distiller, cfg.seed,
                          WindowBatches(stream, cfg.batch_size, cfg.seq_len + 1, cfg.seed),
                          {"head_factor": dataclasses.asdict(cfg)})
    if run["stopped_by"]:
        return {k: v for k, v in run.items() if k not in ("records", "losses")}
    held = WindowBatches(stream, cfg.batch_size, cfg.seq_len + 1, cfg.seed + 1)
    batches = [held.batch(i) for i in range(cfg.eval_batches)]
    evaluation = {"svd": distiller.evaluate(distiller.initial, batches),
                  "trained": distiller.evaluate(state.params, batches)}
    tensors = {k: np.asarray(v, np.float32) for k, v in jax.device_get(state.params).items()}
    if distiller.frozen["ids"] is not None:
        tensors["ids"] = np.asarray(distiller.frozen["ids"], np.int32)
    write_safetensors(os.path.join(cfg.out, HEAD_FACTOR), tensors)
    summary = {"path": os.path.join(cfg.out, HEAD_FACTOR), "head": head.cfg, "steps": run["step"],
               "train_seconds": run["train_seconds"], "eval": evaluation}
    with open(os.path.join(run_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    return summary
