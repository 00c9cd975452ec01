"""Block verification (`decode/verify.py:verify_block`): lossless exactly on enumerated small
vocabularies, never below token-level rejection in expected accepted length (exactly, and for the
sampling functions on the same drafts), the sampled (accepted, bonus) law, the paper's 11/9 vs 10/9
example, and the engine's chi-square check for dflash, DFlash2, mtp and dmtp -- which rejects a
deliberately wrong variant (the last position's block weight replaced by the token-level one)."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stat_checks import assert_matches_target_joint, target_joint_pvalues
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.decode.verify import block_weights, verify_block, verify_rejection

SP = SamplingParams.make(temperature=1.0, top_k=3)


# ---- exact, on enumerated draft blocks ---------------------------------------------------------
def random_tables(vocab, n, seed, alpha=0.5):
    """Prefix-dependent target `P[prefix]` (prefixes up to n) and drafter `Q[prefix]` (up to n-1)."""
    rng = np.random.default_rng(seed)
    prefixes = [s for k in range(n + 1) for s in itertools.product(range(vocab), repeat=k)]
    return ({s: rng.dirichlet([alpha] * vocab) for s in prefixes},
            {s: rng.dirichlet([alpha] * vocab) for s in prefixes if len(s) < n})


def enumerate_blocks(P, Q, vocab, n):
    """Every draft block with its probability under Q and the verifier inputs `(p, q, drafts)`."""
    blocks = list(itertools.product(range(vocab), repeat=n))
    prob = np.array([np.prod([Q[x[:i]][x[i]] for i in range(n)]) for x in blocks])
    p = np.array([[P[x[:i]] for i in range(n + 1)] for x in blocks], np.float32)
    q = np.array([[Q[x[:i]] for i in range(n)] for x in blocks], np.float32)
    return blocks, prob, p, q, np.array(blocks, np.int32)


def tau_law(h):
    """`P(accepted = k)` for k = 0..n from the weights h_1..h_n: the last k with eta_k < h_k."""
    n = h.shape[1]
    return np.stack([(h[:, k - 1] if k else 1.0) * np.prod(1 - h[:, k:], axis=1) for k in range(n + 1)], 1)


def output_law(P, Q, vocab, n, wrong_last=False):
    """Exact law of the first n+1 tokens (verifier output, continued by target sampling)."""
    blocks, prob, p, q, drafts = enumerate_blocks(P, Q, vocab, n)
    w, h, _ = (np.asarray(a, np.float64) for a in block_weights(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts)))
    if wrong_last:
        h[:, -1] = np.minimum(1.0, p[np.arange(len(blocks)), n - 1, drafts[:, -1]]
                              / q[np.arange(len(blocks)), n - 1, drafts[:, -1]])
    law = tau_law(h)
    q_pad = np.concatenate([q, np.zeros_like(q[:, :1])], 1)
    out = {}
    for b, x in enumerate(blocks):
        for k in range(n + 1):
            r = np.maximum(w[b, k] * p[b, k] - q_pad[b, k], 0)
            r = r / r.sum() if r.sum() > 0 else p[b, k]
            for y in range(vocab):
                for rest in itertools.product(range(vocab), repeat=n - k):
                    s = x[:k] + (y,) + rest
                    pr = prob[b] * law[b, k] * r[y] * np.prod([P[s[:i]][s[i]] for i in range(k + 1, n + 1)])
                    out[s] = out.get(s, 0.0) + pr
    return out


def expected_lengths(P, Q, vocab, n):
    """`(E[accepted] block, E[accepted] token-level rejection)` over the drafts, exactly."""
    _, prob, p, q, drafts = enumerate_blocks(P, Q, vocab, n)
    _, h, _ = block_weights(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts))
    block = tau_law(np.asarray(h, np.float64)) @ np.arange(n + 1)
    idx = np.arange(len(drafts))[:, None], np.arange(n)[None], drafts
    token = np.cumprod(np.minimum(1.0, p[:, :n][idx] / q[idx]), axis=1).sum(1)
    return float(prob @ block), float(prob @ token)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_verification_is_lossless_exactly(seed):
    vocab, n = 3, 3
    P, Q = random_tables(vocab, n, seed)
    target = {s: np.prod([P[s[:i]][s[i]] for i in range(n + 1)])
              for s in itertools.product(range(vocab), repeat=n + 1)}
    got = output_law(P, Q, vocab, n)
    assert max(abs(got[s] - target[s]) for s in target) < 1e-5
    wrong = output_law(P, Q, vocab, n, wrong_last=True)
    assert max(abs(wrong.get(s, 0.0) - target[s]) for s in target) > 1e-2


def test_paper_example_eleven_ninths():
    """Sun et al.'s motivating example: p = (1/3, 2/3), q = (2/3, 1/3) at every position, 2 drafts:
    token-level rejection accepts 10/9 drafts per block on average, block verification 11/9."""
    P = {s: np.array([1 / 3, 2 / 3]) for k in range(3) for s in itertools.product(range(2), repeat=k)}
    Q = {s: np.array([2 / 3, 1 / 3]) for s in P if len(s) < 2}
    block, token = expected_lengths(P, Q, 2, 2)
    assert abs(block - 11 / 9) < 1e-6 and abs(token - 10 / 9) < 1e-6


def test_block_never_below_rejection_exactly():
    gains = []
    for seed in range(12):
        vocab, n = (3, 3) if seed % 2 else (4, 2)
        block, token = expected_lengths(*random_tables(vocab, n, 100 + seed), vocab, n)
        assert block >= token - 1e-6, (seed, block, token)
        gains.append(block - token)
    assert max(gains) > 0.01


# ---- the sampling functions --------------------------------------------------------------------
def test_sampled_accept_and_bonus_follow_the_weights():
    """verify_block's (accepted, bonus) over one draft block match `P(accepted = k) r_k(y)`."""
    from scipy.stats import chisquare
    vocab, n, rows = 3, 3, 60_000
    P, Q = random_tables(vocab, n, 5)
    blocks, _, p, q, drafts = enumerate_blocks(P, Q, vocab, n)
    _, h, _ = block_weights(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts))
    law = np.clip(tau_law(np.asarray(h, np.float64)), 1e-12, 1)
    b = int(np.argmax(-(law * np.log(law)).sum(1)))         # the block whose accepted length varies most
    w, h, _ = (np.asarray(a, np.float64)[0] for a in block_weights(jnp.asarray(p[b:b + 1]), jnp.asarray(q[b:b + 1]),
                                                                jnp.asarray(drafts[b:b + 1])))
    law = tau_law(h[None])[0]
    q_pad = np.concatenate([q[b], np.zeros_like(q[b, :1])])
    expected = []
    for k in range(n + 1):
        r = np.maximum(w[k] * p[b, k] - q_pad[k], 0)
        expected.append(law[k] * (r / r.sum() if r.sum() > 0 else p[b, k]))
    expected = np.array(expected).ravel()
    tile = lambda a: jnp.asarray(np.repeat(a[b:b + 1], rows, axis=0))  # noqa: E731
    acc, bonus = jax.jit(verify_block)(tile(p), tile(q), tile(drafts), jax.random.key(0))
    counts = np.bincount(np.asarray(acc) * vocab + np.asarray(bonus), minlength=(n + 1) * vocab)
    keep = expected * rows >= 5
    obs, exp = counts[keep], expected[keep] * rows
    if expected[~keep].sum() > 0:
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, expected[~keep].sum() * rows)
    assert counts[expected == 0].sum() == 0
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_block_accepts_at_least_rejection_on_the_same_drafts():
    """Same drafts (drawn from Q), both verifiers: mean accepted drafts match their exact values and
    block >= rejection."""
    vocab, n, rows = 3, 3, 40_000
    P, Q = random_tables(vocab, n, 7)
    blocks, prob, p, q, drafts = enumerate_blocks(P, Q, vocab, n)
    pick = np.random.default_rng(0).choice(len(blocks), size=rows, p=prob / prob.sum())
    args = jnp.asarray(p[pick]), jnp.asarray(q[pick]), jnp.asarray(drafts[pick])
    block = float(np.mean(jax.jit(verify_block)(*args, jax.random.key(1))[0]))
    token = float(np.mean(jax.jit(verify_rejection)(*args, jax.random.key(2))[0]))
    exact_block, exact_token = expected_lengths(P, Q, vocab, n)
    se = 1.5 / np.sqrt(rows)                              # accepted in [0, 3]: sd <= 1.5
    assert abs(block - exact_block) < 4 * se and abs(token - exact_token) < 4 * se
    assert exact_block > exact_token + 8 * se and block > token


