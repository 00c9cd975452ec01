"""The HTTP server (`dmtp_jax/serve/app.py`) through the real `openai` client against a server on a
free local port: streaming, stop strings, errors, disconnects, /metrics, chat, SIGTERM. The engine
itself: tests/test_serve_engine.py (same tiny models: tests/serve_fixtures.py)."""

import json

import pytest

from dmtp_jax.decode.batch import PROMPT_BUCKET_FLOOR
from dmtp_jax.serve.engine import Engine
from dmtp_jax.serve.warmup import lean_variants
from tests.serve_fixtures import (MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, chat_tokenizer, free_port, serve_decoder,
                                  serve_reference, serve_tokenizer, wait_healthy)


@pytest.fixture(scope="module")
def decoder():
    return serve_decoder()


@pytest.fixture(scope="module")
def reference():
    return [list(r) for r in serve_reference()]


# ---- the HTTP server, through the real openai client ----------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return serve_tokenizer()


@pytest.fixture(scope="module")
def server(decoder, tokenizer):
    """`(base url, scheduler)` of a server on a free local port, in this process (same decoder:
    the compiles are shared with the engine tests). One row bucket (the engine tests move rows
    between buckets) and a greedy warm-up: every request here is greedy."""
    from dmtp_jax.serve.app import Scheduler, build_app, serving_in_thread

    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(4,))
    engine.warm_up(every_bucket=False, sampled=False)
    # warm-up timed the one-call prefill it compiled (what sizes the prefill groups)
    width = min(PROMPT_BUCKET_FLOOR, engine.bank.prefill_chunk)
    assert set(engine.prefill_times.as_dict()) == {(4, width, lean) for lean in lean_variants(engine, width, 1)}
    scheduler = Scheduler(engine)
    with serving_in_thread(build_app(scheduler, tokenizer, "tiny", drain_s=5)) as base:
        yield base, scheduler
    assert not scheduler.accepting


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def test_concurrent_streams_equal_generate(client, reference, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    def stream(i):
        chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i],
                                                temperature=0, stream=True))
        return "".join(c.choices[0].text for c in chunks), chunks[-1]

    first = stream(0)   # the openai client's response models build on first use, which threads may race
    with ThreadPoolExecutor(len(PROMPTS)) as pool:       # more requests than rows: some wait for a row
        results = list(pool.map(stream, range(len(PROMPTS))))
    assert first[0] == results[0][0]
    for (text, last), ref in zip(results, reference):
        assert text == tokenizer.decode(ref, skip_special_tokens=True)
        assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == len(ref)
        assert last.usage.model_extra["dmtp"]["method"] == "dmtp"
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_stop_strings_cut_exactly(client, reference, tokenizer):
    full = tokenizer.decode(reference[2], skip_special_tokens=True)
    stop = next(full[i:i + 2] for i in range(1, len(full) - 2) if "\ufffd" not in full[:i + 2]
                and full.index(full[i:i + 2]) == i)     # a bigram's first occurrence, past the start
    want = full[:full.index(stop)]
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=MAX_TOKENS[2], temperature=0,
                                    stop=[stop, "never seen"])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=MAX_TOKENS[2], temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want


