"""Logprobs through the server (`serve/logprobs.py`, `decode/logprobs.py`), with the real openai client:
the target's raw log-softmax at each emitted token, the same for `ar` and `dmtp`, equal to a plain JAX
forward of the target over prompt + output, streamed with each delta, and no compile after warm-up."""

import json

import numpy as np
import pytest

from dmtp_jax.serve.engine import Engine
from tests.serve_fixtures import (MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, chat_tokenizer, serve_decoder,
                                  serve_reference, serve_tokenizer)

CASES = [0, 2, 3]       # prompts (and max_tokens) of tests/serve_fixtures.py


def start_server(decoder, tokenizer):
    from dmtp_jax.serve.app import Scheduler, build_app, serving_in_thread
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(4,))
    engine.warm_up(every_bucket=False, sampled=False)
    scheduler = Scheduler(engine)
    return scheduler, serving_in_thread(build_app(scheduler, tokenizer, "tiny", drain_s=5))


@pytest.fixture(scope="module")
def servers():
    """`{method: (openai client, scheduler)}` of an `ar` and a `dmtp` server on the same tiny target."""
    import openai

    from dmtp_jax.decode.ar import ARDecoder
    dmtp = serve_decoder()
    out, contexts = {}, []
    for method, dec in (("dmtp", dmtp), ("ar", ARDecoder(dmtp.target, prefill_chunk=dmtp.prefill_chunk))):
        scheduler, ctx = start_server(dec, serve_tokenizer())
        contexts.append(ctx)
        base = ctx.__enter__()
        out[method] = (openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0), scheduler)
    yield out
    for ctx in reversed(contexts):
        ctx.__exit__(None, None, None)


def reference_logprobs(prompt, output) -> np.ndarray:
    """`[len(output), V]`: the target's fp32 log-softmax predicting each output token (a plain forward)."""
    import jax

    from dmtp_jax.compare.forward import jax_forward
    seq = np.array([list(prompt) + list(output)], np.int32)
    logits = jax_forward(serve_decoder().target, seq)["logits"][0]
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return lp[len(prompt) - 1:len(prompt) - 1 + len(output)]


def test_greedy_logprobs_match_the_target_for_ar_and_dmtp(servers):
    reference = serve_reference()
    tok = serve_tokenizer()
    counts = {m: s.engine.compile_counts() for m, (_, s) in servers.items()}
    for case in CASES:
        got = {}
        for method, (client, _) in servers.items():
            out = client.completions.create(model="tiny", prompt=PROMPTS[case], max_tokens=MAX_TOKENS[case],
                                            temperature=0, logprobs=5)
            choice = out.choices[0]
            assert choice.text == tok.decode(reference[case], skip_special_tokens=True)
            got[method] = choice.logprobs
        ids = reference[case]
        want = reference_logprobs(PROMPTS[case], ids)
        for method, lp in got.items():
            assert len(lp.token_logprobs) == len(ids) == len(lp.top_logprobs) == len(lp.text_offset)
            assert np.allclose(lp.token_logprobs, want[np.arange(len(ids)), ids], atol=1e-4), method
            assert lp.tokens == [tok.decode([t]) for t in ids]
            for j, top in enumerate(lp.top_logprobs):
                values = list(top.values())
                assert values == sorted(values, reverse=True) and lp.tokens[j] in top       # greedy: the top
                assert abs(values[0] - lp.token_logprobs[j]) < 1e-6
                assert np.allclose(sorted(values, reverse=True)[:len(values)],
                                   np.sort(want[j])[::-1][:len(values)], atol=1e-4)
        assert got["ar"].tokens == got["dmtp"].tokens
        assert np.allclose(got["ar"].token_logprobs, got["dmtp"].token_logprobs, atol=1e-5)
    # logprobs compiled nothing after warm-up
    assert {m: s.engine.compile_counts() for m, (_, s) in servers.items()} == counts


def test_streamed_deltas_carry_logprobs(servers):
    client, scheduler = servers["dmtp"]
    before = scheduler.engine.compile_counts()
    case = 2
    full = client.completions.create(model="tiny", prompt=PROMPTS[case], max_tokens=MAX_TOKENS[case], temperature=0,
                                     logprobs=3).choices[0].logprobs
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[case], max_tokens=MAX_TOKENS[case],
                                            temperature=0, logprobs=3, stream=True))
    with_lp = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert len(with_lp) > 1
    assert [t for lp in with_lp for t in lp.token_logprobs] == pytest.approx(full.token_logprobs, abs=1e-6)
    assert [t for lp in with_lp for t in lp.text_offset] == full.text_offset
    assert all(len(top) <= 4 for lp in with_lp for top in lp.top_logprobs)
    assert scheduler.engine.compile_counts() == before


