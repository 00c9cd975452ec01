"""The ONE jitted train step of the drafter (sharded, donated, one compile).

`TrainState = (params fp32, opt_state, step)`, `params = {"drafter": ..., "fusion": ...}` (fusion:
DMTP only). `train_step` is jitted over a frozen `DrafterStep` setup, takes the frozen target (and
MTP) state as inputs, accumulates `grad_accum` micro-batches in a scan and applies
`train.optim.apply_gradients` (a non-finite step keeps its state). `Trainer.lower_step` lowers the
same step on abstract inputs for planning."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dmtp_jax.checkpoint.dflash_ckpt import abstract_drafter
from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.errors import InputError
from dmtp_jax.methods import ADAPTIVE
from dmtp_jax.models.dflash import REMAT_POLICIES
from dmtp_jax.models.dflash_config import DFlashConfig
from dmtp_jax.models.fusion import T1Fusion
from dmtp_jax.options import check_ce_chunk, check_positive_int
from dmtp_jax.sharding import (DEFAULT_RULES, MeshRules, at_shardings, batch_sharding, gathered_over, replicated,
                               state_shardings)
from dmtp_jax.train.anchors import sample_anchors
from dmtp_jax.train.features import mtp_hidden, reads_target_kv, target_features
from dmtp_jax.train.loss import (block_inputs, ce_sums, draft_head, drafter_block_hidden, method_layout,
                                 token_ce, uses_mtp)
from dmtp_jax.train.optim import OptimConfig, TrainState, apply_gradients, make_optimizer, new_state
from dmtp_jax.checkpoint.hf import abstract_target, place_abstract
from dmtp_jax.checkpoint.mtp_ckpt import abstract_mtp
from dmtp_jax.models.mtp import mtp_config_for
from dmtp_jax.train.loss import acceptance_proxy


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What one step computes. `gamma` None or 0 = no decay; `block_size` None = the drafter's.

    Memory knobs (the values computed do not change): `ce_chunk` block rows per sequence whose
    vocabulary logits are live at once in the loss (`loss.token_ce`; 0 = all `[B, N*K, V]`);
    `remat` what each drafter layer keeps for the backward pass (`models.dflash.REMAT_POLICIES`:
    "off", "full" = recompute the layer, "dots" = keep its matmul outputs).
    """
    method: str = "dflash"
    block_size: int | None = None
    num_anchors: int = 16
    gamma: float | None = 7.0
    grad_accum: int = 1
    compute_dtype: str = "bfloat16"
    seed: int = 0
    fusion_rank: int = 0          # dmtp-lowrank
    ce_chunk: int = 512
    remat: str = "full"


def abstract_params(dcfg: DFlashConfig, scfg: StepConfig):
    """`(graphdefs, abstract params)`, both `{"drafter": ..., "fusion": ...}` (fusion: DMTP only)."""
    graphdef, abstract = abstract_drafter(dcfg, "float32")
    graphdefs, params = {"drafter": graphdef}, {"drafter": abstract}
    if uses_mtp(scfg.method):
        fusion = nnx.eval_shape(lambda: T1Fusion(scfg.method, hidden=dcfg.hidden_size, rank=scfg.fusion_rank,
                                                 eps=dcfg.rms_norm_eps, dtype=jnp.float32, rngs=nnx.Rngs(0)))
        graphdefs["fusion"], params["fusion"] = nnx.split(fusion)
    return graphdefs, params


