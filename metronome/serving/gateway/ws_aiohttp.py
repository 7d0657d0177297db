"""The gateway's WebSocket transport on aiohttp: ``Gateway.app`` for embedding, and the benchmark baseline.

Each client has a reader loop (``async for`` over the socket: one task wake-up per message) and a
writer task draining a bounded queue of ``send_queue_events`` events and ``send_queue_bytes`` bytes; a
client that lets it fill (it stopped reading) makes ``send`` return False and the gateway closes the
session (1008 ``slow_consumer``). A close stops the reader at once and tells the gateway (its worker
session is freed then); the writer gets ``CLOSE_GRACE_S`` to flush, then the socket is aborted: a
writer stuck on a client that never reads must not keep the connection. No heartbeat timer (aiohttp
re-arms it on every frame) and no permessage-deflate (20 ms of PCM does not compress). aiohttp reassembles fragmented messages itself and answers pings.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import WSMsgType, web

from metronome.serving.auth import chosen_subprotocol
from metronome.serving.gateway.ws_transport import App

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 2.0  # a closing socket whose peer does not read is aborted after this long


class AiohttpConnection:
    """One client socket: a bounded outgoing queue drained by a writer task."""

    def __init__(self, ws: web.WebSocketResponse, send_queue_events: int, send_queue_bytes: int = 1 << 62) -> None:
        self.ws = ws
        self.session = None
        self.held: list[bytes | None] | None = None
        self.closed = False
        self.close_code, self.close_reason = 1000, ""
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=send_queue_events)
        self.send_queue_bytes = send_queue_bytes
        self.queued_bytes = 0  # in ``outbox``
        self.reader: asyncio.Task | None = None  # stopped by ``close``: it may wait on a silent client
        self.readable = asyncio.Event()
        self.readable.set()

    def send(self, data: bytes) -> bool:
        """Queue one event for the writer; False: the queue is full in events or bytes (a slow reader)."""
        if self.closed:
            return True
        if self.queued_bytes + len(data) > self.send_queue_bytes:
            return False
        try:
            self.outbox.put_nowait(data)
        except asyncio.QueueFull:
            return False
        self.queued_bytes += len(data)
        return True

    def send_many(self, data: list[bytes]) -> bool:
        if self.closed:
            return True
        if (self.outbox.maxsize - self.outbox.qsize() < len(data)
                or self.queued_bytes + sum(map(len, data)) > self.send_queue_bytes):
            return False
        return all(self.send(d) for d in data)

    def close(self, code: int, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_code, self.close_reason = code, reason
        self.readable.set()
        if self.reader is not None and self.reader is not asyncio.current_task():
            self.reader.cancel()
        while True:  # room for the sentinel even when the queue is full: the writer stops there
            try:
                self.outbox.put_nowait(None)
                return
            except asyncio.QueueFull:
                dropped = self.outbox.get_nowait()
                self.queued_bytes -= len(dropped) if dropped else 0

    def pause_reading(self) -> None:
        self.readable.clear()

    def resume_reading(self) -> None:
        self.readable.set()

    async def write_loop(self) -> None:
        ws = self.ws
        while True:
            data = await self.outbox.get()
            if data is None:
                break
            self.queued_bytes -= len(data)
            try:
                await ws.send_str(data.decode())  # Realtime clients expect text frames
            except (ConnectionError, RuntimeError):
                break
        if not ws.closed:
            await ws.close(code=self.close_code, message=self.close_reason.encode()[:120])

    async def read_loop(self, app: App) -> None:
        ws = self.ws
        while not self.closed:
            if not self.readable.is_set():
                await self.readable.wait()
                continue
            msg = await ws.receive()
            if msg.type == WSMsgType.TEXT:
                app.ws_text(self, msg.data)
            elif msg.type == WSMsgType.BINARY:
                app.ws_binary(self)
            else:
                if msg.type == WSMsgType.ERROR:
                    log.info("websocket error: %s", ws.exception())
                break


def aiohttp_app(app: App, *, max_frame_bytes: int, send_queue_events: int,
                send_queue_bytes: int = 1 << 62) -> web.Application:
    """An aiohttp application serving the gateway: every GET goes to ``app.http_request`` first."""

    async def handle(request: web.Request) -> web.StreamResponse:
        reply = app.http_request(request.method, request.path, request.headers, request.remote or "")
        if reply is not None:
            return web.Response(status=reply.status, body=reply.body,
                                headers={"Content-Type": reply.content_type, **reply.headers})
        chosen = chosen_subprotocol(request.headers.get("Sec-WebSocket-Protocol", ""))
        ws = web.WebSocketResponse(max_msg_size=max_frame_bytes, compress=False, protocols=(chosen,) if chosen else ())
        await ws.prepare(request)
        conn = AiohttpConnection(ws, send_queue_events, send_queue_bytes)
        writer = asyncio.create_task(conn.write_loop())
        app.ws_opened(conn)
        conn.reader = asyncio.create_task(conn.read_loop(app))
        try:
            await asyncio.wait([conn.reader])  # ends when the client leaves or a close cancels it
        finally:
            conn.close(1000, "")  # no-op when the gateway closed it already
            conn.reader.cancel()
            app.ws_closed(conn)   # now, not after the flush: the session is freed even if the client never reads
            _, pending = await asyncio.wait([writer], timeout=CLOSE_GRACE_S)
            if pending:
                writer.cancel()
                if request.transport is not None:
                    request.transport.abort()
                await asyncio.wait([writer])
        return ws

    web_app = web.Application()
    web_app.add_routes([web.route("*", "/{tail:.*}", handle)])
    return web_app
