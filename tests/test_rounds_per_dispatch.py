"""K rounds per dispatch (`SpecDecoder(rounds_per_dispatch=K)`, `decode/multi_round.py`): the
on-device loop gives what one round per dispatch gives -- tokens (greedy: also `ar`'s), truncation at
a stop token (within a round) and at max_new_tokens, acceptance lengths, target forwards, sampled tokens for one
seed -- streams once per dispatch, and compiles once per bucket.

One DMTP engine per K on the MTP target (every state field travels through the loop: target K/V,
drafter context K/V, MTP cache and hidden), on batches of 4 rows of different lengths (bucket 4);
in the greedy one a row stops early on a stop token, the others at max_new_tokens.
"""

import numpy as np
import pytest

from dflash_fixtures import build_reference_drafter, randomized
from test_mtp_dmtp import PROMPTS
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter, save_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.batch import RequestError
from dmtp_jax.decode.sampling import SamplingParams

KS = (1, 4, 8)
NEW = 20


@pytest.fixture(scope="module")
def engines(mtp_target_dir, tmp_path_factory):
    """`{K: dmtp engine}` sharing one target, MTP head and (randomized-fusion) DMTP drafter."""
    target = load_target(mtp_target_dir)
    mtp = load_mtp(mtp_target_dir, target.cfg)
    root = tmp_path_factory.mktemp("k-rounds")
    build_reference_drafter(str(root / "dflash"), seed=3, layer_types=("sliding_attention", "full_attention"),
                            sliding_window=6)
    drafter, fusion = load_dmtp_drafter(str(root / "dflash"), target.cfg, "dmtp")
    save_dmtp_drafter(drafter, randomized(fusion, 0), str(root / "dmtp"))
    drafter, fusion = load_dmtp_drafter(str(root / "dmtp"), target.cfg)
    return {k: make_decoder("dmtp", target, drafter, mtp=mtp, fusion=fusion, rounds_per_dispatch=k) for k in KS}


def generate_streamed(engine, prompts, stop_ids, **kw):
    """`(result, streamed tokens per row, on_tokens calls)`."""
    streamed, calls = [[] for _ in prompts], [0]

    def on_tokens(row, toks):
        streamed[row].extend(toks)
        calls[0] += 1
    return engine.generate(prompts, NEW, stop_ids=stop_ids, on_tokens=on_tokens, **kw), streamed, calls[0]


# rows of 1, 13, 2 and 7 tokens; greedy, the last row's 5th token is 65 and no other row makes 65 or 119
ROWS = [PROMPTS[1], PROMPTS[2], PROMPTS[3], [64, 98, 39, 54, 94, 14, 36]]
STOPS = [65, 119]


