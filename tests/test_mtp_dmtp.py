"""Native MTP and the DMTP methods: MTP parity with transformers' MtpModel, greedy output equal to
`ar` for every method, the W = 0 identity, MTP history equal to a from-scratch pass, one compile per
bucket, and lossless sampling for mtp and dmtp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_fixtures import build_reference_drafter, saved_dmtp_drafter
from stat_checks import assert_matches_target_joint
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import MissingMtpError, load_mtp
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.batch import RequestError
from dmtp_jax.decode.round import merge_models
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.methods import DMTP_METHODS

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17]]


@pytest.fixture(scope="module")
def models(mtp_target_dir):
    target = load_target(mtp_target_dir)
    return target, load_mtp(mtp_target_dir, target.cfg)


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("dflash") / "d")
    build_reference_drafter(d, seed=3, layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    return d


@pytest.fixture(scope="module")
def dmtp_dirs(models, dflash_dir, tmp_path_factory):
    """A saved DMTP drafter directory per method, with non-zero fusion weights."""
    target, _ = models
    return {method: saved_dmtp_drafter(str(tmp_path_factory.mktemp("dmtp") / method), target.cfg, method,
                                       fusion_seed=i, dflash_dir=dflash_dir)
            for i, method in enumerate(DMTP_METHODS)}


def engine_for(method, models, dmtp_dirs, **options):
    """The engine of `method` on the MTP target, with the saved DMTP drafter of that method."""
    target, mtp = models
    drafter = fusion = None
    if method != "mtp":
        drafter, fusion = load_dmtp_drafter(dmtp_dirs[method], target.cfg)
    return make_decoder(method, target, drafter, mtp=mtp, fusion=fusion, **options)


def test_mtp_matches_transformers_mtp_model(models, mtp_target_dir):
    from transformers import AutoModelForCausalLM

    from dmtp_jax.compare.heads import reference_mtp_model
    target, mtp = models
    hf = AutoModelForCausalLM.from_pretrained(mtp_target_dir, dtype=torch.float32).eval()
    ref = reference_mtp_model(hf, mtp_target_dir)
    ids = torch.tensor([PROMPTS[2]])
    n = ids.shape[1]
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states[-1]
        y = ref.forward_layer(0, hidden[:, :-1], torch.arange(1, n)[None], None, input_ids=ids[:, 1:])
        want = ref._project_to_logits(y).numpy()
    model, head = nnx.merge(target.graphdef, target.state), nnx.merge(mtp.graphdef, mtp.state)
    h, _ = head(model.embed(jnp.asarray(ids[:, 1:].numpy())), jnp.asarray(hidden[:, :-1].numpy()),
                jnp.arange(1, n)[None])
    got = np.asarray(model.logits(head.post_norm(h)))
    assert np.abs(got - want).max() < 1e-4
    # chained drafts: each step feeds the post-norm output and the drafted token back
    with torch.no_grad():
        ref_y, ref_tok, ref_chain = y[:, -1:], torch.tensor([[int(want[0, -1].argmax())]]), []
        our_y, our_tok, our_chain = head.post_norm(h)[:, -1:], jnp.asarray([[int(got[0, -1].argmax())]]), []
        for step in range(3):
            ref_y = ref.forward_layer(0, ref_y, torch.tensor([[n + step]]), None, input_ids=ref_tok)
            ref_tok = ref._project_to_logits(ref_y).argmax(-1)
            ref_chain.append(int(ref_tok))
            our_h, _ = head(model.embed(our_tok), our_y, jnp.asarray([[n + step]]))
            our_y = head.post_norm(our_h)
            our_tok = jnp.argmax(model.logits(our_y), -1)
            our_chain.append(int(our_tok[0, 0]))
    assert our_chain == ref_chain


def test_target_without_mtp_is_refused(tiny_qwen3_dir):
    target = load_target(tiny_qwen3_dir)
    with pytest.raises(MissingMtpError, match="no native MTP head"):
        load_mtp(tiny_qwen3_dir, target.cfg)


@pytest.fixture(scope="module")
def ar_outputs(models):
    """Plain greedy outputs of PROMPTS and of the reversed prompts (one AR compile for the file)."""
    dec = ARDecoder(models[0])
    return (dec.generate(PROMPTS, 20, stop_ids=[]).output_ids,
            dec.generate([p[::-1] for p in PROMPTS], 20, stop_ids=[]).output_ids)


@pytest.mark.parametrize("method", ["mtp"] + list(DMTP_METHODS))
def test_greedy_equals_ar_for_every_method(method, models, dmtp_dirs, ar_outputs):
    engine = engine_for(method, models, dmtp_dirs)
    assert method == "mtp" or engine.fusion.cfg["method"] == method
    res = engine.generate(PROMPTS, 20, stop_ids=[])
    assert res.output_ids == ar_outputs[0]
    hist = res.stats["histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, f"acceptance should be partial, got {hist}"
    assert engine.generate([p[::-1] for p in PROMPTS], 20, stop_ids=[]).output_ids == ar_outputs[1]
    assert engine.compile_counts() == {"prefill": 1, "round": 1}


def first_round_drafts(engine, prompts):
    """The drafts of the first round after prefill, straight from the engine's proposer."""
    from dmtp_jax.decode.batch import pad_prompts
    sp = SamplingParams.make()
    b = pad_prompts(prompts, 8, engine.target.cfg.vocab_size, slack=engine.slots)
    states = engine.model_states()
    st = engine.prefill(states, b.tokens_bt, b.lengths_b, engine.new_state(len(b.lengths_b), b.max_len),
                        sp, jax.random.key(0))
    models, knobs = (lambda states: merge_models(engine.setup.graphdefs, states)), engine.knobs()
    propose = jax.jit(lambda states, st: engine.proposer.propose(models(states), st, sp, jax.random.key(1), True,
                                                                 b.lengths_b + 8, knobs).drafts_bn)
    return np.asarray(propose(states, st)), st