def loss_sums(params, graphdefs, target_graphdef, target_state, mtp_graphdef, mtp_state, tokens_bt,
              loss_mask_bt, key, scfg: StepConfig, compute_dtype, compute_shardings=None) -> tuple[jax.Array, dict]:
    """`(loss_sum, sums)` of one micro-batch: features, anchors, blocks, drafter, decayed CE.
    `compute_shardings` (a tree like `params`, or None): where the compute-dtype copies of the
    trained params live during the step (`Trainer`: gathered over `fsdp`)."""
    target = nnx.merge(target_graphdef, jax.lax.stop_gradient(target_state))   # frozen: no gradient
    cparams = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    if compute_shardings is not None:
        cparams = jax.tree.map(jax.lax.with_sharding_constraint, cparams, compute_shardings)
    drafter = nnx.merge(graphdefs["drafter"], cparams["drafter"])
    fusion = nnx.merge(graphdefs["fusion"], cparams["fusion"]) if "fusion" in graphdefs else None
    dcfg: DFlashConfig = drafter.cfg
    block_size = scfg.block_size or dcfg.block_size
    offsets, known = method_layout(scfg.method, block_size)
    valid_bt = loss_mask_bt >= 0   # every row position is a real key; padding only trails (causal)
    mtp = nnx.merge(mtp_graphdef, jax.lax.stop_gradient(mtp_state)) if uses_mtp(scfg.method) else None
    feats_btf, hidden_bth, target_kv = target_features(target, tokens_bt, valid_bt, dcfg,
                                                       keep_kv=reads_target_kv(mtp))
    mtp_h = None
    if mtp is not None:    # the fusion's MTP feature (`feature`: the state itself, or the assistant's h')
        mtp_h = mtp.feature(mtp_hidden(mtp, target, tokens_bt, hidden_bth, target_kv))
    anchors_bn, keep_bn = sample_anchors(key, loss_mask_bt, scfg.num_anchors, offsets[-1] + 1,
                                         first_label=offsets[known], min_anchor=int(uses_mtp(scfg.method)))
    t1_masked = None
    if scfg.method == ADAPTIVE:     # every anchor twice: dmtp's block (MTP's T1), then DFlash's (T1 slot MASK)
        n = anchors_bn.shape[1]
        anchors_bn, keep_bn = (jnp.concatenate([x, x], axis=1) for x in (anchors_bn, keep_bn))
        t1_masked = jnp.broadcast_to(jnp.arange(2 * n) >= n, anchors_bn.shape)
    blocks = block_inputs(scfg.method, tokens_bt, loss_mask_bt, anchors_bn, keep_bn, block_size,
                          mask_token_id=dcfg.mask_token_id, gamma=scfg.gamma, t1_masked_bn=t1_masked)
    hidden = drafter_block_hidden(drafter, target, feats_btf, valid_bt, blocks, anchors_bn, method=scfg.method,
                                  fusion=fusion, mtp_h_bth=mtp_h, t1_masked_bn=t1_masked, remat=scfg.remat)
    b, n, k = blocks.labels_bnk.shape
    weight, logits_fn = draft_head(drafter, target)
    ce, top1 = token_ce(logits_fn, weight, hidden, blocks.labels_bnk.reshape(b, n * k), scfg.ce_chunk)
    sums = ce_sums(ce.reshape(b, n, k), top1.reshape(b, n, k), blocks)
    return sums["loss_sum"], sums


@dataclasses.dataclass(frozen=True)
class DrafterStep:
    """What the drafter's jitted step and evaluation close over, fixed at construction (as decode's
    `RoundSetup`): the trained params' and frozen models' graphdefs, the configs, the optimizer, the
    compute-dtype params' shardings (or None) and the block's slot count."""
    graphdefs: dict
    target_graphdef: object
    mtp_graphdef: object
    scfg: StepConfig
    ocfg: OptimConfig
    tx: optax.GradientTransformation
    compute_shardings: object
    slots: int


def micro_batch_sums(setup: DrafterStep, params, target_state, mtp_state, tokens_bt, loss_mask_bt, key):
    """`loss_sums` of one micro-batch under `setup`."""
    scfg = setup.scfg
    return loss_sums(params, setup.graphdefs, setup.target_graphdef, target_state, setup.mtp_graphdef, mtp_state,
                     tokens_bt, loss_mask_bt, key, scfg, jnp.dtype(scfg.compute_dtype), setup.compute_shardings)


