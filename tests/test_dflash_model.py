"""DFlash / DFlash2 drafter in JAX vs the `dflash` 0.1.0 reference (fp32, tiny random models).

The reference runs as `dflash_generate` runs it (draft cache, only new context rows per call, crop
after each call); the JAX side caches context K/V from `context_kv` in a fixed-size buffer with
validity flags (stale garbage in the invalid rows) and runs one block per call.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dmtp_jax.checkpoint.dflash_ckpt import init_drafter, load_drafter, save_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.safetensors_io import CheckpointError
from dmtp_jax.config import ConfigError
from dmtp_jax.models.qwen3 import TargetOutput
from dmtp_jax.models.dflash import block_embeddings, context_features, make_block_tokens
from dmtp_jax.models.dflash_config import DFlashConfig, check_fits_target
from tests.dflash_fixtures import BLOCK_SIZE, MASK_TOKEN_ID, build_reference_drafter, reference_draft_calls

torch = pytest.importorskip("torch")
TOL = 1e-4
PROMPT_LEN, SECOND_CTX, CACHE_LEN = 11, 3, 24
# tokens committed over the two rounds: prompt, then 3 more; round anchors are the next tokens
STEPS = ((PROMPT_LEN, 5), (SECOND_CTX, 77))


@pytest.fixture(scope="module")
def target_pair(tiny_qwen3_dir):
    from transformers import Qwen3ForCausalLM

    torch_target = Qwen3ForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    return torch_target, load_target(tiny_qwen3_dir, "float32")


def _prompt():
    rng = np.random.default_rng(0)
    return rng.integers(0, 110, size=(1, PROMPT_LEN + SECOND_CTX))


_TARGET_FNS: dict = {}


def _target_fns(target):
    """Jitted target features (as `dflash` builds them), embedding and LM head (compiled once)."""
    if id(target) in _TARGET_FNS:
        return _TARGET_FNS[id(target)]

    def features(state, tokens, layer_ids):
        out = nnx.merge(target.graphdef, state)(tokens, jnp.arange(tokens.shape[1])[None],
                                                capture_layers=layer_ids)
        return out.captured, out.hidden_bth
    _TARGET_FNS[id(target)] = (jax.jit(features, static_argnums=2),
                               jax.jit(lambda state, x: nnx.merge(target.graphdef, state).embed(x)),
                               jax.jit(lambda state, h: nnx.merge(target.graphdef, state).logits(h)))
    return _TARGET_FNS[id(target)]


def _jax_rounds(loaded, target, prompt_np):
    """JAX drafter hidden states for the rounds of STEPS (one jitted function per drafter)."""
    dcfg = loaded.cfg
    features_fn, embed_fn, _ = _target_fns(target)
    captured, hidden = features_fn(target.state, jnp.asarray(prompt_np, jnp.int32), dcfg.target_layer_ids)
    features = context_features(TargetOutput(hidden, captured, None), dcfg,
                                target.cfg.num_hidden_layers)   # the last layer's entry is normed
    shape = (dcfg.num_hidden_layers, 1, CACHE_LEN, dcfg.num_key_value_heads, dcfg.head_dim)
    garbage = np.random.default_rng(1).normal(size=shape).astype(np.float32)  # invalid rows: ignored
    blocks = [make_block_tokens(jnp.array([anchor]), dcfg) for _, anchor in STEPS]
    embeds = [block_embeddings(lambda t: embed_fn(target.state, t), b, dcfg) for b in blocks]

    @jax.jit
    def rounds(state, features, embeds, cache_k, cache_v):
        drafter = nnx.merge(loaded.graphdef, state)
        start, hiddens = 0, []
        for (n_new, _), block_embeds in zip(STEPS, embeds):
            pos = start + jnp.arange(n_new)[None]
            k, v = drafter.context_kv(drafter.project_context(features[:, start:start + n_new]), pos)
            cache_k = cache_k.at[:, :, start:start + n_new].set(k)
            cache_v = cache_v.at[:, :, start:start + n_new].set(v)
            start += n_new
            hiddens.append(drafter(block_embeds, start + jnp.arange(dcfg.block_size)[None], cache_k,
                                   cache_v, jnp.arange(CACHE_LEN)[None],
                                   (jnp.arange(CACHE_LEN) < start)[None]))
        return hiddens

    hiddens = rounds(loaded.state, features, embeds, garbage, 2 * garbage)
    starts = np.cumsum([n for n, _ in STEPS])
    return list(zip(starts, blocks, hiddens))


def _draft_logits(loaded, target, hidden):
    _, _, logits_fn = _target_fns(target)
    drafter = nnx.merge(loaded.graphdef, loaded.state)
    return drafter.draft_logits(hidden, lambda h: logits_fn(target.state, h))


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b.detach().numpy(), np.float64))))


V1_CASES = {
    "full_unset": dict(layer_types=("full_attention", "full_attention")),
    "sliding_full_unset": dict(layer_types=("sliding_attention", "full_attention"), sliding_window=5),
    "sliding_full_causal_true": dict(layer_types=("sliding_attention", "full_attention"),
                                     sliding_window=5, is_causal=True),
    "sliding_causal_false": dict(layer_types=("sliding_attention", "sliding_attention"),
                                 sliding_window=5, is_causal=False,
                                 output_multiplier=0.5, final_logit_softcapping=3.0,
                                 input_embedding_scale=1.5),
}


@pytest.mark.parametrize("case", sorted(V1_CASES))
def test_dflash_v1_matches_reference(case, target_pair, tmp_path):
    torch_target, target = target_pair
    ref = build_reference_drafter(str(tmp_path), seed=3, **V1_CASES[case])
    loaded = load_drafter(str(tmp_path), target.cfg, "float32")
    prompt = _prompt()
    ref_rounds = reference_draft_calls(ref, torch_target, torch.tensor(prompt), STEPS)
    ours = _jax_rounds(loaded, target, prompt)
    for (r_start, r_block, r_hidden), (start, block, hidden) in zip(ref_rounds, ours):
        assert r_start == start and np.array_equal(r_block.numpy(), np.asarray(block))
        assert _max_diff(hidden, r_hidden) < TOL, case
        with torch.no_grad():
            r_logits = ref.compute_logits(r_hidden[:, 1:], torch_target.lm_head)
        assert _max_diff(_draft_logits(loaded, target, hidden[:, 1:]), r_logits) < TOL, case


def test_dflash2_conv_and_selector_match_reference(target_pair, tmp_path):
    torch_target, target = target_pair
    ref = build_reference_drafter(str(tmp_path), version=2, seed=4, is_causal=False,
                                  layer_types=("sliding_attention", "sliding_attention"),
                                  sliding_window=6, output_multiplier=0.7, final_logit_softcapping=4.0)
    loaded = load_drafter(str(tmp_path), target.cfg, "float32")
    assert loaded.cfg.version == 2
    merge = functools.partial(nnx.merge, loaded.graphdef)
    greedy_fn = jax.jit(lambda st, h, lg, a: merge(st).select_tokens(h, lg, a))
    sample_fn = jax.jit(lambda st, h, lg, a, t, key: merge(st).select_tokens(h, lg, a, t, key))
    scores_fn = jax.jit(lambda st, h, lg, preds: merge(st).selector_scores(h, lg, preds))
    prompt = _prompt()
    ref_rounds = reference_draft_calls(ref, torch_target, torch.tensor(prompt), STEPS)
    ours = _jax_rounds(loaded, target, prompt)
    st = loaded.state
    differs_from_unary = False
    for (_, r_block, r_hidden), (_, block, hidden) in zip(ref_rounds, ours):
        assert _max_diff(hidden, r_hidden) < TOL
        anchor = block[:, 0]
        logits = _draft_logits(loaded, target, hidden[:, 1:])
        with torch.no_grad():
            r_tokens, _, _ = ref.propose(r_hidden[:, 1:], r_block[:, 0], torch_target.lm_head, 0.0)
        greedy = greedy_fn(st, hidden[:, 1:], logits, anchor)
        assert np.array_equal(np.asarray(greedy.tokens_bl), r_tokens.numpy())
        differs_from_unary |= not np.array_equal(r_tokens.numpy(), np.asarray(jnp.argmax(logits, -1)))

        for temperature, seed in ((0.7, 0), (1.3, 1)):
            torch.manual_seed(seed)
            with torch.no_grad():
                r_path, r_cand, r_q = ref.propose(r_hidden[:, 1:], r_block[:, 0], torch_target.lm_head,
                                                  temperature)
            # teacher-force the reference's sampled path: same candidates and probabilities
            preds = jnp.concatenate([anchor[:, None], jnp.asarray(r_path.numpy()[:, :-1])], axis=1)
            scores, cand = scores_fn(st, hidden[:, 1:], logits, preds)
            probs = jax.nn.softmax(scores / temperature, axis=-1)
            order, r_order = np.argsort(np.asarray(cand), -1), np.argsort(r_cand.numpy(), -1)
            assert np.array_equal(np.take_along_axis(np.asarray(cand), order, -1),
                                  np.take_along_axis(r_cand.numpy(), r_order, -1))
            diff = np.abs(np.take_along_axis(np.asarray(probs), order, -1)
                          - np.take_along_axis(r_q.numpy(), r_order, -1)).max()
            assert diff < TOL
            # our own sampling walk is consistent with the parallel scores of its own path
            out = sample_fn(st, hidden[:, 1:], logits, anchor, jnp.float32(temperature),
                            jax.random.key(seed))
            own_preds = jnp.concatenate([anchor[:, None], out.tokens_bl[:, :-1]], axis=1)
            own_scores, _ = scores_fn(st, hidden[:, 1:], logits, own_preds)
            np.testing.assert_allclose(out.probs_blk, jax.nn.softmax(own_scores / temperature, -1),
                                       atol=1e-6)
            assert bool(jnp.all(jnp.any(out.candidates_blk == out.tokens_bl[..., None], -1)))
    assert differs_from_unary, "selector never changed the unary argmax: test is not meaningful"


def test_jit_and_training_layout_equal_single_blocks(target_pair, tmp_path):
    """Several blocks in one call (`block_len`, per-query context validity) == one call per block,
    under jit, for a DFlash2 drafter with a causal sliding layer and a full layer."""
    build_reference_drafter(str(tmp_path), version=2, seed=6, sliding_window=5,
                            layer_types=("sliding_attention", "full_attention"))
    loaded = load_drafter(str(tmp_path), target_pair[1].cfg, "float32")
    dcfg, state, rng = loaded.cfg, loaded.state, np.random.default_rng(2)
    s, anchors = 12, (3, 8)
    feats = rng.normal(size=(1, s, dcfg.num_context_features)).astype(np.float32)
    embeds = rng.normal(size=(1, 2 * BLOCK_SIZE, dcfg.hidden_size)).astype(np.float32)

    @jax.jit
    def run(state, feats, embeds, block_pos, ctx_valid):
        d = nnx.merge(loaded.graphdef, state)
        k, v = d.context_kv(d.project_context(feats), jnp.arange(s)[None])
        block_len = BLOCK_SIZE if embeds.shape[1] > BLOCK_SIZE else None
        return d(embeds, block_pos, k, v, jnp.arange(s)[None], ctx_valid, block_len=block_len)

    pos = jnp.concatenate([a + jnp.arange(BLOCK_SIZE) for a in anchors])[None]
    valid_bts = jnp.concatenate([jnp.broadcast_to(jnp.arange(s) < a, (BLOCK_SIZE, s)) for a in anchors])
    both = run(state, feats, embeds, pos, valid_bts[None])
    for i, a in enumerate(anchors):
        rows = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
        one = run(state, feats, embeds[:, rows], pos[:, rows], (jnp.arange(s) < a)[None])
        np.testing.assert_allclose(both[:, rows], one, atol=1e-4, rtol=1e-5)


def _write_config(path, d):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(d, fh)


def test_both_config_layouts_load(target_pair, tmp_path):
    _, target = target_pair
    for layout in ("legacy", "nested"):
        ref = build_reference_drafter(str(tmp_path / layout), layout=layout, sliding_window=5,
                                      layer_types=("sliding_attention", "full_attention"))
        raw = json.load(open(tmp_path / layout / "config.json"))
        assert ("block_size" in raw) == (layout == "legacy")
        loaded = load_drafter(str(tmp_path / layout), target.cfg, "float32")
        cfg = loaded.cfg
        assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (
            ref.block_size, ref.mask_token_id, tuple(ref.target_layer_ids))
        assert cfg.sliding_window == 5 and cfg.rope_theta == 10000.0 and cfg.version == 1
        assert [cfg.layer_is_causal(i) for i in range(2)] == [l.self_attn.is_causal for l in ref.layers]
        assert [cfg.layer_window(i) for i in range(2)] == [l.self_attn.sliding_window for l in ref.layers]
    # a sliding layer whose window is not enabled (use_sliding_window false): no window, still causal
    d = dict(raw, use_sliding_window=False)
    cfg = DFlashConfig.from_hf_dict(d)
    assert cfg.layer_window(0) is None and cfg.layer_is_causal(0)
    with pytest.raises(ConfigError, match="mask_token_id"):
        DFlashConfig.from_hf_dict(dict(raw, dflash_config={"target_layer_ids": [0, 1]}))
    with pytest.raises(ConfigError, match="conv_kernel_size"):
        DFlashConfig.from_hf_dict(dict(raw, architectures=["DFlash2DraftModel"]))


@pytest.mark.parametrize("change, key", [
    ({"hidden_size": 48}, "hidden_size"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2]}}, "target_layer_ids"),
    ({"dflash_config": {"mask_token_id": 128, "target_layer_ids": [0, 1]}}, "mask_token_id"),
    ({"vocab_size": 256}, "vocab_size"),
])
def test_misfit_drafter_is_refused(change, key, target_pair, tmp_path):
    _, target = target_pair
    raw = build_reference_drafter(None, version=2).config.to_dict()
    raw["dflash_config"] = dict(raw["dflash_config"], **change.pop("dflash_config", {}))
    raw.update(change)
    with pytest.raises(ConfigError, match=key):
        check_fits_target(DFlashConfig.from_hf_dict(raw), target.cfg)
    _write_config(str(tmp_path), raw)
    with pytest.raises(ConfigError, match=key):
        load_drafter(str(tmp_path), target.cfg)


def test_unexpected_tensor_is_refused(target_pair, tmp_path):
    from safetensors.torch import load_file, save_file

    _, target = target_pair
    build_reference_drafter(str(tmp_path), version=1)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["layers.0.extra_gate.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensors.*extra_gate"):
        load_drafter(str(tmp_path), target.cfg)


@pytest.mark.parametrize("version", [1, 2])
def test_save_drafter_reloads_in_reference_and_jax(version, target_pair, tmp_path):
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    from safetensors import safe_open

    _, target = target_pair
    ref = build_reference_drafter(str(tmp_path / "src"), version=version, seed=5, is_causal=True,
                                  layer_types=("sliding_attention", "full_attention"), sliding_window=7,
                                  final_logit_softcapping=9.0)
    loaded = load_drafter(str(tmp_path / "src"), target.cfg, "float32")
    save_drafter(loaded, str(tmp_path / "out"))
    if version == 2:
        with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
            assert "candidate_selector.successor_codebook" in set(f.keys())
    cls = DFlash2DraftModel if version == 2 else DFlashDraftModel
    again = cls.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    want, got = ref.state_dict(), again.state_dict()
    assert set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    for attr in ("block_size", "mask_token_id", "target_layer_ids"):
        assert getattr(again, attr) == getattr(ref, attr)
    assert [l.self_attn.is_causal for l in again.layers] == [l.self_attn.is_causal for l in ref.layers]
    assert [l.self_attn.sliding_window for l in again.layers] == [
        l.self_attn.sliding_window for l in ref.layers]
    reloaded = load_drafter(str(tmp_path / "out"), target.cfg, "float32")
    assert reloaded.cfg == loaded.cfg
    for a, b in zip(jax.tree.leaves(loaded.state), jax.tree.leaves(reloaded.state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert MASK_TOKEN_ID == again.mask_token_id


def test_init_drafter_saves_for_reference(target_pair, tmp_path):
    """A fresh DFlash2 drafter (identity convs, zero successor codebook) saves to a directory that
    `DFlash2DraftModel.from_pretrained` loads with identical weights."""
    from dflash.model import DFlash2DraftModel

    dcfg = DFlashConfig.from_hf_dict(build_reference_drafter(None, version=2).config.to_dict())
    check_fits_target(dcfg, target_pair[1].cfg)
    loaded = init_drafter(dcfg, "float32", seed=0)
    save_drafter(loaded, str(tmp_path))
    ref = DFlash2DraftModel.from_pretrained(str(tmp_path), dtype=torch.float32)
    drafter = nnx.merge(loaded.graphdef, loaded.state)
    conv = ref.layers[0].attention_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, dcfg.hidden_size))
    assert not conv.base_kernel[:, 1:].any() and not conv.kernel_projection.weight.any()
    np.testing.assert_array_equal(ref.fc.weight.detach().numpy().T, np.asarray(drafter.fc[...]))
    np.testing.assert_array_equal(ref.candidate_selector.predecessor_codebook.weight.detach().numpy(),
                                  np.asarray(drafter.candidate_selector.predecessor_codebook[...]))
    assert not ref.candidate_selector.successor_codebook.weight.any()
