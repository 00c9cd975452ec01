"""The drafting side's efficient LM head (`models/draft_head.py`): exact scores on the shortlist,
a full-rank factor's shortlist holds the argmax, greedy speculative decoding with a small
(draft-changing) head equals plain greedy for mtp, dflash and dmtp, and sampled decoding with it
is lossless (chi-square). Over a vocabulary subset: exact on the shortlist, never outside the subset,
and the same exactness and losslessness. The int8 head: within its quantization step of the full
head, and the same exactness and losslessness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stat_checks import assert_matches_target_joint
from test_mtp_dmtp import PROMPTS
from dflash_fixtures import saved_dmtp_drafter
from dmtp_jax.bench.head_agreement import t1_agreement
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.checkpoint.draft_head_ckpt import make_draft_head, make_efficient_head
from dmtp_jax.models.draft_head import (EfficientHead, Int8Head, draft_scores, factor_head, frequent_ids, quantize_head,
                                        subset_size)
from dmtp_jax.models.fusion import mtp_confidence

SMALL = dict(rank=2, shortlist=4)       # of H = 32, V = 128: the shortlist changes drafts


@pytest.mark.parametrize("tied", [False, True])
def test_exact_on_the_shortlist_and_full_rank_holds_the_argmax(tied):
    h_dim, vocab = 16, 64
    w = jax.random.normal(jax.random.key(0), (vocab, h_dim) if tied else (h_dim, vocab))
    x = jax.random.normal(jax.random.key(1), (3, 5, h_dim))
    full = jnp.einsum("...h,vh->...v" if tied else "...h,hv->...v", x, w)
    for rank, shortlist in ((2, 6), (h_dim, 4)):
        head = factor_head(EfficientHead(hidden=h_dim, vocab=vocab, rank=rank, shortlist=shortlist,
                                         dtype=jnp.float32, tied=tied), w)
        scores = head.scores(x, w if tied else None)
        kept = np.isfinite(np.asarray(scores.logits))
        assert (kept.sum(-1) == shortlist).all()
        np.testing.assert_allclose(np.asarray(scores.logits)[kept], np.asarray(full)[kept], rtol=1e-5, atol=1e-5)
        assert np.isfinite(np.asarray(scores.rest_lse)).all()
        if rank == h_dim:      # the full-rank factor scores exactly: its shortlist holds the argmax
            assert (np.argmax(np.asarray(scores.logits), -1) == np.argmax(np.asarray(full), -1)).all()
    # the confidence counts the mass outside the shortlist: no more than the full softmax's top-1
    small = factor_head(EfficientHead(hidden=h_dim, vocab=vocab, rank=2, shortlist=4, dtype=jnp.float32, tied=tied),
                        w).scores(x, w if tied else None)
    shortlist_only = mtp_confidence(small.logits)
    assert (np.asarray(mtp_confidence(small.logits, small.rest_lse)) < np.asarray(shortlist_only)).all()


@pytest.mark.parametrize("tied", [False, True])
def test_subset_head_scores_only_its_ids_exactly(tied):
    h_dim, vocab, n = 16, 64, 13
    w = jax.random.normal(jax.random.key(4), (vocab, h_dim) if tied else (h_dim, vocab))
    x = jax.random.normal(jax.random.key(5), (3, 5, h_dim))
    full = np.asarray(jnp.einsum("...h,vh->...v" if tied else "...h,hv->...v", x, w))
    ids = frequent_ids(np.random.default_rng(0).integers(0, 50, vocab), n)
    assert len(ids) == n and subset_size(n) == 16          # three padding entries
    for rank, shortlist in ((2, 4), (h_dim, 4), (h_dim, 20)):
        head = EfficientHead(hidden=h_dim, vocab=vocab, rank=rank, shortlist=shortlist, dtype=jnp.float32,
                             tied=tied, subset=subset_size(n))
        scores = factor_head(head, w, ids, tied=tied).scores(x)
        logits = np.asarray(scores.logits)
        kept = np.isfinite(logits)
        assert logits.shape == full.shape and (kept.sum(-1) == min(shortlist, n)).all()   # padding never kept
        assert set(np.nonzero(kept)[-1].tolist()) <= set(ids.tolist())
        np.testing.assert_allclose(logits[kept], full[kept], rtol=1e-5, atol=1e-5)
        if rank == h_dim:      # full rank: the subset's own argmax
            assert (np.argmax(logits, -1) == ids[np.argmax(full[..., ids], -1)]).all()
        rest = np.asarray(scores.rest_lse)
        assert np.isneginf(rest).all() if shortlist >= n else np.isfinite(rest).all()


@pytest.mark.parametrize("tied", [False, True])
def test_int8_head_is_within_its_quantization_step(tied):
    h_dim, vocab = 16, 64
    w = jax.random.normal(jax.random.key(2), (vocab, h_dim) if tied else (h_dim, vocab))
    w_hv = w.T if tied else w
    x = jax.random.normal(jax.random.key(3), (3, 5, h_dim))
    head = quantize_head(Int8Head(hidden=h_dim, vocab=vocab), w, tied=tied)
    assert head.weight[...].dtype == jnp.int8 and int(jnp.max(jnp.abs(head.weight[...].astype(jnp.int32)))) == 127
    scores = head.scores(x)
    # each weight is off by at most half a step (scale / 2): |error| <= sum_h |x_h| * scale_v / 2
    bound = np.asarray(jnp.sum(jnp.abs(x), -1, keepdims=True) * head.scale[...] / 2) + 1e-5
    error = np.abs(np.asarray(scores.logits) - np.asarray(x @ w_hv))
    assert (error <= bound).all() and error.max() > 0
    assert np.isneginf(np.asarray(scores.rest_lse)).all()


@pytest.fixture(scope="module")
def models(mtp_target_dir):
    target = load_target(mtp_target_dir)
    return target, load_mtp(mtp_target_dir, target.cfg), make_efficient_head(target, **SMALL)


@pytest.fixture(scope="module")
def dmtp_dir(models, tmp_path_factory):
    return saved_dmtp_drafter(str(tmp_path_factory.mktemp("dmtp") / "dmtp"), models[0].cfg)


@pytest.fixture(scope="module")
def int8_head(models):
    return make_draft_head(models[0], "int8")


def engine(method, models, dmtp_dir, head=True, **options):
    """`head`: True for the small efficient head, None / False for the full head, or a head."""
    target, mtp, efficient = models
    drafter = fusion = None
    if method != "mtp":
        drafter, fusion = load_dmtp_drafter(dmtp_dir, target.cfg)
    head = efficient if head is True else (head or None)
    return make_decoder(method, target, drafter, mtp=mtp, fusion=fusion if method == "dmtp" else None,
                        draft_head=head, **options)


@pytest.mark.heavy
def test_greedy_with_the_efficient_head_equals_plain_greedy(models, dmtp_dir):
    target, _, efficient = models
    # the small head's argmax differs from the full head's on the prompts' own hidden states
    model, head = nnx.merge(target.graphdef, target.state), nnx.merge(efficient.graphdef, efficient.state)
    hidden = model(jnp.asarray([PROMPTS[0]]), jnp.arange(len(PROMPTS[0]))[None]).hidden_bth
    differ = np.argmax(np.asarray(draft_scores(model, head, hidden).logits), -1) != np.argmax(
        np.asarray(model.logits(hidden)), -1)
    assert differ.any() and not differ.all()
    want = ARDecoder(target).generate(PROMPTS, 12, stop_ids=[]).output_ids
    for method in ("mtp", "dflash", "dmtp"):
        dec = engine(method, models, dmtp_dir)
        res = dec.generate(PROMPTS, 12, stop_ids=[])
        assert res.output_ids == want, method
        assert res.stats["draft_head"] == "efficient(rank=2,shortlist=4)"
    # the bench's figure: T1 from this head is the full head's at some positions of the text, not all
    sequences = [p + o for p, o in zip(PROMPTS, want)]
    agreement = t1_agreement(dec, sequences)
    assert 0.0 < agreement < 1.0
    # with prompt lengths it counts from each prompt's last token on: here one position per sequence
    last_only = t1_agreement(dec, sequences, [len(s) for s in sequences]) * len(sequences)
    assert abs(last_only - round(last_only)) < 1e-9


def test_subset_head_greedy_equals_plain_greedy_and_sampled_is_lossless(models, dmtp_dir):
    """The efficient head over 40 of the 128 ids; its sampled check (dmtp: T1 from MTP and the
    drafter's rows) also stands for the whole-vocabulary head's, whose q is built the same way."""
    target = models[0]
    counts = np.zeros(target.cfg.vocab_size, np.int64)
    counts[np.random.default_rng(1).permutation(target.cfg.vocab_size)[:40]] = 1   # 40 of the 128 ids
    head = make_efficient_head(target, **SMALL, counts=counts, subset=40)
    want = ARDecoder(target).generate(PROMPTS, 12, stop_ids=[]).output_ids
    # dmtp drafts with the head at both places (MTP's T1, the drafter's rows); mtp / dflash call the
    # same `draft_scores` (their greedy runs with a head: the tests above)
    res = engine("dmtp", models, dmtp_dir, head=head).generate(PROMPTS, 12, stop_ids=[])
    assert res.output_ids == want
    assert res.stats["draft_head"] == "efficient(rank=2,shortlist=4,vocab=40)"
    dec = engine("dmtp", models, dmtp_dir, head=head, mtp_steps=3)
    assert_matches_target_joint(dec, target, PROMPTS[0], SamplingParams.make(temperature=1.0, top_k=3))


@pytest.mark.heavy
def test_int8_head_greedy_equals_plain_greedy_and_sampled_is_lossless(models, dmtp_dir, int8_head):
    want = ARDecoder(models[0]).generate(PROMPTS, 12, stop_ids=[]).output_ids
    for method in ("mtp", "dflash", "dmtp"):
        dec = engine(method, models, dmtp_dir, head=int8_head)
        res = dec.generate(PROMPTS, 12, stop_ids=[])
        assert res.output_ids == want, method
        assert res.stats["draft_head"] == "int8"
    agreement = t1_agreement(dec, [p + o for p, o in zip(PROMPTS, want)])
    assert agreement is not None and 0.5 < agreement <= 1.0
    dec = engine("dmtp", models, dmtp_dir, head=int8_head, mtp_steps=3)
    assert_matches_target_joint(dec, models[0], PROMPTS[0], SamplingParams.make(temperature=1.0, top_k=3))


@pytest.mark.heavy
def test_trained_factor_beats_its_svd_start_and_decodes_exactly(mtp_target_dir, tmp_path):
    """`train.py head-factor` lowers the KL to the full head on other windows of its data than its
    start (the SVD) had, writes the factor into the drafter directory, and `--draft-head-factor`
    decodes with it token for token as plain greedy does."""
    import json
    import infer
    import train
    rng = np.random.default_rng(0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"input_ids": rng.integers(0, 128, 40).tolist()}) + "\n" for _ in range(16)))
    out = tmp_path / "drafter"
    out.mkdir()
    assert train.main(["head-factor", "--target", mtp_target_dir, "--data", str(data), "--out", str(out),
                       "--rank", "2", "--steps", "100", "--batch-size", "4", "--seq-len", "16", "--lr", "0.03",
                       "--no-progress"]) == 0
    evaluation = json.loads((out / "head_factor_run" / "summary.json").read_text())["eval"]
    assert evaluation["trained"]["kl"] < 0.9 * evaluation["svd"]["kl"], evaluation
    outs = {}
    for name, flags in (("ar", ["--method", "ar"]),
                        ("trained", ["--method", "mtp", "--draft-head", "efficient", "--draft-head-factor", str(out)])):
        path = tmp_path / f"{name}.json"
        assert infer.main(["generate", "--target", mtp_target_dir, "--prompt-ids", "1,2,3", "--prompt-ids", "7",
                           "--max-new-tokens", "10", "--json", str(path), *flags]) == 0
        outs[name] = json.loads(path.read_text())
    assert outs["trained"]["output_ids"] == outs["ar"]["output_ids"]
    assert outs["trained"]["stats"]["draft_head"] == "efficient(rank=2,shortlist=8,trained)"


def test_a_subset_factor_loads_with_its_ids(models):
    """A factor file of a subset head (`down`, `up`, `ids`) sets the head's rank, subset and ids; a
    rank that differs from the file's is an error."""
    from dmtp_jax.errors import InputError
    target = models[0]
    counts = np.arange(target.cfg.vocab_size)[::-1]             # the 20 lowest ids are the most frequent
    svd = make_efficient_head(target, rank=3, shortlist=4, counts=counts, subset=20)
    factor = {k: np.asarray(svd.state[k].get_value()) for k in ("down", "up", "ids")}
    factor["up"] = factor["up"] * 2.0                            # not the SVD: the file's values are used
    head = make_efficient_head(target, shortlist=4, factor=factor)
    assert head.cfg == {"rank": 3, "shortlist": 4, "subset": 20, "trained": True}
    np.testing.assert_array_equal(np.asarray(head.state["ids"].get_value()), factor["ids"])
    np.testing.assert_allclose(np.asarray(head.state["up"].get_value()), factor["up"])
    assert sorted(factor["ids"][factor["ids"] >= 0].tolist()) == list(range(20))
    with pytest.raises(InputError, match="--draft-head-rank 2 differs from the trained head factor's 3"):
        make_efficient_head(target, rank=2, factor=factor)
