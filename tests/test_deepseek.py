"""DeepSeek-V3 / GLM-4.7-Flash targets (MLA + DeepSeek MoE) against transformers on tiny random
checkpoints that transformers writes itself, their next-token layer as our MTP head against the
documented formula run in torch, the latent cache, and greedy `mtp` / `dflash` / `dmtp` == `ar`
on one of them (sampled `dmtp` lossless)."""

import copy
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_fixtures import build_reference_drafter, saved_dmtp_drafter
from stat_checks import assert_matches_target_joint
from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import has_mtp, load_mtp
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.caches import TargetCaches, state_bytes_per_row
from dmtp_jax.decode.sampling import SamplingParams

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, routed_scaling_factor=2.5, eos_token_id=1)
FAMILIES = {
    # DeepSeek-V3: low-rank queries, grouped routing, a dense first layer, YaRN RoPE
    "deepseek_v3": dict(q_lora_rank=24, n_group=2, topk_group=1, first_k_dense_replace=1,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # GLM-4.7-Flash's shape: one q_proj (no q LoRA here, to cover it), one group, plain RoPE
    "glm4_moe_lite": dict(q_lora_rank=None, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"],
                          num_nextn_predict_layers=1,      # the released config.json's key
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17]]


def randomize(module, seed):
    """Every weight random (norms around 1, router bias non-zero), so no part is an identity."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                p.normal_(0.0, 0.3)
            elif p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def nextn_layer(hf_cfg, seed):
    """The next-token layer's modules in torch: enorm, hnorm, eh_proj, a decoder layer of the target's
    class at index L, shared_head.norm."""
    mod = __import__(f"transformers.models.{hf_cfg.model_type}.modeling_{hf_cfg.model_type}", fromlist=["x"])
    prefix = {"deepseek_v3": "DeepseekV3", "glm4_moe_lite": "Glm4MoeLite"}[hf_cfg.model_type]
    norm = getattr(mod, f"{prefix}RMSNorm")
    h = hf_cfg.hidden_size
    if getattr(hf_cfg, "mlp_layer_types", None):             # GLM names every layer's MLP kind
        hf_cfg = copy.deepcopy(hf_cfg)
        hf_cfg.mlp_layer_types = list(hf_cfg.mlp_layer_types) + ["sparse"]
    layer = torch.nn.ModuleDict(dict(
        enorm=norm(h, eps=hf_cfg.rms_norm_eps), hnorm=norm(h, eps=hf_cfg.rms_norm_eps),
        eh_proj=torch.nn.Linear(2 * h, h, bias=False),
        block=getattr(mod, f"{prefix}DecoderLayer")(hf_cfg, hf_cfg.num_hidden_layers),
        head_norm=norm(h, eps=hf_cfg.rms_norm_eps)))
    randomize(layer, seed)
    return layer.eval()


def nextn_tensors(layer, hf_model, n_layers):
    """The next-token layer's tensors in the HF layout (`model.layers.{L}.*`, experts per expert as
    transformers saves them, plus the copies of the embedding and head the layout carries)."""
    p = f"model.layers.{n_layers}."
    out = {p + "enorm.weight": layer["enorm"].weight, p + "hnorm.weight": layer["hnorm"].weight,
           p + "eh_proj.weight": layer["eh_proj"].weight, p + "shared_head.norm.weight": layer["head_norm"].weight,
           p + "shared_head.head.weight": hf_model.lm_head.weight,
           p + "embed_tokens.weight": hf_model.model.embed_tokens.weight}
    for name, t in layer["block"].state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[p + name] = t
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def build(family, out_dir, seed):
    """A tiny random `family` checkpoint saved by transformers, with a next-token layer added."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(family, **TINY, **FAMILIES[family])
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    randomize(model, seed)
    model.save_pretrained(out_dir)
    layer = nextn_layer(hf_cfg, seed + 1)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors.update(nextn_tensors(layer, model, hf_cfg.num_hidden_layers))
    save_file(tensors, path, metadata={"format": "pt"})
    return model, layer


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