def train_step(setup: DrafterStep, state: TrainState, target_state, mtp_state, tokens_bt, loss_mask_bt):
    """One optimizer step: the global batch as `grad_accum` micro-batches (rows j, j+m, ..., each
    spanning every data shard) in a scan, gradients over the step's summed weights, `apply_gradients`."""
    m = setup.scfg.grad_accum
    b, length = tokens_bt.shape
    micro_tokens = tokens_bt.reshape(b // m, m, length).swapaxes(0, 1)
    micro_mask = loss_mask_bt.reshape(b // m, m, length).swapaxes(0, 1)
    key = jax.random.fold_in(jax.random.key(setup.scfg.seed), state.step)
    grad_fn = jax.grad(functools.partial(micro_batch_sums, setup), has_aux=True)

    def micro(carry, xs):
        grads_acc, sums_acc = carry
        j, toks, lm = xs
        grads, sums = grad_fn(state.params, target_state, mtp_state, toks, lm, jax.random.fold_in(key, j))
        return (jax.tree.map(jnp.add, grads_acc, grads), jax.tree.map(jnp.add, sums_acc, sums)), None

    zeros_sums = {"loss_sum": jnp.zeros((), jnp.float32), "weight_sum": jnp.zeros((), jnp.float32),
                  "correct_k": jnp.zeros((setup.slots,), jnp.int32), "count_k": jnp.zeros((setup.slots,), jnp.int32)}
    zero_grads = jax.tree.map(jnp.zeros_like, state.params)
    (grads, sums), _ = jax.lax.scan(micro, (zero_grads, zeros_sums), (jnp.arange(m), micro_tokens, micro_mask))
    denom = jnp.where(sums["weight_sum"] > 0, sums["weight_sum"], 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    loss = sums["loss_sum"] / denom
    state, update = apply_gradients(setup.tx, setup.ocfg, state, grads, loss)
    return state, {"loss": loss, "weight_sum": sums["weight_sum"], "correct_k": sums["correct_k"],
                   "count_k": sums["count_k"], **update}


def eval_sums(setup: DrafterStep, params, target_state, mtp_state, tokens_bt, loss_mask_bt) -> dict:
    """The sums of `loss_sums` on one batch (the key of step 0), no update."""
    return micro_batch_sums(setup, params, target_state, mtp_state, tokens_bt, loss_mask_bt,
                            jax.random.key(setup.scfg.seed))[1]


def abstract_models(target_cfg, dtype, mesh, mesh_rules: MeshRules = DEFAULT_RULES, *, with_mtp: bool = False):
    """`(target, mtp)`: weightless `LoadedModel`s (`checkpoint.hf.place_abstract`), for building a
    `Trainer` that only lowers / compiles (`Trainer.lower_step`). `mtp` is None unless `with_mtp`."""
    target = place_abstract(target_cfg, *abstract_target(target_cfg, dtype, mesh_rules=mesh_rules), mesh,
                            mesh_rules=mesh_rules)
    mtp = (place_abstract(mtp_config_for(target_cfg), *abstract_mtp(target_cfg, dtype, mesh_rules), mesh,
                          mesh_rules=mesh_rules)
           if with_mtp else None)
    return target, mtp


class Trainer:
    """Builds the optimizer, the shardings and the jitted step for one (target, drafter config).

    The trainer interface of `train.loop.run_loop`: `init_state(params)`, `step(state, batch) ->
    (state, metrics)` (`state` donated), `evaluate`, `abstract_state`, `record_fields`,
    `compile_count`, `BAR` (progress-bar label -> metrics-line field). Metrics (replicated
    scalars / `[K]` vectors): loss, weight_sum, correct_k, count_k, grad_norm, lr, nonfinite (1
    when the loss or gradient was not finite and the update was skipped).
    """

    BAR = {"loss": "loss", "acc": "acc", "tok_s": "tokens_per_s"}

    def __init__(self, target, dcfg: DFlashConfig, scfg: StepConfig, ocfg: OptimConfig, mesh,
                 mesh_rules: MeshRules = DEFAULT_RULES, mtp=None):
        method_layout(scfg.method, scfg.block_size or dcfg.block_size)     # validates the method
        if scfg.remat not in REMAT_POLICIES:
            raise InputError(f"unknown remat '{scfg.remat}'; available: {', '.join(REMAT_POLICIES)}")
        check_ce_chunk(scfg.ce_chunk, "ce_chunk")
        if uses_mtp(scfg.method) and mtp is None:
            raise ValueError(f"method '{scfg.method}' trains against the target's frozen MTP head (mtp=...)")
        self.mtp = mtp if uses_mtp(scfg.method) else None
        check_positive_int("grad_accum", scfg.grad_accum)
        self.target, self.dcfg, self.scfg, self.ocfg, self.mesh = target, dcfg, scfg, ocfg, mesh
        self.tx = make_optimizer(ocfg)
        self.graphdefs, abstract = abstract_params(dcfg, scfg)
        self.param_shardings = {k: state_shardings(v, mesh, mesh_rules) for k, v in abstract.items()}
        # FSDP: the step gathers the drafter's (small) weights over `fsdp` at their use and
        # reduce-scatters their gradients (left to itself, XLA gathers the activations instead).
        self.compute_shardings = (gathered_over(self.param_shardings, "fsdp")
                                  if mesh.shape.get("fsdp", 1) > 1 else None)
        self.abstract_params = abstract
        opt_abstract = jax.eval_shape(self.tx.init, abstract)
        rep = replicated(mesh)
        self.opt_shardings = optax.tree_map_params(
            self.tx, lambda _, sh: sh, opt_abstract, self.param_shardings,
            transform_non_params=lambda _: rep)
        self.state_shardings = TrainState(self.param_shardings, self.opt_shardings, rep)
        self.target_shardings = jax.tree.map(lambda x: x.sharding, target.state)
        self.mtp_shardings = None if self.mtp is None else jax.tree.map(lambda x: x.sharding, self.mtp.state)
        self._init = jax.jit(functools.partial(new_state, self.tx), in_shardings=(self.param_shardings,),
                             out_shardings=self.state_shardings)
        self.setup = DrafterStep(self.graphdefs, target.graphdef, None if self.mtp is None else self.mtp.graphdef,
                                 scfg, ocfg, self.tx, self.compute_shardings,
                                 len(method_layout(scfg.method, scfg.block_size or dcfg.block_size)[0]))
        self._steps: dict = {}
        self._eval = None

    # ---- state ---------------------------------------------------------------------------------
    def init_state(self, params: dict) -> TrainState:
        """Fresh optimizer state around fp32 copies of `params` (`{"drafter": state[, "fusion": state]}`)."""
        if set(params) != set(self.graphdefs):
            raise ValueError(f"method '{self.scfg.method}' trains {sorted(self.graphdefs)}, got {sorted(params)}")
        params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        return self._init(jax.device_put(params, self.param_shardings))

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs (with shardings) of the train state, for restoring checkpoints."""
        return at_shardings(jax.eval_shape(functools.partial(new_state, self.tx), self.abstract_params),
                            self.state_shardings)

    def batch_sharding(self, global_shape):
        return batch_sharding(self.mesh, tuple(global_shape))

    # ---- the step ------------------------------------------------------------------------------
    def _jit_kwargs(self, global_shape) -> dict:
        """The step's jit arguments (donation, shardings) for this global batch shape."""
        if global_shape[0] % self.scfg.grad_accum:
            raise ValueError(f"batch size {global_shape[0]} is not a multiple of grad_accum={self.scfg.grad_accum}")
        bs = self.batch_sharding(global_shape)
        return dict(donate_argnums=(0,),
                    in_shardings=(self.state_shardings, self.target_shardings, self.mtp_shardings, bs, bs),
                    out_shardings=(self.state_shardings, replicated(self.mesh)))

    def step_fn(self, global_shape):
        """The jitted step for this global batch shape (built once; one compile)."""
        key = tuple(global_shape)
        if key not in self._steps:
            self._steps[key] = counted_jit(functools.partial(train_step, self.setup), **self._jit_kwargs(key))
        return self._steps[key]

    def step(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """One optimizer step on `batch["tokens_bt"]`, `batch["loss_mask_bt"]` (global `[B, L]`
        arrays, see `global_batch`) against the frozen target (and MTP head); `state` is donated."""
        tokens_bt = batch["tokens_bt"]
        return self.step_fn(tokens_bt.shape)(state, self.target.state, self.mtp.state if self.mtp else None,
                                             tokens_bt, batch["loss_mask_bt"])

    def evaluate(self, params, batches) -> dict:
        """Loss and acceptance proxy of `params` over `batches` (dicts as `step` takes), no update:
        the weighted CE pooled over every batch and `record_fields` of the summed counts."""
        if self._eval is None:
            self._eval = jax.jit(functools.partial(eval_sums, self.setup))
        mtp_state = self.mtp.state if self.mtp else None
        got = [jax.device_get(self._eval(params, self.target.state, mtp_state, b["tokens_bt"], b["loss_mask_bt"]))
               for b in batches]
        if not got:
            return {}
        total = jax.tree.map(lambda *xs: sum(xs), *got)
        loss = float(total["loss_sum"]) / float(total["weight_sum"]) if total["weight_sum"] > 0 else 0.0
        return {"loss": loss, **self.record_fields(total)}

    def record_fields(self, metrics: dict) -> dict:
        """The metrics-line fields derived from a step's host metrics: the acceptance proxy
        (`acc_k`, `acc`, `accept_len_proxy`, `loss.acceptance_proxy`) of its summed counts; DMTP
        counts MTP's T1 as given, dmtp-adaptive's proxy is its DFlash mode."""
        known = method_layout(self.scfg.method, self.scfg.block_size or self.dcfg.block_size)[1]
        base = 2 if uses_mtp(self.scfg.method) and self.scfg.method != ADAPTIVE else 1
        acc_k, acc, accept_len = acceptance_proxy(np.asarray(metrics["correct_k"]).tolist(),
                                                  np.asarray(metrics["count_k"]).tolist(), known, base)
        return {"acc": acc, "acc_k": acc_k, "accept_len_proxy": accept_len}

    def global_batch(self, local: dict, global_shape):
        """Global `[B, L]` arrays from this process's rows (`make_array_from_process_local_data`)."""
        bs = self.batch_sharding(global_shape)
        return tuple(jax.make_array_from_process_local_data(bs, local[name], tuple(global_shape))
                     for name in ("tokens_bt", "loss_mask_bt"))

    def abstract_frozen(self):
        """`(target_state, mtp_state)` as ShapeDtypeStructs at their shardings (mtp None when the
        method has none): what `lower_step` takes in place of the frozen weights."""
        mtp = None if self.mtp is None else at_shardings(self.mtp.state, self.mtp_shardings)
        return at_shardings(self.target.state, self.target_shardings), mtp

    def lower_step(self, global_batch: int, seq_len: int) -> jax.stages.Lowered:
        """The train step for a global batch `[global_batch, seq_len]`, lowered on abstract inputs
        (ShapeDtypeStructs with their shardings) -- nothing allocated; `.compile()` it and read
        `memory_analysis()` / `cost_analysis()`. The same function and jit arguments as `step`;
        `compile_count` is untouched. Works on a Trainer built around `abstract_models(...)`."""
        shape = (int(global_batch), int(seq_len))
        batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding(shape))
        target_state, mtp_state = self.abstract_frozen()
        lowered = jax.jit(functools.partial(train_step, self.setup), **self._jit_kwargs(shape))   # not counted
        return lowered.lower(self.abstract_state(), target_state, mtp_state, batch, batch)

    def backward_residual_bytes(self, batch: int, seq_len: int) -> int:
        """Bytes the backward pass of one micro-batch `[batch, seq_len]` keeps from its forward (the
        leaves of `jax.vjp`'s closure of `loss_sums`, evaluated abstractly), whole batch: what `remat`
        and `ce_chunk` save."""
        shape = (int(batch), int(seq_len))
        target_state, mtp_state = self.abstract_frozen()
        setup = dataclasses.replace(self.setup, compute_shardings=None)

        def vjp_closure(params, t_state, m_state, tokens, mask):
            return jax.vjp(lambda p: micro_batch_sums(setup, p, t_state, m_state, tokens, mask,
                                                      jax.random.key(setup.scfg.seed))[0], params)[1]
        batch_abs = jax.ShapeDtypeStruct(shape, jnp.int32)
        leaves = jax.tree.leaves(jax.eval_shape(vjp_closure, self.abstract_params, target_state, mtp_state,
                                                batch_abs, batch_abs))
        return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)

    def compile_count(self) -> int:
        """Compiled variants of the train step (1 after any number of same-shape steps)."""
        return sum(f.compiles for f in self._steps.values())
