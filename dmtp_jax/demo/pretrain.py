"""Pretraining a Qwen3-format target jointly with its native MTP head, then distilling the head.

`Pretrainer`: `main CE + mtp_lambda * MTP CE` (the MTP row `(h_t, embed(x_{t+1}))` at position
`t+1` predicts `x_{t+2}` through the shared LM head, exactly the rows decoding feeds it; its
gradient reaches the trunk unless `mtp_stop_gradient`). `MtpDistiller`: only the MTP head, against
the frozen target's own next-token distribution on text the target wrote (soft cross-entropy).
Both are `train.window.WindowTrainer`s (one jitted donated step of a pure loss) run by
`train.loop.run_loop` on `train.window.WindowBatches`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dmtp_jax.checkpoint.hf import abstract_target
from dmtp_jax.checkpoint.mtp_ckpt import abstract_mtp
from dmtp_jax.config import TargetConfig
from dmtp_jax.train.optim import OptimConfig
from dmtp_jax.train.window import WindowTrainer
from dmtp_jax.models import build_target
from dmtp_jax.models.mtp import MtpHead, mtp_config_for


def token_ce(logits_btv: jax.Array, labels_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean CE, top-1 accuracy) of fp32 logits against labels.

    Example:
        >>> ce, acc = token_ce(jnp.array([[[0.0, 10.0]]]), jnp.array([[1]]))
        >>> round(float(ce), 4), float(acc)
        (0.0, 1.0)
    """
    logits = logits_btv.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels_bt)
    acc = (jnp.argmax(logits, -1) == labels_bt).astype(jnp.float32)
    return ce.mean(), acc.mean()


