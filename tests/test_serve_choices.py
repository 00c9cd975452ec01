"""`n` > 1 choices (issue 68, item 2; `serve/choices.py`) through the server with the real openai client:
one HTTP request's `n` choices are `n` engine requests of one prompt, prefilled in one call (one row
each, even where the measured prefill times would split them), answered as one response (`index`
0..n-1, `usage` counting the prompt once); sampled choices differ and repeat with the seed, greedy ones
are the greedy output n times; streamed chunks carry their choice's index; `n` past the rows and
`best_of` are 400s naming their field; chat's choices alike (stop strings, streamed roles)."""

import json

import httpx
import pytest

from dmtp_jax.decode.batch import PROMPT_BUCKET_FLOOR
from dmtp_jax.serve.admission import form_group
from dmtp_jax.serve.choices import fan_out
from dmtp_jax.serve.engine import Engine
from dmtp_jax.serve.request import Request
from dmtp_jax.serve.stats import RecentMedians
from tests.serve_fixtures import MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, serve_decoder, serve_reference, serve_tokenizer
from tests.test_serve_engine import spy_prefill

SAMPLED = dict(temperature=1.0, top_p=1.0)


def start_server(decoder):
    """`(scheduler, serving context)` of a fresh 4-row engine (row buckets 1 and 4) on `decoder`."""
    from dmtp_jax.serve.app import Scheduler, build_app, serving_in_thread
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(1, 4))
    engine.warm_up(every_bucket=False, sampled=False)
    scheduler = Scheduler(engine)
    return scheduler, serving_in_thread(build_app(scheduler, serve_tokenizer(), "tiny", drain_s=5))


def client_of(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def server():
    """`(base url, openai client, scheduler)` of a dmtp server on the tiny target."""
    scheduler, ctx = start_server(serve_decoder())
    with ctx as base:
        yield base, client_of(base), scheduler


def ar_decoder():
    from dmtp_jax.decode.ar import ARDecoder
    dmtp = serve_decoder()
    return ARDecoder(dmtp.target, prefill_chunk=dmtp.prefill_chunk)


def split_times(width: int) -> RecentMedians:
    """Prefill times by which a 1-row call is far cheaper per request than a 4-row one (a CPU's)."""
    times = RecentMedians()
    for lean in (False, True):
        times.restart((1, width, lean), 0.001)
        times.restart((4, width, lean), 1.0)
    return times


def test_form_group_keeps_a_requests_choices_in_one_prefill():
    """Measured times that split any group into 1-row calls still leave one request's choices together
    (and no one else's)."""
    width = min(PROMPT_BUCKET_FLOOR, 512)
    times = split_times(width)
    other, choices = Request([9, 9], 4), fan_out(Request([1, 2, 3], 4, temperature=1.0, seed=3), 3)
    assert form_group([other, *choices], 4, (1, 4), 10**6, 512, set(), times=times) == [other]
    group = form_group([*choices, other], 4, (1, 4), 10**6, 512, set(), times=times)
    assert group == choices and [r.seed for r in group] == [3, 4, 5]
    assert form_group([*choices, other], 2, (1, 4), 10**6, 512, set(), times=times) == choices[:2]   # rows free


def run_sampled(client, **extra):
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, n=4, seed=7, **SAMPLED, **extra)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    return out


def test_sampled_choices_differ_repeat_with_the_seed_and_cost_one_prefill(server, monkeypatch):
    """n = 4 sampled: four choices, not all alike, in ONE prefill call (4 rows) even where the measured
    times would prefill them one by one; usage counts the prompt once. A fresh server answers the same
    request with the same four texts (the seed seeds the choices' first tokens, the server's round keys
    the rest: reproducible from a fresh server, the same server's first tokens alike)."""
    base, client, scheduler = server
    engine = scheduler.engine
    width = min(PROMPT_BUCKET_FLOOR, engine.bank.prefill_chunk)
    monkeypatch.setattr(engine, "prefill_times", split_times(width))
    spy = spy_prefill(engine, monkeypatch)
    out = run_sampled(client)
    assert spy.calls == [4], spy.calls
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1, texts
    assert out.usage.prompt_tokens == len(PROMPTS[0]) and out.usage.completion_tokens == 4 * 8
    assert all(c.finish_reason == "length" for c in out.choices)
    firsts = [client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1, n=4, seed=7, **SAMPLED)
              for _ in range(2)]
    assert [c.text for c in firsts[0].choices] == [c.text for c in firsts[1].choices]

    runs = []
    for _ in range(2):      # plain rounds (no method switch): a fresh server's round keys are the same
        scheduler, ctx = start_server(ar_decoder())
        with ctx as base:
            runs.append([c.text for c in run_sampled(client_of(base)).choices])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1, runs


def test_greedy_choices_are_the_greedy_output(server):
    _, client, _ = server
    want = serve_tokenizer().decode(serve_reference()[0], skip_special_tokens=True)
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS[0], n=2, temperature=0,
                                    logprobs=2)
    assert [(c.index, c.text) for c in out.choices] == [(0, want), (1, want)]
    assert out.choices[0].logprobs.token_logprobs == out.choices[1].logprobs.token_logprobs
    assert out.usage.prompt_tokens == len(PROMPTS[0]) and out.usage.completion_tokens == 2 * MAX_TOKENS[0]


def test_streamed_choices_carry_their_index_and_one_done(server):
    base, _, _ = server
    want = serve_tokenizer().decode(serve_reference()[0], skip_special_tokens=True)
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS[0], "n": 2, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {0: want, 1: want} and reasons == {0: "length", 1: "length"}
    usages = [c["usage"] for c in chunks if "usage" in c]
    assert len(usages) == 1 and usages[0]["completion_tokens"] == 2 * MAX_TOKENS[0]
    assert "usage" in chunks[-1]


@pytest.mark.parametrize("extra, param, words", [({"n": 5}, "n", "--max-batch-size"), ({"n": 0}, "n", "[1, 4]"),
                                                 ({"best_of": 2}, "best_of", "not supported")])
def test_n_past_the_rows_and_best_of_are_400s(server, extra, param, words):
    base, _, _ = server
    r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, **extra}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text


def test_chat_choices(server, tmp_path):
    """Chat with n = 2, greedy: both messages the greedy output of the templated prompt (cut at a stop
    string alike), streamed with the role in each choice's first delta."""
    from fastapi.testclient import TestClient

    from dmtp_jax.serve.app import build_app
    from tests.serve_fixtures import chat_tokenizer
    _, client, scheduler = server
    messages = [{"role": "user", "content": "hi"}]
    tok, ids = chat_tokenizer(str(tmp_path), messages)
    want = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0).choices[0].text
    http = TestClient(build_app(scheduler, tok, "tiny"))
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "n": 2}
    out = http.post("/v1/chat/completions", json=body).json()
    assert [(c["index"], c["message"]["content"]) for c in out["choices"]] == [(0, want), (1, want)]
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 12
    stop = want[2:4]
    cut = http.post("/v1/chat/completions", json={**body, "stop": [stop]}).json()
    assert [c["message"]["content"] for c in cut["choices"]] == [want[:want.index(stop)]] * 2
    assert [c["finish_reason"] for c in cut["choices"]] == ["stop", "stop"]
    lines = http.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]
    for i in (0, 1):
        mine = [c["delta"] for c in chunks if c["index"] == i]
        assert mine[0]["role"] == "assistant" and "".join(d.get("content", "") for d in mine) == want
