"""What the gateway and its WebSocket transports agree on: the app's callbacks and a connection's state.

The gateway (``realtime.py``) speaks the Realtime protocol; a transport moves frames. Two transports
implement the same contract:

* ``ws_picows`` (the default, production): picows, a Cython WebSocket server. Each frame reaches the
  gateway in a synchronous callback (no task wake-up per message) and sends are synchronous writes.
* ``ws_aiohttp``: aiohttp, for ``Gateway.app`` (embedding in an aiohttp application) and as the
  gateway benchmark's baseline.

A transport calls, on the event loop::

    app.http_request(method, path, headers, peer) -> HttpReply | None   # None: upgrade to the WebSocket
    app.ws_opened(conn)      app.ws_text(conn, data)      app.ws_binary(conn)      app.ws_closed(conn)

``data`` may be a memoryview into the transport's read buffer: valid only during the call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from metronome.serving.gateway.client_session import ClientSession

JSON = "application/json; charset=utf-8"


@dataclass
class HttpReply:
    """A small HTTP answer (the GET endpoints, or a refused upgrade such as 401); ``headers``: extra ones."""

    status: int
    body: bytes
    content_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> HttpReply:
        return cls(status, json.dumps(obj).encode())


class Connection(Protocol):
    """One client socket as the gateway sees it.

    ``session``: set once admitted. ``held``: while the gateway awaits something before it may handle
    more of this client's events (OpenSession at connect, a re-open on ``session.update``), reading is
    paused and the events that had already arrived wait here, in order (``None``: a binary frame).
    ``closed``: the socket is gone or closing; nothing more is handled or sent.
    """

    session: ClientSession | None
    held: list[bytes | None] | None
    closed: bool

    def send(self, data: bytes) -> bool:
        """Write a text frame (or queue it while the socket is backed up); False: the queue is full."""
        ...

    def send_many(self, data: list[bytes]) -> bool:
        """``send`` for several frames, written together."""
        ...

    def close(self, code: int, reason: str) -> None: ...
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class App(Protocol):
    def http_request(self, method: str, path: str, headers: Mapping[str, str], peer: str = "") -> HttpReply | None: ...
    def ws_opened(self, conn: Connection) -> None: ...
    def ws_text(self, conn: Connection, data: bytes | memoryview | str) -> None: ...
    def ws_binary(self, conn: Connection) -> None: ...
    def ws_closed(self, conn: Connection) -> None: ...
