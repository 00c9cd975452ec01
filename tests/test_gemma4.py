"""Gemma 4: the text target against transformers on tiny random checkpoints that transformers
writes itself (sliding and full layers of their own sizes, keys as values, proportional RoPE,
soft-capped logits), its packed cache, and greedy `ar` == transformers' greedy past the window."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.config import ConfigError, TargetConfig
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.caches import TargetCaches

WINDOW = 8
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=WINDOW, final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=256,
            eos_token_id=1, pad_token_id=0, bos_token_id=2)
PROMPTS = [[5, 9, 31, 4, 77, 2, 18, 200, 13, 61, 7], [3, 250, 17]]
IDS = np.random.RandomState(0).randint(3, 256, (2, 20)).astype(np.int32)       # 20 > 2 x WINDOW


def randomize(module, seed):
    """Every weight random (norms and layer scalars around 1), so no part is an identity."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name or "embed_scale" in name or "token_ordering" in name:
                continue
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                p.uniform_(0.5, 1.5)
            elif p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma 4 target: its directory, the transformers model, ours loaded from the directory."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    d = str(tmp_path_factory.mktemp("gemma4"))
    hf_cfg = Gemma4TextConfig(**TINY)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(hf_cfg).eval()
    randomize(model, 0)
    model.save_pretrained(d)
    return dict(dir=d, hf=model, target=load_target(d))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_config_reads_the_gemma_fields_and_refuses_the_rest(gemma):
    cfg = gemma["target"].cfg
    g = cfg.gemma
    assert (cfg.model_type, cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window) == ("gemma4", 8, 2, WINDOW)
    assert (g.global_head_dim, g.global_kv_heads, g.k_eq_v, g.global_rotary_factor) == (16, 1, True, 0.25)
    assert g.final_logit_softcapping == 5.0 and cfg.tie_word_embeddings
    assert cfg.kv_cache_dims == (2, 4, 8, 8)            # a full layer's 1 x 16 packs as 2 heads of 8
    hf = json.load(open(os.path.join(gemma["dir"], "config.json")))
    with pytest.raises(ConfigError, match="per-layer input embeddings"):
        TargetConfig.from_hf_dict(dict(hf, hidden_size_per_layer_input=256))


@pytest.fixture(scope="module")
def uncached(gemma):
    target = gemma["target"]

    @jax.jit
    def run(state, ids_bt):
        model = nnx.merge(target.graphdef, state)
        b, t = ids_bt.shape
        return model.logits(model(ids_bt, jnp.broadcast_to(jnp.arange(t), (b, t))).hidden_bth)
    return np.asarray(run(target.state, jnp.asarray(IDS)))


def test_logits_match_transformers(gemma, uncached):
    """fp32 logits of a 20-token forward (past the window of 8) within 1e-4 of transformers."""
    want = hf_logits(gemma["hf"], IDS)
    assert np.abs(want).max() > 1.0
    assert np.abs(uncached - want).max() < 1e-4


def test_packed_cache_chunks_match_transformers(gemma):
    """Both layer types share one cache `[layers, B, S, 2, 8]`; 4 chunks of 5 through it (the later
    ones read the earlier K/V, sliding layers only the last 8 positions) give transformers' logits."""
    target = gemma["target"]
    cache = TargetCaches(target).new(2, 32)
    assert cache.kv.k_lbskd.shape == (4, 2, 32, 2, 8)

    @jax.jit
    def step(state, ids_bt, positions_bt, cache):
        model = nnx.merge(target.graphdef, state)
        out = model(ids_bt, positions_bt, cache)
        return model.logits(out.hidden_bth), out.cache
    logits = []
    for start in range(0, 20, 5):
        pos = jnp.broadcast_to(jnp.arange(start, start + 5), (2, 5))
        out, cache = step(target.state, jnp.asarray(IDS[:, start:start + 5]), pos, cache)
        logits.append(np.asarray(out))
    assert np.abs(np.concatenate(logits, axis=1) - hf_logits(gemma["hf"], IDS)).max() < 1e-4


def test_greedy_ar_equals_transformers_generate(gemma):
    """Greedy `ar` over prompt + 14 new tokens (past the window) emits transformers' greedy tokens."""
    ours = ARDecoder(gemma["target"]).generate(PROMPTS, 14, stop_ids=[]).output_ids
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            want = gemma["hf"].generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want
