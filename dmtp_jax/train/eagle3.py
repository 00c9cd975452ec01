"""Training an EAGLE-3 drafter (`train.py train --method eagle3`) on the one loop, data, mesh and
checkpoints: the drafter unrolled on its own outputs for `block_size - 1` passes over the frozen
target's tapped features, cross-entropy over the draft vocabulary against the next-next token,
pass k weighted `decay ** k` (details: docs/training.md)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.checkpoint.eagle3_ckpt import eagle3_config, init_eagle3, load_eagle3, save_eagle3
from dmtp_jax.checkpoint.hf import LoadedModel, load_target
from dmtp_jax.config import load_target_config
from dmtp_jax.models.eagle3 import DraftVocab, Eagle3Config, Eagle3Drafter, default_eagle3_config
from dmtp_jax.sharding import batch_sharding, make_mesh
from dmtp_jax.tokenizer import load_tokenizer
from dmtp_jax.train.data import TokenDataset
from dmtp_jax.train.optim import optim_config
from dmtp_jax.train.window import WindowTrainer

STEP_DECAY = 0.8
DRAFT_VOCAB_FILE = "draft_vocab.npy"     # beside run_config.json: the target id of each draft id


def fresh_eagle3_config(cfg, target_cfg) -> Eagle3Config:
    """The drafter a run starts from without `--init-from` (`models.eagle3.default_eagle3_config`):
    `--draft-intermediate-size`, `--target-layer-ids` and `--block-size` when given."""
    return default_eagle3_config(target_cfg, cfg.block_size, cfg.draft_intermediate_size, cfg.target_layer_ids)


def eagle3_loss(drafter: Eagle3Drafter, target, tokens_bt: jax.Array, loss_mask_bt: jax.Array, passes: int,
                decay: float = STEP_DECAY) -> tuple[jax.Array, dict]:
    """`(loss, metrics)`: the `decay ** k`-weighted sum over passes of each pass's mean CE;
    metrics `acc_k` (top-1 agreement with the label of pass k), `ce_0`, `tokens`."""
    b, length = tokens_bt.shape
    valid_bt = loss_mask_bt >= 0
    out = target(tokens_bt, jnp.broadcast_to(jnp.arange(length), (b, length)), None,
                 capture_layers=drafter.cfg.target_layer_ids, kv_valid_bt=valid_bt)
    features = jax.lax.stop_gradient(jnp.concatenate(out.captured, axis=-1))[:, :-2]
    embeds = jax.lax.stop_gradient(drafter.embed(tokens_bt[:, 1:-1], target)) if drafter.embed_tokens is None \
        else drafter.embed(tokens_bt[:, 1:-1], target)
    h_kbth = drafter.unrolled(embeds, features, valid_bt[:, 1:-1], passes)
    vocab = drafter.vocab_map[...]
    to_draft = jnp.full((drafter.cfg.vocab_size,), -1, jnp.int32).at[vocab].set(jnp.arange(vocab.shape[0]))
    labels = to_draft[tokens_bt[:, 2:]]
    base = (loss_mask_bt[:, 2:] > 0) & (labels >= 0)
    rows = jnp.arange(length - 2)[None]
    loss, metrics = jnp.float32(0.0), {}
    for k in range(passes):
        logits = drafter.draft_logits(h_kbth[k])
        logp = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        m = (base & (rows >= k)).astype(jnp.float32)
        n = jnp.maximum(m.sum(), 1.0)
        step_ce = (ce * m).sum() / n
        loss = loss + decay ** k * step_ce
        metrics[f"acc_{k}"] = ((jnp.argmax(logits, -1) == labels) * m).sum() / n
        if k == 0:
            metrics["ce_0"], metrics["tokens"] = step_ce, m.sum()
    return loss, metrics


def eagle3_train_loss(target_graphdef, graphdef, compute_dtype, passes: int, params, frozen, batch):
    """`eagle3_loss` as a `WindowTrainer` loss: `frozen = (target state, draft vocabulary)`, `batch =
    (tokens_bt, loss_mask_bt)`, the drafter's fp32 params cast to `compute_dtype`."""
    tokens_bt, loss_mask_bt = batch
    target_state, vocab = frozen
    target = nnx.merge(target_graphdef, jax.lax.stop_gradient(target_state))
    cparams = jax.tree.map(lambda x: x.astype(compute_dtype), params["drafter"])
    return eagle3_loss(nnx.merge(graphdef, cparams, vocab), target, tokens_bt, loss_mask_bt, passes)


