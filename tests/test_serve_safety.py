"""The server against a hostile client (issue 35): every bad request gets a 4xx in OpenAI's error
format while a greedy stream started before them finishes with the text it has alone; a request
whose admission fails ends alone; new top_k values compile nothing; disconnects free the row with
no traceback in the log; body size, queue length, header timeout and the API key; the serve CLI's
port, default method and CUDA-plugin items. One tiny random DMTP decoder and one server (on a free
local port, in this process) for the whole module."""

import json
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from dmtp_jax.serve.engine import Engine
from tests.serve_fixtures import MAX_MODEL_LEN, serve_decoder, serve_tokenizer

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STREAM_PROMPT, STREAM_TOKENS = [5, 9, 31, 4, 77, 2, 18], 60


@pytest.fixture(scope="module")
def decoder():
    """The serve tests' tiny DMTP decoder (tests/serve_fixtures.py: one per process, its compiles shared)."""
    return serve_decoder()


@pytest.fixture(scope="module")
def tokenizer():
    return serve_tokenizer()


@pytest.fixture(scope="module")
def server(decoder, tokenizer):
    """`(base url, scheduler)`: an API key, small limits, uvicorn's logging left to the root logger
    (so `caplog` sees its tracebacks, if any)."""
    from dmtp_jax.serve.app import ServerLimits, Scheduler, build_app, serving_in_thread, warm_up

    limits = ServerLimits(max_body_bytes=64 * 1024, max_waiting=2, max_stop_strings=4, max_stop_chars=32,
                          header_timeout_s=1.0, body_timeout_s=1.0)
    engine = Engine(decoder, max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(4,))
    warm_up(engine, every_bucket=False)
    scheduler = Scheduler(engine, max_waiting=limits.max_waiting)
    app = build_app(scheduler, tokenizer, "tiny", drain_s=5, limits=limits, api_key=KEY)
    with serving_in_thread(app, limits.header_timeout_s, log_config=None) as base:
        yield base, scheduler


@pytest.fixture
def slow_engine(server, monkeypatch):
    """Each engine dispatch 20 ms longer: a 60-token stream outlives the probes sent meanwhile."""
    engine = server[1].engine
    real_decode = engine.decode

    def slow_decode():
        time.sleep(0.02)
        return real_decode()
    monkeypatch.setattr(engine, "decode", slow_decode)


def post(base, body, timeout=30):
    return httpx.post(base + "/v1/completions", json=body, headers=AUTH, timeout=timeout)


def assert_openai_error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err


