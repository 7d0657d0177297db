"""The gateway: OpenAI-Realtime-style WebSocket sessions at ``/v1/realtime``, ticked to the workers.

A connection is admitted only if some worker's AIMD cap and memory capacity have room; otherwise it
gets ``error{type: server_overloaded}`` and a close (1013), or, when no worker is up at all,
``error{code: worker_restarting}`` and 1012. Admitted sessions are never evicted. Bad client input
gets an ``error`` event and is logged; only abuse closes the socket: oversized frames far over the
limit, a sustained flood, a client that stops reading, or ``abuse_strikes`` refusals of oversized input
(text, instructions, audio faster than real time, messages over the limit) close to one another. A
session that sends no event for ``idle_timeout_s`` is closed, so silent clients give their slots back.
The HTTP endpoints are ``http.py``'s.

This module speaks the protocol; the sockets are a transport's (``ws_transport.py``): picows by default
(``server.py``: ``serve_gateway``, ``run_gateway``), aiohttp through ``Gateway.app``. The workers, their
tickers and the frame budget B are the pool's (``pool.py``). Client events are handled
synchronously inside the transport's frame callback; only OpenSession at connect and a session re-open
on ``session.update`` await, and while they do the client's later events wait, in order.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine, Mapping
from typing import Any

import grpc

from metronome.config import GatewayConfig
from metronome.serving.gateway.client_session import ClientSession
from metronome.serving.gateway.discovery import Resolver, resolve_dns
from metronome.serving.gateway.handle import TickReport, WorkerHandle
from metronome.serving.gateway.http import REALTIME_PATH, HttpEndpoints
from metronome.serving.gateway.pool import WorkerPool
from metronome.serving.gateway.response import ResponseRequest, new_id
from metronome.serving.gateway.responses import cancel_response, commit_turn, speech_events, tick_events
from metronome.serving.gateway.session_update import SessionChange, apply_update, read_update, session_view
from metronome.serving.metrics import GatewayMetrics
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.protocol import (
    ConversationItemCreate, InputAudioBufferAppend, InputAudioBufferClear,
    InputAudioBufferCommit, ProtocolError, ResponseCancel, ResponseCreate, SessionUpdate, decode_client_event,
    encode, error_event)
from metronome.serving.gateway.ws_transport import Connection, HttpReply

log = logging.getLogger(__name__)

# A client over its message rate this many times in a row is flooding: it is disconnected.
FLOOD_STRIKES = 100
# Refusals of oversized input: each is a strike toward closing the session for abuse (``ClientSession.strike``).
OVERSIZED = frozenset({"message_too_large", "nested_too_deep", "text_buffer_full", "instructions_too_large",
                       "audio_too_fast", "audio_buffer_full", "input_too_large", "input_refused",
                       "session_update_refused"})
IDLE_SWEEP_S = 1.0
SERVER_ERRORS = frozenset({"worker_unavailable", "worker_draining", "step_failed", "internal_error",
                           "session_failed", "unknown_session"})


class Gateway:
    def __init__(self, config: GatewayConfig, resolve: Resolver = resolve_dns) -> None:
        self.config = config
        self.metrics = GatewayMetrics(config.budget_ms)
        self.pool = WorkerPool(config, self.metrics, self._deliver, self._worker_failed, self._deliver_speech, resolve)
        self.http = HttpEndpoints(config, self.metrics, self._health)
        self.connections: set[Connection] = set()
        self._tasks: set[asyncio.Task] = set()  # strong references to the per-connection awaits
        self._stopping = False  # once set, nothing new is spawned (the channels are about to close)
        self.draining = False   # once set (``drain.py``), no new session is admitted

    @property
    def max_frame_bytes(self) -> int:
        """Frames (and reassembled messages) beyond this close the socket; up to it, an error event."""
        return 4 * self.config.max_message_bytes

    async def start(self) -> None:
        await self.pool.start()
        if self.config.idle_timeout_s:
            asyncio.get_running_loop().call_later(IDLE_SWEEP_S, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Close sessions whose client sent nothing for ``idle_timeout_s`` (a timer, not a task: nothing to cancel)."""
        if self._stopping:
            return
        limit = self.config.idle_timeout_s
        for conn in list(self.connections):
            session = conn.session
            if session is not None and not session.closed and conn.held is None and session.idle_s > limit:
                self._client_error(session, "idle_timeout", f"no event for {limit:g} s; closing")
                session.close("idle_timeout")
        asyncio.get_running_loop().call_later(IDLE_SWEEP_S, self._sweep_idle)

    async def stop(self) -> None:
        """Close every client, free every worker session (CloseSession), then the worker channels."""
        self._stopping = True
        for conn in list(self.connections):
            conn.close(1001, "server shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close_all_sessions()
        await self.pool.stop()

    @property
    def app(self):
        """The gateway as an aiohttp application (starts and stops the worker pool with it)."""
        from metronome.serving.gateway.ws_aiohttp import aiohttp_app

        web_app = aiohttp_app(self, max_frame_bytes=self.max_frame_bytes,
                              send_queue_events=self.config.send_queue_events,
                              send_queue_bytes=self.config.send_queue_bytes)
        web_app.on_startup.append(lambda _app: self.start())
        web_app.on_cleanup.append(lambda _app: self.stop())
        return web_app

    def _handle_of(self, session: ClientSession) -> WorkerHandle | None:
        return next((h for h in self.pool.handles if h.address == session.worker_name), None)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._stopping:  # stop() frees the worker sessions itself; the channels may be closed already
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ HTTP
    def http_request(self, method: str, path: str, headers: Mapping[str, str], peer: str = "") -> HttpReply | None:
        """The reply to a request; None: go on and upgrade to the Realtime WebSocket (``http.py``)."""
        return self.http.request(method, path, headers, peer)

    def _health(self) -> dict[str, Any]:
        workers = [{"address": h.address, "healthy": h.healthy, "live": len(h.sessions), "cap": h.cap,
                    "memory_capacity": h.memory_capacity, "ticks": h.ticks, "draining": h.draining,
                    "retired": h.retired, "model": h.health.model if h.health else None} for h in self.pool.handles]
        return {"status": "ok" if any(w["healthy"] for w in workers) else "unavailable", "workers": workers,
                "draining": self.draining}

    # ------------------------------------------------------------------ WebSocket life cycle
    def ws_opened(self, conn: Connection) -> None:
        self.connections.add(conn)
        if self.draining:
            self._refuse(conn, "server_draining", "this gateway is shutting down; connect again to reach another")
            return
        handle = self.pool.reserve()
        if handle is None:
            self._refuse(conn, *self.pool.refusal())
            return
        self._hold(conn)  # events that arrive while OpenSession is in flight wait for it
        self._spawn(self._open(conn, handle))

    async def _open(self, conn: Connection, handle: WorkerHandle) -> None:
        sid = f"sess_{uuid.uuid4().hex[:16]}"
        handle, opened = await self.pool.open_session(handle, sid)   # the next worker is asked if one refuses
        if not opened.ok:
            self._refuse(conn, "server_overloaded", opened.error)
            return
        c = self.config
        session = ClientSession(sid, handle.address, conn, max_buffered_audio_s=c.max_buffered_audio_s,
                                max_messages_per_s=c.max_messages_per_s, max_text_bytes=c.max_text_bytes_per_tick,
                                audio_realtime_factor=c.audio_realtime_factor, abuse_strikes=c.abuse_strikes,
                                abuse_window_s=c.abuse_window_s)
        handle.sessions[sid] = session
        self.metrics.sessions_admitted.labels(handle.address).inc()
        self.metrics.sessions_live.labels(handle.address).set(len(handle.sessions))
        if conn.closed:  # the client left while OpenSession was in flight
            session.disconnected()
            await self._release(handle, session)
            return
        conn.session = session
        log.info("session %s admitted on %s (%d live, cap %d)", sid, handle.address, len(handle.sessions), handle.cap)
        session.send({"type": "session.created", "session": self._session_view(session)})
        self._unhold(conn)

    def _refuse(self, conn: Connection, code: str, why: str) -> None:
        """Refuse a new session: overloaded (1013, try again later) or no worker up (1012, service restart)."""
        self.metrics.sessions_rejected.labels(code).inc()
        log.info("connection refused: %s", why)
        conn.held = None
        if code == "server_overloaded":
            conn.send(encode(error_event(code, f"server overloaded: {why}", type="server_overloaded")))
            conn.close(1013, "server overloaded")
        elif code == "server_draining":
            conn.send(encode(error_event(code, why, type="server_error")))
            conn.close(1001, "server shutting down")
        else:
            conn.send(encode(error_event(code, why, type="server_error")))
            conn.close(1012, "worker restarting")

    def ws_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        conn.closed = True
        conn.held = None
        session = conn.session
        if session is None:
            return  # refused, or still opening (``_open`` releases it)
        session.disconnected()
        handle = self._handle_of(session)
        if handle is not None:
            self._spawn(self._release(handle, session))

    async def _release(self, handle: WorkerHandle, session: ClientSession) -> None:
        """Free the worker-side session at once: its KV returns to the pool within this tick.

        Not while a re-open (``_reopen``) is in flight: it could land after this CloseSession; ``_reopen``
        releases the session when it is done instead.
        """
        if session.reopening:
            return
        if handle.sessions.pop(session.sid, None) is None:
            return  # the worker already dropped it (worker failure)
        self.metrics.sessions_live.labels(handle.address).set(len(handle.sessions))
        try:
            await handle.stub.CloseSession(pb.CloseSessionRequest(sid=session.sid), timeout=5.0,
                                           metadata=handle.metadata)
        except grpc.aio.AioRpcError as exc:
            log.warning("closing %s on %s failed: %s", session.sid, handle.address, exc.code().name)
        log.info("session %s closed (%s)", session.sid, session.close_reason)

    # ------------------------------------------------------------------ holding events during an await
    @staticmethod
    def _hold(conn: Connection) -> None:
        if conn.held is None:
            conn.held = []
            conn.pause_reading()

    def _unhold(self, conn: Connection) -> None:
        """Handle the events that waited, in order; stop early if one of them has to await again."""
        waiting, conn.held = conn.held or [], None
        try:
            for i, data in enumerate(waiting):
                if conn.closed:
                    return
                if data is None:
                    self.ws_binary(conn)
                else:
                    self.ws_text(conn, data)
                if conn.held is not None:  # that event awaits now: the rest waits behind it
                    conn.held.extend(waiting[i + 1:])
                    return
        except Exception:  # a bug: never leave the socket paused (its close would go unnoticed)
            log.exception("handling held events failed; closing the connection")
            conn.close(1011, "internal error")
        finally:
            if conn.held is None and not conn.closed:
                conn.resume_reading()

    # ------------------------------------------------------------------ frames
    def ws_binary(self, conn: Connection) -> None:
        if conn.closed:
            return
        if conn.held is not None:
            conn.held.append(None)
        elif conn.session is not None:
            self._client_error(conn.session, "unsupported_frame", "send JSON text frames")

    def ws_text(self, conn: Connection, data: bytes | memoryview | str) -> None:
        """One client event, handled here and now (the hot path: 50 of these per second per session)."""
        if conn.closed:
            return  # closing: events that were already on the wire are not acted on
        if conn.held is not None:
            conn.held.append(bytes(data) if not isinstance(data, str) else data.encode())
            return
        session = conn.session
        if session is None or session.closed:
            return
        if not session.rate.take():
            session.strikes += 1
            if session.strikes == 1:
                self._client_error(session, "rate_limited",
                                   f"more than {self.config.max_messages_per_s:.0f} events/s; events dropped")
            if session.strikes >= FLOOD_STRIKES:
                self._client_error(session, "flood", "too many events; closing")
                session.close("flood")
            return
        session.strikes = 0
        if len(data) > self.config.max_message_bytes:
            self._client_error(session, "message_too_large",
                               f"{len(data)} bytes > limit {self.config.max_message_bytes}")
            return
        try:
            event = decode_client_event(data)
            if type(event) is InputAudioBufferAppend:
                pcm = event.audio
                if len(pcm) & 1:
                    raise ProtocolError("invalid_audio", f"PCM16 needs an even byte count, got {len(pcm)}")
                if session.audio_too_fast(len(pcm)):
                    raise ProtocolError("audio_too_fast", f"audio faster than {self.config.audio_realtime_factor:g}x "
                                        "real time; dropped")
                if not session.append_audio(pcm):
                    raise ProtocolError("audio_buffer_full",
                                        f"more than {self.config.max_buffered_audio_s:.0f} s of audio waiting; dropped")
            else:
                self._handle(conn, session, event)
        except ProtocolError as exc:
            self._client_error(session, exc.code, exc.message)
        except Exception:  # a bug, not the client's fault: report it and keep the session
            log.exception("session %s: handling a client event failed", session.sid)
            self._client_error(session, "internal_error", "the server failed to handle this event")

    def _client_error(self, session: ClientSession, code: str, message: str) -> None:
        session.send(self._error(session, code, message))
        if code in OVERSIZED and session.strike():
            self._abuse(session)

    def _abuse(self, session: ClientSession) -> None:
        session.send(self._error(session, "abuse", f"{self.config.abuse_strikes} oversized inputs within "
                                 f"{self.config.abuse_window_s:g} s of each other; closing"))
        session.close("abuse")

    def _error(self, session: ClientSession, code: str, message: str) -> dict[str, Any]:
        """An error event for this session, counted, and logged the first time the session gets this code."""
        self.metrics.client_errors.labels(code).inc()
        level = logging.DEBUG if code in session.logged_codes else logging.INFO
        session.logged_codes.add(code)
        log.log(level, "session %s: %s: %s", session.sid, code, message)
        return error_event(code, message, type="server_error" if code in SERVER_ERRORS else "invalid_request_error")

    # ------------------------------------------------------------------ client events
    def _handle(self, conn: Connection, session: ClientSession, event: Any) -> None:
        if isinstance(event, SessionUpdate):
            self._update_session(conn, session, event)
        elif isinstance(event, InputAudioBufferCommit):
            session.commit()
            events = commit_turn(session)
            events[0]["event_id"] = event.event_id
            session.send_all(events)
        elif isinstance(event, InputAudioBufferClear):
            session.discard_audio()
            session.send({"type": "input_audio_buffer.cleared", "event_id": event.event_id})
        elif isinstance(event, ConversationItemCreate):
            text = event.text()
            if not session.append_text(text):
                raise ProtocolError("text_buffer_full", f"more than {self.config.max_text_bytes_per_tick} bytes "
                                    "of text in one tick; this item was dropped")
            item = {"object": "realtime.item", "status": "completed", **event.echo(text)}
            item.setdefault("id", new_id("item"))
            session.send_all([{"type": "conversation.item.created", "event_id": event.event_id,
                               "previous_item_id": None, "item": item},
                              {"type": "conversation.item.added", "previous_item_id": None, "item": item},
                              {"type": "conversation.item.done", "previous_item_id": None, "item": item}])
        elif isinstance(event, ResponseCreate):
            if event.response is not None:
                session.next_response = ResponseRequest(event.response.output_tokens() or 0,
                                                        event.response.modalities_given())
            session.new_turn = session.started = True
        elif isinstance(event, ResponseCancel):
            session.send_all(cancel_response(session))

    def _update_session(self, conn: Connection, session: ClientSession, event: SessionUpdate) -> None:
        change = read_update(session, event.session, self.config.max_instruction_bytes)
        if (change.mode, change.instructions) != (session.mode, session.instructions):
            if session.started:
                raise ProtocolError("session_started", "mode and instructions can change only before the first "
                                    "audio or text (they shape the conversation's pinned header)")
            self._hold(conn)  # later events wait until the worker session is re-opened
            self._spawn(self._reopen(conn, session, event, change))
            return
        apply_update(session, change)
        session.send({"type": "session.updated", "event_id": event.event_id, "session": self._session_view(session)})

    async def _reopen(self, conn: Connection, session: ClientSession, event: SessionUpdate,
                      change: SessionChange) -> None:
        """Give the (still empty) worker session a new mode / system prompt in place, then go on reading.

        Refused (instructions too long for the model, say), the worker session stays as it was, and so does
        this one: the client gets an error and the session lives on."""
        handle = self._handle_of(session)
        request = pb.OpenSessionRequest(sid=session.sid, mode=change.mode, instructions=change.instructions,
                                        replace=True)
        session.reopening = True  # a close meanwhile does not release; this does, below
        try:
            opened = await handle.stub.OpenSession(request, timeout=10.0, metadata=handle.metadata)
        except grpc.aio.AioRpcError as exc:
            opened = pb.OpenSessionResponse(ok=False, error=f"worker unavailable: {exc.code().name}")
        finally:
            session.reopening = False
            if conn.closed:  # the client left meanwhile: free the worker session
                session.disconnected()
                self._spawn(self._release(handle, session))
        if conn.closed:
            return
        if opened.ok:
            session.mode, session.instructions = change.mode, change.instructions
            apply_update(session, change)
            session.send({"type": "session.updated", "event_id": event.event_id,
                          "session": self._session_view(session)})
        else:
            self._client_error(session, "session_update_refused",
                               f"the update was not applied: {opened.error}; the session is unchanged")
        if not session.closed:
            self._unhold(conn)

    def _session_view(self, session: ClientSession) -> dict[str, Any]:
        return session_view(session, model=self.config.model_name, budget_ms=self.pool.budget_ms,
                            tokens_per_tick=self.config.tokens_per_tick)

    # ------------------------------------------------------------------ tick fan-out
    def _deliver(self, handle: WorkerHandle, session: ClientSession, out: pb.SessionOutput,
                 report: TickReport) -> None:
        """One session's share of a tick: its events, then ``metronome.tick``, written together.

        An error on the output (the worker refused this tick's input, say) leaves the session open; refusals
        of oversized input count toward closing it for abuse."""
        code = out.error_code or "session_failed"
        error = self._error(session, code, out.error) if out.error else None
        session.send_all(tick_events(session, out, report, self.pool.budget_ms, error))
        if error is not None and code in OVERSIZED and session.strike():
            self._abuse(session)

    @staticmethod
    def _deliver_speech(handle: WorkerHandle, session: ClientSession, out: pb.SessionOutput) -> None:
        """Speech the worker finished between ticks: the answer's audio events, at once."""
        session.send_all(speech_events(session, out))

    def _worker_failed(self, handle: WorkerHandle, session: ClientSession, code: str) -> None:
        what = "shut down (drained)" if code == "worker_draining" else "stopped and is being restarted"
        self._client_error(session, code, f"the worker serving this session ({handle.address}) {what}; this "
                           "session has ended: reconnect to start a new one")
        session.close(code)