def test_sampled_logprobs_are_the_raw_target_log_softmax(servers):
    """Sampled rows (temperature, top-k) of `ar` and `dmtp`: the raw target log-softmax, not the filtered."""
    from dmtp_jax.serve.request import Request
    for method in ("ar", "dmtp"):
        engine = Engine(servers[method][1].engine.decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN,
                        stop_ids=[], buckets=(4,))
        reqs = [engine.add(Request(PROMPTS[i], 8, temperature=0.8, top_k=5, seed=i, logprobs=20)) for i in CASES]
        while engine.busy:
            engine.step()
        for i, req in zip(CASES, reqs):
            want = reference_logprobs(PROMPTS[i], req.output_ids)
            assert len(req.token_logprobs) == len(req.output_ids) == 8
            for j, (t, (lp, top)) in enumerate(zip(req.output_ids, req.token_logprobs)):
                assert abs(lp - want[j, t]) < 1e-4 and len(top) == 20
                assert [x for _, x in top] == pytest.approx(np.sort(want[j])[::-1][:20], abs=1e-4)
                assert t in [x for x, _ in top][:5] or want[j, t] <= top[4][1] + 1e-5     # top-k 5 sampled


def test_bad_logprobs_are_400s_naming_the_field(servers):
    import openai
    client, _ = servers["dmtp"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, logprobs=21)
    assert err.value.body["param"] == "logprobs"
    from dmtp_jax.serve.protocol import ApiError, ChatBody, logprobs_of
    assert logprobs_of(ChatBody(messages=[], logprobs=True, top_logprobs=20)) == 20
    assert logprobs_of(ChatBody(messages=[], logprobs=False)) is None
    for body, param in ((ChatBody(messages=[], top_logprobs=2), "top_logprobs"),
                        (ChatBody(messages=[], logprobs=True, top_logprobs=21), "top_logprobs"),
                        (ChatBody(messages=[], logprobs=3), "logprobs")):
        with pytest.raises(ApiError) as e:
            logprobs_of(body)
        assert e.value.param == param


def test_chat_logprobs(servers, tmp_path):
    """Chat's format (`logprobs: true`, `top_logprobs`), streamed and not, equal to completions' numbers."""
    from fastapi.testclient import TestClient

    from dmtp_jax.serve.app import build_app
    messages = [{"role": "user", "content": "hi"}]
    tok, ids = chat_tokenizer(str(tmp_path), messages)
    client, scheduler = servers["dmtp"]
    want = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    want = want.choices[0].logprobs.token_logprobs
    http = TestClient(build_app(scheduler, tok, "tiny"))
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}
    content = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(want, abs=1e-6)
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"] for c in content)
    assert all(c["bytes"] == list(c["token"].encode("utf-8", "replace")) for c in content)
    lines = http.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    streamed = [c["logprob"] for ch in chunks if ch["choices"][0]["logprobs"] for c in ch["choices"][0]["logprobs"]["content"]]
    assert streamed == pytest.approx(want, abs=1e-6)
    plain = http.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_auto_switching_bank_logprobs():
    """auto's engine: ar, mtp and dmtp rounds forced in turn on one state (lean and full prefills): each
    greedy row's logprobs are the target's log-softmax."""
    import itertools

    from dmtp_jax.decode import make_decoder
    from dmtp_jax.decode.auto import AutoDecoder, VerdictStore
    from dmtp_jax.serve.request import Request
    dmtp = serve_decoder()
    auto = AutoDecoder({"ar": make_decoder("ar", dmtp.target), "dmtp": dmtp}, store=VerdictStore(None))
    engine = Engine(auto, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(4,),
                    extra_methods=("mtp",))
    turns, leans = itertools.cycle(engine.bank.methods), itertools.cycle(["ar", "dmtp"])
    engine.policy.choose = lambda *a, **k: next(turns)
    engine.policy.best = lambda *a, **k: next(leans)
    reqs = [engine.add(Request(PROMPTS[i], MAX_TOKENS[i], logprobs=2)) for i in CASES]
    while engine.busy:
        engine.step()
    assert all(engine.counters[f"rounds/{m}"] >= 1 for m in ("ar", "mtp", "dmtp"))
    for i, req in zip(CASES, reqs):
        assert req.output_ids == list(serve_reference()[i])
        want = reference_logprobs(PROMPTS[i], req.output_ids)
        got = [lp for lp, _ in req.token_logprobs]
        assert np.allclose(got, want[np.arange(len(got)), req.output_ids], atol=1e-4)
        assert all(top[0][0] == t for t, (_, top) in zip(req.output_ids, req.token_logprobs))
