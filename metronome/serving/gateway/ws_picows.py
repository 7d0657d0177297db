"""The gateway's WebSocket transport on picows (a Cython WebSocket server): one callback per frame.

Why: on aiohttp every client message wakes an asyncio task (``async for msg in ws``) and goes through
aiohttp's Python receive path, which at tens of thousands of messages a second is the gateway's whole
core (docs/benchmarks/gateway.md). Here picows parses frames in C and calls ``on_ws_frame`` synchronously; the gateway handles the event inside that call
and sends are direct transport writes, so a message costs no task switch at all.

The same port answers the small HTTP endpoints: ``http_front.py`` reads each connection's request head
and answers it, or hands an upgrade the app lets through to picows.

Liveness: a ping after ``ping_interval_s`` with nothing received; no pong within ``pong_timeout_s``
and picows closes the socket (so a client that completed the handshake and never reads or answers is
not kept). picows logs a client's protocol errors (bad frames, a missing pong) at ERROR and WARNING;
``ConnectionLog`` makes that the first such line per connection at INFO, the rest DEBUG (our bugs,
logged with their traceback, keep their level).

Frames:

* text: handed to the app; a fragmented message is reassembled up to ``max_frame_bytes`` (the same
  abuse limit as a single frame: beyond it the socket is closed with 1009);
* binary: the app answers with an error event (the protocol is JSON text);
* ping: answered by picows (auto-pong); pong: ignored; close: answered with a close, then disconnect.
  Our own close sends the Close frame and disconnects when the client's Close comes back.

Slow readers: a send writes to the socket's transport at once. When the transport's buffer passes its
high-water mark (the kernel socket buffer is full: the client is not reading), picows calls
``pause_writing``; from then on events wait in a queue of at most ``send_queue_events`` events and
``send_queue_bytes`` bytes. The next event beyond either makes ``send`` return False and the gateway
closes the session (1008 ``slow_consumer``). So a client holds at most the transport's high-water mark
plus ``send_queue_bytes`` of server memory.

Closing: every close (ours, the client's Close frame, and the ones picows starts itself on an oversized
frame or a protocol error) flushes gracefully, but a peer that does not read would keep a graceful
close (and its session, and the worker's KV) forever. So ours and the client's go through ``close``,
which aborts after ``CLOSE_GRACE_S``; picows' own are found by a sweep of the server's connections
every ``CLOSE_GRACE_S / 2`` and aborted once they have been closing for ``CLOSE_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from functools import partial

from picows import (WSAutoPingStrategy, WSCloseCode, WSListener, WSMsgType, WSUpgradeRequest, WSUpgradeResponse,
                    WSUpgradeResponseWithListener)
from picows.picows import WSProtocol   # the protocol ws_create_server builds; picows is pinned

from metronome.serving.auth import chosen_subprotocol
from metronome.serving.gateway.http_front import HttpFront
from metronome.serving.gateway.ws_transport import App

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 2.0  # a closing socket whose peer does not read is aborted after this long

_TEXT, _BINARY, _CONT, _CLOSE = WSMsgType.TEXT, WSMsgType.BINARY, WSMsgType.CONTINUATION, WSMsgType.CLOSE


class PicowsConnection(WSListener):
    """One client socket: frames to the app, bounded sends, fragment reassembly, the close handshake."""

    def __init__(self, app: App, max_frame_bytes: int, send_queue_events: int, send_queue_bytes: int = 1 << 62,
                 live: set[PicowsConnection] | None = None) -> None:
        super().__init__()
        self.app = app
        self.max_frame_bytes = max_frame_bytes
        self.send_queue_events = send_queue_events
        self.send_queue_bytes = send_queue_bytes
        self.live = live                           # the server's open connections (for the close sweep)
        self.closing_since: float | None = None    # when the sweep first saw picows closing this socket
        self.transport = None
        self.session = None
        self.held: list[bytes | None] | None = None
        self.closed = False
        self.gone = False
        self.paused = False                        # the transport is over its high-water mark
        self.backlog: deque[bytes] = deque()       # events waiting while paused
        self.backlog_bytes = 0
        self.fragments: bytearray | None = None    # a fragmented message being reassembled
        self.fragmented_binary = False

    # ------------------------------------------------------------------ picows callbacks
    def on_ws_connected(self, transport) -> None:
        self.transport = transport
        if self.live is not None:
            self.live.add(self)
        self.app.ws_opened(self)

    def on_ws_frame(self, transport, frame) -> None:
        try:
            self._frame(transport, frame)
        except Exception:  # a bug, not the client's: close this socket ourselves (bounded), keep serving
            log.exception("websocket frame handler failed")
            self._fail(WSCloseCode.INTERNAL_ERROR, "internal error")

    def _frame(self, transport, frame) -> None:
        kind = frame.msg_type
        if kind is _TEXT and frame.fin and self.fragments is None:  # the hot path: one whole text message
            self.app.ws_text(self, frame.get_payload_as_memoryview())
        elif kind is _TEXT or kind is _BINARY:
            if self.fragments is not None:
                self._fail(WSCloseCode.PROTOCOL_ERROR, "new message inside a fragmented one")
            elif frame.fin:
                self.app.ws_binary(self)
            else:
                self.fragments = bytearray(frame.get_payload_as_memoryview())
                self.fragmented_binary = kind is _BINARY
        elif kind is _CONT:
            self._continuation(frame)
        elif kind is _CLOSE:
            if not self.closed:
                self.close(WSCloseCode.OK.value, "")  # our answer; aborted after the grace if the peer does not read
            self.transport.disconnect(graceful=True)  # both Close frames are out: the handshake is complete
        # PING is answered by picows itself; PONG needs nothing.

    def on_ws_disconnected(self, transport) -> None:
        self.closed = self.gone = True
        self._clear_backlog()
        if self.live is not None:
            self.live.discard(self)
        self.app.ws_closed(self)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        backlog, send = self.backlog, self.transport.send
        while backlog and not self.paused:
            data = backlog.popleft()
            self.backlog_bytes -= len(data)
            send(_TEXT, data)

    # ------------------------------------------------------------------ the gateway's side
    def send(self, data: bytes) -> bool:
        if self.closed:
            return True  # closing: dropped, and not the client's fault
        if self.paused:
            if len(self.backlog) >= self.send_queue_events or self.backlog_bytes + len(data) > self.send_queue_bytes:
                return False
            self.backlog.append(data)
            self.backlog_bytes += len(data)
            return True
        self.transport.send(_TEXT, data)
        return True

    def send_many(self, data: list[bytes]) -> bool:
        """Several text frames in one socket write (a tick's events for one client: one syscall, not three)."""
        if self.closed:
            return True
        if self.paused:
            size = sum(map(len, data))
            if (len(self.backlog) + len(data) > self.send_queue_events
                    or self.backlog_bytes + size > self.send_queue_bytes):
                return False
            self.backlog.extend(data)
            self.backlog_bytes += size
            return True
        self.transport.underlying_transport.write(text_frames(data))
        return True

    def close(self, code: int, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self._clear_backlog()
        self.transport.send_close(WSCloseCode(code), reason.encode()[:120])
        # The TCP connection stays open until the peer's Close arrives (``_frame``): closing it now, while the
        # client is still sending, makes our kernel answer its data with a RST, and a RST discards what the
        # client has not read yet (the error events that explain the close, and the Close frame itself).
        # A peer that never answers is aborted after the grace.
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self._abort)

    def _clear_backlog(self) -> None:
        self.backlog.clear()
        self.backlog_bytes = 0

    def sweep(self, now: float) -> None:
        """Bound a close picows started itself (oversized frame, protocol error): abort after the grace."""
        if self.gone or self.transport is None:
            return
        if self.closing_since is not None:
            if now - self.closing_since >= CLOSE_GRACE_S:
                self._abort()
        elif self.transport.is_close_frame_sent or self.transport.underlying_transport.is_closing():
            self.closing_since = now
            if not self.closed:  # picows closed it behind our back: stop handling and sending
                self.closed = True
                self._clear_backlog()

    def pause_reading(self) -> None:
        self.transport.underlying_transport.pause_reading()

    def resume_reading(self) -> None:
        if not self.gone:
            self.transport.underlying_transport.resume_reading()

    # ------------------------------------------------------------------ internals
    def _continuation(self, frame) -> None:
        if self.fragments is None:
            self._fail(WSCloseCode.PROTOCOL_ERROR, "continuation frame without a message to continue")
            return
        if len(self.fragments) + frame.payload_size > self.max_frame_bytes:
            self.fragments = None
            self._fail(WSCloseCode.MESSAGE_TOO_BIG, f"fragmented message over {self.max_frame_bytes} bytes")
            return
        self.fragments += frame.get_payload_as_memoryview()
        if frame.fin:
            message, self.fragments = self.fragments, None
            if self.fragmented_binary:
                self.app.ws_binary(self)
            else:
                self.app.ws_text(self, message)

    def _fail(self, code: WSCloseCode, why: str) -> None:
        log.info("websocket protocol error: %s", why)
        self.close(code.value, why)
        if self.session is not None:
            self.session.close("protocol_error")  # the socket is closing already: this only records why

    def _abort(self) -> None:
        if not self.gone:
            self.transport.disconnect(graceful=False)


def text_frames(payloads: list[bytes]) -> bytes:
    """Unmasked, final text frames (RFC 6455 section 5.2), as a server sends them, back to back."""
    parts = []
    for payload in payloads:
        n = len(payload)
        if n < 126:
            parts.append(bytes((0x81, n)))
        elif n < 1 << 16:
            parts.append(b"\x81\x7e" + n.to_bytes(2, "big"))
        else:
            parts.append(b"\x81\x7f" + n.to_bytes(8, "big"))
        parts.append(payload)
    return b"".join(parts)


class ConnectionLog(logging.LoggerAdapter):
    """picows' log for one connection: the client's errors once at INFO, then DEBUG; tracebacks as they are."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self.told = False

    def log(self, level, msg, *args, **kwargs) -> None:
        if level >= logging.WARNING and not kwargs.get("exc_info"):
            level, self.told = (logging.DEBUG if self.told else logging.INFO), True
        super().log(level, msg, *args, **kwargs)


async def start_server(app: App, host: str, port: int, *, max_frame_bytes: int, send_queue_events: int,
                       send_queue_bytes: int = 1 << 62, ping_interval_s: float = 20.0, pong_timeout_s: float = 20.0,
                       handshake_timeout_s: float = 5.0, max_header_bytes: int = 16 << 10) -> asyncio.Server:
    """Listen on ``host:port``: WebSocket upgrades where the app returns no reply, small HTTP answers otherwise."""
    live: set[PicowsConnection] = set()
    picows_log = logging.getLogger("picows.server")

    def listener(request: WSUpgradeRequest) -> PicowsConnection | WSUpgradeResponseWithListener:
        """The app let it through (``http_front``); a subprotocol offered is echoed (``auth.chosen_subprotocol``)."""
        conn = PicowsConnection(app, max_frame_bytes, send_queue_events, send_queue_bytes, live)
        chosen = chosen_subprotocol(request.headers.get("Sec-WebSocket-Protocol", ""))
        if chosen is None:
            return conn
        return WSUpgradeResponseWithListener(
            WSUpgradeResponse.create_101_response(extra_headers={"Sec-WebSocket-Protocol": chosen}), conn)

    def websocket() -> WSProtocol:   # as ws_create_server makes it, with our logger, pings and limits
        return WSProtocol(None, None, False, listener, ConnectionLog(picows_log), True, handshake_timeout_s,
                          True, ping_interval_s, pong_timeout_s, WSAutoPingStrategy.PING_WHEN_IDLE, True,
                          max_frame_bytes, None, 16 * 1024)

    # The loop's own TCP transport (uvloop's, in C), not aiofastnet's: no faster in the gateway
    # benchmark, and one transport fewer to reason about.
    loop = asyncio.get_running_loop()
    server = await loop.create_server(partial(HttpFront, app, websocket, deadline_s=handshake_timeout_s,
                                              max_header_bytes=max_header_bytes), host, port)

    def sweep() -> None:  # a timer, not a task: nothing to cancel when the server goes
        now = time.monotonic()
        for conn in list(live):
            conn.sweep(now)
        if server.is_serving() or live:
            loop.call_later(CLOSE_GRACE_S / 2, sweep)

    loop.call_later(CLOSE_GRACE_S / 2, sweep)
    return server
