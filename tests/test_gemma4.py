"""Gemma 4: the text target against transformers on tiny random checkpoints that transformers
writes itself (sliding and full layers of their own sizes, keys as values, proportional RoPE,
soft-capped logits), its packed cache, greedy `ar` == transformers' greedy past the window, the
`gemma4_assistant` drafter (reading the target's cache, centroid-masked head) against transformers,
and the methods on the target: greedy `mtp` (the assistant) / `dflash` / `dmtp` == `ar`, sampled
`dmtp` lossless, the assistant's state in the rounds == a from-scratch step; the draft-head tools
refuse the assistant (it scores with its own head)."""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_fixtures import build_reference_drafter, saved_dmtp_drafter
from gemma_fixtures import WINDOW, build_tiny_gemma4
from stat_checks import assert_matches_target_joint
from dmtp_jax.checkpoint.assistant_ckpt import load_assistant
from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.compare import compare_target, format_table
from dmtp_jax.config import ConfigError, TargetConfig
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.caches import TargetCaches
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.models.gemma4 import pack_heads, unpack_heads

PROMPTS = [[5, 9, 31, 4, 77, 2, 18, 100, 13, 61, 7], [3, 120, 17]]
IDS = np.random.RandomState(0).randint(3, 128, (2, 20)).astype(np.int32)       # 20 > 2 x WINDOW


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma 4 target and its assistant (8 centroids, top 2, a random token ordering): their
    directories, the transformers models, ours loaded from the directories."""
    d, a_dir = str(tmp_path_factory.mktemp("gemma4")), str(tmp_path_factory.mktemp("gemma4_assistant"))
    model, assistant = build_tiny_gemma4(d, a_dir)
    target = load_target(d)
    return dict(dir=d, assistant_dir=a_dir, hf=model, target=target, hf_assistant=assistant,
                assistant=load_assistant(a_dir, target.cfg))


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


@pytest.mark.parametrize("tensor", [2, 4, 8])
def test_packed_cache_shards_hold_the_heads_their_queries_read(tensor):
    """The 31B config's packed cache (16 heads of 256; a full layer's 4 x 512 repeated into them, not
    zero-padded) split over `tensor`: each layer type unpacks to the KV head every query head reads,
    and the slots of the KV head read by a shard's query heads lie in that shard's own slots (no
    gather of the cache at a read)."""
    cfg = TargetConfig.from_hf_dict(json.load(open(os.path.join(os.path.dirname(__file__), "..", "configs",
                                                                "models", "gemma-4-31b.json"))))
    heads, nh, dim, _ = cfg.kv_cache_dims
    assert (heads, nh, dim) == (16, 32, 256)
    for kv, d in ((cfg.num_key_value_heads, cfg.head_dim), (cfg.gemma.global_kv_heads, cfg.gemma.global_head_dim)):
        x = jnp.arange(kv * d, dtype=jnp.float32).reshape(1, 1, kv, d)
        got = np.asarray(unpack_heads(pack_heads(x, heads, dim), kv, d, nh))[0, 0]
        virtual = got.shape[0]
        for q in range(nh):
            v = q // (nh // virtual)                         # the (virtual) KV head query head q reads
            assert (got[v] == np.asarray(x[0, 0, q // (nh // kv)])).all()
            shard, per = q // (nh // tensor), heads // tensor
            assert shard * per <= v * d // dim and (v + 1) * d // dim <= (shard + 1) * per, (kv, d, q)


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


def test_compare_reports_target_and_assistant(gemma):
    """`infer.py compare --mtp ASSISTANT` on the tiny Gemma 4: every target check (logits, per-layer
    hidden states, the packed cache's decode, greedy past the window) and the assistant's two chained
    steps (`h'`, masked logits) within fp32 tolerance of transformers."""
    report = compare_target(gemma["dir"], dtype="float32", num_new_tokens=4, mtp_dir=gemma["assistant_dir"])
    names = [c["name"] for c in report["checks"]]
    assert names[-2:] == ["assistant_hidden", "assistant_logits"] and "cached_decode" in names, names
    assert report["ok"], format_table(report)
    assert max(report["prompt_lengths"]) > 4 * WINDOW and report["greedy"]["ours"] == report["greedy"]["hf"]


@pytest.fixture(scope="module")
def ar_output(gemma):
    return ARDecoder(gemma["target"]).generate(PROMPTS, 16, stop_ids=[]).output_ids


def test_greedy_ar_equals_transformers_generate(gemma, ar_output):
    """Greedy `ar` over prompt + 16 new tokens (past the window) emits transformers' greedy tokens."""
    for prompt, got in zip(PROMPTS, ar_output):
        with torch.no_grad():
            want = gemma["hf"].generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == want


def test_assistant_matches_transformers(gemma):
    """The assistant driven as transformers' candidate generator drives it: after a 13-token prompt
    (past the window), rows `(E(x_13), h_12)` then `(E(its argmax), its h')`, both at position 13 over
    the target's K/V of positions < 13 (ours: read from the target's cache, layers 2 and 3):
    `h'` and the masked logits within 1e-4."""
    hf, hf_a = gemma["hf"], gemma["hf_assistant"]
    target, assistant = gemma["target"], gemma["assistant"]
    assert assistant.cfg.kv_source_layers == (2, 3)
    p, ids = 13, torch.tensor(IDS[:1, :14])
    tok, want = ids[:, p:], []
    with torch.no_grad():
        out = hf.model(ids[:, :p], output_hidden_states=True, return_shared_kv_states=True)
        h = out.hidden_states[-1][:, -1:]
        for _ in range(2):
            step = hf_a(inputs_embeds=torch.cat([hf.model.embed_tokens(tok), h], -1), position_ids=torch.tensor([[p]]),
                        shared_kv_states=out.shared_kv_states, attention_mask=torch.ones(1, p + 1, dtype=torch.long))
            want.append((step.last_hidden_state.numpy(), step.logits.numpy()))
            tok, h = step.logits.argmax(-1), step.last_hidden_state

    @jax.jit
    def ours(t_state, a_state, ids_bt, nxt_b1, cache):
        tm, am = nnx.merge(target.graphdef, t_state), nnx.merge(assistant.graphdef, a_state)
        out = tm(ids_bt, jnp.arange(p)[None], cache)
        h, pos, got = out.hidden_bth[:, -1:], jnp.array([[p]]), []
        for _ in range(2):
            h, _ = am(tm.embed(nxt_b1), h, pos, target_kv=out.cache.kv)
            logits = am.scores(tm, None, h).logits
            got.append((am.feature(h), logits))
            nxt_b1 = jnp.argmax(logits, -1)
        return got
    got = ours(target.state, assistant.state, jnp.asarray(IDS[:1, :p]), jnp.asarray(IDS[:1, p:p + 1]),
               TargetCaches(target).new(1, 32))
    for (h, logits), (want_h, want_logits) in zip(got, want):
        assert np.abs(want_logits).max() > 1.0 and (want_logits == want_logits.min()).sum() == 128 - 2 * 16
        assert np.abs(np.asarray(h) - want_h).max() < 1e-4
        assert np.abs(np.asarray(logits) - want_logits).max() < 1e-4


@pytest.fixture(scope="module")
def decoders(gemma, tmp_path_factory):
    """`mtp` (the assistant loaded by `load_mtp` as the MTP head), `dflash` and `dmtp` (T1 from the
    assistant, the rest from DFlash) on the Gemma target; the drafters built as the Qwen tests build
    theirs (reference drafter reading target layers 0 and 1, noise fusion)."""
    target = gemma["target"]
    dflash_dir = str(tmp_path_factory.mktemp("dflash") / "d")
    build_reference_drafter(dflash_dir, seed=3, layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    dmtp_dir = saved_dmtp_drafter(str(tmp_path_factory.mktemp("dmtp") / "dmtp"), target.cfg, "dmtp",
                                  fusion_seed=1, dflash_dir=dflash_dir)
    assistant = load_mtp(gemma["assistant"].model_dir, target.cfg)
    drafter, fusion = load_dmtp_drafter(dmtp_dir, target.cfg)
    return {"mtp": make_decoder("mtp", target, None, mtp=assistant, mtp_steps=2),
            "dflash": make_decoder("dflash", target, load_drafter(dflash_dir, target.cfg)),
            "dmtp": make_decoder("dmtp", target, drafter, mtp=assistant, fusion=fusion)}


def test_greedy_methods_equal_ar(decoders, ar_output):
    """Greedy `mtp` (the assistant chained at the pending token's position over the committed K/V),
    `dflash` and `dmtp` emit `ar`'s tokens, one compile of each. (Random drafters for a random target
    of 128 tokens are almost never right greedily: acceptance is exercised by the sampled test,
    the assistant's step by `test_assistant_matches_transformers`.)"""
    for method, engine in decoders.items():
        res = engine.generate(PROMPTS, 16, stop_ids=[])
        assert res.output_ids == ar_output, method
        assert sum(res.stats["histogram"]) > 0, method
        assert engine.compile_counts() == {"prefill": 1, "round": 1}


@pytest.mark.heavy
def test_sampled_dmtp_is_lossless(gemma, decoders):
    """Sampled `dmtp` draws the target's joint over 3 tokens (chi-square); top-8, so that the random
    drafters' and the target's supports overlap and drafts get accepted."""
    assert_matches_target_joint(decoders["dmtp"], gemma["target"], PROMPTS[1],
                                SamplingParams.make(temperature=1.0, top_k=8))


def test_assistant_state_after_rounds_is_a_from_scratch_step(gemma, decoders):
    """After `mtp` rounds, each row's carried assistant state is the step a from-scratch pass gives:
    `(E(A), h_{L-1})` at the pending position L over the target's K/V of the committed text (so the
    rounds hand the assistant the right hidden, embedding, position and cache)."""
    target, assistant = gemma["target"], gemma["assistant"]
    engine = decoders["mtp"]
    res = engine.generate(PROMPTS, 16, stop_ids=[])
    st = engine.last_state

    @jax.jit
    def from_scratch(t_state, a_state, ids_bt, cache):
        tm, am = nnx.merge(target.graphdef, t_state), nnx.merge(assistant.graphdef, a_state)
        n = ids_bt.shape[1] - 1
        out = tm(ids_bt[:, :n], jnp.arange(n)[None], cache)
        return am(tm.embed(ids_bt[:, n:]), out.hidden_bth[:, -1:], jnp.array([[n]]), target_kv=out.cache.kv)[0][:, 0]
    checked = 0
    for row, (prompt, out) in enumerate(zip(PROMPTS, res.output_ids)):
        seq = prompt + out
        if int(st.lengths_b[row]) != len(seq) - 1:      # committed past the output: pending token unknown
            continue
        want = from_scratch(target.state, assistant.state, jnp.asarray([seq]), TargetCaches(target).new(1, 64))
        assert np.abs(np.asarray(st.mtp_h_bh[row]) - np.asarray(want[0])).max() < 1e-4
        checked += 1
    assert checked


@pytest.fixture(scope="module")
def trained_on_gemma(gemma, tmp_path_factory):
    """`get(method)`: `train.py` on the tiny Gemma 4 target, 6 steps on random data, exported: a DFlash
    drafter, or a DMTP one whose frozen T1 head is the assistant (its step reads the target's K/V of
    the training rows, `train/features.py:target_features(keep_kv=True)`). `(summary, export dir)`."""
    from train_fixtures import tiny_train_config, write_random_data
    from dmtp_jax.train.export import export_run
    from dmtp_jax.train.run import run_training

    tmp = tmp_path_factory.mktemp("gemma-train")
    data = write_random_data(str(tmp / "random.jsonl"), n=16, length=32)
    made = {}

    def get(method):
        if method not in made:
            extra = {"mtp": gemma["assistant_dir"]} if method == "dmtp" else {}
            cfg = tiny_train_config(gemma["dir"], data, str(tmp / method), method=method, steps=6, seq_len=32,
                                    warmup_steps=1, lr=1e-2, checkpoint_every=6, **extra)
            summary = run_training(cfg)
            export_run(cfg.out, str(tmp / f"{method}-exported"))
            made[method] = summary, str(tmp / f"{method}-exported")
        return made[method]
    return get


@pytest.mark.parametrize("method", [pytest.param("dflash", marks=pytest.mark.heavy), "dmtp"])
def test_train_on_gemma_loss_falls_and_export_decodes(method, gemma, trained_on_gemma, ar_output):
    """6 steps: the loss is finite and falls, one compile; the export loads and decodes greedy == `ar`
    (dmtp with the assistant as its T1 head; dflash, the same training without it: heavy)."""
    summary, out = trained_on_gemma(method)
    losses = summary["losses"]
    assert summary["steps_run"] == 6 and summary["compile_count"] == 1
    assert np.isfinite(losses).all() and np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1, losses
    target = gemma["target"]
    if method == "dflash":
        engine = make_decoder("dflash", target, load_drafter(out, target.cfg))
    else:
        drafter, fusion = load_dmtp_drafter(out, target.cfg)
        engine = make_decoder("dmtp", target, drafter, mtp=load_mtp(gemma["assistant_dir"], target.cfg), fusion=fusion)
    assert engine.generate(PROMPTS, 16, stop_ids=[]).output_ids == ar_output


DRAFT_HEAD_REFUSAL = "the Gemma 4 assistant scores with its own head, so a draft head does not apply"


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    return lines[0]


def test_draft_head_tools_refuse_the_assistant(gemma, decoders, tmp_path, capsys, monkeypatch):
    """The assistant scores with its own head: `--draft-head` with `mtp` (`infer.py generate` too), the
    draft-head T1 agreement and `train.py head-factor` (before the target loads) each refuse in one line,
    before any round compiles; dmtp keeps the head for its DFlash positions."""
    import infer
    import train
    from dmtp_jax.bench.head_agreement import t1_agreement
    from dmtp_jax.checkpoint.draft_head_ckpt import make_draft_head
    from dmtp_jax.errors import RequestError
    from dmtp_jax.train import head_factor  # noqa: F401  (imported before the no-load guard below)
    target, assistant, head = gemma["target"], gemma["assistant"], make_draft_head(gemma["target"], "int8")
    with pytest.raises(RequestError, match=f"^--draft-head int8: {DRAFT_HEAD_REFUSAL}$"):
        make_decoder("mtp", target, mtp=assistant, draft_head=head)
    dmtp = decoders["dmtp"]
    assert make_decoder("dmtp", target, dmtp.drafter, mtp=dmtp.mtp, fusion=dmtp.fusion, draft_head=head).draft_head
    decoder = types.SimpleNamespace(draft_head=head, proposer=types.SimpleNamespace(needs={"mtp": True}),
                                    target=target, mtp=assistant)
    with pytest.raises(RequestError, match=f"^draft-head T1 agreement: {DRAFT_HEAD_REFUSAL}$"):
        t1_agreement(decoder, [[5, 9, 31]])
    assert infer.main(["generate", "--target", gemma["dir"], "--mtp", gemma["assistant_dir"], "--method", "mtp",
                       "--draft-head", "efficient", "--prompt-ids", "5,9", "--max-new-tokens", "2"]) == 2
    assert one_error_line(capsys) == f"error: --draft-head efficient: {DRAFT_HEAD_REFUSAL}"

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the MTP head was checked")
    monkeypatch.setattr("dmtp_jax.checkpoint.hf.load_target", no_load)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(3, 40))}) + "\n" for _ in range(4)))
    assert train.main(["head-factor", "--target", gemma["dir"], "--mtp", gemma["assistant_dir"], "--data", str(data),
                       "--out", str(tmp_path / "out"), "--seq-len", "16", "--steps", "1", "--no-progress"]) == 2
    assert one_error_line(capsys) == f"error: head-factor --mtp {gemma['assistant_dir']}: {DRAFT_HEAD_REFUSAL}"
