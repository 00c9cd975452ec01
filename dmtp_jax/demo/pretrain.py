"""Pretraining a Qwen3-format target jointly with its native (Qwen3.5-format) MTP head.

Loss (DeepSeek-V3 / Qwen MTP pretraining): `main CE + mtp_lambda * MTP CE`.

* main: the target's post-norm hidden `h_t` -> LM head -> `x_{t+1}`;
* MTP: rows `(h_t, embed(x_{t+1}))` at position `t+1` -> `MtpHead` -> `post_norm` -> the shared
  LM head -> `x_{t+2}`, exactly the rows the decoder feeds the head.

Gradients of the MTP loss flow into the trunk, the shared embedding and the LM head (as in
DeepSeek-V3; `mtp_stop_gradient=True` detaches `h_t` instead). Data: packed windows of
`seq_len + 1` tokens drawn from one token stream; batch `s` is a pure function of `(seed, s)`, so a
resumed run sees exactly the batches an uninterrupted one would.

The state is `train.step.TrainState` with `params = {"target": ..., "mtp": ...}`; optimiser
`train.step.make_optimizer`, checkpoints `train.loop.save_checkpoint` / `restore_checkpoint`
(orbax, async, atomic), one jitted donated step.

A second phase, `MtpDistiller`, trains only the MTP head against the frozen target: at every row it
matches the target's own next-token distribution (soft cross-entropy to `softmax(target logits)`
of the token the head predicts) on text the target wrote. That makes the head a predictor of *its
target* rather than of the corpus -- the role a native MTP head plays in speculative decoding.

Example:
    >>> pt = Pretrainer(target_cfg, PretrainConfig())  # doctest: +SKIP
    >>> state = pt.init_state(seed=0)  # doctest: +SKIP
    >>> state, metrics = pt.step(state, tokens_bt)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dmtp_jax.checkpoint.hf import abstract_target
from dmtp_jax.checkpoint.mtp_ckpt import abstract_mtp
from dmtp_jax.config import TargetConfig
from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.train.step import OptimConfig, TrainState, lr_schedule, make_optimizer


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
    """`(loss, metrics)` on packed rows `tokens_bt [B, L+1]`.

    Example:
        >>> loss, m = joint_loss(params, tgd, mgd, tokens, 0.3)  # doctest: +SKIP
        >>> sorted(m)  # doctest: +SKIP
        ['main_acc', 'main_ce', 'mtp_acc', 'mtp_ce']
    """
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
    data token.

    Example:
        >>> loss, m = mtp_distil_loss(mtp_params, t_params, tgd, mgd, tokens)  # doctest: +SKIP
        >>> sorted(m)  # doctest: +SKIP
        ['agree', 'kl', 'mtp_acc', 'mtp_ce']
    """
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


