"""Prompt lookup (`--method lookup`) and a full-model drafter (`--method draft-model`): greedy output
equals `ar` for every row on a Qwen3 and a hybrid Qwen3.5 target, one compile per bucket, sampled
draft-model reproduces the target's distribution (lookup's proposal probabilities are one-hot), a drafter of another vocabulary is refused
before any load, and the n-gram lookup itself picks the longest, latest match.

The draft models are smaller targets cut from the target itself (some layers kept, every weight
perturbed), so acceptance is partial and the draft model's caches roll back every round."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from stat_checks import assert_matches_target_joint
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.lookup import lookup_drafts
from dmtp_jax.decode.sampling import SamplingParams

PROMPTS = [[5, 9, 31, 4, 77, 2, 18, 5, 9, 31], [3], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94], [42, 17]]
SLOTS = 4
KEEP_LAYERS = {"qwen3": [0], "qwen3_5": [0, 3]}     # the draft model's layers (hybrid: one DeltaNet + attention)


def smaller_draft(src: str, out: str, keep: list[int], sigma: float = 0.15, seed: int = 0) -> str:
    """A draft-model directory from the target at `src`: layers `keep` (renumbered), every tensor
    perturbed by `sigma` of its own spread, no MTP head."""
    from dmtp_jax.checkpoint.safetensors_io import CheckpointReader, write_safetensors
    rng = np.random.default_rng(seed)
    reader = CheckpointReader(src)
    tensors = {}
    for name in reader.keys():
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if name.startswith("mtp.") or (m and int(m.group(1)) not in keep):
            continue
        x = np.array(reader.array(name), np.float32)
        x = x + sigma * x.std() * rng.standard_normal(x.shape).astype(np.float32)
        tensors[f"model.layers.{keep.index(int(m.group(1)))}.{m.group(2)}" if m else name] = x
    os.makedirs(out)
    write_safetensors(os.path.join(out, "model.safetensors"), tensors)
    with open(os.path.join(src, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["num_hidden_layers"] = len(keep)
    if "layer_types" in cfg:
        cfg["layer_types"] = [cfg["layer_types"][i] for i in keep]
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    shutil.copy(os.path.join(src, "generation_config.json"), out)
    return out


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def models(request, tmp_path_factory):
    """`(target, draft model, {method: decoder})` per family, shared by the tests of that family."""
    src = request.getfixturevalue("tiny_qwen3_dir" if request.param == "qwen3" else "tiny_qwen3_5_dir")
    draft_dir = smaller_draft(src, str(tmp_path_factory.mktemp("draft") / "d"), KEEP_LAYERS[request.param])
    target, draft = load_target(src), load_target(draft_dir)
    # one block size for both: one exactness probe per target (memoized by target and width)
    decoders = {"ar": make_decoder("ar", target), "lookup": make_decoder("lookup", target, block_size=SLOTS),
                "draft-model": make_decoder("draft-model", target, draft_model=draft, block_size=SLOTS)}
    return target, draft, decoders


def test_greedy_equals_ar_for_every_row(models):
    _, _, decoders = models
    want = decoders["ar"].generate(PROMPTS, 24, stop_ids=[]).output_ids
    for method in ("lookup", "draft-model"):
        dec = decoders[method]
        res = dec.generate(PROMPTS, 24, stop_ids=[])
        assert res.output_ids == want, method
        hist = res.stats["histogram"]
        assert sum(hist[1:]) > 0, f"{method}: no draft accepted: {hist}"
        assert res.stats["exactness_probe"]["decision"] == "speculative"
        rev = [p[::-1] for p in PROMPTS]
        assert dec.generate(rev, 24, stop_ids=[]).output_ids == decoders["ar"].generate(rev, 24, stop_ids=[]).output_ids
        assert dec.compile_counts() == {"prefill": 1, "round": 1}, method
    hist = decoders["draft-model"].generate(PROMPTS, 24, stop_ids=[]).stats["histogram"]
    assert hist[0] > 0, f"draft-model acceptance should be partial (its caches roll back), got {hist}"


def test_finished_rows_do_no_harm(models):
    _, _, decoders = models
    free = decoders["ar"].generate(PROMPTS, 16, stop_ids=[]).output_ids
    stop = free[2][4]
    for method in ("lookup", "draft-model"):
        got = decoders[method].generate(PROMPTS, 16, stop_ids=[stop]).output_ids
        for row in range(len(PROMPTS)):
            cut = free[row].index(stop) + 1 if stop in free[row] else 16
            assert got[row] == free[row][:cut], (method, row)


@pytest.mark.parametrize("models", ["qwen3"], indirect=True)    # the rounds are the greedy test's, on both families
def test_server_engine_switches_between_them_on_one_state(models):
    """`serve --method auto` over ar and draft-model, lookup as an extra method: one state (token
    buffer, draft-model cache) for the three rounds, switched live; every request gets `generate`'s
    tokens."""
    from dmtp_jax.decode.auto import AutoDecoder, VerdictStore
    from dmtp_jax.serve.engine import Engine, Request
    _, _, decoders = models
    engine = Engine(AutoDecoder(decoders, store=VerdictStore(None)), max_batch_size=2, max_model_len=128,
                    buckets=(2,), extra_methods=("lookup",))
    assert engine.bank.slots == {"ar": 1, "draft-model": SLOTS, "lookup": SLOTS}
    reqs = [engine.add(Request(p, max_tokens=12, stop_ids=())) for p in PROMPTS]
    while not all(r.finished for r in reqs):
        engine.step()
    assert [r.output_ids for r in reqs] == decoders["ar"].generate(PROMPTS, 12, stop_ids=[]).output_ids
    assert {m for m, *_ in engine.policy.round_s} == {"ar", "draft-model", "lookup"}


def test_sampled_draft_model_reproduces_target_distribution(peaked_target_dir, tmp_path_factory):
    """Chi-square of 4096 sampled 3-token continuations against the exact target joint."""
    target = load_target(peaked_target_dir)
    draft = load_target(smaller_draft(peaked_target_dir, str(tmp_path_factory.mktemp("sdraft") / "d"), [0]))
    assert_matches_target_joint(make_decoder("draft-model", target, draft_model=draft, block_size=SLOTS), target,
                                PROMPTS[0], SamplingParams.make(temperature=1.0, top_k=3))


def test_lookup_proposes_one_hot_probabilities():
    """Sampled lookup is lossless by the verifier's rule when q is the one-hot of its drafts."""
    import jax
    import jax.numpy as jnp
    from types import SimpleNamespace
    from dmtp_jax.decode.proposers import RoundKnobs, make_proposer
    from dmtp_jax.decode.round import RoundModels
    tokens = jnp.array([[3, 4, 5, 3, 4, 0, 0, 0, 0]])
    state = SimpleNamespace(tokens_bs=tokens, lengths_b=jnp.array([4]), pending_b=jnp.array([4]), mtp_cache=None)
    models = RoundModels(SimpleNamespace(cfg=SimpleNamespace(vocab_size=8)))
    prop = make_proposer("lookup", SLOTS).propose(models, state, None, jax.random.key(0), False, None,
                                                  RoundKnobs.make())
    assert prop.drafts_bn.tolist() == [[5, 3, 4]]
    assert prop.q_bnv.tolist() == jax.nn.one_hot(prop.drafts_bn, 8).tolist()


