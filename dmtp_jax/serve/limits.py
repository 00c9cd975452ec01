"""What guards the server below the routes:

* `BodyLimit` (ASGI): a body over `max_bytes` is a 413 before any parsing, from Content-Length or
  as soon as a chunked body passes it; at most `max_bytes` are held. A body not whole within
  `timeout_s` of its request head (one that never ends, or is dripped) is a 408, its connection closed.
* `ApiKeyAuth` (ASGI): with a key, every path but `/health` (and docs pages) needs
  `Authorization: Bearer KEY` (constant-time compare); else a 401.
* `header_timeout_protocol(s)`: uvicorn's h11 protocol that also closes connections sending no
  whole request head within `s` seconds, and at shutdown those still sending a body (else shutdown
  would wait for them, then answer a plain-text 500).
* `bind_socket(host, port)`: the server's socket, bound before anything is printed."""

from __future__ import annotations

import asyncio
import hmac
import json
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

from dmtp_jax.errors import InputError
from dmtp_jax.serve.protocol import error_body

OPEN_PATHS = ("/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


async def send_json(send, status: int, body: dict, close: bool = False) -> None:
    """A whole JSON response on a raw ASGI `send` (`close`: ask the connection to close after it)."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def header(scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


class BodyLimit:
    """ASGI middleware: request bodies over `max_bytes` get a 413, bodies not whole within `timeout_s`
    of the request head a 408 (both close the connection); the body is read here and replayed to
    `app` whole."""

    def __init__(self, app, max_bytes: int, timeout_s: float | None = None):
        self.app, self.max_bytes, self.timeout_s = app, int(max_bytes), timeout_s

    async def too_large(self, send, size: str):
        await send_json(send, 413, error_body(f"the request body ({size}) exceeds the limit of {self.max_bytes} "
                                              f"bytes (--max-body-mb)", param="body"), close=True)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = header(scope, b"content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_bytes):
            return await self.too_large(send, f"Content-Length {length.decode('latin-1')[:20]}")
        chunks, size = [], 0
        deadline = None if self.timeout_s is None else asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), None if deadline is None else
                                                 max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                chunks.clear()
                return await send_json(send, 408, error_body(
                    f"the request body did not arrive whole within {self.timeout_s:g} s (--body-timeout)",
                    param="body", code="request_timeout"), close=True)
            if message["type"] == "http.disconnect":
                return                      # the client went away before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                return await self.too_large(send, f"over {self.max_bytes} bytes sent")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()          # then the client's own messages (its disconnect)
        await self.app(scope, replay, send)


class ApiKeyAuth:
    """ASGI middleware: `Authorization: Bearer KEY` on every path but `OPEN_PATHS`."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    def authorized(self, scope) -> bool:
        value = header(scope, b"authorization") or b""
        scheme, _, given = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self.authorized(scope):
            return await send_json(send, 401, error_body("invalid or missing API key: send the header "
                                                         "'Authorization: Bearer <key>'", code="invalid_api_key"))
        return await self.app(scope, receive, send)


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing connections that send no whole request head within `timeout_s` of
    opening or of their previous response (`uvicorn.Config(http=...)`)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer = None

        def _arm(self, cycle) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(timeout_s, self._expire, cycle)

        def _expire(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():    # no new request began
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm(None)

        def on_response_complete(self) -> None:
            cycle = self.cycle              # before a pipelined request starts its own cycle
            super().on_response_complete()
            self._arm(cycle)

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def shutdown(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and not cycle.response_started:
                self.transport.close()      # still sending its body: the app sees a disconnect, answers nothing
            else:
                super().shutdown()

    return HeaderTimeoutProtocol


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` (not listening yet: uvicorn listens once the app is ready).

    Example:
        >>> with bind_socket("127.0.0.1", 0) as s: s.getsockname()[1] > 0
        True
    """
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
