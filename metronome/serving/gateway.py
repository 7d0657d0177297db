"""The gateway: OpenAI-Realtime-style WebSocket sessions at ``/v1/realtime``, ticked to the workers.

    GET /v1/realtime   WebSocket (Authorization: Bearer <key> when an API key is set)
    GET /health        JSON: workers, their caps, live sessions
    GET /v1/models     the served model, OpenAI list format
    GET /metrics       Prometheus text

A connection is admitted only if some worker's AIMD cap and memory capacity have room; otherwise it
gets ``error{type: server_overloaded}`` and a close. Admitted sessions are never evicted. Bad client
input gets an ``error`` event and is logged; only abuse (oversized frames far over the limit, a
sustained flood, a client that stops reading) closes the socket.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import WSMsgType, web

from metronome.config import GatewayConfig
from metronome.serving.client_session import ClientSession
from metronome.serving.metrics import CONTENT_TYPE, GatewayMetrics
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.protocol import (
    SUPPORTED_SAMPLE_RATES, ConversationItemCreate, InputAudioBufferAppend, InputAudioBufferClear,
    InputAudioBufferCommit, ProtocolError, ResponseCancel, ResponseCreate, SessionUpdate, decode_client_event,
    encode, error_event)
from metronome.serving.workers import TickReport, WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

# A client over its message rate this many times in a row is flooding: it is disconnected.
FLOOD_STRIKES = 100


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics(config.budget_ms)
        self.pool = WorkerPool(config, self.metrics, self._deliver, self._worker_failed)
        self.app = web.Application()
        self.app.add_routes([web.get("/v1/realtime", self.realtime), web.get("/health", self.health),
                             web.get("/v1/models", self.models), web.get("/metrics", self.prometheus)])
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    async def _start(self, _app: web.Application) -> None:
        await self.pool.start()

    async def _stop(self, _app: web.Application) -> None:
        await self.pool.stop()

    # ------------------------------------------------------------------ HTTP
    async def health(self, _request: web.Request) -> web.Response:
        workers = [{"address": h.address, "healthy": h.healthy, "live": len(h.sessions), "cap": h.cap,
                    "memory_capacity": h.memory_capacity, "ticks": h.ticks,
                    "model": h.health.model if h.health else None} for h in self.pool.handles]
        status = "ok" if any(w["healthy"] for w in workers) else "unavailable"
        return web.json_response({"status": status, "workers": workers}, status=200 if status == "ok" else 503)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "owned_by": "metronome"}]})

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _authorized(self, request: web.Request) -> bool:
        if not self.config.api_key:
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), self.config.api_key)

    # ------------------------------------------------------------------ WebSocket
    async def realtime(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            self.metrics.sessions_rejected.labels("unauthorized").inc()
            return web.json_response({"error": {"type": "invalid_request_error", "code": "invalid_api_key",
                                                "message": "missing or wrong API key"}}, status=401)
        # No per-connection heartbeat timer (it is re-armed on every frame: ~15% of the read path) and no
        # permessage-deflate (20 ms PCM does not compress; it would cost CPU on every message).
        ws = web.WebSocketResponse(max_msg_size=4 * self.config.max_message_bytes, compress=False)
        await ws.prepare(request)
        handle = self.pool.reserve()
        if handle is None:
            return await self._refuse(ws, "no worker has room under its admission cap")
        sid = f"sess_{uuid.uuid4().hex[:16]}"
        session = ClientSession(sid, handle.address, max_buffered_audio_s=self.config.max_buffered_audio_s,
                                send_queue_events=self.config.send_queue_events,
                                max_messages_per_s=self.config.max_messages_per_s)
        try:
            opened = await handle.stub.OpenSession(pb.OpenSessionRequest(sid=sid), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            opened = pb.OpenSessionResponse(ok=False, error=f"worker unavailable: {exc.code().name}")
        finally:
            handle.pending -= 1
        if not opened.ok:
            return await self._refuse(ws, opened.error)
        handle.sessions[sid] = session
        self.metrics.sessions_admitted.labels(handle.address).inc()
        self.metrics.sessions_live.labels(handle.address).set(len(handle.sessions))
        log.info("session %s admitted on %s (%d live, cap %d)", sid, handle.address, len(handle.sessions), handle.cap)
        writer = asyncio.create_task(self._write(ws, session), name=f"writer {sid}")
        session.send({"type": "session.created", "session": self._session_view(session)})
        try:
            await self._read(ws, session)
        finally:
            session.close(session.close_reason or "client_closed")
            await writer
            await self._release(handle, session)
        return ws

    async def _refuse(self, ws: web.WebSocketResponse, why: str) -> web.WebSocketResponse:
        self.metrics.sessions_rejected.labels("server_overloaded").inc()
        log.info("connection refused: %s", why)
        await ws.send_str(encode(error_event("server_overloaded", f"server overloaded: {why}",
                                             type="server_overloaded")).decode())  # a text frame, as clients expect
        await ws.close(code=1013, message=b"server overloaded")  # 1013: try again later
        return ws

    async def _release(self, handle: WorkerHandle, session: ClientSession) -> None:
        """Free the worker-side session at once: its KV returns to the pool within this tick."""
        if handle.sessions.pop(session.sid, None) is None:
            return  # the worker already dropped it (worker failure)
        self.metrics.sessions_live.labels(handle.address).set(len(handle.sessions))
        try:
            await handle.stub.CloseSession(pb.CloseSessionRequest(sid=session.sid), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("closing %s on %s failed: %s", session.sid, handle.address, exc.code().name)
        log.info("session %s closed (%s)", session.sid, session.close_reason)

    async def _write(self, ws: web.WebSocketResponse, session: ClientSession) -> None:
        while True:
            data = await session.outbox.get()
            if data is None:
                break
            try:
                await ws.send_str(data.decode())  # Realtime clients expect text frames
            except (ConnectionError, RuntimeError):
                session.close("client_gone")
                break
        if not ws.closed:
            code = 1008 if session.close_reason in ("slow_consumer", "flood") else 1000
            await ws.close(code=code, message=(session.close_reason or "").encode()[:120])

    async def _read(self, ws: web.WebSocketResponse, session: ClientSession) -> None:
        strikes = 0
        async for msg in ws:
            if session.closed:
                break
            if msg.type == WSMsgType.ERROR:
                log.info("session %s: websocket error %s", session.sid, ws.exception())
                break
            if msg.type != WSMsgType.TEXT:
                self._client_error(session, "unsupported_frame", "send JSON text frames")
                continue
            if not session.rate.take():
                strikes += 1
                if strikes == 1:
                    self._client_error(session, "rate_limited",
                                       f"more than {self.config.max_messages_per_s:.0f} events/s; events dropped")
                if strikes >= FLOOD_STRIKES:
                    self._client_error(session, "flood", "too many events; closing")
                    session.close("flood")
                continue
            strikes = 0
            if len(msg.data) > self.config.max_message_bytes:
                self._client_error(session, "message_too_large",
                                   f"{len(msg.data)} bytes > limit {self.config.max_message_bytes}")
                continue
            try:
                await self._handle(session, decode_client_event(msg.data))
            except ProtocolError as exc:
                self._client_error(session, exc.code, exc.message)

    def _client_error(self, session: ClientSession, code: str, message: str, event_id: str | None = None) -> None:
        self.metrics.client_errors.labels(code).inc()
        log.info("session %s: %s: %s", session.sid, code, message)
        session.send(error_event(code, message, event_id=event_id))

    # ------------------------------------------------------------------ client events
    async def _handle(self, session: ClientSession, event: Any) -> None:
        if isinstance(event, InputAudioBufferAppend):
            pcm = event.audio
            if len(pcm) % 2:
                raise ProtocolError("invalid_audio", f"PCM16 needs an even byte count, got {len(pcm)}")
            if not session.append_audio(pcm):
                raise ProtocolError("audio_buffer_full",
                                    f"more than {self.config.max_buffered_audio_s:.0f} s of audio waiting; dropped")
        elif isinstance(event, SessionUpdate):
            await self._update_session(session, event)
        elif isinstance(event, InputAudioBufferCommit):
            session.new_turn = session.started = True
            session.send({"type": "input_audio_buffer.committed", "event_id": event.event_id})
        elif isinstance(event, InputAudioBufferClear):
            session.audio.clear()
            session.send({"type": "input_audio_buffer.cleared", "event_id": event.event_id})
        elif isinstance(event, ConversationItemCreate):
            session.texts.append(event.text())
            session.started = True
            session.send({"type": "conversation.item.created", "event_id": event.event_id, "item": event.item})
        elif isinstance(event, ResponseCreate):
            session.new_turn = session.started = True
        elif isinstance(event, ResponseCancel):
            session.cancel = True
            if session.response_id:
                self._finish_response(session, "cancelled")

    async def _update_session(self, session: ClientSession, event: SessionUpdate) -> None:
        cfg = event.session
        if cfg.input_audio_format not in (None, "pcm16"):
            raise ProtocolError("unsupported_audio_format", f"input_audio_format {cfg.input_audio_format!r}; "
                                "only 'pcm16' (little-endian, mono) is supported")
        rate = cfg.sample_rate()
        if rate is not None and rate not in SUPPORTED_SAMPLE_RATES:
            raise ProtocolError("unsupported_sample_rate",
                                f"sample rate {rate} Hz; supported: {', '.join(map(str, SUPPORTED_SAMPLE_RATES))}")
        if cfg.mode not in (None, "turn", "free_running"):
            raise ProtocolError("invalid_mode", f"mode {cfg.mode!r}; use 'turn' or 'free_running'")
        mode = session.mode if cfg.mode is None else cfg.mode
        instructions = session.instructions if cfg.instructions is None else cfg.instructions
        if (mode, instructions) != (session.mode, session.instructions):
            if session.started:
                raise ProtocolError("session_started", "mode and instructions can change only before the first "
                                    "audio or text (they shape the conversation's pinned header)")
            await self._reopen(session, mode, instructions)
        if rate is not None and rate != session.sample_rate:
            session.audio.clear()  # buffered audio was at the old rate
            session.sample_rate = rate
        session.send({"type": "session.updated", "event_id": event.event_id, "session": self._session_view(session)})

    async def _reopen(self, session: ClientSession, mode: str, instructions: str) -> None:
        """Re-create the (still empty) worker session with a new mode / system prompt."""
        handle = next(h for h in self.pool.handles if h.address == session.worker_name)
        request = pb.OpenSessionRequest(sid=session.sid, mode=mode, instructions=instructions)
        try:
            await handle.stub.CloseSession(pb.CloseSessionRequest(sid=session.sid), timeout=5.0)
            opened = await handle.stub.OpenSession(request, timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            opened = pb.OpenSessionResponse(ok=False, error=f"worker unavailable: {exc.code().name}")
        if not opened.ok:
            session.close("session_failed")
            raise ProtocolError("session_failed", f"could not apply the update: {opened.error}")
        session.mode, session.instructions = mode, instructions

    def _session_view(self, session: ClientSession) -> dict[str, Any]:
        return {"id": session.sid, "object": "realtime.session", "model": self.config.model_name,
                "input_audio_format": "pcm16", "input_audio_sample_rate": session.sample_rate,
                "instructions": session.instructions, "mode": session.mode or "default",
                "budget_ms": self.config.budget_ms, "tokens_per_tick": self.config.tokens_per_tick}

    # ------------------------------------------------------------------ tick fan-out
    def _deliver(self, handle: WorkerHandle, session: ClientSession, out: pb.SessionOutput,
                 report: TickReport) -> None:
        if out.error:
            self._client_error(session, "session_failed", out.error)
        if out.transcript:
            # Adapters report whole utterances (the cascade transcribes VAD-delimited utterances), so each
            # transcript is final: a delta with all of it, then `completed`. A user turn that arrives while
            # a response streams ends that response (barge-in; the adapter closed the answer already).
            item_id = f"item_{uuid.uuid4().hex[:16]}"
            session.send({"type": "conversation.item.input_audio_transcription.delta", "item_id": item_id,
                          "content_index": 0, "delta": out.transcript})
            session.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                          "content_index": 0, "transcript": out.transcript})
            if session.response_id:
                self._finish_response(session, "completed" if session.mode == "free_running" else "cancelled")
        if out.text or out.tokens:
            if session.response_id is None:
                rid = session.start_response()
                session.send({"type": "response.created", "response": {"id": rid, "object": "realtime.response",
                                                                       "status": "in_progress"}})
            session.send({"type": "response.output_text.delta", "response_id": session.response_id,
                          "item_id": f"item_{session.response_id}", "output_index": 0, "content_index": 0,
                          "delta": out.text})
        if out.audio_pcm16:
            if session.response_id is None:
                rid = session.start_response()
                session.send({"type": "response.created", "response": {"id": rid, "object": "realtime.response",
                                                                       "status": "in_progress"}})
            session.send({"type": "response.output_audio.delta", "response_id": session.response_id,
                          "item_id": f"item_{session.response_id}", "output_index": 0, "content_index": 0,
                          "delta": base64.b64encode(out.audio_pcm16).decode("ascii"),
                          "sample_rate": out.audio_sample_rate})
        if out.finished and session.response_id:
            self._finish_response(session, "completed")
        session.send({"type": "metronome.tick", "tick": report.tick, "latency_ms": round(report.latency_ms, 3),
                      "budget_ms": self.config.budget_ms, "deadline_met": report.deadline_met,
                      "batch": report.batch, "drift_ms": round(report.drift_ms, 3), "preempted": out.preempted,
                      "input_dbfs": round(out.input_dbfs, 1), "input_clipping": round(out.input_clipping, 4)})

    def _finish_response(self, session: ClientSession, status: str) -> None:
        session.send({"type": "response.done", "response": {"id": session.response_id, "object": "realtime.response",
                                                            "status": status}})
        session.response_id = None

    def _worker_failed(self, handle: WorkerHandle, session: ClientSession, code: str) -> None:
        self._client_error(session, code, f"worker {handle.address} failed; this session has ended")
        session.close(code)


@dataclass
class GatewayServer:
    """A started gateway: ``url`` is where Realtime clients connect."""

    gateway: Gateway
    runner: web.AppRunner
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"ws://{self.address}/v1/realtime"

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_gateway(config: GatewayConfig) -> GatewayServer:
    """Start the gateway on the running loop and return at once (``port=0``: an ephemeral port)."""
    gateway = Gateway(config)
    runner = web.AppRunner(gateway.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return GatewayServer(gateway, runner, config.host, port)


def run_gateway(config: GatewayConfig) -> None:
    """Serve until interrupted, on uvloop."""
    import uvloop

    web.run_app(Gateway(config).app, host=config.host, port=config.port, print=None, access_log=None,
                loop=uvloop.new_event_loop())