def test_greedy_limit_is_exact_match():
    """One-hot p and q (what greedy would be): block verification is exact match."""
    eye = np.eye(5, dtype=np.float32)
    p = jnp.asarray(eye[[[1, 2, 3, 4], [1, 0, 3, 4]]])
    q = jnp.asarray(eye[[[1, 2, 3], [1, 2, 3]]])
    acc, bonus = verify_block(p, q, jnp.asarray([[1, 2, 3], [1, 2, 3]]), jax.random.key(0))
    assert acc.tolist() == [3, 1] and bonus.tolist() == [4, 0]


# ---- the engine: chi-square against the exact target joint -------------------------------------
def _dflash_engine(name, peaked_target_dir, tmp_path_factory, **options):
    from test_spec_decode import make_pair

    from dmtp_jax.decode.spec import SpecDecoder
    target, drafter, _, _ = make_pair(name, peaked_target_dir, tmp_path_factory)
    return SpecDecoder(target, drafter, **options), target


@pytest.fixture(scope="module")
def mtp_models(mtp_target_dir):
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    target = load_target(mtp_target_dir)
    return target, load_mtp(mtp_target_dir, target.cfg)


@pytest.fixture(scope="module")
def dmtp_dir(mtp_models, tmp_path_factory):
    """A saved `dmtp` drafter with non-zero fusion weights (as test_mtp_dmtp's `dmtp_dirs`)."""
    from dflash_fixtures import saved_dmtp_drafter
    from dmtp_jax.methods import DMTP_METHODS
    return saved_dmtp_drafter(str(tmp_path_factory.mktemp("dmtp") / "dmtp"), mtp_models[0].cfg,
                              fusion_seed=list(DMTP_METHODS).index("dmtp"))