def joint_loss(params: dict, target_graphdef, mtp_graphdef, tokens_bt: jax.Array, mtp_lambda: float,
               mtp_stop_gradient: bool = False, compute_dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """`(loss, metrics {"main_ce", "main_acc", "mtp_ce", "mtp_acc"})` on packed rows `tokens_bt [B, L+1]`."""
    cparams = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    target = nnx.merge(target_graphdef, cparams["target"])
    mtp = nnx.merge(mtp_graphdef, cparams["mtp"])
    b, n = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    hidden = target(tokens_bt, positions).hidden_bth                          # [B, n, H], post-norm
    main_ce, main_acc = token_ce(target.logits(hidden[:, :-1]), tokens_bt[:, 1:])
    h_t = jax.lax.stop_gradient(hidden[:, :-2]) if mtp_stop_gradient else hidden[:, :-2]
    h_mtp, _ = mtp(target.embed(tokens_bt[:, 1:-1]), h_t, positions[:, 1:-1])
    mtp_ce, mtp_acc = token_ce(target.logits(mtp.post_norm(h_mtp)), tokens_bt[:, 2:])
    loss = main_ce + mtp_lambda * mtp_ce
    return loss, {"main_ce": main_ce, "main_acc": main_acc, "mtp_ce": mtp_ce, "mtp_acc": mtp_acc}


def mtp_distil_loss(mtp_params, target_params, target_graphdef, mtp_graphdef, tokens_bt: jax.Array,
                    compute_dtype=jnp.float32) -> tuple[jax.Array, dict]:
    """`(loss, metrics)` of the MTP head against the frozen target on packed rows `[B, L+1]`.

    The MTP row `(h_t, x_{t+1})` (position t+1) predicts x_{t+2}; its teacher is the target's
    distribution at position t+1, `softmax(lm_head(h_{t+1}))`. Loss: soft cross-entropy (= KL +
    the teacher's entropy). Metrics: `kl`, `agree` (MTP top-1 == target top-1: the greedy
    first-candidate acceptance the head would get on this text), `mtp_ce` / `mtp_acc` against the
    data token."""
    cast = lambda tree: jax.tree.map(lambda x: x.astype(compute_dtype), tree)  # noqa: E731
    target = nnx.merge(target_graphdef, jax.lax.stop_gradient(cast(target_params)))
    mtp = nnx.merge(mtp_graphdef, cast(mtp_params))
    b, n = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    hidden = jax.lax.stop_gradient(target(tokens_bt, positions).hidden_bth)
    teacher = jax.nn.log_softmax(target.logits(hidden[:, 1:-1]).astype(jnp.float32), axis=-1)
    h_mtp, _ = mtp(target.embed(tokens_bt[:, 1:-1]), hidden[:, :-2], positions[:, 1:-1])
    student_logits = target.logits(mtp.post_norm(h_mtp)).astype(jnp.float32)
    student = jax.nn.log_softmax(student_logits, axis=-1)
    p = jnp.exp(teacher)
    soft_ce = -jnp.sum(p * student, axis=-1).mean()
    kl = jnp.sum(p * (teacher - student), axis=-1).mean()
    agree = (jnp.argmax(student, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32).mean()
    mtp_ce, mtp_acc = token_ce(student_logits, tokens_bt[:, 2:])
    return soft_ce, {"kl": kl, "agree": agree, "mtp_ce": mtp_ce, "mtp_acc": mtp_acc}


@dataclasses.dataclass(frozen=True)
class PretrainStep:
    """What one step computes (static in the jit)."""
    mtp_lambda: float = 0.3
    mtp_stop_gradient: bool = False
    compute_dtype: str = "float32"


def pretrain_loss(target_graphdef, mtp_graphdef, scfg: PretrainStep, params, frozen, tokens_bt):
    """`joint_loss` as a `WindowTrainer` loss (nothing frozen)."""
    del frozen
    return joint_loss(params, target_graphdef, mtp_graphdef, tokens_bt, scfg.mtp_lambda, scfg.mtp_stop_gradient,
                      jnp.dtype(scfg.compute_dtype))


def distil_loss(target_graphdef, mtp_graphdef, compute_dtype, params, frozen, tokens_bt):
    """`mtp_distil_loss` as a `WindowTrainer` loss (the target frozen)."""
    return mtp_distil_loss(params["mtp"], frozen, target_graphdef, mtp_graphdef, tokens_bt, compute_dtype)


class Pretrainer(WindowTrainer):
    """The joint target + MTP trainer (`joint_loss`); fresh params from the seed."""

    BAR = {"loss": "loss", "ce": "main_ce", "mtp": "mtp_ce"}

    def __init__(self, target_cfg: TargetConfig, scfg: PretrainStep, ocfg: OptimConfig):
        self.cfg, self.scfg = target_cfg, scfg
        self.target_graphdef, t_abs = abstract_target(target_cfg, "float32")
        self.mtp_graphdef, m_abs = abstract_mtp(target_cfg, "float32")
        loss_fn = functools.partial(pretrain_loss, self.target_graphdef, self.mtp_graphdef, scfg)
        super().__init__(ocfg, {"target": t_abs, "mtp": m_abs}, loss_fn)

    def initial_params(self, seed: int) -> dict:
        """Fresh fp32 target (from `seed`) and MTP head (from `seed + 1`)."""
        def make():
            t = nnx.split(build_target(self.cfg, jnp.float32, nnx.Rngs(seed)))[1]
            m = nnx.split(MtpHead(mtp_config_for(self.cfg), dtype=jnp.float32, rngs=nnx.Rngs(seed + 1)))[1]
            return {"target": t, "mtp": m}
        return jax.jit(make)()



class MtpDistiller(WindowTrainer):
    """The MTP-only phase (`mtp_distil_loss`): the target is frozen (the jit input `frozen`, never
    an optimiser input); the state is `TrainState` with `params = {"mtp": ...}` from the given head."""

    BAR = {"kl": "kl", "agree": "agree"}

    def __init__(self, target_cfg: TargetConfig, target_params, mtp_params, ocfg: OptimConfig,
                 compute_dtype: str = "float32"):
        self.cfg, self.compute_dtype = target_cfg, jnp.dtype(compute_dtype)
        self.target_graphdef, _ = abstract_target(target_cfg, "float32")
        self.mtp_graphdef, m_abs = abstract_mtp(target_cfg, "float32")
        self.initial_mtp = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), mtp_params)
        loss_fn = functools.partial(distil_loss, self.target_graphdef, self.mtp_graphdef, self.compute_dtype)
        super().__init__(ocfg, {"mtp": m_abs}, loss_fn,
                         jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), target_params))

    def initial_params(self, seed: int) -> dict:
        """The given MTP head (`seed` unused: nothing is random)."""
        del seed
        return {"mtp": self.initial_mtp}

