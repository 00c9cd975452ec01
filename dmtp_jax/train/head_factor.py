"""`train.py head-factor`: the efficient drafting head's low-rank factor, trained toward the full head.

The efficient head (`models/draft_head.py`) shortlists with low-rank scores `(x A) B` and rescores
the shortlist exactly. Its factor is the truncated SVD of the LM head by default: the best rank-r
approximation of the head's weights, whatever hidden states it is applied to. This trains `A, B`
(starting from that SVD) toward the full head's distribution on the hidden states the drafting side
actually scores: the frozen target's final post-norm hidden states and, when the target has an MTP
head, the MTP's post-norm hidden states (T1), on the drafter's training data. Loss: soft
cross-entropy of `softmax((x A) B)` against `softmax(x W)` (= KL + the teacher's entropy), over the
vocabulary or over a frequency subset (`vocab` N with token counts, `train.py token-counts`).
Metrics: `kl`, `agree` (low-rank argmax == full argmax) and `recall` (the full head's argmax is in
the low-rank top-`shortlist`: the rounds where the shortlist holds the draft the full head would
make).

    python train.py head-factor --target DIR --data FILE --out DRAFTER_DIR --rank 64 [--vocab N]
    python infer.py generate ... --draft-head efficient --draft-head-factor DRAFTER_DIR

Writes `DRAFTER_DIR/head_factor.safetensors` (`down [H, r]`, `up [r, C]` fp32, and `ids [C]` for a
subset) at the end; the run itself (checkpoints, `metrics.jsonl`, `--resume`, signals) is the one
training loop's (`train/loop.py:run_loop`) in `DRAFTER_DIR/head_factor_run`. One device: the target
is not sharded here.

Example:
    >>> summary = train_head_factor(FactorConfig(target="t", data="d.jsonl", out="drafter"))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.demo.pretrain import WindowRunConfig, WindowTrainer
from dmtp_jax.errors import InputError
from dmtp_jax.models.draft_head import HEAD_FACTOR


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


def factor_loss(params: dict, frozen: dict, target_graphdef, mtp_graphdef, tokens_bt: jax.Array, tied: bool,
                shortlist: int) -> tuple[jax.Array, dict]:
    """`(soft cross-entropy, metrics)` of the low-rank scores `(x A) B` against the full head's
    `softmax(x W)` at every position of `tokens_bt` (`x`: the target's and the MTP's post-norm
    hidden states; `W`: the head's columns at `frozen["ids"]`, or all of them). Pure.

    Example:
        >>> loss, m = factor_loss(params, frozen, tgd, mgd, tokens_bt, False, 256)  # doctest: +SKIP
        >>> sorted(m)  # doctest: +SKIP
        ['agree', 'kl', 'recall']
    """
    from dmtp_jax.models.draft_head import subset_columns
    from dmtp_jax.train.features import mtp_hidden

    target = nnx.merge(target_graphdef, frozen["target"])
    positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    hidden = jax.lax.stop_gradient(target(tokens_bt, positions).hidden_bth)
    xs = [hidden]
    if mtp_graphdef is not None:
        mtp = nnx.merge(mtp_graphdef, frozen["mtp"])
        xs.append(jax.lax.stop_gradient(mtp.post_norm(mtp_hidden(mtp, target, tokens_bt, hidden)[:, 1:])))
    x = jnp.concatenate([a.reshape(-1, a.shape[-1]) for a in xs]).astype(jnp.float32)
    w_hc = subset_columns(target.head_weight(), frozen["ids"], tied).astype(jnp.float32)
    valid = jnp.ones(w_hc.shape[1], bool) if frozen["ids"] is None else frozen["ids"] >= 0
    teacher = jax.nn.log_softmax(jnp.where(valid, x @ w_hc, -jnp.inf), axis=-1)
    student = jax.nn.log_softmax(jnp.where(valid, (x @ params["down"]) @ params["up"], -jnp.inf), axis=-1)
    p = jnp.exp(teacher)
    soft_ce = -jnp.sum(jnp.where(valid, p * student, 0.0), axis=-1).mean()
    kl = jnp.sum(jnp.where(valid, p * (teacher - student), 0.0), axis=-1).mean()
    best = jnp.argmax(teacher, -1)
    _, top = jax.lax.top_k(student, min(shortlist, w_hc.shape[1]))
    recall = jnp.any(top == best[:, None], axis=-1).astype(jnp.float32).mean()
    agree = (jnp.argmax(student, -1) == best).astype(jnp.float32).mean()
    return soft_ce, {"kl": kl, "agree": agree, "recall": recall}


class FactorDistiller(WindowTrainer):
    """`factor_loss` as a `train.loop.run_loop` trainer: params `{"down", "up"}` (fp32, from the given
    efficient head's factor), the target, MTP and subset ids frozen.

    Example:
        >>> d = FactorDistiller(target, mtp, head, OptimConfig(total_steps=10))  # doctest: +SKIP
    """

    BAR = {"kl": "kl", "recall": "recall"}

    def __init__(self, target, mtp, head, ocfg):
        model = nnx.merge(head.graphdef, head.state)
        self.target_graphdef, self.tied = target.graphdef, target.cfg.tie_word_embeddings
        self.mtp_graphdef = None if mtp is None else mtp.graphdef
        self.shortlist = model.shortlist
        self.initial = {k: jnp.asarray(getattr(model, k)[...], jnp.float32) for k in ("down", "up")}
        frozen = {"target": target.state, "mtp": None if mtp is None else mtp.state,
                  "ids": model.ids[...] if model.subset else None}
        super().__init__(ocfg, jax.eval_shape(lambda: self.initial), frozen)

    def initial_params(self, seed: int) -> dict:
        """The given head's factor (`seed` unused)."""
        del seed
        return self.initial

    def loss(self, params, frozen, tokens_bt):
        return factor_loss(params, frozen, self.target_graphdef, self.mtp_graphdef, tokens_bt, self.tied,
                           self.shortlist)


def train_head_factor(cfg: FactorConfig) -> dict:
    """Trains the factor (`FactorDistiller` in `run_loop`), evaluates the SVD start and the trained
    factor on other random windows of the same data (drawn with `seed + 1`), and writes
    `<out>/head_factor.safetensors`; returns the summary (also `<run>/summary.json`). A run stopped by
    a signal writes no factor and resumes with `resume`.

    Example: see the module docstring.
    """
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import has_mtp, load_mtp
    from dmtp_jax.checkpoint.safetensors_io import write_safetensors
    from dmtp_jax.config import load_target_config
    from dmtp_jax.demo.pretrain import WindowBatches, window_run_options
    from dmtp_jax.models.draft_head import make_efficient_head, read_token_counts
    from dmtp_jax.tokenizer import load_tokenizer
    from dmtp_jax.train.data import TokenDataset, token_stream
    from dmtp_jax.train.loop import run_loop
    from dmtp_jax.train.step import optim_config

    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.seq_len < 2:
        raise InputError(f"--steps and --batch-size must be >= 1 and --seq-len >= 2, got {cfg.steps}, "
                         f"{cfg.batch_size}, {cfg.seq_len}")
    vocab = load_target_config(cfg.target).vocab_size       # the data is checked before any weights load
    dataset = TokenDataset.from_file(cfg.data, cfg.seq_len, load_tokenizer(cfg.target), vocab)
    target = load_target(cfg.target, "float32")
    mtp_dir = cfg.mtp or cfg.target
    mtp = load_mtp(mtp_dir, target.cfg, "float32") if has_mtp(mtp_dir) else None
    counts = read_token_counts(cfg.counts or cfg.out, target.cfg.vocab_size) if cfg.vocab else None
    head = make_efficient_head(target, cfg.rank, cfg.shortlist, counts, cfg.vocab)
    stream = token_stream(dataset.records, target.cfg.eos_token_ids[0] if target.cfg.eos_token_ids else 0,
                          dataset.tokenizer, vocab, cfg.seq_len)
    if len(stream) < cfg.seq_len + 1:
        raise InputError(f"{cfg.data}: {len(stream)} tokens, fewer than one window of --seq-len {cfg.seq_len} + 1")
    ocfg = optim_config(cfg)
    distiller = FactorDistiller(target, mtp, head, ocfg)
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
