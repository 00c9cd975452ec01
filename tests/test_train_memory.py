"""Memory-saving forms of the train step compute the same numbers: the fp32 LM head, the loss chunked
over block rows (`loss.token_ce`), remat of the drafter layers; the step lowers on abstract inputs
(`Trainer.lower_step`) and the frozen target holds no residuals for the backward pass.

Run: `python -m pytest -q tests/test_train_memory.py`
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dmtp_jax.checkpoint.dflash_ckpt import init_drafter
from dmtp_jax.checkpoint.hf import init_target
from dmtp_jax.checkpoint.mtp_ckpt import init_mtp
from dmtp_jax.config import TargetConfig
from dmtp_jax.models.qwen3 import QwenTarget, lm_head_logits
from dmtp_jax.sharding import make_mesh
from dmtp_jax.tiny import tiny_target_config
from dmtp_jax.train.config import TrainConfig, fresh_drafter_config
from dmtp_jax.train.loss import token_ce
from dmtp_jax.train.optim import OptimConfig
from dmtp_jax.train.step import StepConfig, Trainer, abstract_models, loss_sums


def _close(a, b, tol=1e-6):
    """Equal within `tol` relative to the larger magnitude of the two trees' leaves."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(1.0, float(np.abs(y).max(initial=0.0)))
        assert np.abs(x - y).max(initial=0.0) <= tol * scale, (np.abs(x - y).max(), scale)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_is_fp32_in_every_dtype(tied):
    """bf16 hidden and head give fp32 logits: the bf16 values' exact products summed in fp32 (no
    bf16 rounding of the logits); fp32 inputs give the plain product."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(40, 16) if tied else (16, 40)), jnp.bfloat16)
    out = lm_head_logits(h, w, tied=tied)
    assert out.dtype == jnp.float32
    w32 = w.astype(jnp.float32)
    want = h.astype(jnp.float32) @ (w32.T if tied else w32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not np.array_equal(np.asarray(out), np.asarray(out.astype(jnp.bfloat16).astype(jnp.float32)))
    h32 = h.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(lm_head_logits(h32, w32, tied=tied)),
                                  np.asarray(jnp.einsum("...h,vh->...v" if tied else "...h,hv->...v", h32, w32)))
    cfg = TargetConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 40, "hidden_size": 16,
                                     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "head_dim": 8, "tie_word_embeddings": tied})
    model = QwenTarget(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert model.logits(h).dtype == jnp.float32


@pytest.mark.parametrize("chunk", [1, 3, 5, 8, 50])
def test_chunked_token_ce_equals_full(chunk):
    """Loss, top-1 and gradients (w.r.t. hidden and the head) of the chunked CE equal the full
    `[B, T, V]` computation within 1e-6 (T = 8 rows: chunks that divide it, do not, and exceed it)."""
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(16, 64)) * 0.5, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)
    decay = jnp.asarray(rng.uniform(size=(2, 8)), jnp.float32)

    def logits_fn(w, h):        # softcapped like a drafter head
        return jnp.tanh(lm_head_logits(h, w, tied=False) / 3.0) * 3.0

    def loss(h, w, c):
        ce, top = token_ce(logits_fn, w, h, labels, c)
        return jnp.sum(decay * ce), top

    (full, top_full), g_full = jax.value_and_grad(loss, (0, 1), has_aux=True)(hidden, weight, 0)
    (part, top_part), g_part = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True),
                                       static_argnums=2)(hidden, weight, chunk)
    _close(part, full)
    _close(g_part, g_full)
    np.testing.assert_array_equal(np.asarray(top_part), np.asarray(top_full))


def _tiny_models(method, tie=False):
    cfg = tiny_target_config(vocab_size=96)
    if tie:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    mesh = make_mesh()
    target = init_target(cfg, "float32", mesh, seed=3)
    mtp = init_mtp(cfg, "float32", mesh, seed=4) if method != "dflash" else None
    dcfg = fresh_drafter_config(TrainConfig(draft_layers=2, block_size=4, mask_token_id=90,
                                            target_layer_ids=(0, 1)), cfg)
    return target, mtp, dcfg, mesh


@pytest.mark.parametrize("method,tie", [("dflash", True), pytest.param("dmtp", False, marks=pytest.mark.heavy)])
def test_loss_sums_same_with_chunks_and_remat(method, tie):
    """The step's loss, accuracy counts and gradients are the same (1e-6, fp32) for every
    (ce_chunk, remat) pair, the reference being all logits at once without remat; the drafter's
    logit transform (multiplier, softcap) is on."""
    target, mtp, dcfg, mesh = _tiny_models(method, tie)
    dcfg = dataclasses.replace(dcfg, output_multiplier=0.7, final_logit_softcapping=5.0)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 90, (2, 24)), jnp.int32)
    mask = jnp.asarray(np.concatenate([np.zeros((2, 3)), np.ones((2, 21))], 1), jnp.int32)
    params = None

    def run(ce_chunk, remat):
        nonlocal params
        scfg = StepConfig(method=method, num_anchors=4, compute_dtype="float32", ce_chunk=ce_chunk, remat=remat)
        trainer = Trainer(target, dcfg, scfg, OptimConfig(), mesh, mtp=mtp)
        if params is None:
            drafter = init_drafter(dcfg, "float32", mesh, seed=5)
            params = {"drafter": drafter.state, **({"fusion": jax.tree.map(
                lambda s: jnp.full(s.shape, 0.01, s.dtype), trainer.abstract_params["fusion"])}
                if "fusion" in trainer.abstract_params else {})}

        def f(p):
            return loss_sums(p, trainer.graphdefs, target.graphdef, target.state, mtp and mtp.graphdef,
                             mtp and mtp.state, tokens, mask, jax.random.key(7), scfg, jnp.float32)
        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (ref, ref_sums), ref_g = run(0, "off")
    assert float(ref_sums["weight_sum"]) > 0
    for ce_chunk, remat in ((3, "off"), (5, "full"), (512, "dots")):
        (num, sums), g = run(ce_chunk, remat)
        _close(num, ref)
        _close(g, ref_g)
        for k in ("correct_k", "count_k"):
            np.testing.assert_array_equal(np.asarray(sums[k]), np.asarray(ref_sums[k]))


def test_frozen_target_keeps_no_residuals_and_remat_keeps_fewer():
    """What the backward pass keeps does not grow with the frozen target's depth (its forward
    holds nothing for the backward); remat and the chunked CE keep less than neither."""
    mesh = make_mesh()
    sizes = {}
    for layers in (2, 6):
        cfg = dataclasses.replace(tiny_target_config(vocab_size=512), num_hidden_layers=layers,
                                  layer_types=("full_attention",) * layers)
        target, _ = abstract_models(cfg, "float32", mesh)
        dcfg = fresh_drafter_config(TrainConfig(draft_layers=2, block_size=8, mask_token_id=500,
                                                target_layer_ids=(0, 1)), cfg)
        for remat, chunk in (("off", 0), ("full", 16)):
            scfg = StepConfig(num_anchors=8, compute_dtype="float32", remat=remat, ce_chunk=chunk)
            trainer = Trainer(target, dcfg, scfg, OptimConfig(), mesh)
            sizes[layers, remat] = trainer.backward_residual_bytes(2, 64)
    assert sizes[2, "off"] == sizes[6, "off"] and sizes[2, "full"] == sizes[6, "full"], sizes
    assert sizes[2, "full"] < sizes[2, "off"] / 2, sizes


def test_lower_step_compiles_without_weights():
    """A Trainer around weightless models lowers and compiles its step (the planner's path);
    memory analysis reports the arguments: the train state and the frozen target."""
    cfg = tiny_target_config(vocab_size=256)
    mesh = make_mesh()
    target, mtp = abstract_models(cfg, "bfloat16", mesh, with_mtp=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target.state))
    dcfg = fresh_drafter_config(TrainConfig(draft_layers=1, block_size=4, mask_token_id=250,
                                            target_layer_ids=(0, 1)), cfg)
    trainer = Trainer(target, dcfg, StepConfig(method="dmtp", num_anchors=4), OptimConfig(), mesh, mtp=mtp)
    lowered = trainer.lower_step(2, 32)
    assert isinstance(lowered, jax.stages.Lowered)
    mem = lowered.compile().memory_analysis()
    state_bytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                      for x in jax.tree.leaves((trainer.abstract_state(), *trainer.abstract_frozen())))
    assert mem.argument_size_in_bytes >= state_bytes > 0 and mem.temp_size_in_bytes > 0
    assert trainer.compile_count() == 0      # lowering compiles outside the step's cache
