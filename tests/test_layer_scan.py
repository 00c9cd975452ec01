"""Scanned layer stacks (`models/layer_stack.py`) equal the unrolled loop, exactly, in fp32.

For each family a tiny checkpoint (tests/conftest.py's builder, with enough layers that groups
repeat: 3 dense / MoE Qwen3 layers, 8 hybrid layers = 2 groups of 3 DeltaNet + 1 attention, and a
12-layer Qwen3-Next whose layer 1 is dense, so its first group stands alone) is loaded twice: with
the layers scanned (the default) and as one unrolled stack (`scan_layers=False`). Both run a full
forward with captures, a padded prefill into a cache, a decode step, a speculative verify block and
its commit; every output (logits, captures, K/V, conv windows, DeltaNet states, pending blocks)
agrees within 1e-6. Also: the stack plans of the released configs, HF names of stacked params, and
that a donated cache is updated in place (no temporary as large as the cache).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_tiny_checkpoint
from flax import nnx

from dmtp_jax.checkpoint.hf import export_tensors, init_target, load_target, resolve_source
from dmtp_jax.config import TargetConfig
from dmtp_jax.decode.caches import TargetCaches
from dmtp_jax.models.layer_stack import plan_stacks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = {"qwen3": dict(num_hidden_layers=3), "qwen3_moe": dict(num_hidden_layers=3),
            "qwen3_5": dict(num_hidden_layers=8), "qwen3_5_moe": dict(num_hidden_layers=8),
            "qwen3_next": dict(num_hidden_layers=12)}
DEFAULT_FAMILIES = ("qwen3", "qwen3_5")     # the others: `-m heavy`
TOL = 1e-6


@pytest.fixture(scope="module", params=[f if f in DEFAULT_FAMILIES else pytest.param(f, marks=pytest.mark.heavy)
                                              for f in FAMILIES])
def pair(request, tmp_path_factory):
    family = request.param
    d = build_tiny_checkpoint(str(tmp_path_factory.mktemp(f"scan-{family}")), family, seed=7,
                              **FAMILIES[family])
    return load_target(d), load_target(d, scan_layers=False)


def _run(target, capture):
    """Every output the forward contract has, as numpy, for a fixed little script of calls (one
    jit, as the decoders run them)."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, target.cfg.vocab_size, (2, 11)), jnp.int32)
    cache = TargetCaches(target).new(2, 128)
    script = jax.jit(lambda state, tokens, cache: _script(nnx.merge(target.graphdef, state), tokens, cache,
                                                          capture))
    return jax.tree.map(np.asarray, script(target.state, tokens, cache))


def _script(model, tokens, cache, capture):
    b, t, n = 2, 6, 4
    out = {}
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    full = model(tokens[:, :t], pos, capture_layers=capture)
    out["logits"], out["captured"] = model.logits(full.hidden_bth), full.captured
    valid = pos < jnp.asarray([[t], [t - 2]])
    pre = model(tokens[:, :t], pos, cache, kv_valid_bt=valid, capture_layers=capture)
    out["prefill_hidden"], out["prefill_captured"], out["prefill_cache"] = pre.hidden_bth, pre.captured, pre.cache
    lengths = jnp.asarray([t, t - 2])
    step = model(tokens[:, t:t + 1], lengths[:, None], pre.cache)
    out["step_hidden"], out["step_cache"] = step.hidden_bth, step.cache
    vpos = lengths[:, None] + 1 + jnp.arange(n)
    ver = model(tokens[:, t + 1:], vpos, step.cache, speculative=True, capture_layers=capture)
    out["verify_logits"], out["verify_captured"], out["pending"] = (model.logits(ver.hidden_bth),
                                                                     ver.captured, ver.pending)
    out["committed"] = model.commit(ver.cache, ver.pending, jnp.asarray([3, 1]))
    return out


def test_scanned_equals_unrolled(pair):
    scanned, unrolled = pair
    n = scanned.cfg.num_hidden_layers
    assert len(plan_stacks(scanned.cfg)) < n and any(s.repeats > 1 for s in plan_stacks(scanned.cfg))
    capture = (1, 0, n - 2, n - 1, 1)          # out of order, repeated, and the last layer
    got, want = _run(scanned, capture), _run(unrolled, capture)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    if scanned.cfg.linear_layers:
        assert got["pending"] is not None
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = dict(jax.tree_util.tree_leaves_with_path(want))[path]
        assert a.shape == b.shape, path
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, atol=TOL * scale, rtol=0, err_msg=jax.tree_util.keystr(path))