def window_batch(stream: np.ndarray, batch_size: int, length: int, seed: int, step: int) -> np.ndarray:
    """Batch `step`: `batch_size` random windows of `length` tokens of `stream` (pure in `(seed, step)`).

    Example:
        >>> window_batch(np.arange(100), 2, 5, seed=0, step=3).shape
        (2, 5)
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - length + 1, size=batch_size)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class PretrainStep:
    """What one step computes (static in the jit)."""
    mtp_lambda: float = 0.3
    mtp_stop_gradient: bool = False
    compute_dtype: str = "float32"


class Pretrainer:
    """The joint target + MTP trainer: init, the jitted donated step, eval, abstract state.

    Example:
        >>> pt = Pretrainer(cfg, PretrainStep(), OptimConfig(total_steps=10))  # doctest: +SKIP
        >>> state = pt.init_state(0); state, m = pt.step(state, batch)  # doctest: +SKIP
    """

    def __init__(self, target_cfg: TargetConfig, scfg: PretrainStep, ocfg: OptimConfig):
        self.cfg, self.scfg, self.ocfg = target_cfg, scfg, ocfg
        self.tx = make_optimizer(ocfg)
        self.target_graphdef, t_abs = abstract_target(target_cfg, "float32")
        self.mtp_graphdef, m_abs = abstract_mtp(target_cfg, "float32")
        self.abstract_params = {"target": t_abs, "mtp": m_abs}
        self._step = counted_jit(self._step_impl, donate_argnums=(0,))
        self._eval = jax.jit(self._eval_impl)

    def init_state(self, seed: int) -> TrainState:
        """Fresh fp32 params (target and MTP from `seed`) and optimizer state."""
        from dmtp_jax.models import build_target
        from dmtp_jax.models.mtp import MtpHead, mtp_config_for

        def make():
            t = nnx.split(build_target(self.cfg, jnp.float32, nnx.Rngs(seed)))[1]
            m = nnx.split(MtpHead(mtp_config_for(self.cfg), dtype=jnp.float32, rngs=nnx.Rngs(seed + 1)))[1]
            params = {"target": t, "mtp": m}
            return TrainState(params, self.tx.init(params), jnp.zeros((), jnp.int32))
        return jax.jit(make)()

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs of the state (for `train.loop.restore_checkpoint`)."""
        rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shapes = jax.eval_shape(lambda p: TrainState(p, self.tx.init(p), jnp.zeros((), jnp.int32)),
                                self.abstract_params)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), shapes)

    def _loss(self, params, tokens_bt):
        return joint_loss(params, self.target_graphdef, self.mtp_graphdef, tokens_bt, self.scfg.mtp_lambda,
                          self.scfg.mtp_stop_gradient, jnp.dtype(self.scfg.compute_dtype))

    def _step_impl(self, state: TrainState, tokens_bt):
        (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(state.params, tokens_bt)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": lr_schedule(self.ocfg)(state.step)}
        return TrainState(params, opt_state, state.step + 1), metrics

    def _eval_impl(self, params, tokens_bt):
        return self._loss(params, tokens_bt)[1]

    def step(self, state: TrainState, tokens_bt) -> tuple[TrainState, dict]:
        """One optimizer step on `[B, L+1]` token windows; `state` is donated."""
        return self._step(state, jnp.asarray(tokens_bt))

    def evaluate(self, params, batches) -> dict:
        """Mean metrics (main / MTP CE and accuracy) over `batches` (held-out windows).

        Example:
            >>> pt.evaluate(state.params, [window_batch(val, 8, 257, 0, i) for i in range(4)])  # doctest: +SKIP
        """
        got = [jax.device_get(self._eval(params, jnp.asarray(b))) for b in batches]
        return {k: float(np.mean([g[k] for g in got])) for k in got[0]} if got else {}

    def compile_count(self) -> int:
        """Compiled variants of the train step (1 for a fixed batch shape)."""
        return self._step.compiles


class MtpDistiller:
    """The MTP-only phase: the target is frozen (held as `target_params`, never an optimiser
    input); the state is `TrainState` with `params = {"mtp": ...}`, same loop as `Pretrainer`.

    Example:
        >>> d = MtpDistiller(target_cfg, t_params, m_params, OptimConfig(total_steps=10))  # doctest: +SKIP
        >>> state = d.init_state(0); state, m = d.step(state, batch)  # doctest: +SKIP
    """

    def __init__(self, target_cfg: TargetConfig, target_params, mtp_params, ocfg: OptimConfig,
                 compute_dtype: str = "float32"):
        self.cfg, self.ocfg, self.compute_dtype = target_cfg, ocfg, jnp.dtype(compute_dtype)
        self.tx = make_optimizer(ocfg)
        self.target_graphdef, _ = abstract_target(target_cfg, "float32")
        self.mtp_graphdef, m_abs = abstract_mtp(target_cfg, "float32")
        self.abstract_params = {"mtp": m_abs}
        self.target_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), target_params)
        self.initial_mtp = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), mtp_params)
        self._step = counted_jit(self._step_impl, donate_argnums=(0,))
        self._eval = jax.jit(self._eval_impl)

    def init_state(self, seed: int) -> TrainState:
        """The given MTP head (fp32) and a fresh optimizer state (`seed` unused: nothing is random)."""
        del seed
        params = {"mtp": self.initial_mtp}
        return jax.jit(lambda p: TrainState(p, self.tx.init(p), jnp.zeros((), jnp.int32)))(params)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs of the state (for `train.loop.restore_checkpoint`)."""
        rep = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shapes = jax.eval_shape(lambda p: TrainState(p, self.tx.init(p), jnp.zeros((), jnp.int32)),
                                self.abstract_params)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), shapes)

    def _loss(self, params, target_params, tokens_bt):
        return mtp_distil_loss(params["mtp"], target_params, self.target_graphdef, self.mtp_graphdef, tokens_bt,
                               self.compute_dtype)

    def _step_impl(self, state: TrainState, target_params, tokens_bt):
        (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(state.params, target_params, tokens_bt)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": lr_schedule(self.ocfg)(state.step)}
        return TrainState(params, opt_state, state.step + 1), metrics

    def _eval_impl(self, params, target_params, tokens_bt):
        return self._loss(params, target_params, tokens_bt)[1]

    def step(self, state: TrainState, tokens_bt) -> tuple[TrainState, dict]:
        """One optimizer step of the MTP head on `[B, L+1]` token windows; `state` is donated."""
        return self._step(state, self.target_params, jnp.asarray(tokens_bt))

    def evaluate(self, params, batches) -> dict:
        """Mean metrics (KL, agreement with the target, CE) over `batches`."""
        got = [jax.device_get(self._eval(params, self.target_params, jnp.asarray(b))) for b in batches]
        return {k: float(np.mean([g[k] for g in got])) for k in got[0]} if got else {}

    def compile_count(self) -> int:
        return self._step.compiles