def test_lookup_picks_the_longest_then_latest_match():
    import jax.numpy as jnp
    hist = jnp.array([[1, 2, 3, 9, 2, 3, 4, 1, 2, 3, 0, 0],     # "1 2 3" at 0..2 beats "2 3" at 4..5
                      [5, 6, 7, 5, 6, 8, 5, 6, 0, 0, 0, 0],     # "5 6" twice: the latest (3..4)
                      [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0],     # no match: the pending token repeated
                      [4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0]])    # the run continues periodically
    lengths = jnp.array([9, 7, 3, 2])
    assert lookup_drafts(hist, lengths, 4).tolist() == [[9, 2, 3, 4], [8, 5, 6, 8], [4, 4, 4, 4], [4, 4, 4, 4]]


def test_a_draft_model_of_another_vocabulary_is_refused_before_any_load(tiny_qwen3_dir, tmp_path, capsys,
                                                                        monkeypatch):
    """Preflight reads the two configs: one `error:` line, exit status 2, no model loaded."""
    import infer

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr("dmtp_jax.checkpoint.hf.load_target", no_load)
    draft = tmp_path / "other-vocab"
    draft.mkdir()
    with open(os.path.join(tiny_qwen3_dir, "config.json")) as fh:
        cfg = json.load(fh)
    (draft / "config.json").write_text(json.dumps({**cfg, "vocab_size": 256}))
    rc = infer.main(["generate", "--target", tiny_qwen3_dir, "--method", "draft-model", "--draft", str(draft),
                     "--prompt-ids", "1,2,3", "--max-new-tokens", "4"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert rc == 2 and captured.out == "" and len(err) == 1, captured.err
    assert err[0].startswith("error: draft model ") and "vocabulary of 256 tokens, the target 128" in err[0]
