"""The first request of every connection on the picows port: plain HTTP answered here, upgrades handed on.

Why not picows alone: it takes only HTTP/1.1 GETs (``HEAD /health`` and HTTP/1.0 probes from load
balancers got 400), answers a wrong method with 400, and drops a request whose head is over 16 KiB
with a TCP reset. Here h11 (a well-kept HTTP/1.1 parser) reads the request head, bounded in size
(``max_header_bytes``: 431 beyond it) and in time (``deadline_s`` for the whole head: 408, so a client
that trickles bytes cannot hold a socket); ``app.http_request`` answers it (``HEAD`` gets the same
status and headers as ``GET``, no body; 405 for other methods). A WebSocket upgrade the app lets
through (``None``) is handed, with every byte received so far, to a picows protocol, which validates
it and runs the WebSocket from then on. Every answer here closes the connection, and a peer that does
not read it is aborted after ``CLOSE_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from http import HTTPStatus

import h11
from multidict import CIMultiDict

from metronome.serving.gateway.ws_transport import App, HttpReply

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 2.0


def _reply_bytes(reply: HttpReply, head_only: bool) -> bytes:
    try:
        phrase = HTTPStatus(reply.status).phrase
    except ValueError:
        phrase = ""
    lines = [f"HTTP/1.1 {reply.status} {phrase}", f"Content-Type: {reply.content_type}",
             f"Content-Length: {len(reply.body)}", "Connection: close",
             *(f"{name}: {value}" for name, value in reply.headers.items())]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (b"" if head_only else reply.body)


def _problem(status: int, message: str) -> HttpReply:
    return HttpReply(status, json.dumps({"error": {"type": "invalid_request_error", "message": message}}).encode())


class HttpFront(asyncio.Protocol):
    """Reads one request head; answers it, or hands the connection to ``upgrade()`` (a picows protocol)."""

    def __init__(self, app: App, upgrade: Callable[[], asyncio.BufferedProtocol], *, deadline_s: float,
                 max_header_bytes: int) -> None:
        self.app = app
        self.upgrade = upgrade
        self.deadline_s = deadline_s
        self.max_header_bytes = max_header_bytes
        self.parser = h11.Connection(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.received = bytearray()
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.done = False
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.timer = asyncio.get_running_loop().call_later(self.deadline_s, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        self.received += data
        self.parser.receive_data(data)
        try:
            event = self.parser.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            self._answer(_problem(status, "request head too large" if status == 431 else f"bad request: {exc}"))
            return
        if isinstance(event, h11.Request):
            # h11 bounds a head that is still arriving; one that came whole in a single read is measured here.
            if len(self.received) - len(self.parser.trailing_data[0]) > self.max_header_bytes:
                self._answer(_problem(431, "request head too large"))
            else:
                self._route(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self.done = True
        if self.timer is not None:
            self.timer.cancel()

    def _route(self, request: h11.Request) -> None:
        method = request.method.decode("ascii", "replace")
        headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers)
        upgrade = (method == "GET" and request.http_version == b"1.1"
                   and headers.get("Upgrade", "").lower() == "websocket")
        reply = self.app.http_request(method, request.target.decode("latin-1"), headers, self.peer)
        if reply is None:
            if upgrade:
                self._hand_over()
                return
            reply = _problem(426, "this endpoint speaks WebSocket (HTTP/1.1 GET with Upgrade: websocket)")
            reply.headers["Upgrade"] = "websocket"
        self._answer(reply, head_only=method == "HEAD")

    def _hand_over(self) -> None:
        """picows takes the connection from here, reading the request head again from the bytes kept."""
        self.done = True
        self.timer.cancel()
        protocol = self.upgrade()
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        pending = memoryview(bytes(self.received))
        self.received = bytearray()
        while pending:
            buffer = protocol.get_buffer(len(pending))
            n = min(len(buffer), len(pending))
            buffer[:n] = pending[:n]
            protocol.buffer_updated(n)
            pending = pending[n:]

    def _answer(self, reply: HttpReply, head_only: bool = False) -> None:
        self.done = True
        self.timer.cancel()
        self.transport.write(_reply_bytes(reply, head_only))
        self.transport.close()   # after the write is flushed
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self.transport.abort)

    def _too_slow(self) -> None:
        if not self.done:
            log.info("%s: no whole request head within %g s; closing", self.peer, self.deadline_s)
            self._answer(_problem(408, f"no whole request head within {self.deadline_s:g} s"))