def test_k_rounds_equal_one_round_and_ar(engines):
    target = engines[1].target
    free = ARDecoder(target).generate(ROWS, NEW, stop_ids=[]).output_ids
    want = [out[:out.index(65) + 1] if 65 in out else out for out in free]
    assert [len(w) for w in want] == [NEW, NEW, NEW, 5]
    runs = {k: generate_streamed(engines[k], ROWS, STOPS) for k in KS}
    one, _, one_calls = runs[1]
    hist = one.stats["histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, f"acceptance should be partial, got {hist}"
    for k, (res, streamed, calls) in runs.items():
        assert res.output_ids == want, f"K={k}"
        assert streamed == want, f"K={k}"
        assert res.stats["acceptance_lengths"] == one.stats["acceptance_lengths"], f"K={k}"
        assert res.stats["target_forwards"] == one.stats["target_forwards"]
        assert res.stats["rounds_per_dispatch"] == k
        if k > 1:       # one call per row per dispatch (and the first token), far fewer than per round
            assert calls < one_calls
    # a second request of the same bucket reuses every executable; K > 1 never runs the single round
    reversed_prompts = [p[::-1] for p in PROMPTS]
    want2 = ARDecoder(target).generate(reversed_prompts, NEW, stop_ids=[]).output_ids
    for k in KS:
        assert engines[k].generate(reversed_prompts, NEW, stop_ids=[]).output_ids == want2
        counts = {"prefill": 1, "round": 1} if k == 1 else {"prefill": 1, "round": 0, "multi_round": 1}
        assert engines[k].compile_counts() == counts, f"K={k}"


@pytest.mark.heavy
def test_sampled_k_rounds_equal_one_round_for_a_seed(engines):
    sp = SamplingParams.make(temperature=1.0, top_k=3)
    one = engines[1].generate(PROMPTS, NEW, sp, seed=7, stop_ids=[])
    four = engines[4].generate(PROMPTS, NEW, sp, seed=7, stop_ids=[])
    assert four.output_ids == one.output_ids
    assert four.stats["acceptance_lengths"] == one.stats["acceptance_lengths"]
    assert engines[4].generate(PROMPTS, NEW, sp, seed=8, stop_ids=[]).output_ids != one.output_ids


@pytest.mark.parametrize("k", [1, 4])
def test_one_host_transfer_per_dispatch(engines, k, monkeypatch):
    """The host syncs once per dispatch: one explicit `spec.to_host` (one `jax.device_get` of the
    round's tokens, accepted counts and first-candidate sources) per jitted call, plus the first
    token after prefill, and no implicit device-to-host transfer anywhere (the PRNG key is folded on
    device). Sampling parameters as host scalars, so that reading `is_greedy` transfers nothing."""
    import jax

    from dmtp_jax.decode import spec
    engine = engines[k]
    engine.generate(ROWS, NEW, stop_ids=[])        # the exactness probe and the compiles are done
    compiled = engine.compile_counts()
    fetches, real = [], spec.to_host
    monkeypatch.setattr(spec, "to_host", lambda tree: fetches.append(len(jax.tree.leaves(tree))) or real(tree))
    sp = SamplingParams(np.float32(0.0), np.float32(1.0), np.int32(0))
    with jax.transfer_guard_device_to_host("disallow"):
        res = engine.generate(ROWS, NEW, sampling=sp, stop_ids=[])
    rounds = res.stats["target_forwards"] - 1
    assert fetches[0] == 1                          # the first tokens
    assert all(n == (3 if k == 1 else 5) for n in fetches[1:])
    if k == 1:
        assert len(fetches) == 1 + rounds
    else:
        assert len(fetches) - 1 <= rounds and len(fetches) - 1 >= -(-rounds // k)
    assert engine.compile_counts() == compiled     # host scalars for `sp`: the same programs


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_rounds_per_dispatch_below_one_is_refused(engines, bad):
    e = engines[1]
    with pytest.raises(RequestError, match="rounds-per-dispatch must be an integer >= 1"):
        make_decoder("dmtp", e.target, e.drafter, mtp=e.mtp, fusion=e.fusion, rounds_per_dispatch=bad)


def test_stop_and_budget_verdict_is_the_trackers():
    """`rows_still_running` (device) says done exactly when `StopTracker` (host) does."""
    import jax.numpy as jnp

    from dmtp_jax.decode.batch import StopTracker
    from dmtp_jax.decode.multi_round import pad_stop_ids, rows_still_running

    rng = np.random.default_rng(0)
    stops = [3, 7]
    for _ in range(50):
        max_new, prompt_len = int(rng.integers(1, 12)), int(rng.integers(1, 5))
        emitted = int(rng.integers(1, max_new + 1))
        tracker = StopTracker(1, max_new, stops)
        tracker.add(0, [0] * emitted)
        was_running = not tracker.done[0]
        tokens = rng.integers(0, 10, size=4)
        accepted = int(rng.integers(0, 4))
        tracker.add(0, tokens[:accepted + 1])
        lengths = prompt_len + emitted - 1 + accepted + 1        # committed after the round
        run = rows_still_running(jnp.asarray(tokens[None]), jnp.asarray([accepted]), jnp.asarray([lengths]),
                                 jnp.asarray([prompt_len + max_new]), jnp.asarray(pad_stop_ids(stops)),
                                 jnp.asarray([was_running]))
        assert bool(run[0]) == (was_running and not tracker.done[0])


def test_cli_passes_rounds_per_dispatch_to_the_decoder(tiny_qwen3_dir, monkeypatch):
    import infer

    seen = {}

    class Captured(Exception):
        pass

    def capture(method, target, *args, **options):
        seen.update(options, method=method)
        raise Captured
    monkeypatch.setattr("dmtp_jax.decode.loading.make_decoder", capture)
    with pytest.raises(Captured):
        infer.main(["generate", "--target", tiny_qwen3_dir, "--prompt-ids", "1,2", "--rounds-per-dispatch", "3"])
    assert seen["method"] == "ar" and seen["rounds_per_dispatch"] == 3
    args = infer.build_parser().parse_args(["bench", "--rounds-per-dispatch", "16"])
    assert args.rounds_per_dispatch == 16
