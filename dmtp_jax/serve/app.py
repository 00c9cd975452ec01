"""The OpenAI-compatible HTTP server: FastAPI routes (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`, `/metrics`) over a scheduler thread that drives the `Engine`. Requests are
checked by `protocol.py` and guarded by `limits.py`; errors are OpenAI-style JSON. Routes, status
codes and shutdown: docs/serving.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dmtp_jax.errors import RequestError
from dmtp_jax.serve.engine import SERVE_ROUNDS_PER_DISPATCH, Engine
from dmtp_jax.serve.limits import ApiKeyAuth, BodyLimit, bind_socket, header_timeout_protocol
from dmtp_jax.serve.choices import Choice, fan_out, merged_logprobs, usage
from dmtp_jax.serve.protocol import (ApiError, ChatBody, CompletionBody, ServerLimits, check_prompt_chars, check_text,
                                     error_body, max_body_values, one_prompt, parse_body, request_of, stops_of)
from dmtp_jax.serve.request import Request
from dmtp_jax.serve.scheduler import Scheduler
from dmtp_jax.serve.text import max_token_chars
from dmtp_jax.serve.tool_calls import chat_stops, offered_tools, tool_names, uses_think

__all__ = ["ApiError", "Scheduler", "ServerLimits", "build_app", "error_body", "one_prompt", "serve", "serving_in_thread",
           "warm_up"]

log = logging.getLogger(__name__)


def build_app(scheduler: Scheduler, tokenizer, model_name: str, drain_s: float = 30.0,
              limits: ServerLimits = ServerLimits(), api_key: str | None = None, enable_docs: bool = False) -> FastAPI:
    """The FastAPI app serving `scheduler`'s engine as `model_name` (`tokenizer` None: token-id prompts
    only); drains the scheduler for up to `drain_s` on shutdown. `api_key`: a Bearer token required on
    every path but /health; `enable_docs`: serve /docs and /openapi.json."""
    engine = scheduler.engine
    vocab_size = engine.cfg.vocab_size
    token_chars = max_token_chars(tokenizer) if tokenizer is not None else 0

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(scheduler.shutdown, drain_s)

    docs = {} if enable_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="dmtp-jax", lifespan=lifespan, **docs)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)        # outermost: before any body is read

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return JSONResponse(error_body(str(exc), exc.kind, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        message = ("the request body is not valid JSON in UTF-8" if exc.status_code == 400 else str(exc.detail))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):      # a bug: logged once, answered in OpenAI's format
        log.error("request failed: %r", exc, exc_info=exc)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

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

    max_values = max_body_values(engine.max_model_len, token_chars, limits)

    async def body_of(http: HttpRequest, model):
        """The request's body as `model` (its size checked before parsing: `protocol.parse_body`)."""
        return parse_body(model, await http.body(), max_values)

    def make_requests(body, prompt_ids, max_tokens) -> list[Request]:
        """The engine requests of a body's `n` choices (`choices.fan_out`)."""
        return fan_out(request_of(body, prompt_ids, max_tokens, model_name=model_name,
                                  max_model_len=engine.max_model_len, vocab_size=vocab_size,
                                  max_top_k=engine.max_top_k, max_n=engine.max_batch_size), body.n)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text).input_ids)

    def decode(ids) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""

    def token_str(tid: int) -> str:
        return tokenizer.decode([tid]) if tokenizer is not None else f"token_id:{tid}"

    async def run(reqs: list[Request], stops: list[str], stream_out: bool, http: HttpRequest, chat: bool,
                  parse: tuple[set, bool] | None = None):
        """Runs a request's choices (`reqs`, one per choice: `serve/choices.py`) and answers them as one
        response, streamed or whole; `parse`: chat's (tool names, think) split (`serve/tool_calls.py`)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(ev):
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, ev)
        try:
            scheduler.submit_many(reqs, sink)
        except RequestError as e:            # the engine's own checks: the field is the message's first word
            field = str(e).split(" ", 1)[0].rstrip(":")
            raise ApiError(str(e), param=field if field in CompletionBody.model_fields else None) from None
        choices = [Choice(i, r, decode, stops, token_str, chat, parse) for i, r in enumerate(reqs)]
        by_id = {c.req.id: c for c in choices}
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def cancel_all():
            for r in reqs:
                if not r.finished:
                    scheduler.cancel(r, "cancelled")

        async def events():
            """(choice, text delta, finished, logprobs) per committed chunk, in the order they come; a
            choice whose text reached a stop string is cancelled and ends once its request has."""
            left = len(choices)
            while left:
                ev = await queue.get()
                c = by_id[ev.request.id]
                if c.stopping:
                    if ev.finished:
                        left -= 1
                        yield c, c.pending, True, c.logprobs()
                    continue
                delta = c.text.add(ev.tokens)
                if c.text.stopped and not ev.finished:
                    scheduler.cancel(c.req, "stop_string")
                    c.stopping, c.pending = True, delta
                    continue
                left -= ev.finished
                yield c, delta + (c.text.flush() if ev.finished else ""), ev.finished, c.logprobs()

        if not stream_out:
            async def watch_disconnect():
                """Cancels the request as soon as its client goes away (while tokens flow)."""
                while (await http.receive())["type"] != "http.disconnect":
                    pass
                cancel_all()
            watcher = asyncio.create_task(watch_disconnect())
            parts = [([], []) for _ in choices]
            try:
                async for c, delta, _, lp in events():
                    parts[c.index][0].append(delta)
                    parts[c.index][1].append(lp)
            finally:
                watcher.cancel()
                cancel_all()
            out = []
            for c, (deltas, lps) in zip(choices, parts):
                text, lp = "".join(deltas), None if c.req.logprobs is None else merged_logprobs(lps, chat)
                choice = ({"index": c.index, "message": c.message(text), "logprobs": lp}
                          if chat else {"index": c.index, "text": text, "logprobs": lp})
                out.append({**choice, "finish_reason": c.finish_reason()})
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name,
                                 "choices": out, "usage": usage(choices, engine.method)})

        def chunk(c: Choice, delta, finish, lp=None, last=False):
            if chat:
                choice = {"index": c.index, "delta": c.delta(delta, finish is not None), "logprobs": lp,
                          "finish_reason": finish}
            else:
                choice = {"index": c.index, "text": delta, "logprobs": lp, "finish_reason": finish}
            c.first = False
            body_ = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created, "model": model_name,
                     "choices": [choice]}
            if last:                   # the last choice's end: the whole response's usage
                body_["usage"] = usage(choices, engine.method)
            return f"data: {json.dumps(body_)}\n\n"

        async def stream():
            try:
                done = 0
                async for c, delta, finished, lp in events():
                    done += finished
                    if delta or c.first or finished or lp:
                        yield chunk(c, delta, c.finish_reason() if finished else None, lp, done == len(choices))
                yield "data: [DONE]\n\n"
            finally:
                cancel_all()             # the client went away (Starlette cancelled us): free the rows now
        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionBody))
    async def completions(http: HttpRequest):
        body = await body_of(http, CompletionBody)
        prompt = one_prompt(body.prompt)
        if body.echo:
            raise ApiError("echo is not supported", param="echo")
        stops = stops_of(body, limits)
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ApiError("this model has no tokenizer: send token ids as the prompt", param="prompt")
            check_text(prompt, "prompt")
            check_prompt_chars(len(prompt), engine.max_model_len, token_chars)
            ids = await asyncio.to_thread(encode, prompt)
        else:
            ids = prompt
        return await run(make_requests(body, ids, body.max_tokens), stops, body.stream, http, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatBody))
    async def chat(http: HttpRequest):
        body = await body_of(http, ChatBody)
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(f"the model '{model_name}' has no chat template: use /v1/completions", param="messages")
        stops = stops_of(body, limits) + chat_stops(tokenizer)
        tools = offered_tools(body.tools, body.tool_choice)
        check_text(body.messages, "messages")
        check_text(tools, "tools")
        content = sum(len(str(m.get("content") or "")) for m in body.messages)     # characters the template gets
        check_prompt_chars(content + len(json.dumps(tools or [])), engine.max_model_len, token_chars)
        try:
            ids = await asyncio.to_thread(tokenizer.apply_chat_template, body.messages, tools=tools,
                                          add_generation_prompt=True, tokenize=True)
        except Exception as e:          # the template's own complaint about the messages
            raise ApiError(f"messages: {e}", param="messages") from None
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return await run(make_requests(body, ids, body.max_completion_tokens or body.max_tokens), stops,
                         body.stream, http, chat=True, parse=(tool_names(tools), uses_think(tokenizer)))

    return app


def body_schema(model) -> dict:
    """The OpenAPI request body of a route that parses its own body (`/docs`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def warm_up(engine: Engine, every_bucket: bool = True, progress: bool = False) -> int:
    """Compiles the engine's rounds (greedy and sampled), row moves, prefills and prefix-cache programs
    (`Engine.warm_up`; a bar on stderr when `progress`) before `/health` answers, so no request waits
    for a compile; returns the programs' count (`Engine.compile_counts`, as /metrics shows it)."""
    engine.warm_up(every_bucket, progress=progress)
    engine.counters.clear()
    return sum(engine.compile_counts().values())


def serve(decoder, tokenizer, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          max_batch_size: int = 8, max_model_len: int | None = None, stop_ids=None,
          limits: ServerLimits = ServerLimits(), api_key: str | None = None, enable_docs: bool = False,
          sock=None, max_top_k: int = 256, prefix_cache_gb: float = 0.0, rounds_per_dispatch: int | None = None) -> int:
    """Binds `host:port` (or uses the bound `sock`; a port in use is an `InputError`), builds and compiles
    the engine (at most `rounds_per_dispatch` rounds per dispatch, default `SERVE_ROUNDS_PER_DISPATCH`),
    prints "serving ..." and serves until SIGTERM / Ctrl-C (exit 0: running requests finished, or
    cancelled after 30 s). `infer.py serve` calls it."""

    sock = sock or bind_socket(host, port)
    port = sock.getsockname()[1]
    engine = Engine(decoder, max_batch_size=max_batch_size, max_model_len=max_model_len, stop_ids=stop_ids,
                    max_top_k=max_top_k, prefix_cache_gb=prefix_cache_gb,
                    rounds_per_dispatch=rounds_per_dispatch or SERVE_ROUNDS_PER_DISPATCH)
    start = time.perf_counter()
    programs = warm_up(engine, progress=True)
    print(f"compiled {programs} programs in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    scheduler = Scheduler(engine, max_waiting=limits.max_waiting)
    app = build_app(scheduler, tokenizer, model_name, limits=limits, api_key=api_key, enable_docs=enable_docs)
    method = engine.method + (f" over {', '.join(engine.bank.methods)}" if engine.auto is not None else "")
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30,
                            http=header_timeout_protocol(limits.header_timeout_s))
    sock.listen(2048)                   # connections wait in the backlog until uvicorn accepts them
    print(f"serving {model_name} ({method}, {max_batch_size} rows, max_model_len {engine.max_model_len}) "
          f"on http://{host}:{port}/v1" + ("" if api_key is None else " (API key required)"),
          file=sys.stderr, flush=True)
    # uvicorn re-raises the SIGTERM it handled once it has shut down; with this handler that ends
    # the process normally (exit status 0) instead of by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


@contextlib.contextmanager
def serving_in_thread(app, header_timeout_s: float = ServerLimits().header_timeout_s, **uvicorn_config):
    """Serves `app` on a free port of 127.0.0.1 from a daemon thread of this process (tests and
    benchmarks); yields the base url once uvicorn listens and shuts the server down on exit.
    `uvicorn_config`: more `uvicorn.Config` fields (default `log_level="warning"`)."""
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, http=header_timeout_protocol(header_timeout_s),
                                           **{"log_level": "warning", **uvicorn_config}))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the in-thread server stopped before it listened")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
