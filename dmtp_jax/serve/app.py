"""The OpenAI-compatible HTTP server: FastAPI routes over a scheduler thread that drives the `Engine`.

    POST /v1/completions        prompt (text or token ids), max_tokens, temperature, top_p, top_k,
                                seed, stop (strings), stream (server-sent events), n = 1
    POST /v1/chat/completions   messages through the tokenizer's chat template (400 without one)
    GET  /v1/models, /health, /metrics (Prometheus text)

The scheduler thread owns the engine: it admits submitted requests, runs `Engine.step()` while
anything is running and hands each request's events to its handler's asyncio queue. A handler
turns tokens into text with `text.TextStream` (stop strings cut exactly, streaming or not) and, on
a stop string or a client gone mid-stream, cancels its request, which frees the row at the next
step. Errors are OpenAI-style JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for bad
input, 413 for a prompt that does not fit `--max-model-len`, 404 for an unknown model. On
shutdown (SIGTERM: uvicorn stops accepting connections and waits for running requests) the
scheduler stops admitting and cancels what is left after `drain_s`.

Example:
    >>> app = build_app(Scheduler(engine), tokenizer, "demo")  # doctest: +SKIP
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from dmtp_jax.errors import RequestError
from dmtp_jax.serve.engine import Engine, Request
from dmtp_jax.serve.metrics import ServerMetrics
from dmtp_jax.serve.text import TextStream

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as OpenAI JSON with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object.

    Example:
        >>> error_body("bad", param="n")["error"]["param"]
        'n'
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Scheduler:
    """The thread that drives an `Engine`: `submit` from any thread, events to each request's sink."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None):
        self.engine, self.metrics = engine, metrics or ServerMetrics()
        self.accepting = True
        self._inbox: list = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._sinks: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._run, name="dmtp-scheduler", daemon=True)
        self._thread.start()

    def submit(self, req: Request, sink) -> Request:
        """Checks and queues `req`; `sink(event)` is called (on the scheduler thread) per event.

        Example:
            >>> scheduler.submit(Request([1, 2], 8), print)  # doctest: +SKIP
        """
        if not self.accepting:
            raise ApiError("the server is shutting down", 503, kind="server_error")
        self.engine.check(req)
        with self._lock:
            self._inbox.append((req, sink))
        self._wake.set()
        return req

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        self.engine.cancel(req, reason)
        self._wake.set()

    def _run(self):
        engine = self.engine
        while not self._stop:
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for req, sink in inbox:
                self._sinks[req.id] = sink
                engine.add(req)
            if not engine.busy:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                events = engine.step()
            except Exception:           # a bug, not bad input: logged, its requests end, the server lives on
                log.exception("engine step failed; ending every running request")
                events = engine.abort_all("error")
            for event in events:
                sink = self._sinks.get(event.request.id)
                if event.finished:
                    self._sinks.pop(event.request.id, None)
                    self.metrics.observe_finished(event.request)
                if sink is not None:
                    sink(event)

    def shutdown(self, drain_s: float = 30.0) -> None:
        """Stops admitting, lets running requests finish for up to `drain_s`, cancels the rest.

        Example:
            >>> scheduler.shutdown(drain_s=5)  # doctest: +SKIP
        """
        self.accepting = False
        deadline = time.monotonic() + drain_s
        while (self.engine.busy or self._inbox) and time.monotonic() < deadline:
            time.sleep(0.02)
        for req in [r for r in self.engine.running if r is not None] + list(self.engine.waiting):
            self.engine.cancel(req, "cancelled")
        end = time.monotonic() + 5
        while self.engine.busy and time.monotonic() < end:
            time.sleep(0.02)
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


class CompletionBody(BaseModel):
    """The fields of `/v1/completions` (others are ignored, as OpenAI's server does with unknown ones)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    logprobs: Any = None
    echo: bool = False


class ChatBody(CompletionBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    max_tokens: int | None = None


def one_prompt(prompt) -> str | list[int]:
    """The request's single prompt (a string, token ids, or a list of one of them).

    Example:
        >>> one_prompt(["hi"]), one_prompt([1, 2])
        ('hi', [1, 2])
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError("only one prompt per request is supported (n = 1, one prompt)", param="prompt")
        prompt = prompt[0]
    if prompt is None or len(prompt) == 0:
        raise ApiError("prompt must not be empty", param="prompt")
    return prompt