def test_hf_tensors_bit_identical(pair):
    scanned, unrolled = pair
    a, b = export_tensors(scanned.state), export_tensors(unrolled.state)
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    ids = [int(k.split(".")[2]) for k in a if k.startswith("model.layers.")]
    assert sorted(set(ids)) == list(range(scanned.cfg.num_hidden_layers))


def test_layer_view_matches_stack(pair):
    scanned, unrolled = pair
    model, ref = nnx.merge(scanned.graphdef, scanned.state), nnx.merge(unrolled.graphdef, unrolled.state)
    for i in range(scanned.cfg.num_hidden_layers):
        mine, theirs = nnx.state(model.layer(i)), nnx.state(ref.layer(i))
        assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), mine, theirs))


def _released(name):
    with open(os.path.join(ROOT, "configs", "models", name)) as fh:
        return TargetConfig.from_hf_dict(json.load(fh))


def test_plans_of_released_configs():
    plan = plan_stacks(_released("qwen3.6-27b.json"))
    assert [(s.start, s.period, s.repeats) for s in plan] == [(0, 4, 16)]
    assert plan[0].linear_members == (0, 1, 2) and plan[0].attn_members == (3,)
    assert [(s.period, s.repeats) for s in plan_stacks(_released("qwen3.6-35b-a3b.json"))] == [(4, 10)]
    assert [(s.period, s.repeats) for s in plan_stacks(_released("qwen3-next-80b-a3b.json"))] == [(4, 12)]
    base = {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    every_other = plan_stacks(TargetConfig.from_hf_dict({**base, "decoder_sparse_step": 2}))
    assert [(s.start, s.period, s.repeats) for s in every_other] == [(0, 2, 4)]
    dense_first = plan_stacks(TargetConfig.from_hf_dict({**base, "mlp_only_layers": [0]}))
    assert [(s.start, s.period, s.repeats) for s in dense_first] == [(0, 1, 1), (1, 1, 7)]
    unrolled = plan_stacks(TargetConfig.from_hf_dict(base), scan=False)
    assert [(s.start, s.period, s.repeats) for s in unrolled] == [(0, 8, 1)]


def test_stacked_expert_names():
    src = resolve_source("stacks.0.0.mlp.down_proj", (2, 3, 8, 4), layer_ids={(0, 0): (0, 1)})
    assert src.stack == (2, 3) and src.transpose and src.hf_shape((2, 3, 8, 4)) == (4, 8)
    assert src.hf_names[4] == "model.layers.1.mlp.experts.1.down_proj.weight"


def test_decode_step_updates_the_cache_in_place():
    """The compiled decode step of a scanned 16-layer hybrid (4 groups) keeps its donated cache in
    place: its temporaries (the attention layers' K/V reads, one layer each) hold less than one
    of the cache's two arrays, and the whole cache is aliased to the output."""
    cfg = TargetConfig.from_hf_dict({"model_type": "qwen3_5", "vocab_size": 64, "hidden_size": 32,
                                     "intermediate_size": 32, "num_hidden_layers": 16, "num_attention_heads": 2,
                                     "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 1,
                                     "linear_num_value_heads": 2, "linear_key_head_dim": 8,
                                     "linear_value_head_dim": 8})
    target = init_target(cfg)
    assert [(s.period, s.repeats) for s in plan_stacks(cfg)] == [(4, 4)]
    cache = TargetCaches(target).new(2, 1024)

    def step(state, tokens, positions, cache):
        model = nnx.merge(target.graphdef, state)
        return model(tokens, positions, cache).cache

    ints = jnp.zeros((2, 1), jnp.int32)
    mem = jax.jit(step, donate_argnums=(3,)).lower(target.state, ints, ints, cache).compile().memory_analysis()
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert mem.temp_size_in_bytes < cache.kv.k_lbskd.nbytes, (mem.temp_size_in_bytes, cache_bytes)
    assert mem.alias_size_in_bytes >= cache_bytes
