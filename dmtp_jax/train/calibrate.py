"""dmtp-adaptive's arbitration threshold, calibrated on target-written text (never on eval prompts).

Teacher forcing on the target's greedy text scores each anchor A in both modes as greedy
verification would (tokens committed: accepted drafts + bonus):

    MTP mode    : 1 + (MTP's T1 == x_{A+1}) * (1 + matching prefix of the drafter's T2..T7)
    DFlash mode : 1 + matching prefix of the drafter's own T1..T7

The threshold maximises the mean committed tokens over a grid of MTP top-1 probabilities (0:
always MTP, above 1: never). Usage: docs/training.md#dmtp-adaptive-calibrate-its-threshold."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.config import read_config_json
from dmtp_jax.errors import InputError
from dmtp_jax.models.fusion import mtp_first_candidate
from dmtp_jax.options import NEVER_MTP_THRESHOLD
from dmtp_jax.train.anchors import sample_anchors
from dmtp_jax.train.data import TokenDataset
from dmtp_jax.train.features import mtp_hidden, reads_target_kv, target_features
from dmtp_jax.train.loss import block_inputs, drafter_block_logits

GRID = tuple(round(0.05 * i, 2) for i in range(21)) + (NEVER_MTP_THRESHOLD,)     # never MTP's T1


@dataclasses.dataclass
class CalibrateConfig:
    target: str = ""
    draft: str = ""                 # a dmtp-adaptive drafter directory (its config.json is updated)
    data: str = ""                  # target-written records (`train.py regen` output)
    mtp: str | None = None          # MTP head directory (default: the target's)
    seq_len: int = 256
    batch_size: int = 8
    num_anchors: int = 32
    dtype: str = "float32"
    write: bool = True


def anchor_outcomes(target, mtp, drafter, fusion, tokens_bt, loss_mask_bt, anchors_bn, keep_bn):
    """Per anchor, all `[B, N]`: MTP top-1 probability, and the tokens the round commits in MTP mode and
    in DFlash mode (teacher-forced greedy)."""

    dcfg = drafter.cfg
    valid_bt = loss_mask_bt >= 0
    feats, hidden, target_kv = target_features(target, tokens_bt, valid_bt, dcfg, keep_kv=reads_target_kv(mtp))
    mtp_state = mtp_hidden(mtp, target, tokens_bt, hidden, target_kv)
    mtp_h = mtp.feature(mtp_state)                                     # the fusion's MTP feature
    h_a = jnp.take_along_axis(mtp_state, anchors_bn[..., None], axis=1)
    _, mtp_logits, top_p = mtp_first_candidate(target, mtp, h_a)     # the decode round's confidence
    x_next = jnp.take_along_axis(tokens_bt, anchors_bn + 1, axis=1)
    mtp_right = jnp.argmax(mtp_logits, -1) == x_next
    committed = {}
    for masked in (False, True):
        t1_masked = jnp.full(anchors_bn.shape, masked)
        blocks = block_inputs("dmtp-adaptive", tokens_bt, loss_mask_bt, anchors_bn, keep_bn, dcfg.block_size,
                              mask_token_id=dcfg.mask_token_id, gamma=None, t1_masked_bn=t1_masked)
        logits = drafter_block_logits(drafter, target, feats, valid_bt, blocks, anchors_bn, method="dmtp-adaptive",
                                      fusion=fusion, mtp_h_bth=mtp_h, t1_masked_bn=t1_masked)
        b, n, k = blocks.labels_bnk.shape
        hit = jnp.argmax(logits.reshape(b, n, k, -1), -1) == blocks.labels_bnk       # rows 0..k-1
        first = 1 if masked else 2
        run = jnp.cumprod(hit[..., first:], axis=-1).sum(-1)
        committed[masked] = 1 + run if masked else 1 + mtp_right * (1 + run)
    return top_p, committed[False], committed[True]


def calibration_table(top_p, tokens_mtp, tokens_drafter, grid=GRID) -> list[dict]:
    """Per threshold: expected tokens per verify and the fraction of rounds given MTP's T1.

    Example:
        >>> t = calibration_table(np.array([0.9, 0.2]), np.array([3, 1]), np.array([2, 2]), grid=(0.0, 0.5, 1.01))
        >>> [(r["threshold"], r["tokens_per_verify"], r["mtp_fraction"]) for r in t]
        [(0.0, 2.0, 1.0), (0.5, 2.5, 0.5), (1.01, 2.0, 0.0)]
    """
    top_p, tokens_mtp, tokens_drafter = (np.asarray(x, np.float64) for x in (top_p, tokens_mtp, tokens_drafter))
    out = []
    for t in grid:
        use = top_p >= t
        out.append({"threshold": float(t), "tokens_per_verify": float(np.where(use, tokens_mtp, tokens_drafter).mean()),
                    "mtp_fraction": float(use.mean())})
    return out


def best_threshold(table: list[dict]) -> dict:
    """The row of the highest expected tokens per verify (the lowest threshold among ties)."""
    return max(table, key=lambda r: (r["tokens_per_verify"], -r["threshold"]))


def run_calibrate(cfg: CalibrateConfig) -> dict:
    """Collects anchor outcomes over `cfg.data`, picks the threshold and writes it (and the table, as
    `calibration.json`) into the drafter directory; returns the summary."""

    stored = read_config_json(cfg.draft).get("dmtp_config") or {}
    if stored.get("method") != "dmtp-adaptive":
        raise InputError(f"{cfg.draft} is not a dmtp-adaptive drafter (dmtp_config.method is "
                         f"'{stored.get('method')}')")
    target = load_target(cfg.target, cfg.dtype)
    mtp = load_mtp(cfg.mtp or cfg.target, target.cfg, cfg.dtype, target.mesh)
    drafter, fusion = load_dmtp_drafter(cfg.draft, target.cfg, "dmtp-adaptive", cfg.dtype, target.mesh)
    dataset = TokenDataset.from_file(cfg.data, cfg.seq_len, vocab_size=target.cfg.vocab_size)
    block = drafter.cfg.block_size

    @jax.jit
    def outcomes(states, tokens_bt, loss_mask_bt, key):
        t, m, d, f = (nnx.merge(x.graphdef, s) for x, s in zip((target, mtp, drafter, fusion), states))
        anchors, keep = sample_anchors(key, loss_mask_bt, cfg.num_anchors, block, first_label=block - 1,
                                       min_anchor=1)
        return (*anchor_outcomes(t, m, d, f, tokens_bt, loss_mask_bt, anchors, keep), keep)

    states = tuple(x.state for x in (target, mtp, drafter, fusion))
    got = {"top_p": [], "mtp": [], "drafter": []}
    for start in tqdm(range(0, len(dataset), cfg.batch_size), unit="batch", desc="calibrate"):
        rows = [dataset.encode(i) for i in range(start, min(start + cfg.batch_size, len(dataset)))]
        rows += [rows[-1]] * (cfg.batch_size - len(rows))          # fixed shape: repeat, then drop
        real = min(cfg.batch_size, len(dataset) - start)
        tokens = np.stack([r[0] for r in rows]).astype(np.int32)
        mask = np.stack([r[1] for r in rows]).astype(np.int32)
        top_p, t_mtp, t_own, keep = (np.asarray(x)[:real] for x in outcomes(
            states, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(start)))
        for name, x in (("top_p", top_p), ("mtp", t_mtp), ("drafter", t_own)):
            got[name].append(x[keep])
    top_p, t_mtp, t_own = (np.concatenate(got[k]) for k in ("top_p", "mtp", "drafter"))
    if not len(top_p):
        raise InputError(f"{cfg.data}: no anchor with {block} target-written tokens after it")
    table = calibration_table(top_p, t_mtp, t_own)
    best = best_threshold(table)
    summary = {"anchors": int(len(top_p)), "threshold": best["threshold"],
               "tokens_per_verify": best["tokens_per_verify"], "mtp_fraction": best["mtp_fraction"],
               "always_mtp": table[0]["tokens_per_verify"], "never_mtp": table[-1]["tokens_per_verify"],
               "mtp_first_acceptance": float(np.mean(t_mtp > 1)),
               "drafter_first_acceptance": float(np.mean(t_own > 1)), "data": cfg.data, "mtp": cfg.mtp,
               "table": table}
    if cfg.write:
        path = os.path.join(cfg.draft, "config.json")
        with open(path) as fh:
            config = json.load(fh)
        config["dmtp_config"]["threshold"] = best["threshold"]
        with open(path + ".tmp", "w") as fh:
            json.dump(config, fh, indent=2)
        os.replace(path + ".tmp", path)
        with open(os.path.join(cfg.draft, "calibration.json"), "w") as fh:
            json.dump(summary, fh, indent=2)
    return summary