def test_zero_fusion_is_dflash_conditioned_on_mtp_t1(models, dflash_dir, dmtp_dirs):
    target, mtp = models
    drafter, zero = load_dmtp_drafter(dflash_dir, target.cfg, "dmtp")      # plain DFlash dir: W = 0
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(zero.state) if x.ndim == 2)
    engine = make_decoder("dmtp", target, drafter, mtp=mtp, fusion=zero)
    drafts, st = first_round_drafts(engine, PROMPTS)
    model, head, dr = (nnx.merge(m.graphdef, m.state) for m in (target, mtp, drafter))
    t1 = jnp.argmax(model.logits(head.post_norm(st.mtp_h_bh)), -1)
    block = jnp.full((t1.shape[0], 8), drafter.cfg.mask_token_id).at[:, 0].set(st.pending_b).at[:, 1].set(t1)
    positions = st.lengths_b[:, None] + jnp.arange(8)
    ctx_pos = jnp.broadcast_to(jnp.arange(st.ctx_cache.max_len), (t1.shape[0], st.ctx_cache.max_len))
    hidden = dr(model.embed(block), positions, st.ctx_cache.k_lbskd, st.ctx_cache.v_lbskd, ctx_pos,
                ctx_pos < st.lengths_b[:, None])
    want = np.concatenate([np.asarray(t1)[:, None],
                           np.asarray(jnp.argmax(dr.draft_logits(hidden[:, 2:], model.logits), -1))], 1)
    assert (drafts == want).all()
    drafter, fusion = load_dmtp_drafter(dmtp_dirs["dmtp"], target.cfg)
    fused, _ = first_round_drafts(make_decoder("dmtp", target, drafter, mtp=mtp, fusion=fusion), PROMPTS)
    assert (fused[:, 0] == want[:, 0]).all() and (fused[:, 1:] != want[:, 1:]).any()


def test_zero_context_fusion_is_candidate_only_drafting(models, dflash_dir):
    """`dmtp-ctx-fusion` at its zero init drafts exactly what `dmtp-candidate` drafts."""
    target, mtp = models
    drafts = {}
    for method in ("dmtp-candidate", "dmtp-ctx-fusion"):
        drafter, fusion = load_dmtp_drafter(dflash_dir, target.cfg, method)
        drafts[method], _ = first_round_drafts(make_decoder(method, target, drafter, mtp=mtp, fusion=fusion),
                                               PROMPTS)
    assert (drafts["dmtp-candidate"] == drafts["dmtp-ctx-fusion"]).all()


