"""EAGLE-3: a checkpoint written in the published layout (from its documented key names and
config fields) loads and computes what the published math says; an exported one is bit-identical;
a drafter that does not fit the target is refused before any tensor is read; greedy `eagle3` equals
`ar` on every row (Qwen3 and the hybrid Qwen3.5 target, drafts partly accepted), in `generate`
and in the server's engine; sampled `eagle3`
is lossless (chi-square); `train.py --method eagle3` lowers its loss and exports the published layout."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stat_checks import assert_matches_target_joint
from train_fixtures import tiny_train_config
from dmtp_jax.checkpoint.eagle3_ckpt import init_eagle3, load_eagle3, save_eagle3, with_draft_vocab
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.safetensors_io import CheckpointReader, write_safetensors
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.errors import ConfigError
from dmtp_jax.layers.kv_cache import KVCache
from dmtp_jax.train.eagle3 import fresh_eagle3_config

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17]]
NEW = 20
TAPS = [0, 1, 1]
DRAFT_VOCAB = 96


def published_tensors(target_dir: str, seed: int = 0) -> tuple[dict, dict]:
    """`(tensors, config)` of an EAGLE-3 drafter for the tiny Qwen3 target, named as the published
    checkpoints name them (torch layout `[out, in]`); the draft vocabulary is a shuffled subset
    holding the target's boosted LM-head rows, whose LM-head rows it copies (so drafts are partly
    accepted)."""
    reader = CheckpointReader(target_dir)
    head = np.array(reader.array("lm_head.weight"))         # [V, H]
    cfg = json.load(open(os.path.join(target_dir, "config.json")))
    vocab, h, heads, kv, d, inter = cfg["vocab_size"], cfg["hidden_size"], 4, 2, 8, 64
    rng = np.random.default_rng(seed)
    ids = np.sort(np.concatenate([np.arange(10, 16), rng.permutation(np.r_[0:10, 16:vocab])[:DRAFT_VOCAB - 6]]))
    w = lambda *shape: (rng.standard_normal(shape) * 0.3 / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    tensors = {
        "fc.weight": w(h, 3 * h) * 4,
        "midlayer.input_layernorm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32),
        "midlayer.hidden_norm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32),
        "midlayer.post_attention_layernorm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h) * 3,
        "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h) * 3,
        "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": np.ones(h, np.float32),
        "lm_head.weight": head[ids].astype(np.float32),
        "d2t": (ids - np.arange(DRAFT_VOCAB)).astype(np.int64),
        "t2d": np.isin(np.arange(vocab), ids),
    }
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": d, "vocab_size": vocab, "draft_vocab_size": DRAFT_VOCAB,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu",
              "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": TAPS, "use_aux_hidden_state": True}}
    return tensors, config


def write_dir(path: str, tensors: dict | None, config: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    if tensors is not None:
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    return path


@pytest.fixture(scope="module")
def published(peaked_target_dir, tmp_path_factory):
    tensors, config = published_tensors(peaked_target_dir)
    return write_dir(str(tmp_path_factory.mktemp("eagle3") / "published"), tensors, config), tensors, config


@pytest.fixture(scope="module")
def target(peaked_target_dir):
    return load_target(peaked_target_dir)


@pytest.fixture(scope="module")
def drafter(target, published):
    return load_eagle3(published[0], target.cfg)


@pytest.fixture(scope="module")
def decoder(target, drafter):
    """One eagle3 decoder (greedy and sampled rounds; the exactness probe runs once)."""
    return make_decoder("eagle3", target, drafter, block_size=4)


@pytest.fixture(scope="module")
def ar_outputs(target):
    return make_decoder("ar", target).generate(PROMPTS, NEW, stop_ids=[]).output_ids


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None]     # [T, 1, D]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def reference_forward(t: dict, cfg: dict, features, embeds):
    """The published math (numpy, torch layout): rows (features at p, embedding of x_{p+1}) at
    positions p, causal over the rows; returns the pre-norm outputs and the draft logits."""
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = len(embeds)
    g = features @ t["fc.weight"].T
    x = np.concatenate([_rms(embeds, t["midlayer.input_layernorm.weight"]),
                        _rms(g, t["midlayer.hidden_norm.weight"])], -1)
    pos = np.arange(n, dtype=np.float64)
    q = _rope((x @ t["midlayer.self_attn.q_proj.weight"].T).reshape(n, heads, d), pos)
    k = _rope((x @ t["midlayer.self_attn.k_proj.weight"].T).reshape(n, kv, d), pos)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).reshape(n, kv, d)
    k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d) + np.triu(np.full((n, n), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    a = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(n, -1)
    h = g + a @ t["midlayer.self_attn.o_proj.weight"].T
    y = _rms(h, t["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ t["midlayer.mlp.gate_proj.weight"].T, y @ t["midlayer.mlp.up_proj.weight"].T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ t["midlayer.mlp.down_proj.weight"].T
    return h, _rms(h, t["norm.weight"]) @ t["lm_head.weight"].T


def test_published_layout_loads_and_matches_the_published_math(target, drafter, published):
    _, tensors, config = published
    model, module = nnx.merge(target.graphdef, target.state), nnx.merge(drafter.graphdef, drafter.state)
    rng = np.random.default_rng(1)
    n, h = 9, config["hidden_size"]
    features = rng.standard_normal((n, 3 * h)).astype(np.float32)
    tokens = rng.integers(0, config["vocab_size"], n)
    embeds = np.asarray(model.embed(jnp.asarray(tokens)))
    want_h, want_logits = reference_forward(tensors, config, features.astype(np.float64), embeds.astype(np.float64))
    cache = KVCache.zeros(1, 1, 16, 2, 8, jnp.float32)
    got_h, _ = module.step(jnp.asarray(embeds)[None], module.fuse(jnp.asarray(features)[None]),
                           jnp.arange(n)[None], cache)
    assert np.abs(np.asarray(got_h[0]) - want_h).max() < 1e-4
    assert np.abs(np.asarray(module.draft_logits(got_h[0])) - want_logits).max() < 1e-3
    # draft id d proposes target id d + d2t[d]: the target-vocabulary argmax is the mapped draft argmax
    mapped = np.arange(DRAFT_VOCAB) + tensors["d2t"]
    assert (np.asarray(jnp.argmax(module.target_logits(got_h[0]), -1)) == mapped[want_logits.argmax(-1)]).all()
    assert drafter.cfg.target_layer_ids == tuple(TAPS) and drafter.cfg.draft_vocab_size == DRAFT_VOCAB


def test_training_time_test_sees_what_the_decode_chain_sees(target, drafter, published):
    """Pass k of `unrolled` at row p (teacher-forced tokens) equals the decode chain's step k from the
    committed position p - k: the cache rows (features, next token) up to p - k, then the drafter's
    own outputs."""
    _, _, config = published
    model, module = nnx.merge(target.graphdef, target.state), nnx.merge(drafter.graphdef, drafter.state)
    rng = np.random.default_rng(2)
    n, h, passes = 10, config["hidden_size"], 3
    features = jnp.asarray(rng.standard_normal((1, n, 3 * h)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, config["vocab_size"], (1, n + 1)))
    embeds = model.embed(tokens[:, 1:])                   # row p reads x_{p+1}
    unrolled = module.unrolled(embeds, features, jnp.ones((1, n), bool), passes)
    for p0 in (4,):                                       # the chain's last committed position
        cache = KVCache.zeros(1, 1, 16, 2, 8, jnp.float32)
        rows = jnp.arange(p0 + 1)[None]
        hs, cache = module.step(embeds[:, :p0 + 1], module.fuse(features[:, :p0 + 1]), rows, cache)
        g = hs[:, p0]
        assert np.abs(np.asarray(g - unrolled[0, :, p0])).max() < 1e-4
        for k in range(1, passes):
            out, cache = module.step(embeds[:, p0 + k][:, None], g[:, None], jnp.array([[p0 + k]]), cache)
            g = out[:, 0]
            assert np.abs(np.asarray(g - unrolled[k, :, p0 + k])).max() < 1e-4, (p0, k)


def test_export_reloads_bit_identically(target, drafter, published, tmp_path):
    path, tensors, _ = published
    save_eagle3(drafter, str(tmp_path / "exported"))
    reader = CheckpointReader(str(tmp_path / "exported"))
    assert sorted(reader.keys()) == sorted(tensors)
    for name, want in tensors.items():
        got = reader.array(name)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    again = load_eagle3(str(tmp_path / "exported"), target.cfg)
    assert again.cfg == drafter.cfg
    fields = json.load(open(tmp_path / "exported" / "config.json"))
    assert fields["architectures"] == ["LlamaForCausalLMEagle3"] and fields["draft_vocab_size"] == DRAFT_VOCAB


@pytest.mark.parametrize("change", [{"hidden_size": 48}, {"vocab_size": 256}])
def test_a_drafter_that_does_not_fit_is_refused_before_any_load(target, published, peaked_target_dir, tmp_path,
                                                                change, capsys, monkeypatch):
    import infer
    _, _, config = published
    path = write_dir(str(tmp_path / "bad"), None, {**config, **change})     # no tensors at all
    with pytest.raises(ConfigError, match="EAGLE-3 drafter does not fit the target") as e:
        load_eagle3(path, target.cfg)
    assert "\n" not in str(e.value) and next(iter(change)) in str(e.value)

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the drafter was checked")
    monkeypatch.setattr("dmtp_jax.checkpoint.hf.load_target", no_load)
    rc = infer.main(["generate", "--target", peaked_target_dir, "--eagle3", path, "--prompt-ids", "1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: EAGLE-3 drafter does not fit"), lines


def test_greedy_eagle3_equals_ar_on_qwen3(decoder, ar_outputs):
    res = decoder.generate(PROMPTS, NEW, stop_ids=[])
    assert res.output_ids == ar_outputs
    lengths = [n for row in res.stats["acceptance_lengths"] for n in row]
    assert max(lengths) > 1 and min(lengths) == 1, "drafts must be partly accepted"
    assert decoder.compile_counts() == {"prefill": 1, "round": 1}


def test_served_eagle3_equals_generate(decoder, ar_outputs):
    """The server's engine (continuous batching: a row joins a running batch) on an eagle3 decoder:
    every request's tokens are `ar`'s."""
    from dmtp_jax.serve.engine import Engine, Request
    engine = Engine(decoder, max_batch_size=4, max_model_len=64, stop_ids=[], buckets=(4,))
    reqs = [engine.add(Request(p, NEW)) for p in PROMPTS[:3]]
    engine.step()
    reqs.append(engine.add(Request(PROMPTS[3], NEW)))
    while engine.busy:
        engine.step()
    assert [r.output_ids for r in reqs] == ar_outputs
    assert max(a for r in reqs for a in r.acceptance) > 1


@pytest.mark.heavy
def test_greedy_eagle3_equals_ar_on_the_hybrid_target(tiny_qwen3_5_dir):
    hybrid = load_target(tiny_qwen3_5_dir)
    cfg = fresh_eagle3_config(tiny_train_config(tiny_qwen3_5_dir, "", "", method="eagle3", block_size=3,
                                                target_layer_ids=(0, 1, 3)), hybrid.cfg)
    drafter = init_eagle3(cfg, seed=2)
    # the draft head is the target's (the boosted rows): drafts are partly accepted
    head = np.array(CheckpointReader(tiny_qwen3_5_dir).array("lm_head.weight"))
    module = nnx.merge(drafter.graphdef, drafter.state)
    module.lm_head[...] = jnp.asarray(head.T)
    drafter.state = nnx.split(module)[1]
    drafter = with_draft_vocab(drafter, np.arange(cfg.vocab_size))
    prompts = PROMPTS[::2]
    want = make_decoder("ar", hybrid).generate(prompts, NEW, stop_ids=[]).output_ids
    res = make_decoder("eagle3", hybrid, drafter).generate(prompts, NEW, stop_ids=[])
    assert res.output_ids == want
    assert max(n for row in res.stats["acceptance_lengths"] for n in row) > 1


def test_sampled_eagle3_is_lossless(target, decoder):
    assert_matches_target_joint(decoder, target, PROMPTS[0], SamplingParams.make(temperature=1.0, top_k=3))


def write_counting_data(path: str, n: int = 16, length: int = 40, seed: int = 0) -> str:
    """Learnable records: each row counts up by one from a random start (mod 120), the
    first 4 tokens unsupervised."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for _ in range(n):
            start, step = rng.integers(0, 120), 1
            fh.write(json.dumps({"input_ids": [int((start + step * i) % 120) for i in range(length)],
                                 "loss_mask": [0] * 4 + [1] * (length - 4)}) + "\n")
    return path


def test_train_eagle3_loss_falls_and_exports_the_published_layout(peaked_target_dir, target, tmp_path):
    from dmtp_jax.train.export import export_run
    from dmtp_jax.train.run import run_training
    data = write_counting_data(str(tmp_path / "d.jsonl"), length=32)
    cfg = tiny_train_config(peaked_target_dir, data, str(tmp_path / "run"), method="eagle3", steps=20,
                            batch_size=4, seq_len=32, block_size=3, lr=3e-2, warmup_steps=1,
                            target_layer_ids=tuple(TAPS), checkpoint_every=20)
    summary = run_training(cfg)
    losses = summary["losses"]
    assert summary["compile_count"] == 1 and np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    assert summary["last"]["acc_1"] > 0      # the unrolled pass learns too
    export_run(str(tmp_path / "run"), str(tmp_path / "exported"))
    trained = load_eagle3(str(tmp_path / "exported"), target.cfg)
    assert trained.cfg.block_size == 3 and trained.cfg.target_layer_ids == tuple(TAPS)
    assert {"d2t", "t2d", "fc.weight", "midlayer.self_attn.q_proj.weight"} <= set(
        CheckpointReader(str(tmp_path / "exported")).keys())