def _mtp_engine(method, request, **options):
    from test_mtp_dmtp import engine_for
    models = request.getfixturevalue("mtp_models")
    dirs = {"dmtp": request.getfixturevalue("dmtp_dir")} if method == "dmtp" else {}
    return engine_for(method, models, dirs, mtp_steps=3, **options), models[0]


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.heavy) for m in ("dflash", "dflash2", "mtp")]
                         + ["dmtp"])
def test_sampled_block_verification_reproduces_target_distribution(method, request, peaked_target_dir,
                                                                  tmp_path_factory):
    """The harness of test_spec_decode / test_mtp_dmtp with `verify="block"` (DFlash2: the selector's
    distribution as q; mtp: the chained MTP's; dmtp: MTP's for T1, the drafter's for the rest)."""
    if method.startswith("dflash"):
        name = "dflash-sliding+full" if method == "dflash" else "dflash2-noncausal-sliding"
        engine, target = _dflash_engine(name, peaked_target_dir, tmp_path_factory, verify="block")
    else:
        engine, target = _mtp_engine(method, request, verify="block")
    assert_matches_target_joint(engine, target, [5, 9, 31, 4, 77, 2, 18], SP)


class CappedRounds:
    """`generate` of a decoder whose rounds commit one token per row (`RoundKnobs.commit_cap` 0, as the
    serving engine's in-step dispatches do); its stats' histogram counts the drafts the target
    accepted and the cap cut, so the harness's check that verification ran reads them."""

    def __init__(self, decoder):
        self.decoder, self.cut = decoder, 0
        knobs = decoder.knobs()
        decoder.knobs = lambda: dataclasses.replace(knobs, commit_cap=np.int32(0))
        decoder.round, decoder.multi_round = RoundSpy(decoder.round, self), RoundSpy(decoder.multi_round, self)

    def generate(self, *args, **kwargs):
        self.cut = 0
        res = self.decoder.generate(*args, **kwargs)
        assert {n for row in res.stats["acceptance_lengths"] for n in row} == {1}
        res.stats["histogram"] = [0, self.cut]
        return res