@pytest.mark.parametrize("method", ["mtp", "dmtp"])
def test_mtp_history_equals_a_from_scratch_pass(method, models, dmtp_dirs):
    target, mtp = models
    engine = engine_for(method, models, dmtp_dirs)
    res = engine.generate(PROMPTS, 24, stop_ids=[])
    st = engine.last_state

    @jax.jit
    def from_scratch(t_state, m_state, ids, cache):
        """MTP K/V of rows (h_i, x_{i+1}) at i+1 over the committed text, from a full target pass."""
        model, head = nnx.merge(target.graphdef, t_state), nnx.merge(mtp.graphdef, m_state)
        n = ids.shape[1] - 1
        hidden = model(ids[:, :n], jnp.arange(n)[None]).hidden_bth
        return head(model.embed(ids[:, 1:]), hidden, jnp.arange(1, n + 1)[None], cache)[1]

    for row, (prompt, out) in enumerate(zip(PROMPTS, res.output_ids)):
        seq = prompt + out                       # every token the engine committed and we know
        n = len(seq) - 1
        assert int(st.lengths_b[row]) >= n
        cache = jax.tree.map(lambda x: x[:, row:row + 1], st.mtp_cache)
        scratch = from_scratch(target.state, mtp.state, jnp.asarray([seq]),
                               type(cache)(jnp.zeros_like(cache.k_lbskd), jnp.zeros_like(cache.v_lbskd)))
        for got, want in ((cache.k_lbskd, scratch.k_lbskd), (cache.v_lbskd, scratch.v_lbskd)):
            assert np.abs(np.asarray(got[0, 0, 1:n + 1]) - np.asarray(want[0, 0, 1:n + 1])).max() < 1e-4


@pytest.mark.parametrize("method", ["mtp", "dmtp"])
def test_sampled_mtp_and_dmtp_are_lossless(method, models, dmtp_dirs):
    engine = engine_for(method, models, dmtp_dirs, mtp_steps=3)
    assert_matches_target_joint(engine, models[0], PROMPTS[0], SamplingParams.make(temperature=1.0, top_k=3))


def test_compare_reports_mtp(mtp_target_dir):
    from dmtp_jax.compare import compare_target
    report = compare_target(mtp_target_dir)
    mtp = [c for c in report["checks"] if c["name"] == "mtp"]
    assert report["ok"] and len(mtp) == 1 and mtp[0]["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("method", [m if m == "dmtp" else pytest.param(m, marks=pytest.mark.heavy)
                                    for m in DMTP_METHODS if m != "dmtp-adaptive"])
def test_training_block_equals_the_decode_round(method, models, dmtp_dirs):
    """The trainer's block for anchor A (T1 from the data) drafts what the decode round drafts when
    the data's T1 is MTP's: same block input, positions, context and context alignment."""
    from dmtp_jax.train.features import mtp_hidden, target_features
    from dmtp_jax.train.loss import block_inputs, drafter_block_logits, method_layout
    target, mtp = models
    drafter, fusion = load_dmtp_drafter(dmtp_dirs[method], target.cfg)
    engine = make_decoder(method, target, drafter, mtp=mtp, fusion=fusion)
    prompt = PROMPTS[2]
    drafts, st = first_round_drafts(engine, [prompt])
    a = len(prompt)
    tokens = jnp.asarray([prompt + [int(st.pending_b[0]), int(drafts[0, 0])] + [0] * 8])
    valid = jnp.ones(tokens.shape, bool)
    model, head, dr, fu = (nnx.merge(m.graphdef, m.state) for m in (target, mtp, drafter, fusion))
    feats, hidden, _ = target_features(model, tokens, valid, drafter.cfg)
    blocks = block_inputs(method, tokens, jnp.ones(tokens.shape, jnp.int32), jnp.asarray([[a]]),
                          jnp.asarray([[True]]), 8, mask_token_id=drafter.cfg.mask_token_id, gamma=None)
    logits = drafter_block_logits(dr, model, feats, valid, blocks, jnp.asarray([[a]]), method=method,
                                  fusion=fu, mtp_h_bth=mtp_hidden(head, model, tokens, hidden))
    known = method_layout(method, 8)[1]
    assert np.asarray(jnp.argmax(logits[0, known:], -1)).tolist() == drafts[0, 1:].tolist()