class Eagle3Trainer(WindowTrainer):
    """The EAGLE-3 drafter's trainer for `train.loop.run_loop`: `params = {"drafter": its nnx.Param
    state}` (fp32 masters, cast to `compute_dtype` in the step), the target and the draft vocabulary
    frozen; batches are `DrafterBatches`' `{"tokens_bt", "loss_mask_bt"}`."""

    BAR = {"loss": "loss", "acc0": "acc_0"}

    def __init__(self, target: LoadedModel, drafter: LoadedModel, ocfg, mesh, compute_dtype: str = "float32"):
        self.dcfg: Eagle3Config = drafter.cfg
        self.target_graphdef, self.graphdef = target.graphdef, drafter.graphdef
        self.compute_dtype = jnp.dtype(compute_dtype)
        params, vocab = drafter.state.filter(nnx.Param), drafter.state.filter(DraftVocab)
        self.initial = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
        loss_fn = functools.partial(eagle3_train_loss, self.target_graphdef, self.graphdef, self.compute_dtype,
                                    self.dcfg.block_size - 1)
        super().__init__(ocfg, {"drafter": abstract}, loss_fn, (target.state, vocab), mesh)

    def initial_params(self, seed: int) -> dict:
        """The drafter's starting params (`seed` unused: drawn when the drafter was made)."""
        del seed
        return {"drafter": self.initial}

    def batch_sharding(self, global_shape):
        return batch_sharding(self.mesh, tuple(global_shape))

    def global_batch(self, local: dict, global_shape):
        """Global `[B, L]` token and loss-mask arrays from this process's rows (as `Trainer`'s)."""
        bs = self.batch_sharding(global_shape)
        return tuple(jax.make_array_from_process_local_data(bs, local[name], tuple(global_shape))
                     for name in ("tokens_bt", "loss_mask_bt"))

    def step(self, state, batch: dict):
        """One optimizer step on `{"tokens_bt", "loss_mask_bt"}`; `state` is donated."""
        return self._step(state, self.frozen, (batch["tokens_bt"], batch["loss_mask_bt"]))


def eagle3_setup(cfg):
    """`(target, trainer, dataset)` of an EAGLE-3 run (`train.run.setup` for `--method eagle3`,
    which adds the one batch source): the drafter from `--init-from` or fresh
    (`fresh_eagle3_config`, seed `--seed`)."""
    cfg.validate()
    target_cfg = load_target_config(cfg.target)
    mesh = make_mesh(cfg.mesh)
    dataset = TokenDataset.from_file(cfg.data, cfg.seq_len, load_tokenizer(cfg.target), target_cfg.vocab_size)
    target = load_target(cfg.target, dtype=cfg.target_dtype or cfg.compute_dtype, mesh=mesh)
    if cfg.init_from:
        drafter = load_eagle3(cfg.init_from, target.cfg, "float32", mesh)
        drafter = dataclasses.replace(drafter, cfg=dataclasses.replace(drafter.cfg, block_size=cfg.block_size))
    else:
        drafter = init_eagle3(fresh_eagle3_config(cfg, target.cfg), "float32", mesh, seed=cfg.seed)
    return target, Eagle3Trainer(target, drafter, optim_config(cfg), mesh, cfg.compute_dtype), dataset


def run_drafter_config(trainer: Eagle3Trainer, out: str) -> dict:
    """The drafter entry of an EAGLE-3 run's `run_config.json` (its `config.json` dict and whether
    it has its own embeddings); its draft vocabulary goes to `<out>/draft_vocab.npy` (process 0)."""
    if jax.process_index() == 0:
        os.makedirs(out, exist_ok=True)
        np.save(os.path.join(out, DRAFT_VOCAB_FILE), np.asarray(jax.device_get(jax.tree.leaves(trainer.frozen[1])[0])))
    return {**trainer.dcfg.to_hf_dict(), "dmtp_own_embeddings": trainer.dcfg.own_embeddings}


def _run_drafter(run: dict):
    ecfg = eagle3_config(run["drafter"], 0, bool(run["drafter"].get("dmtp_own_embeddings")))
    return ecfg, nnx.split(nnx.eval_shape(lambda: Eagle3Drafter(ecfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))


def abstract_eagle3_params(run: dict) -> dict:
    """`{"drafter": its nnx.Param state, abstract}` (fp32) of a run (what its checkpoints restore to)."""
    return {"drafter": _run_drafter(run)[1][1].filter(nnx.Param)}


def export_eagle3(run_dir: str, run: dict, params, out_dir: str, dtype=None) -> None:
    """Writes a run's trained EAGLE-3 drafter (`params` restored from its checkpoint) with the run's
    draft vocabulary to `out_dir` (`save_eagle3`: the published layout)."""
    ecfg, (graphdef, abstract) = _run_drafter(run)
    ids = np.load(os.path.join(run_dir, DRAFT_VOCAB_FILE))
    vocab = jax.tree.map(lambda _: jnp.asarray(ids, jnp.int32), abstract.filter(DraftVocab))
    save_eagle3(LoadedModel(ecfg, graphdef, nnx.merge_state(params["drafter"], vocab), make_mesh()), out_dir,
                dtype=dtype)