def test_bad_requests_get_openai_errors(client, server):
    import httpx
    import openai

    for kwargs in (dict(max_tokens=-1), dict(temperature=-0.5), dict(n=5), dict(top_p=0),
                   dict(prompt=[1, 999999]), dict(extra_body={"max_tokens": "many"})):
        args = {"model": "tiny", "prompt": [1, 2], "max_tokens": 4, **kwargs}
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**args)
    with pytest.raises(openai.BadRequestError) as err:             # past the context: 400, as vLLM
        client.completions.create(model="tiny", prompt=[1] * 100, max_tokens=50)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(server[0] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(server[0] + "/health").status_code == 200


def test_disconnect_frees_the_row_and_metrics(server, monkeypatch):
    import time

    import httpx
    base, scheduler = server
    real_decode = scheduler.engine.decode

    def slow_decode():
        """10 ms more per round: the 100-token request outlives the disconnect by far (unslowed,
        its rounds after the first chunk take ~60 ms here; a faster machine could finish them
        before the server sees the client go, as stop 32's CI did to the SIGTERM test)."""
        time.sleep(0.01)
        return real_decode()
    monkeypatch.setattr(scheduler.engine, "decode", slow_decode)
    body = {"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body) as r:
        next(r.iter_lines())
    deadline = time.time() + 20
    while scheduler.engine.busy and time.time() < deadline:
        time.sleep(0.05)
    assert not scheduler.engine.busy, "the disconnected request should free its row"
    text = httpx.get(base + "/metrics").text
    assert 'dmtp_requests_finished_total{reason="cancelled"} 1' in text
    for name in ("dmtp_requests_total", "dmtp_generation_tokens_total", "dmtp_running_rows 0",
                 "dmtp_waiting_requests 0", 'dmtp_verify_rounds_total{method="dmtp"}',
                 "dmtp_time_to_first_token_seconds_bucket", "dmtp_time_per_output_token_seconds_count"):
        assert name in text


def test_a_failing_step_ends_its_requests_and_the_server_lives_on(client, server, reference, tokenizer,
                                                                  monkeypatch):
    bank = server[1].engine.bank
    real_run = bank.run

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(bank, "run", real_run)
        raise RuntimeError("injected")
    monkeypatch.setattr(bank, "run", fail_once)
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "error"
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert out.choices[0].text == tokenizer.decode(reference[0][:5], skip_special_tokens=True)


def test_chat_completions_use_the_chat_template(server, decoder, tmp_path):
    """A tokenizer with a chat template (transformers'): the messages' ids through the engine equal
    `generate` on those ids, streamed and not."""
    from fastapi.testclient import TestClient

    from dmtp_jax.serve.app import build_app
    messages = [{"role": "user", "content": "hi"}]
    tok, ids = chat_tokenizer(str(tmp_path), messages)
    want = tok.decode(decoder.generate([ids], 6, stop_ids=[]).output_ids[0], skip_special_tokens=True)
    http = TestClient(build_app(server[1], tok, "tiny"))      # the running scheduler; no lifespan
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    out = http.post("/v1/chat/completions", json=body).json()
    assert out["choices"][0]["message"]["content"] == want and out["usage"]["prompt_tokens"] == len(ids)
    lines = http.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and lines[-2] == "data: [DONE]"


# ---- SIGTERM on a real `infer.py serve` process (slow) ------------------------------------------
def test_sigterm_finishes_the_running_request_and_exits_0(tiny_qwen3_dir):
    """`infer.py serve` as users run it: SIGTERM while a request runs lets that request finish
    (all its tokens, finish_reason "length"), refuses what comes after, and the process exits 0.

    The request streams, and the signal goes out as soon as its first chunk arrives: the request
    is then running for certain (an earlier version polled /metrics for a running row, and a fast
    machine sometimes finished the whole request between two polls)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    import httpx

    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    max_tokens = 400                     # prompt [1, 2, 3] does not reach EOS within 400 greedy tokens
    proc = subprocess.Popen([sys.executable, "infer.py", "serve", "--target", tiny_qwen3_dir, "--method", "ar",
                             "--port", str(port), "--max-batch-size", "2", "--max-model-len", "420"],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=300)
        first_chunk = threading.Event()
        result = {"chunks": [], "done": False}

        def complete():
            body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        result["done"] = True
                    else:
                        result["chunks"].append(json.loads(line[len("data: "):]))
                    first_chunk.set()
        thread = threading.Thread(target=complete)
        thread.start()
        assert first_chunk.wait(timeout=120), result
        proc.send_signal(signal.SIGTERM)
        signalled_after = len(result["chunks"])
        time.sleep(0.2)
        try:                             # nothing new is admitted (uvicorn closed its socket, or 503)
            late = httpx.post(url + "/v1/completions", timeout=30, json={"prompt": [1], "max_tokens": 2})
            assert late.status_code == 503, late.text
        except httpx.TransportError:
            pass
        thread.join(timeout=120)
        assert result["status"] == 200 and result["done"], result
        last = result["chunks"][-1]
        assert last["choices"][0]["finish_reason"] == "length", last
        assert last["usage"]["completion_tokens"] == max_tokens, last
        assert signalled_after < len(result["chunks"])   # chunks kept coming after the signal
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