def adaptive_training_drafts(models, drafter, fusion, prompt, pending, t1, t1_masked):
    """Greedy drafts of the trainer's dmtp-adaptive block at anchor A = len(prompt) in one mode."""
    from dmtp_jax.train.features import mtp_hidden, target_features
    from dmtp_jax.train.loss import block_inputs, drafter_block_logits
    target, mtp = models
    a = len(prompt)
    tokens = jnp.asarray([prompt + [pending, t1] + [0] * 8])
    valid = jnp.ones(tokens.shape, bool)
    model, head, dr, fu = (nnx.merge(m.graphdef, m.state) for m in (target, mtp, drafter, fusion))
    feats, hidden, _ = target_features(model, tokens, valid, drafter.cfg)
    masked = jnp.asarray([[t1_masked]])
    blocks = block_inputs("dmtp-adaptive", tokens, jnp.ones(tokens.shape, jnp.int32), jnp.asarray([[a]]),
                          jnp.asarray([[True]]), 8, mask_token_id=drafter.cfg.mask_token_id, gamma=None,
                          t1_masked_bn=masked)
    assert blocks.weights_bnk[0, 0].tolist() == [0.0] + [float(t1_masked)] + [1.0] * 6
    logits = drafter_block_logits(dr, model, feats, valid, blocks, jnp.asarray([[a]]), method="dmtp-adaptive",
                                  fusion=fu, mtp_h_bth=mtp_hidden(head, model, tokens, hidden), t1_masked_bn=masked)
    return np.asarray(jnp.argmax(logits[0, 1:], -1)).tolist()


def test_adaptive_training_block_equals_the_decode_round_in_both_modes(models, dmtp_dirs):
    """Threshold 0: every row takes MTP's T1 (dmtp's block); threshold 1: none does (DFlash's block,
    the drafter's own T1). The trainer's block of each mode drafts exactly what the round drafts."""
    target, _ = models
    drafter, fusion = load_dmtp_drafter(dmtp_dirs["dmtp-adaptive"], target.cfg)
    prompt = PROMPTS[2]
    for threshold, t1_masked in ((0.0, False), (1.0, True)):
        engine = make_decoder("dmtp-adaptive", target, drafter, mtp=models[1], fusion=fusion,
                              adaptive_threshold=threshold)
        drafts, st = first_round_drafts(engine, [prompt])
        got = adaptive_training_drafts(models, drafter, fusion, prompt, int(st.pending_b[0]), int(drafts[0, 0]),
                                       t1_masked)
        want = drafts[0].tolist() if t1_masked else drafts[0, 1:].tolist()
        assert (got if t1_masked else got[1:]) == want


def splitting_threshold(models, drafter, fusion):
    """The median of the MTP's first-round top-1 probabilities over PROMPTS: rows fall on both sides."""
    target, mtp = models
    probe = make_decoder("dmtp-adaptive", target, drafter, mtp=mtp, fusion=fusion)
    _, st = first_round_drafts(probe, PROMPTS)
    head, model = nnx.merge(mtp.graphdef, mtp.state), nnx.merge(target.graphdef, target.state)
    top_p = np.asarray(jax.nn.softmax(model.logits(head.post_norm(st.mtp_h_bh)), -1).max(-1))[:len(PROMPTS)]
    return float(np.median(top_p))


