"""DeepSeek-V3 / GLM-4.7-Flash targets (MLA + DeepSeek MoE) against transformers on tiny random
checkpoints that transformers writes itself, their next-token layer as our MTP head against the
documented formula run in torch, the latent cache, and greedy `mtp` / `dflash` / `dmtp` == `ar`
on one of them (sampled `dmtp` lossless)."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_fixtures import build_reference_drafter, saved_dmtp_drafter
from mla_fixtures import FAMILIES, build
from stat_checks import assert_matches_target_joint
from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import has_mtp, load_mtp
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.caches import TargetCaches, state_bytes_per_row
from dmtp_jax.decode.sampling import SamplingParams

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`get(family)`: its tiny checkpoint (built once per module), the HF model, the torch next-token
    layer, and our target and MTP head loaded from the directory."""
    made = {}

    def get(name):
        if name not in made:
            d = str(tmp_path_factory.mktemp(name))
            model, layer = build(name, d, seed=len(name))
            target = load_target(d)
            made[name] = dict(name=name, dir=d, hf=model, nextn=layer, target=target, mtp=load_mtp(d, target.cfg))
        return made[name]
    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, checkpoints):
    return checkpoints(request.param)


@functools.partial(jax.jit, static_argnums=(0, 2))
def uncached_logits(graphdef, state, mtp_graphdef, mtp_state, ids_bt):
    """The target's logits of a whole sequence (no cache), and the MTP head's over every row
    `(h_t, x_{t+1})` at position t + 1 (one compile per family)."""
    tm, mm = nnx.merge(graphdef, state), nnx.merge(mtp_graphdef, mtp_state)
    b, t = ids_bt.shape
    out = tm(ids_bt, jnp.broadcast_to(jnp.arange(t), (b, t)))
    h, _ = mm(tm.embed(ids_bt[:, 1:]), out.hidden_bth[:, :-1], jnp.broadcast_to(jnp.arange(1, t), (b, t - 1)))
    return tm.logits(out.hidden_bth), tm.logits(mm.post_norm(h))


@functools.partial(jax.jit, static_argnums=0)
def cached_logits(graphdef, state, ids_bt, positions_bt, cache):
    """The target's logits of new tokens through a cache, and the cache."""
    model = nnx.merge(graphdef, state)
    out = model(ids_bt, positions_bt, cache)
    return model.logits(out.hidden_bth), out.cache


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


IDS = np.array([PROMPTS[2], PROMPTS[0] + PROMPTS[3] + [9, 70, 3, 11]], np.int32)     # [2, 13]


@pytest.fixture(scope="module")
def ours(family):
    target, mtp = family["target"], family["mtp"]
    return tuple(map(np.asarray, uncached_logits(target.graphdef, target.state, mtp.graphdef, mtp.state,
                                                 jnp.asarray(IDS))))


def test_config_reads_the_mla_fields(family):
    cfg = family["target"].cfg
    hf = json.load(open(os.path.join(family["dir"], "config.json")))
    assert cfg.is_mla and cfg.kv_lora_rank == 16 and cfg.rotary_dim == 8 and cfg.v_head_dim == 12
    assert cfg.q_lora_rank == (hf["q_lora_rank"] or 0)
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
    assert cfg.mtp_num_hidden_layers == 1 and has_mtp(family["dir"])
    assert bool(cfg.rope_scaling) == (family["name"] == "deepseek_v3")


def test_logits_match_transformers(family, ours):
    """fp32 logits of the whole forward (no cache: the latent attention over the prompt's own
    latents) within 1e-4 of transformers, for two rows of different content."""
    assert np.abs(ours[0] - hf_logits(family["hf"], IDS)).max() < 1e-4