def build_app(scheduler: Scheduler, tokenizer, model_name: str, drain_s: float = 30.0) -> FastAPI:
    """The FastAPI app serving `scheduler`'s engine as `model_name` (`tokenizer` may be None:
    token-id prompts only); on shutdown it drains the scheduler for up to `drain_s`.

    Example:
        >>> app = build_app(Scheduler(engine), tokenizer, "demo")  # doctest: +SKIP
    """
    engine = scheduler.engine

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(scheduler.shutdown, drain_s)

    app = FastAPI(title="dmtp-jax", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return JSONResponse(error_body(str(exc), exc.kind, exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        return JSONResponse(error_body(f"{'.'.join(loc) + ': ' if loc else ''}{msg}", param=".".join(loc) or None),
                            status_code=400)

    @app.get("/health")
    async def health():
        if not scheduler.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "dmtp-jax", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(scheduler.metrics.render(engine), media_type="text/plain; version=0.0.4")

    def request_of(body: CompletionBody, prompt_ids: list[int], max_tokens: int | None) -> Request:
        if body.model not in (None, model_name):
            raise ApiError(f"the model '{body.model}' does not exist; this server serves '{model_name}'", 404,
                           param="model", kind="not_found_error")
        if body.n != 1:
            raise ApiError(f"only n = 1 is supported, got {body.n}", param="n")
        if body.logprobs not in (None, False, 0):
            raise ApiError("logprobs are not supported", param="logprobs")
        if max_tokens is None:
            max_tokens = engine.max_model_len - len(prompt_ids)
        if max_tokens < 1:
            raise ApiError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if len(prompt_ids) + max_tokens > engine.max_model_len:
            raise ApiError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the maximum "
                           f"model length {engine.max_model_len}", 413, param="prompt")
        temperature = 1.0 if body.temperature is None else body.temperature
        top_k = body.top_k if body.top_k and body.top_k > 0 else 0      # -1 / 0 / None: off
        return Request(list(prompt_ids), int(max_tokens), temperature=float(temperature),
                       top_p=1.0 if body.top_p is None else float(body.top_p), top_k=int(top_k),
                       seed=int(body.seed or 0))

    def stops_of(body) -> list[str]:
        return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise ApiError("this model has no tokenizer: send token ids as the prompt", param="prompt")
        return list(tokenizer(text).input_ids)

    def decode(ids) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""

    async def run(req: Request, body, http: HttpRequest, chat: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            scheduler.submit(req, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        except RequestError as e:
            raise ApiError(str(e)) from None
        text = TextStream(decode, stops_of(body))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def usage():
            n = len(req.output_ids)
            return {"prompt_tokens": len(req.prompt_ids), "completion_tokens": n,
                    "total_tokens": len(req.prompt_ids) + n,
                    "dmtp": {"method": engine.method, **req.acceptance_stats()}}

        def finish_reason():
            return "stop" if req.finish_reason in ("stop", "stop_string") else req.finish_reason

        async def next_event():
            """The next event; checks every second whether the client is still there (a
            non-streaming client that went away cancels its request too)."""
            while True:
                try:
                    return await asyncio.wait_for(queue.get(), 1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        scheduler.cancel(req, "cancelled")
                        raise asyncio.CancelledError from None

        async def events():
            """(text delta, token ids, finished) per committed chunk; cancels on a stop string."""
            while True:
                ev = await next_event()
                delta = text.add(ev.tokens)
                if text.stopped and not ev.finished:
                    scheduler.cancel(req, "stop_string")
                    while not (await next_event()).finished:
                        pass
                    yield delta, ev.tokens, True
                    return
                if ev.finished:
                    yield delta + text.flush(), ev.tokens, True
                    return
                yield delta, ev.tokens, False

        if not body.stream:
            parts = []
            try:
                async for delta, _, _ in events():
                    parts.append(delta)
            finally:
                if not req.finished:
                    scheduler.cancel(req, "cancelled")
            out = "".join(parts)
            choice = ({"index": 0, "message": {"role": "assistant", "content": out}} if chat
                      else {"index": 0, "text": out, "logprobs": None})
            choice["finish_reason"] = finish_reason()
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name,
                                 "choices": [choice], "usage": usage()})

        def chunk(delta, finish, first=False):
            if chat:
                d = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            body_ = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created, "model": model_name,
                     "choices": [choice]}
            if finish is not None:
                body_["usage"] = usage()
            return f"data: {json.dumps(body_)}\n\n"

        async def stream():
            try:
                first = True
                async for delta, _, finished in events():
                    if delta or first or finished:
                        yield chunk(delta, finish_reason() if finished else None, first)
                        first = False
                yield "data: [DONE]\n\n"
            finally:
                if not req.finished:         # the client went away: free the row now
                    scheduler.cancel(req, "cancelled")
        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        prompt = one_prompt(body.prompt)
        ids = encode(prompt) if isinstance(prompt, str) else prompt
        if body.echo:
            raise ApiError("echo is not supported", param="echo")
        return await run(request_of(body, ids, body.max_tokens), body, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest):
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(f"the model '{model_name}' has no chat template: use /v1/completions", param="messages")
        try:
            ids = tokenizer.apply_chat_template(body.messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:          # the template's own complaint about the messages
            raise ApiError(f"messages: {e}", param="messages") from None
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return await run(request_of(body, ids, body.max_completion_tokens or body.max_tokens), body, http, chat=True)

    return app


def warm_up(engine: Engine, every_bucket: bool = True) -> None:
    """Compiles the greedy prefill of every prompt bucket (`every_bucket`; else the shortest only),
    the row scatter and the round before the first request, so that `/health` answers only once
    they are ready and no request waits for a compile.

    Example:
        >>> warm_up(engine)  # doctest: +SKIP
    """
    from dmtp_jax.decode.batch import PROMPT_BUCKET_FLOOR, next_pow2

    if engine.rows is None:         # auto without a verdict: its first requests measure (and compile)
        return
    top = next_pow2(engine.max_model_len - 1, PROMPT_BUCKET_FLOOR) if every_bucket else PROMPT_BUCKET_FLOOR
    chunk = max(engine.rows.decoder.prefill_chunk, PROMPT_BUCKET_FLOOR)
    bucket, lengths = PROMPT_BUCKET_FLOOR, []
    while bucket <= min(top, chunk):
        lengths.append(min(bucket, engine.max_model_len - 2))
        bucket *= 2
    if top > chunk:                 # longer prompts run chunks of `prefill_chunk` tokens
        lengths.append(engine.max_model_len - 2)
    cache, engine.prefix_cache = engine.prefix_cache, None     # every bucket compiled, not resumed from another
    reqs = [engine.add(Request([0] * n, 2, stop_ids=())) for n in lengths]
    while not all(r.finished for r in reqs):
        engine.step()
    engine.prefix_cache = cache
    if cache is not None:
        from dmtp_jax.serve.prefix_cache import warm_up_resumes
        warm_up_resumes(engine)     # a resumed prefill's short buckets
    engine.counters.clear()


def serve(decoder, tokenizer, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          max_batch_size: int = 8, max_model_len: int | None = None, stop_ids=None,
          prefix_cache_gb: float = 0.0) -> int:
    """Builds the engine, compiles it, and serves until SIGTERM / Ctrl-C (then exits 0: running
    requests are finished, or cancelled after 30 s). `infer.py serve` calls it.

    Example:
        >>> serve(make_decoder("dmtp", target, d, mtp=m, fusion=f), tok, "demo", port=8000)  # doctest: +SKIP
    """
    import sys

    import uvicorn

    engine = Engine(decoder, max_batch_size=max_batch_size, max_model_len=max_model_len, stop_ids=stop_ids,
                    prefix_cache_gb=prefix_cache_gb)
    warm_up(engine)
    scheduler = Scheduler(engine)
    app = build_app(scheduler, tokenizer, model_name)
    method = engine.method + (" (not measured yet: the first requests measure the candidates "
                              f"{', '.join(engine.auto.candidates)})" if engine.rows is None else "")
    print(f"serving {model_name} ({method}, {max_batch_size} rows, max_model_len {engine.max_model_len}) "
          f"on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    # uvicorn re-raises the SIGTERM it handled once it has shut down; with this handler that ends
    # the process normally (exit status 0) instead of by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  timeout_graceful_shutdown=30)).run()
    return 0
