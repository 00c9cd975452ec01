"""The holes a hostile client still found (issue 68, item 6), each closed: an endless or dripped body
(408 within the body timeout, /health answering meanwhile; shutdown closes it at once), a temperature
that overflows float32, a body of millions of ids refused before it is parsed, fields that would
change the output refused and unknown ones logged, errors naming their field, and a stop string in
the round that reaches max_tokens. The server is tests/test_serve_safety.py's (one per module)."""

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from tests.serve_fixtures import PROMPTS, serve_reference
from tests.test_serve_safety import AUTH, KEY, assert_openai_error, decoder, post, server, tokenizer  # noqa: F401


def endless_body(base, chunked: bool, stop: threading.Event) -> bytes:
    """What the server sends to a client dripping a body (a byte every 0.1 s) that never ends."""
    host, port = base.removeprefix("http://").split(":")
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: 1000"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\ncontent-type: application/json\r\n" + framing + b"\r\n\r\n")
        sock.settimeout(0.1)
        got = b""
        while not stop.is_set():
            try:
                sock.sendall(b"1\r\n{\r\n" if chunked else b"{")
                data = sock.recv(4096)
                if not data:
                    return got                  # closed by the server
                got += data
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return got
    return got


@pytest.mark.parametrize("chunked", [False, True])
def test_an_endless_body_gets_408_within_the_body_timeout_while_health_answers(server, chunked):
    base = server[0]
    stop, out = threading.Event(), []
    t0 = time.time()
    dripper = threading.Thread(target=lambda: out.append(endless_body(base, chunked, stop)), daemon=True)
    dripper.start()
    while dripper.is_alive() and time.time() - t0 < 0.8:       # the body timeout is 1 s
        assert httpx.get(base + "/health", timeout=2).status_code == 200
        time.sleep(0.1)
    dripper.join(5)
    stop.set()
    assert not dripper.is_alive() and time.time() - t0 < 4, "the connection should be closed by the server"
    head, _, body = out[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["param"] == "body"


def test_shutdown_closes_a_connection_still_sending_its_body():
    """Before: shutdown waited for the body (uvicorn's graceful timeout, 30 s), then sent a plain-text 500."""
    from dmtp_jax.serve.app import serving_in_thread
    from dmtp_jax.serve.limits import BodyLimit

    async def echo(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    stop, out = threading.Event(), []
    with serving_in_thread(BodyLimit(echo, 2**20, timeout_s=60)) as base:
        dripper = threading.Thread(target=lambda: out.append(endless_body(base, False, stop)), daemon=True)
        dripper.start()
        time.sleep(0.5)
        t0 = time.time()
    assert time.time() - t0 < 5
    dripper.join(5)
    stop.set()
    assert out == [b""], "closed without an answer"


BAD_FIELDS = [  # (body fields over {"prompt": [1, 2], "max_tokens": 4}, status, param, words in the message)
    ({"temperature": 1e308}, 400, "temperature", "float32"),
    ({"top_p": 1e-50}, 400, "top_p", "float32"),
    ({"temperature": "0.5"}, 400, "temperature", "valid number"),
    ({"stream": "true"}, 400, "stream", "boolean"),
    ({"top_k": 257}, 400, "top_k", "--max-top-k"),
    ({"max_tokens": 1000}, 400, "max_tokens", "maximum model length"),
    ({"prompt": 5}, 400, "prompt", "token ids"),
    ({"prompt": [1, True]}, 400, "prompt.1", "integer"),
    ({"best_of": 2}, 400, "best_of", "not supported"),
    ({"logit_bias": {"5": 10}}, 400, "logit_bias", "not supported"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ({"frequency_penalty": -1}, 400, "frequency_penalty", "not supported"),
    ({"repetition_penalty": 1.2}, 400, "repetition_penalty", "not supported"),
    ({"n": 99}, 400, "n", "--max-batch-size"),
]


def test_bad_fields_are_refused_by_name_and_unknown_ones_logged(server, caplog):
    base = server[0]
    for fields, status, param, words in BAD_FIELDS:
        r = post(base, {"prompt": [1, 2], "max_tokens": 4, **fields})
        assert_openai_error(r, status)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (fields, err)
    caplog.set_level(logging.WARNING)
    neutral = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u"}
    r = post(base, {"prompt": [1, 2], "max_tokens": 2, "temperature": 0, "frobnicate": 3, **neutral})
    assert r.status_code == 200, r.text
    assert "frobnicate" in caplog.text and "best_of" not in caplog.text and "user" not in caplog.text


def test_a_body_of_millions_of_ids_is_refused_before_it_is_parsed(server, monkeypatch):
    from dmtp_jax.serve.protocol import CompletionBody, parse_body
    parsed = []
    real = CompletionBody.model_validate_json.__func__
    monkeypatch.setattr(CompletionBody, "model_validate_json",
                        classmethod(lambda cls, raw, **kw: parsed.append(len(raw)) or real(cls, raw, **kw)))
    raw = b'{"prompt": [' + b"7," * 3_000_000 + b'7], "max_tokens": 4}'      # 6 MB
    with pytest.raises(Exception) as err:
        parse_body(CompletionBody, raw, max_values=10_000)
    assert err.value.status == 413 and err.value.param == "body" and parsed == []
    r = httpx.post(server[0] + "/v1/completions", headers={**AUTH, "content-type": "application/json"},
                   content=b'{"prompt": [' + b"7," * 30_000 + b'7], "max_tokens": 4}')          # under 64 KiB
    assert_openai_error(r, 413)
    assert r.json()["error"]["param"] == "body" and parsed == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("past", [0, 3])
def test_a_stop_string_in_the_last_round_finishes_with_stop(server, tokenizer, stream, past):
    """The stop string is the k-th token's text, max_tokens k + 1 (the stop in the round that reaches
    it) or k + 4: the text before it, finish "stop", the tokens through the stop string counted (not
    those past it in its round)."""
    ref = list(serve_reference()[0])
    text = [tokenizer.decode([t]) for t in ref]
    k = next(k for k in range(1, len(ref)) if len(text[k]) == 1 and text[k].isprintable()
             and text[k] not in "".join(text[:k]) and "\ufffd" not in "".join(text[:k]))
    body = {"prompt": PROMPTS[0], "max_tokens": k + 1 + past, "temperature": 0, "stop": [text[k]], "stream": stream}
    if stream:
        with httpx.stream("POST", server[0] + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        out, last = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]
    else:
        last = post(server[0], body).json()
        out = last["choices"][0]["text"]
    assert out == "".join(text[:k])
    assert last["choices"][0]["finish_reason"] == "stop" and last["usage"]["completion_tokens"] == k + 1