def test_adaptive_mixes_modes_per_row_and_equals_ar(models, dmtp_dirs, ar_outputs):
    """A threshold inside the range of the MTP's confidences splits rows between the modes within
    rounds; greedy output stays exactly `ar`'s, stats split acceptance by mode, one round compile."""
    target, mtp = models
    drafter, fusion = load_dmtp_drafter(dmtp_dirs["dmtp-adaptive"], target.cfg)
    engine = make_decoder("dmtp-adaptive", target, drafter, mtp=mtp, fusion=fusion,
                          adaptive_threshold=splitting_threshold(models, drafter, fusion))
    res = engine.generate(PROMPTS, 20, stop_ids=[])
    assert res.output_ids == ar_outputs[0]
    s = res.stats
    assert 0.0 < s["mtp_t1_fraction"] < 1.0, s["mtp_t1_fraction"]
    assert s["first_candidate_acceptance_mtp_t1"] is not None and s["first_candidate_acceptance_drafter_t1"] is not None
    assert engine.compile_counts() == {"prefill": 1, "round": 1}


def test_changing_the_adaptive_threshold_takes_effect_without_recompiling(models, dmtp_dirs, ar_outputs):
    """The threshold is a traced argument of the round: set on the decoder between requests, it
    decides the next request's first candidates (0: always MTP's, 1.01: never), with one compile."""
    target, mtp = models
    drafter, fusion = load_dmtp_drafter(dmtp_dirs["dmtp-adaptive"], target.cfg)
    engine = make_decoder("dmtp-adaptive", target, drafter, mtp=mtp, fusion=fusion, adaptive_threshold=0.0)
    for threshold, fraction in ((0.0, 1.0), (1.01, 0.0), (0.0, 1.0)):
        engine.adaptive_threshold = threshold
        res = engine.generate(PROMPTS, 20, stop_ids=[])
        assert res.output_ids == ar_outputs[0]
        assert res.stats["mtp_t1_fraction"] == fraction and res.stats["adaptive_threshold"] == threshold
    assert engine.compile_counts() == {"prefill": 1, "round": 1}
    engine.adaptive_threshold = 2.0
    with pytest.raises(RequestError, match="adaptive-threshold"):
        engine.generate(PROMPTS, 4)
    with pytest.raises(AttributeError):
        engine.verify_mode = "block"        # fixed at construction: read-only, never silently ignored


def test_decoding_and_calibration_share_the_mtp_confidence(models):
    """dmtp-adaptive's confidence is one function (`fusion.mtp_first_candidate`): the round's first
    candidate and calibration both call it, and it is the MTP's top-1 softmax probability."""
    import inspect

    from dmtp_jax.decode import proposers
    from dmtp_jax.models.fusion import mtp_first_candidate
    from dmtp_jax.train import calibrate
    target, mtp = models
    model, head = nnx.merge(target.graphdef, target.state), nnx.merge(mtp.graphdef, mtp.state)
    h = jax.random.normal(jax.random.key(0), (3, target.cfg.hidden_size))
    _, logits, confidence = mtp_first_candidate(model, head, h)
    np.testing.assert_allclose(np.asarray(confidence), np.asarray(jax.nn.softmax(logits, -1).max(-1)), rtol=1e-6)
    for module in (proposers, calibrate):
        assert "mtp_first_candidate(" in inspect.getsource(module)


@pytest.mark.heavy
def test_sampled_adaptive_is_lossless(models, dmtp_dirs):
    target, mtp = models
    drafter, fusion = load_dmtp_drafter(dmtp_dirs["dmtp-adaptive"], target.cfg)
    engine = make_decoder("dmtp-adaptive", target, drafter, mtp=mtp, fusion=fusion,
                          adaptive_threshold=splitting_threshold(models, drafter, fusion))
    assert_matches_target_joint(engine, target, PROMPTS[0], SamplingParams.make(temperature=1.0, top_k=3))
    sources = [s for row in engine.generate(PROMPTS, 6, SamplingParams.make(temperature=1.0, top_k=3),
                                            stop_ids=[]).stats["t1_from_mtp"] for s in row]
    assert any(sources) and not all(sources), "both proposers must have been used for T1"