class RoundSpy:
    """A jitted round (or K-round dispatch) that adds the drafts each call accepted to `owner.cut`
    (`lower` and the rest pass through)."""

    def __init__(self, real, owner):
        self.real, self.owner = real, owner

    def __call__(self, *args, **kwargs):
        out = self.real(*args, **kwargs)
        self.owner.cut += int(np.asarray(out[2]).sum())
        return out

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("verify", ["rejection", "block"])
def test_rounds_cut_to_one_token_stay_lossless(verify, request):
    """dmtp rounds whose committed tokens are cut after the first (`round.cap_accepted`): the first
    token is the accepted draft, not the bonus, and the next round drafts from it; the joint is the
    target's for token-level and block verification."""
    engine, target = _mtp_engine("dmtp", request, verify=verify)
    assert_matches_target_joint(CappedRounds(engine), target, [5, 9, 31, 4, 77, 2, 18], SP)


@pytest.mark.heavy
def test_harness_rejects_the_wrong_block_variant(request, monkeypatch):
    """The same harness fails for block verification whose last weight h_n is the token-level
    min(1, p/q) instead of w_n (fixed seeds: deterministic). The variant accepts whole blocks
    through earlier drafts the target gives probability 0 (about 1 sample in 6 lies outside the
    target's top-k support) and skews the rest (chi-square p ~ 1e-31 on the in-support samples)."""
    from dmtp_jax.decode import round as round_phases       # the round's accept phase calls it
    monkeypatch.setattr(round_phases, "verify_block", functools.partial(verify_block, _token_level_last=True))
    engine, target = _mtp_engine("mtp", request, verify="block")
    pvalue, _ = target_joint_pvalues(engine, target, [5, 9, 31, 4, 77, 2, 18], SP)
    assert pvalue < 1e-3, pvalue


# ---- the bench CLI: several verifiers side by side ---------------------------------------------
def test_bench_runs_verifiers_side_by_side(tiny_qwen3_dir, tmp_path, capsys):
    import json

    import infer
    from dflash_fixtures import build_reference_drafter
    draft = str(tmp_path / "draft")
    build_reference_drafter(draft, seed=1)
    wl = tmp_path / "ids.jsonl"
    wl.write_text('{"prompt_ids": [5, 9, 31, 4]}\n{"prompt_ids": [3, 8]}\n')
    out = tmp_path / "bench.json"
    rc = infer.main(["bench", "--target", tiny_qwen3_dir, "--draft", draft, "--methods", "ar,dflash",
                     "--verify", "rejection,block", "--temperature", "1", "--workload", str(wl),
                     "--batch-size", "2", "--max-new-tokens", "6", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "dflash/rejection" in table and "dflash/block" in table
    data = json.loads(out.read_text())
    assert list(data["methods"]) == ["ar", "dflash/rejection", "dflash/block"]
    assert data["config"]["verify"] == ["rejection", "block"]
    for name in ("dflash/rejection", "dflash/block"):
        m = data["methods"][name]
        assert m["tokens_per_second"] > 0 and 1.0 <= m["per_verify_acceptance_length"] <= 8.0
        assert 0.0 <= m["first_candidate_acceptance"] <= 1.0

    assert infer.main(["bench", "--target", tiny_qwen3_dir, "--verify", "rejection,bogus"]) == 2
    assert "unknown verifier(s) ['bogus']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        infer.main(["generate", "--target", tiny_qwen3_dir, "--verify", "rejection,block", "--prompt-ids", "1"])