def test_latent_cache_holds_one_latent_per_token_and_chunks_match(family):
    """The cache is `[layers, B, S, 1, kv_lora_rank + rope]` (values zero-wide), and two 6-token
    chunks through it (the second reads the first's latents) give transformers' logits. One-token
    steps through it are the decode tests' `ar`."""
    target = family["target"]
    cache = TargetCaches(target).new(2, 32)
    assert cache.kv.k_lbskd.shape == (2, 2, 32, 1, 16 + 8) and cache.kv.v_lbskd.shape[-1] == 0
    assert state_bytes_per_row(target.cfg, 32, dtype_bytes=2)["kv"] == 2 * 32 * (16 + 8) * 2
    logits = []
    for start in (0, 6):
        pos = jnp.broadcast_to(jnp.arange(start, start + 6), (2, 6))
        step, cache = cached_logits(target.graphdef, target.state, jnp.asarray(IDS[:, start:start + 6]), pos, cache)
        logits.append(np.asarray(step))
    assert np.abs(np.concatenate(logits, axis=1) - hf_logits(family["hf"], IDS)[:, :12]).max() < 1e-4


def test_nextn_layer_is_the_mtp_head(family, ours):
    """Our MTP head loaded from `model.layers.{L}.*` equals the next-token layer's formula in torch:
    `shared_head.norm(block(eh_proj([enorm(embed(x_{t+1})) ; hnorm(h_t)])))` -> the target's head,
    rows at positions t + 1, causal over the layer's own rows."""
    hf, layer = family["hf"], family["nextn"]
    ids = torch.tensor(IDS)
    n = ids.shape[1] - 1
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[:, :-1]
        pos = torch.arange(1, n + 1)[None].expand(2, n)
        u = layer["eh_proj"](torch.cat([layer["enorm"](hf.model.embed_tokens(ids[:, 1:])), layer["hnorm"](h)], -1))
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer["block"](u, attention_mask=mask, position_ids=pos,
                           position_embeddings=hf.model.rotary_emb(u, pos))
        want = hf.lm_head(layer["head_norm"](y)).numpy()
    assert np.abs(ours[1] - want).max() < 1e-4


@pytest.fixture(scope="module")
def deepseek(checkpoints):
    made = checkpoints("deepseek_v3")
    return made["target"], made["mtp"]


@pytest.fixture(scope="module")
def drafters(deepseek, tmp_path_factory):
    """A DFlash drafter and a DMTP drafter (noise fusion) for the DeepSeek target, built as the Qwen
    tests build theirs (the reference drafter reads target layers 0 and 1, hidden 32, vocab 128)."""
    target, _ = deepseek
    dflash_dir = str(tmp_path_factory.mktemp("dflash") / "d")
    build_reference_drafter(dflash_dir, seed=3, layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    dmtp_dir = saved_dmtp_drafter(str(tmp_path_factory.mktemp("dmtp") / "dmtp"), target.cfg, "dmtp",
                                  fusion_seed=1, dflash_dir=dflash_dir)
    return load_drafter(dflash_dir, target.cfg), load_dmtp_drafter(dmtp_dir, target.cfg)


def decoder(method, deepseek, drafters, **options):
    target, mtp = deepseek
    if method == "mtp":
        return make_decoder("mtp", target, None, mtp=mtp, mtp_steps=2, **options)
    if method == "dflash":
        return make_decoder("dflash", target, drafters[0], **options)
    drafter, fusion = drafters[1]
    return make_decoder(method, target, drafter, mtp=mtp, fusion=fusion, **options)


@pytest.fixture(scope="module")
def ar_output(deepseek):
    return ARDecoder(deepseek[0]).generate(PROMPTS, 16, stop_ids=[]).output_ids


@pytest.mark.parametrize("method", ["mtp", "dflash", "dmtp"])
def test_greedy_methods_equal_ar_on_deepseek(method, deepseek, drafters, ar_output):
    engine = decoder(method, deepseek, drafters)
    res = engine.generate(PROMPTS, 16, stop_ids=[])
    assert res.output_ids == ar_output
    hist = res.stats["histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, f"acceptance should be partial, got {hist}"
    assert engine.compile_counts() == {"prefill": 1, "round": 1}


@pytest.mark.heavy
def test_sampled_dmtp_is_lossless_on_deepseek(deepseek, drafters):
    engine = decoder("dmtp", deepseek, drafters)
    assert_matches_target_joint(engine, deepseek[0], PROMPTS[0], SamplingParams.make(temperature=1.0, top_k=3))