def test_calibration_scores_each_mode_as_the_round_commits(models, dmtp_dirs, ar_outputs):
    """Teacher forcing on the target's own greedy text (`train.calibrate.anchor_outcomes`) gives, for
    each mode, exactly the tokens the decode round's first greedy verification commits, on every row."""
    from dmtp_jax.train.calibrate import anchor_outcomes
    target, mtp = models
    drafter, fusion = load_dmtp_drafter(dmtp_dirs["dmtp-adaptive"], target.cfg)
    model, head, dr, fu = (nnx.merge(m.graphdef, m.state) for m in (target, mtp, drafter, fusion))
    firsts = {}
    for threshold in (0.0, 1.0):
        engine = make_decoder("dmtp-adaptive", target, drafter, mtp=mtp, fusion=fusion, adaptive_threshold=threshold)
        res = engine.generate(PROMPTS, 9, stop_ids=[])
        firsts[threshold] = [lengths[0] for lengths in res.stats["acceptance_lengths"]]
    rows = [prompt + out for prompt, out in zip(PROMPTS, ar_outputs[0])]
    width = max(map(len, rows))
    tokens = jnp.asarray([r + [0] * (width - len(r)) for r in rows])       # right padding: causal, unseen
    anchors = jnp.asarray([[len(p)] for p in PROMPTS])
    top_p, by_mtp, by_drafter = jax.jit(anchor_outcomes)(model, head, dr, fu, tokens, jnp.ones(tokens.shape, jnp.int32),
                                                         anchors, jnp.ones(anchors.shape, bool))
    assert ((np.asarray(top_p) > 0) & (np.asarray(top_p) <= 1)).all()
    assert np.asarray(by_mtp)[:, 0].tolist() == firsts[0.0]
    assert np.asarray(by_drafter)[:, 0].tolist() == firsts[1.0]


def test_mtp_advance_is_the_full_layer_at_the_last_row(models):
    """`MtpHead.advance` (keys and values of every row, the rest of the layer for one row) writes
    the cache `__call__` writes and returns `__call__`'s output at that row."""
    from dmtp_jax.layers.kv_cache import KVCache
    target, mtp = models
    head = nnx.merge(mtp.graphdef, mtp.state)
    cfg = target.cfg
    b, n, slots = 3, 8, 32
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    embeds = jax.random.normal(k1, (b, n, cfg.hidden_size))
    hidden = jax.random.normal(k2, (b, n, cfg.hidden_size))
    shape = (1, b, slots, cfg.num_key_value_heads, cfg.head_dim)
    cache = KVCache(jax.random.normal(k3, shape), jax.random.normal(k4, shape))   # history at slots < 6
    j = jnp.arange(n)[None]
    last = jnp.asarray([7, 0, 3])
    positions = jnp.where(j <= last[:, None], 6 + j, slots)                       # rows past `last`: scratch
    h_full, c_full = head(embeds, hidden, positions, cache)
    h_last, c_last = head.advance(embeds, hidden, positions, cache, last)
    for got, want in ((c_last.k_lbskd, c_full.k_lbskd), (c_last.v_lbskd, c_full.v_lbskd)):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    want = np.asarray(jnp.take_along_axis(h_full, last[:, None, None], axis=1)[:, 0])
    assert np.abs(np.asarray(h_last) - want).max() < 1e-5


def test_adaptive_training_may_start_from_a_dmtp_drafter(models, dmtp_dirs):
    """`train.py --init-from DMTP_DIR` for dmtp-adaptive: the same block layout and fusion, so the
    dmtp drafter loads as dmtp-adaptive with its weights; decoding still refuses the mix-up."""
    from dmtp_jax.config import ConfigError
    target, _ = models
    _, fusion = load_dmtp_drafter(dmtp_dirs["dmtp"], target.cfg, "dmtp")
    _, as_adaptive = load_dmtp_drafter(dmtp_dirs["dmtp"], target.cfg, "dmtp-adaptive", same_layout=True)
    assert as_adaptive.cfg["method"] == "dmtp-adaptive" and "threshold" not in as_adaptive.cfg
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fusion.state), jax.tree.leaves(as_adaptive.state)))
    with pytest.raises(ConfigError, match="holds a 'dmtp' drafter, not 'dmtp-adaptive'"):
        load_dmtp_drafter(dmtp_dirs["dmtp"], target.cfg, "dmtp-adaptive")
    with pytest.raises(ConfigError, match="holds a 'dmtp' drafter, not 'dmtp-single'"):   # another layout
        load_dmtp_drafter(dmtp_dirs["dmtp"], target.cfg, "dmtp-single", same_layout=True)