class Stream(threading.Thread):
    """A greedy stream of `STREAM_PROMPT`, its text collected; `started` once a first chunk came."""

    def __init__(self, base):
        super().__init__(daemon=True)
        self.base, self.text, self.finish, self.started = base, "", None, threading.Event()

    def run(self):
        body = {"prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True}
        with httpx.stream("POST", self.base + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    self.text += choice["text"]
                    self.finish = choice["finish_reason"] or self.finish
                    self.started.set()


@pytest.fixture(scope="module")
def stream_alone(server):
    """The stream's text with nothing else running (tests/test_serve.py: the engine's rows equal
    `generate`)."""
    stream = Stream(server[0])
    stream.run()
    assert stream.finish == "length" and stream.text
    return stream.text


BAD_JSON = [  # (raw JSON body, status): each must be refused before the engine sees it
    (b'{"prompt": [1, 2], "max_tokens": 4, "seed": 9223372036854775808}', 400),
    (b'{"prompt": [1, 2], "max_tokens": 4, "seed": -9223372036854775809}', 400),
    (b'{"prompt": [1, 2], "max_tokens": 4, "temperature": NaN}', 400),
    (b'{"prompt": [1, 2], "max_tokens": 4, "temperature": Infinity}', 400),
    (b'{"prompt": [1, 2], "max_tokens": 4, "top_p": NaN}', 400),
    (b'{"prompt": [1, 2], "max_tokens": 4, "temperature": true}', 400),
    (b'{"prompt": [true], "max_tokens": 4}', 400),
    (b'{"prompt": [[1, true]], "max_tokens": 4}', 400),
    (b'{"prompt": [1, 320], "max_tokens": 4}', 400),
    (b'{"prompt": [-1], "max_tokens": 4}', 400),
    (b'{"prompt": [1], "max_tokens": 4, "top_k": "5"}', 400),
    (b'{"prompt": [1], "max_tokens": 4, "top_k": -2}', 400),
    (b'{"prompt": [1], "max_tokens": 4, "top_k": 300}', 400),      # over --max-top-k (256), under the vocabulary
    (b'{"prompt": "a\\ud800b", "max_tokens": 4}', 400),
    (b'{"prompt": "\xff\xfe", "max_tokens": 4}', 400),
    (b'{"prompt": [1], "max_tokens": 4, "stop": ["a", "b", "c", "d", "e"]}', 400),
    (b'{"prompt": [1], "max_tokens": 4, "stop": "' + b"x" * 33 + b'"}', 400),
    (b'{"prompt": [1], "max_tokens": 4, "stop": "\\udc00"}', 400),
    (b'{"prompt": [1], "max_tokens": 1000}', 400),                   # past the context: 400, as vLLM
    (b'{"prompt": "' + b"x" * 60000 + b'", "max_tokens": 4}', 413),
]


def test_bad_requests_get_4xx_and_a_concurrent_stream_is_untouched(server, slow_engine, stream_alone, tokenizer,
                                                                   monkeypatch):
    base, scheduler = server
    calls = []
    real_call = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__", lambda self, text, **kw: calls.append(len(text)) or
                        real_call(self, text, **kw))
    stream = Stream(base)
    stream.start()
    assert stream.started.wait(30)
    for body, status in BAD_JSON:
        r = httpx.post(base + "/v1/completions", content=body, timeout=30,
                       headers={**AUTH, "content-type": "application/json"})
        assert_openai_error(r, status)
    assert calls == [], "the 60000-character prompt cannot fit 120 tokens: refused before tokenising"
    assert_openai_error(httpx.post(base + "/v1/completions", content=b"x" * (65 * 1024), headers=AUTH), 413)
    assert_openai_error(httpx.get(base + "/v1/models"), 401)                          # no key
    assert_openai_error(httpx.get(base + "/metrics", headers={"Authorization": "Bearer nope"}), 401)
    assert httpx.get(base + "/health").status_code == 200                             # open
    for path in ("/docs", "/redoc", "/openapi.json"):                                 # off by default
        assert httpx.get(base + path, headers=AUTH).status_code == 404
    stream.join(60)
    assert stream.text == stream_alone and stream.finish == "length"
    assert scheduler._thread.is_alive()


def test_a_failing_admission_ends_that_request_alone(server, slow_engine, stream_alone, monkeypatch):
    base, scheduler = server
    engine = scheduler.engine
    real_add = engine.add

    def add(req):
        if req.seed == 666:
            raise OverflowError("injected")
        return real_add(req)
    monkeypatch.setattr(engine, "add", add)
    stream = Stream(base)
    stream.start()
    assert stream.started.wait(30)
    r = post(base, {"prompt": [1, 2], "max_tokens": 4, "temperature": 0.5, "seed": 666})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "error"
    stream.join(60)
    assert stream.text == stream_alone and stream.finish == "length"
    assert post(base, {"prompt": [1, 2], "max_tokens": 3, "temperature": 0}).json()["usage"]["completion_tokens"] == 3


def test_new_top_k_values_compile_nothing(server):
    base, scheduler = server
    before = scheduler.engine.compile_counts()
    for k, top_p in ((3, 1.0), (17, 0.95), (250, 0.9), (320, 1.0), (0, 0.8)):     # 320: the vocabulary, off
        r = post(base, {"prompt": [4, 8, 15], "max_tokens": 6, "temperature": 0.9, "top_k": k, "top_p": top_p,
                        "seed": k})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert scheduler.engine.compile_counts() == before


def test_a_full_queue_answers_429(server, slow_engine):
    from concurrent.futures import ThreadPoolExecutor
    base, _ = server
    with ThreadPoolExecutor(10) as pool:      # 4 rows + 2 waiting: the rest are refused
        codes = list(pool.map(lambda _: post(base, {"prompt": [3, 4], "max_tokens": 30, "temperature": 0}),
                              range(10)))
    assert {r.status_code for r in codes} == {200, 429}
    assert_openai_error(next(r for r in codes if r.status_code == 429), 429)


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_frees_the_row_without_a_traceback(server, slow_engine, caplog, monkeypatch, stream):
    base, scheduler = server
    caplog.set_level(logging.DEBUG)
    finished = []
    real_observe = scheduler.metrics.observe_finished
    monkeypatch.setattr(scheduler.metrics, "observe_finished", lambda req: finished.append(req) or real_observe(req))
    body = {"prompt": [4, 5, 6], "max_tokens": 100, "temperature": 0, "stream": stream}
    if stream:                                    # the client leaves after its first chunk
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
            next(r.iter_lines())
    else:                                         # the client gives up while tokens flow
        with pytest.raises(httpx.ReadTimeout):
            post(base, body, timeout=0.5)
    deadline = time.time() + 10
    while scheduler.engine.busy and time.time() < deadline:
        time.sleep(0.02)
    assert not scheduler.engine.busy, "the disconnected request should free its row"
    assert [(r.finish_reason, len(r.output_ids) < 100) for r in finished] == [("cancelled", True)]
    time.sleep(0.2)
    assert "Traceback" not in caplog.text and "CancelledError" not in caplog.text, caplog.text


def test_header_timeout_closes_silent_and_trickling_connections(server):
    host, port = server[0].removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(2)]
    socks[1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")          # never finishes its head
    t0 = time.time()
    for s in socks:
        s.settimeout(5)
        assert s.recv(100) == b""                  # closed by the server
        s.close()
    assert time.time() - t0 < 4


def test_a_50mb_body_is_refused_while_health_answers(server):
    """Announced (Content-Length): 413 from the head alone. Chunked: refused once past the limit,
    the connection closed; /health answers within 1 s throughout."""
    base = server[0]
    host, port = base.removeprefix("http://").split(":")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + b"Content-Length: 52428800\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
    answers, sent = [], 0
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            while sent < 50 * 2**20:
                t0 = time.time()
                assert httpx.get(base + "/health").status_code == 200
                answers.append(time.time() - t0)
                sock.sendall(b"100000\r\n" + b"x" * 2**20 + b"\r\n")
                sent += 2**20
        except (BrokenPipeError, ConnectionResetError):
            pass                                   # refused and closed long before 50 MB
    assert sent < 50 * 2**20 and answers and max(answers) < 1.0


# ---- the serve CLI ----------------------------------------------------------------------------------
def test_serve_port_out_of_range_and_in_use_are_one_line_errors(tiny_qwen3_dir, capsys):
    import infer
    with pytest.raises(SystemExit) as stop:
        infer.main(["serve", "--target", tiny_qwen3_dir, "--port", "99999"])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith("error: argument --port")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert infer.main(["serve", "--target", tiny_qwen3_dir, "--port", str(busy.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen on") and "Traceback" not in err and "serving" not in err


def test_a_drafter_directorys_own_method_is_the_default(tmp_path):
    import argparse

    from dmtp_jax.commands.models import default_method
    (tmp_path / "config.json").write_text(json.dumps({"dmtp_config": {"method": "dmtp-adaptive"}}))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"dflash_config": {}}))
    args = argparse.Namespace(draft=str(tmp_path), target="/models/x")
    assert default_method(args) == "dmtp-adaptive"
    assert default_method(argparse.Namespace(draft=str(tmp_path / "plain"), target="x")) == "dflash"
    assert default_method(argparse.Namespace(draft=None, target="/models/x")) == "ar"


def test_an_installed_cuda_plugin_is_quiet_without_a_gpu(tmp_path):
    """A stand-in for the plan-gpu extra's plugin: like jax_plugins.xla_cuda12, its initialize()
    fails its CUDA check (logged by JAX as a traceback) unless the platforms exclude CUDA."""
    plugin = tmp_path / "jax_plugins" / "xla_cuda12"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(textwrap.dedent("""
        def initialize():
            from jax._src import config
            if "cuda" in (config.jax_platforms.value or "cuda"):
                raise RuntimeError("Unable to load CUDA (stand-in)")
    """))
    import os

    from dmtp_jax.cli import visible_nvidia_gpu
    if visible_nvidia_gpu():
        pytest.skip("a GPU is visible: the plugin is meant to load")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"PYTHONPATH": f"{tmp_path}:{root}"}
    code = "from dmtp_jax.cli import skip_absent_gpu_plugin as s; {} import jax; print(jax.devices()[0].platform)"
    runs = [subprocess.run([sys.executable, "-c", code.format(call)], capture_output=True, text=True,
                           env=env, cwd=root)
            for call in ("", "s();")]
    assert "Traceback" in runs[0].stderr                     # the stand-in does fail without the guard
    assert runs[1].returncode == 0 and runs[1].stdout.strip() == "cpu" and "Traceback" not in runs[1].stderr, runs[1]
