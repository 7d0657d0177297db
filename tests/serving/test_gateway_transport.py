"""The gateway's WebSocket transports over real sockets: framing, HTTP on the same port, ordering, backpressure.

Raw frames are written by hand here (fragmented messages, a stray continuation, a ping) so the server's
behaviour is tested without depending on what a client library chooses to send.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import grpc
import pytest
from aiohttp import web
from picows import WSMsgType

from metronome.config import GatewayConfig
from metronome.serving import protocol
from metronome.serving.gateway import ws_aiohttp, ws_picows
from metronome.serving.gateway.client_session import ClientSession, step_request_wire
from metronome.serving.gateway import Gateway, serve_gateway
from metronome.serving.metrics import GatewayMetrics
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc as pb_grpc
from metronome.serving.gateway.pool import WorkerHandle, WorkerPool
from metronome.serving.gateway.step_fit import fit_step
from metronome.serving.gateway.ws_aiohttp import AiohttpConnection
from metronome.serving.gateway.ws_picows import PicowsConnection
from tests.serving.test_gateway import BUDGET_MS, chunks, of_type, recv_until, running_gateway, start_worker, tone

MAX_MESSAGE = 4096  # the per-message limit in these tests; 4x this closes the socket


@pytest.fixture
async def worker(chat_checkpoint):
    handle = await start_worker(chat_checkpoint)
    yield handle
    await handle.stop()


# ------------------------------------------------------------------ a minimal client that writes raw frames
def frame(payload: bytes, opcode: int = 0x1, fin: bool = True) -> bytes:
    """One masked client frame (RFC 6455 section 5.2)."""
    n = len(payload)
    first = (0x80 if fin else 0) | opcode
    if n < 126:
        header = bytes([first, 0x80 | n])
    elif n < 1 << 16:
        header = bytes([first, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        header = bytes([first, 0x80 | 127]) + n.to_bytes(8, "big")
    mask = os.urandom(4)
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, addr: str, first_frames: bytes = b"", headers: str = "") -> RawClient:
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /v1/realtime HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n").encode()
                     + first_frames)  # frames in the same write as the handshake arrive with it
        status = await reader.readuntil(b"\r\n\r\n")
        assert b" 101 " in status.split(b"\r\n", 1)[0], status
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self, timeout: float = 10.0) -> tuple[int, bytes]:
        """The next (opcode, payload) from the server (which never masks)."""
        async with asyncio.timeout(timeout):
            head = await self.reader.readexactly(2)
            n = head[1] & 0x7F
            if n == 126:
                n = int.from_bytes(await self.reader.readexactly(2), "big")
            elif n == 127:
                n = int.from_bytes(await self.reader.readexactly(8), "big")
            return head[0] & 0x0F, await self.reader.readexactly(n)

    async def event(self, kind: str) -> list[dict]:
        """Text events up to and including the first of ``kind``."""
        seen = []
        while True:
            opcode, payload = await self.recv()
            assert opcode == 0x1, (opcode, payload)
            seen.append(json.loads(payload))
            if seen[-1]["type"] == kind:
                return seen

    async def close_frame(self) -> tuple[int, str]:
        """Skip text events until the server's close frame: (code, reason)."""
        while True:
            opcode, payload = await self.recv()
            if opcode == 0x8:
                return int.from_bytes(payload[:2], "big"), payload[2:].decode()

    def close(self) -> None:
        self.writer.close()


def append_event(seconds: float = 0.02) -> bytes:
    return json.dumps({"type": "input_audio_buffer.append", "audio": next(chunks(tone(seconds)))}).encode()


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


# ------------------------------------------------------------------ framing
async def test_a_fragmented_message_is_reassembled(worker):
    async with running_gateway([worker], max_message_bytes=MAX_MESSAGE) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        message = json.dumps({"type": "session.update", "session": {"input_audio_sample_rate": 16000},
                              "event_id": "frag"}).encode()
        parts = [message[:10], message[10:30], message[30:]]
        client.send(frame(parts[0], fin=False) + frame(parts[1], opcode=0x0, fin=False)
                    + frame(b"ping!", opcode=0x9)  # a control frame may come between fragments
                    + frame(parts[2], opcode=0x0))
        opcode, payload = await client.recv()
        assert (opcode, payload) == (0xA, b"ping!")  # the pong
        updated = (await client.event("session.updated"))[-1]
        assert updated["session"]["input_audio_sample_rate"] == 16000   # not the default: the update was whole
        client.send(frame(append_event()))
        await client.event("metronome.tick")
        client.close()


async def test_a_fragmented_message_over_the_abuse_limit_closes_with_1009(worker):
    async with running_gateway([worker], max_message_bytes=MAX_MESSAGE) as (gateway, addr):
        bystander = await RawClient.connect(addr)
        await bystander.event("session.created")
        client = await RawClient.connect(addr)
        await client.event("session.created")
        piece = b"x" * (2 * MAX_MESSAGE)
        client.send(frame(piece, fin=False) + frame(piece, opcode=0x0, fin=False) + frame(b"x", opcode=0x0))
        code, _ = await client.close_frame()
        assert code == 1009
        async with asyncio.timeout(5):
            while len(gateway.pool.handles[0].sessions) > 1:  # its worker session is released
                await asyncio.sleep(0.01)
        bystander.send(frame(append_event()))
        await bystander.event("metronome.tick")
        client.close()
        bystander.close()


async def test_a_message_between_the_limit_and_the_abuse_limit_gets_an_error_when_fragmented(worker):
    async with running_gateway([worker], max_message_bytes=MAX_MESSAGE) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        big = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (MAX_MESSAGE + 100)}).encode()
        client.send(frame(big[:100], fin=False) + frame(big[100:], opcode=0x0))
        assert (await client.event("error"))[-1]["error"]["code"] == "message_too_large"
        client.send(frame(append_event()))
        await client.event("metronome.tick")
        client.close()


async def test_a_continuation_without_a_message_is_a_protocol_error(worker):
    async with running_gateway([worker]) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        client.send(frame(b"{}", opcode=0x0))
        code, _ = await client.close_frame()
        assert code == 1002
        client.close()


async def test_binary_messages_whole_or_fragmented_get_an_error_and_the_session_lives_on(worker):
    async with running_gateway([worker]) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        client.send(frame(b"\x00\x01", opcode=0x2))
        assert (await client.event("error"))[-1]["error"]["code"] == "unsupported_frame"
        client.send(frame(b"\x00", opcode=0x2, fin=False) + frame(b"\x01", opcode=0x0))
        assert (await client.event("error"))[-1]["error"]["code"] == "unsupported_frame"
        client.send(frame(append_event()))
        await client.event("metronome.tick")
        client.close()


async def test_a_client_close_is_answered_and_frees_the_session(worker):
    async with running_gateway([worker]) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        assert len(gateway.pool.handles[0].sessions) == 1
        client.send(frame((1000).to_bytes(2, "big") + b"bye", opcode=0x8))
        code, _ = await client.close_frame()
        assert code == 1000
        async with asyncio.timeout(5):
            while gateway.pool.handles[0].sessions or gateway.connections:
                await asyncio.sleep(0.01)
        client.close()


# ------------------------------------------------------------------ ordering while the gateway awaits
async def test_events_sent_with_the_handshake_wait_for_the_session_and_keep_their_order(worker):
    async with running_gateway([worker]) as (gateway, addr):
        early = (frame(json.dumps({"type": "session.update", "session": {"mode": "free_running"},
                                   "event_id": "u1"}).encode())
                 + frame(json.dumps({"type": "conversation.item.create", "event_id": "c1", "item": {
                     "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}).encode()))
        client = await RawClient.connect(addr, first_frames=early)
        events = await client.event("conversation.item.created")
        kinds = [e["type"] for e in events]
        # session.created first, then the update (which re-opened the worker session), then the item.
        assert kinds.index("session.created") < kinds.index("session.updated") < kinds.index("conversation.item.created")
        assert not any(e["type"] == "error" for e in events)
        assert next(e for e in events if e["type"] == "session.updated")["session"]["mode"] == "free_running"
        client.close()


# ------------------------------------------------------------------ HTTP on the WebSocket port
async def test_get_endpoints_404_and_the_api_key_on_the_websocket_port(worker):
    async with running_gateway([worker], api_key="sekret") as (gateway, addr):
        loop = asyncio.get_running_loop()
        status, ctype, body = await loop.run_in_executor(None, http_get, f"http://{addr}/health")
        assert status == 200 and ctype.startswith("application/json") and json.loads(body)["status"] == "ok"
        status, _, body = await loop.run_in_executor(None, http_get, f"http://{addr}/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "metronome"
        status, ctype, body = await loop.run_in_executor(None, http_get, f"http://{addr}/metrics")
        assert status == 200 and ctype.startswith("text/plain") and b"metronome_sessions_live" in body
        status, _, _ = await loop.run_in_executor(None, http_get, f"http://{addr}/nope")
        assert status == 404
        # A plain GET of the Realtime path without the key: 401 with an OpenAI-style error body.
        status, _, body = await loop.run_in_executor(None, http_get, f"http://{addr}/v1/realtime?model=x")
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, body = await loop.run_in_executor(None, http_get, f"http://{addr}/metrics")
        assert b'metronome_sessions_rejected_total{reason="unauthorized"}' in body
        # With the key (and a query string, as the OpenAI SDK sends ?model=...) the upgrade succeeds.
        async with aiohttp.ClientSession() as http, http.ws_connect(
                f"ws://{addr}/v1/realtime?model=metronome", headers={"Authorization": "Bearer sekret"}) as ws:
            await recv_until(ws, of_type("session.created"))
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with aiohttp.ClientSession() as http:
                await http.ws_connect(f"ws://{addr}/v1/realtime", headers={"Authorization": "Basic sekret"})
        assert refused.value.status == 401


# ------------------------------------------------------------------ slow readers
class FakeTransport:
    """picows' WSTransport as far as PicowsConnection's send path uses it."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.closes: list[int] = []
        self.underlying_transport = self  # send_many writes pre-framed bytes straight to the socket
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def send(self, kind, data: bytes) -> None:
        self.frames.append(data)

    def send_close(self, code, reason: bytes) -> None:
        self.closes.append(code.value)

    def disconnect(self, graceful: bool = True) -> None:
        pass


async def test_a_backed_up_socket_queues_a_bounded_number_of_events_then_refuses():
    conn = PicowsConnection(app=None, max_frame_bytes=MAX_MESSAGE, send_queue_events=3)
    conn.transport = FakeTransport()
    assert conn.send(b"a")
    conn.pause_writing()  # the transport passed its high-water mark: the client is not reading
    assert conn.send(b"b") and conn.send(b"c") and conn.send(b"d")
    assert not conn.send(b"e")  # the queue is full: the gateway closes the session as slow_consumer
    assert conn.transport.frames == [b"a"]
    conn.resume_writing()  # drained below the low-water mark: the queue goes out, in order
    assert conn.transport.frames == [b"a", b"b", b"c", b"d"] and not conn.backlog
    assert conn.send_many([b"x", b"y" * 200])  # a tick's events: one write of back-to-back text frames
    assert conn.transport.written == [b"\x81\x01x" + b"\x81\x7e\x00\xc8" + b"y" * 200]
    conn.pause_writing()
    assert conn.send_many([b"1", b"2"]) and not conn.send_many([b"3", b"4"])  # all of a batch fits, or none
    assert list(conn.backlog) == [b"1", b"2"]
    conn.close(1008, "slow_consumer")
    assert conn.transport.closes == [1008] and conn.send(b"late") and conn.transport.frames[-1] == b"d"


async def test_a_client_that_stops_reading_is_closed_as_a_slow_consumer(worker):
    """End to end: a client that never reads, a tiny send queue, and a flood of error events for it."""
    async with running_gateway([worker], send_queue_events=8, max_messages_per_s=1e6) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        session = next(iter(gateway.pool.handles[0].sessions.values()))
        bad = frame(b"{not json" + b" " * 1000)  # each one answers with an error event (~100 bytes)
        async with asyncio.timeout(60):
            while not session.closed:
                client.send(bad * 200)
                await client.writer.drain()
                await asyncio.sleep(0)
        assert session.close_reason == "slow_consumer"
        client.close()


# ------------------------------------------------------------------ the aiohttp transport (Gateway.app)
@asynccontextmanager
async def aiohttp_gateway(config: GatewayConfig):
    """The gateway served through its aiohttp app (``Gateway.app``); yields (gateway, host:port)."""
    gateway = Gateway(config)
    runner = web.AppRunner(gateway.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield gateway, f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


async def test_the_aiohttp_transport_still_serves_sessions(worker):
    config = GatewayConfig(workers=(worker.address,), port=0, budget_ms=BUDGET_MS, tokens_per_tick=4,
                           max_message_bytes=MAX_MESSAGE, max_sessions=2)
    async with aiohttp_gateway(config) as (gateway, addr):
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(f"ws://{addr}/v1/realtime")
            await recv_until(ws, of_type("session.created"))
            await ws.send_str("{not json")
            assert (await recv_until(ws, of_type("error")))[-1]["error"]["code"] == "invalid_json"
            await ws.send_bytes(b"\x00")
            assert (await recv_until(ws, of_type("error")))[-1]["error"]["code"] == "unsupported_frame"
            await ws.send_json({"type": "session.update", "session": {"mode": "free_running"}})
            await recv_until(ws, of_type("session.updated"))
            await ws.send_json({"type": "input_audio_buffer.append", "audio": next(chunks(tone(0.02)))})
            await recv_until(ws, of_type("metronome.tick"))
            other = await http.ws_connect(f"ws://{addr}/v1/realtime")
            await recv_until(other, of_type("session.created"))
            refused = await http.ws_connect(f"ws://{addr}/v1/realtime")
            event = json.loads((await refused.receive()).data)
            assert event["error"]["type"] == "server_overloaded"
            await refused.receive()
            assert refused.close_code == 1013
            async with http.get(f"http://{addr}/health") as r:
                assert r.status == 200 and (await r.json())["workers"][0]["live"] == 2
            for sock in (ws, other, refused):
                await sock.close()


# ------------------------------------------------------------------ regressions: resources a client could hold forever
class RecordingWorker(pb_grpc.WorkerServicer):
    """A model-free worker that records which sessions are open on it (what a leak would leave behind).

    ``fail_steps``: status codes the next Steps abort with, one per Step. ``fail_streams``: status codes the
    next StreamSteps abort with when a message before their last arrives (mid-tick). ``streamed_audio``,
    ``last_audio``: per session, audio bytes received before a tick's last message and in it.
    """

    def __init__(self) -> None:
        self.open: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.fail_steps: list[grpc.StatusCode] = []
        self.fail_streams: list[grpc.StatusCode] = []
        self.steps = 0
        self.streamed_audio: dict[str, int] = {}
        self.last_audio: dict[str, int] = {}

    async def OpenSession(self, request, context):
        self.calls.append(("open", request.sid))
        self.open.add(request.sid)
        return pb.OpenSessionResponse(ok=True)

    async def CloseSession(self, request, context):
        self.calls.append(("close", request.sid))
        known = request.sid in self.open
        self.open.discard(request.sid)
        return pb.CloseSessionResponse(closed=known)

    async def Health(self, request, context):
        return pb.HealthResponse(ready=True, model="recording", budget_ms=BUDGET_MS, capacity_sessions=64,
                                 kv_blocks_total=64, sessions=len(self.open), input_sample_rate=16000)

    async def Step(self, request, context):
        self.steps += 1
        if self.fail_steps:
            await context.abort(self.fail_steps.pop(0), "injected")
        for inp in request.sessions:
            self.last_audio[inp.sid] = self.last_audio.get(inp.sid, 0) + len(inp.audio_pcm16)
        return pb.StepResponse(outputs=[pb.SessionOutput(sid=s.sid, tokens=[1], text=".") for s in request.sessions])

    async def StreamStep(self, request_iterator, context):
        streamed: dict[str, int] = {}
        async for message in request_iterator:
            if message.tick:   # the last message
                for sid, n in streamed.items():
                    if any(inp.sid == sid for inp in message.sessions):   # unnamed: dropped, as the worker does
                        self.streamed_audio[sid] = self.streamed_audio.get(sid, 0) + n
                await context.write(await self.Step(message, context))
                return
            if self.fail_streams:
                await context.abort(self.fail_streams.pop(0), "injected mid-tick")
            for inp in message.sessions:
                streamed[inp.sid] = streamed.get(inp.sid, 0) + len(inp.audio_pcm16)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no last message")


class StepOnlyWorker(RecordingWorker):
    """A worker from before StreamStep."""

    StreamStep = pb_grpc.WorkerServicer.StreamStep


@dataclass
class RecordingServer:
    servicer: RecordingWorker
    server: grpc.aio.Server
    address: str


async def serve_recording(servicer: RecordingWorker) -> RecordingServer:
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return RecordingServer(servicer, server, f"127.0.0.1:{port}")


@pytest.fixture
async def recording():
    served = await serve_recording(RecordingWorker())
    yield served
    await served.server.stop(0)


async def until(condition, timeout: float = 10.0) -> None:
    """Wait (polling the loop) until ``condition()`` holds; fail after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def non_reading_client(addr: str, first_frames: bytes = b"") -> RawClient:
    """A client with a tiny receive buffer; it reads only when the test says so (its reader stops at 64 KiB)."""
    host, port = addr.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /v1/realtime HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode() + first_frames)
    assert b" 101 " in (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n", 1)[0]
    return RawClient(reader, writer)


def backed_up(gateway: Gateway) -> PicowsConnection:
    """Fill the only connection's outgoing buffers (its client does not read): a graceful close cannot finish."""
    (conn,) = gateway.connections
    conn.transport.send(WSMsgType.TEXT, b"x" * (32 << 20))
    assert conn.transport.underlying_transport.get_write_buffer_size() > 0
    return conn


@pytest.mark.parametrize("how", ["close_frame", "oversized_frame"])
async def test_a_closing_client_that_does_not_read_is_aborted_and_its_sessions_freed(recording, monkeypatch, how):
    """Client-initiated closes (a Close frame) and picows' own (a frame over the limit) both end within a grace."""
    monkeypatch.setattr(ws_picows, "CLOSE_GRACE_S", 0.3)
    async with running_gateway([recording], max_message_bytes=MAX_MESSAGE) as (gateway, addr):
        client = await non_reading_client(addr)
        await client.event("session.created")
        conn = backed_up(gateway)
        if how == "close_frame":
            client.send(frame((1000).to_bytes(2, "big"), opcode=0x8))
        else:  # only the header of a frame far over 4x max_message_bytes: picows closes with 1009 itself
            client.send(bytes([0x81, 0x80 | 127]) + (1 << 20).to_bytes(8, "big") + b"mask")
        await client.writer.drain()
        await until(lambda: conn.closed)  # set as the close starts: nothing more is handled or sent
        await until(lambda: not gateway.connections and not gateway.pool.handles[0].sessions
                    and not recording.servicer.open)
        assert conn.gone
        client.writer.transport.abort()


async def test_an_exception_in_the_frame_handler_closes_the_socket_within_the_grace(recording, monkeypatch):
    monkeypatch.setattr(ws_picows, "CLOSE_GRACE_S", 0.3)
    async with running_gateway([recording]) as (gateway, addr):
        client = await non_reading_client(addr)
        await client.event("session.created")
        conn = backed_up(gateway)
        monkeypatch.setattr(gateway, "ws_binary", lambda conn: 1 / 0)
        client.send(frame(b"\x00", opcode=0x2))
        await until(lambda: not gateway.connections and not recording.servicer.open)
        assert conn.session.close_reason == "protocol_error"
        client.writer.transport.abort()


async def test_a_close_right_after_a_reopening_session_update_leaks_no_worker_session(recording):
    """session.update (new instructions: CloseSession + OpenSession on the worker) and a Close in one write."""
    async with running_gateway([recording]) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        update = json.dumps({"type": "session.update", "session": {"instructions": "be brief"}}).encode()
        later = json.dumps({"type": "input_audio_buffer.commit"}).encode()
        client.send(frame(update) + frame((1000).to_bytes(2, "big"), opcode=0x8) + frame(later))
        await until(lambda: not gateway.connections and not gateway._tasks)
        assert not recording.servicer.open, recording.servicer.calls
        assert [c for c, _ in recording.servicer.calls][-1] == "close"
        client.close()


BAD_ITEM = json.dumps({"type": "conversation.item.create", "item": {"content": 5}}).encode()
COMMIT = json.dumps({"type": "input_audio_buffer.commit", "event_id": "after"}).encode()


@pytest.mark.parametrize("held", [False, True])
async def test_an_item_whose_content_is_not_a_list_gets_an_error_and_the_session_lives_on(recording, held):
    """Direct, and held while OpenSession is in flight (sent with the handshake): reading must resume."""
    async with running_gateway([recording]) as (gateway, addr):
        client = await RawClient.connect(addr, first_frames=frame(BAD_ITEM) if held else b"")
        await client.event("session.created")
        if not held:
            client.send(frame(BAD_ITEM))
        assert (await client.event("error"))[-1]["error"]["code"] == "invalid_item"
        client.send(frame(COMMIT))
        assert (await client.event("input_audio_buffer.committed"))[-1]["event_id"] == "after"
        client.close()
        await until(lambda: not gateway.connections and not recording.servicer.open)


async def test_an_unexpected_exception_in_an_event_handler_is_an_internal_error_event(recording, monkeypatch):
    async with running_gateway([recording]) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        monkeypatch.setattr(gateway, "_handle", lambda *args: {}["boom"])
        client.send(frame(COMMIT))
        assert (await client.event("error"))[-1]["error"]["code"] == "internal_error"
        monkeypatch.undo()
        client.send(frame(COMMIT))
        assert (await client.event("input_audio_buffer.committed"))[-1]["event_id"] == "after"
        client.close()


def item_event(text: str, event_id: str) -> bytes:
    return json.dumps({"type": "conversation.item.create", "event_id": event_id,
                       "item": {"content": [{"type": "input_text", "text": text}]}}).encode()


async def test_text_per_tick_is_capped_and_a_long_item_is_echoed_cut(recording):
    async with running_gateway([recording], max_message_bytes=8192, max_text_bytes_per_tick=3000) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        client.send(frame(item_event("a" * 2000, "i1")) + frame(item_event("b" * 2000, "i2")))  # one read: one tick
        created = (await client.event("conversation.item.created"))[-1]
        assert created["event_id"] == "i1" and created["item"]["truncated"] is True
        assert created["item"]["content"][0]["text"] == "a" * protocol.ECHO_TEXT_CHARS
        assert (await client.event("error"))[-1]["error"]["code"] == "text_buffer_full"
        await client.event("metronome.tick")  # that tick took the text: the next one has room again
        client.send(frame(item_event("c" * 10, "i3")))
        created = (await client.event("conversation.item.created"))[-1]
        assert created["item"]["content"][0]["text"] == "c" * 10 and "truncated" not in created["item"]
        client.close()


def created_sid(gateway: Gateway) -> str:
    (sid,) = gateway.pool.handles[0].sessions
    return sid


class Quiet:
    """A client connection that takes every event."""

    def send(self, data):
        return True


def small_step_pool(sessions: int) -> tuple[GatewayConfig, WorkerPool, list[ClientSession]]:
    """A pool whose last message holds 1.3 MB, and sessions that may buffer 500 kB of text a tick."""
    config = GatewayConfig(port=0, max_text_bytes_per_tick=500_000, max_buffered_audio_s=1.0,
                           max_step_bytes=1_300_000)
    pool = WorkerPool(config, GatewayMetrics(config.budget_ms), lambda *a: None, lambda *a: None, lambda *a: None)
    return config, pool, [ClientSession(f"s{i}", "w", Quiet(), max_buffered_audio_s=1.0, max_messages_per_s=50.0,
                                        max_text_bytes=500_000) for i in range(sessions)]


async def test_a_step_takes_only_the_sessions_that_fit_and_the_rest_wait_their_turn():
    config, pool, sessions = small_step_pool(5)
    for s in sessions:
        assert s.append_text("x" * 400_000) and not s.append_text("x" * 200_000)
    ticked: set[str] = set()
    for tick in range(1, 4):
        waiting = [s for s in sessions if s.texts]
        if not waiting:
            break
        chosen = fit_step(waiting, tick, config.max_step_bytes)
        assert chosen and sum(s.tick_bytes for s in chosen) <= config.max_step_bytes
        for s in chosen:
            s.take_tick_wire()
            ticked.add(s.sid)
    assert ticked == {s.sid for s in sessions}  # everyone got through within a few ticks


async def test_a_session_left_out_of_the_last_message_keeps_what_it_streamed():
    """``fit_step`` leaves a session's remainder for a later tick; if it streamed input this tick, the last
    message still names it (with nothing more), so the worker uses that input instead of dropping it."""
    _, pool, sessions = small_step_pool(4)
    handle = WorkerHandle("127.0.0.1:1", grpc.aio.insecure_channel("127.0.0.1:1"), None)
    for s in sessions:
        assert s.append_audio(b"\x01\x00" * 800)
    streamed = pb.StepRequest.FromString(step_request_wire([s.take_stream_wire() for s in sessions], 0, 0))
    assert [len(i.audio_pcm16) for i in streamed.sessions] == [1600] * 4
    for s in sessions:
        assert s.append_text("x" * 400_000)   # four of these do not fit one message of 1.3 MB
    handle.ticks = 1
    wire, named = pool._last_message(handle, sessions)
    last = pb.StepRequest.FromString(wire)
    assert [s.sid for s in named] == [i.sid for i in last.sessions] == ["s0", "s1", "s2", "s3"]
    waiting = [s for s in sessions if s.texts]
    assert waiting and len(waiting) < 4
    for s in waiting:   # named with nothing more: its text waits, its streamed audio counts no longer
        entry = next(i for i in last.sessions if i.sid == s.sid)
        assert entry.text == "" and entry.audio_pcm16 == b"" and s.streamed_audio_bytes == 0
    await handle.channel.close()


async def test_a_stream_still_open_when_the_worker_has_no_stream_step_is_dropped_and_reported():
    _, pool, sessions = small_step_pool(2)
    handle = WorkerHandle("127.0.0.1:1", grpc.aio.insecure_channel("127.0.0.1:1"), None)
    assert sessions[0].append_audio(b"\x01\x00" * 100)
    sessions[0].take_stream_wire()                   # streamed on the open call, never to be read
    handle.stream = open_call = handle.stream_step_wire(timeout=5.0)
    handle.streams = False                            # the last tick found out the worker has no StreamStep
    call, named, lost = await pool._send_tick(handle, sessions)
    assert lost == [sessions[0]] and open_call.cancelled() and handle.stream is None
    assert sessions[0].streamed_audio_bytes == 0
    call.cancel()
    await handle.channel.close()


async def test_a_refused_step_keeps_the_sessions_and_a_failed_one_closes_them_on_the_worker(recording):
    async with running_gateway([recording]) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        recording.servicer.fail_steps = [grpc.StatusCode.RESOURCE_EXHAUSTED]
        client.send(frame(append_event()))
        assert (await client.event("error"))[-1]["error"]["code"] == "tick_failed"
        client.send(frame(append_event()))
        await client.event("metronome.tick")  # it lives on
        assert len(recording.servicer.open) == 1
        recording.servicer.fail_steps = [grpc.StatusCode.INTERNAL]
        client.send(frame(append_event()))
        assert (await client.event("error"))[-1]["error"]["code"] == "step_failed"
        await until(lambda: not recording.servicer.open)  # the gateway forgot it: it closed it on the worker
        client.close()


async def stream_until_the_worker_has_streamed_audio(client: RawClient, worker: RecordingWorker, sid: str,
                                                   ticks: int = 20) -> int:
    """Send one chunk a tick until some reached the worker before its tick's last message; returns the bytes
    sent. (A chunk that lands in the few ms before a tick goes in the last message instead.)"""
    sent = 0
    for _ in range(ticks):
        event = append_event()
        client.send(frame(event))
        sent += len(base64.b64decode(json.loads(event)["audio"]))
        await client.event("metronome.tick")
        if worker.streamed_audio.get(sid):
            return sent
    raise AssertionError(f"no audio was streamed in {ticks} ticks")


async def test_audio_is_streamed_to_the_worker_before_the_tick_and_none_is_lost(recording):
    async with running_gateway([recording], stream_interval_ms=5.0) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        sid = created_sid(gateway)
        sent = await stream_until_the_worker_has_streamed_audio(client, recording.servicer, sid)
        worker = recording.servicer
        await until(lambda: worker.streamed_audio.get(sid, 0) + worker.last_audio.get(sid, 0) == sent)
        client.close()


async def test_a_stream_that_fails_mid_tick_loses_that_input_only_and_the_session_lives(recording):
    async with running_gateway([recording], stream_interval_ms=5.0) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        recording.servicer.fail_streams = [grpc.StatusCode.RESOURCE_EXHAUSTED]
        events: list[dict] = []
        for _ in range(20):   # until a chunk is streamed mid-tick (one landing just before a tick is not)
            client.send(frame(append_event()))
            events = await client.event("metronome.tick")
            if not recording.servicer.fail_streams:
                break
        assert not recording.servicer.fail_streams
        # Whether the gateway saw the abort on a mid-tick write or on the tick's last message, the input is
        # reported lost and the session stays.
        if not any(e["type"] == "error" for e in events):
            events = await client.event("error")
        assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["tick_failed"]
        client.send(frame(append_event()))
        await client.event("metronome.tick")   # later ticks carry on
        assert recording.servicer.open
        client.close()


async def test_a_worker_without_stream_step_gets_one_step_a_tick():
    old = await serve_recording(StepOnlyWorker())
    try:
        async with running_gateway([old]) as (gateway, addr):
            client = await RawClient.connect(addr)
            await client.event("session.created")
            client.send(frame(append_event()))
            assert (await client.event("error"))[-1]["error"]["code"] == "tick_failed"   # the tick it found out on
            client.send(frame(append_event()))
            await client.event("metronome.tick")
            assert old.servicer.steps >= 1 and not gateway.pool.handles[0].streams
            client.close()
    finally:
        await old.server.stop(0)


class SpeechAheadWorker(RecordingWorker):
    """Answers its first tick with text, held back until the next tick's stream has sent that answer's speech
    ahead (``speech_only``, at its first message, which the gateway marks ``speech_ahead``): a gateway that
    handed speech out as it came would have it before the answer it belongs to."""

    SPEECH = b"\x01\x02" * 240

    def __init__(self) -> None:
        super().__init__()
        self.streams = 0
        self.speech_sent = asyncio.Event()

    async def StreamStep(self, request_iterator, context):
        self.streams += 1
        stream, last = self.streams, None
        async for message in request_iterator:
            if stream == 2 and message.speech_ahead and not self.speech_sent.is_set():   # the gateway takes it
                await context.write(pb.StepResponse(speech_only=True, outputs=[
                    pb.SessionOutput(sid=inp.sid, audio_pcm16=self.SPEECH, audio_sample_rate=24000,
                                     audio_transcript="Hi.") for inp in message.sessions]))
                self.speech_sent.set()
            last = message
        if stream == 1:
            await self.speech_sent.wait()
        await context.write(pb.StepResponse(outputs=[
            pb.SessionOutput(sid=inp.sid, tokens=[1] if stream == 1 else [], text="Hi." if stream == 1 else "",
                             finished=stream == 2) for inp in last.sessions]))


async def test_speech_sent_ahead_of_a_tick_is_handed_out_after_the_tick_before():
    worker = await serve_recording(SpeechAheadWorker())
    try:
        async with running_gateway([worker]) as (gateway, addr), aiohttp.ClientSession() as http:
            async with http.ws_connect(f"ws://{addr}/v1/realtime") as ws:
                await recv_until(ws, of_type("session.created"))

                async def talk():   # audio keeps streaming, so each tick's stream opens before its last message
                    for chunk in chunks(tone(5.0)):
                        await ws.send_json({"type": "input_audio_buffer.append", "audio": chunk})
                        await asyncio.sleep(0.02)

                talking = asyncio.ensure_future(talk())
                try:
                    events = await recv_until(ws, of_type("response.done"), timeout=20)
                finally:
                    talking.cancel()
        kinds = [e["type"] for e in events if e["type"].startswith("response.")]
        assert kinds.index("response.output_text.delta") < kinds.index("response.output_audio.delta") \
            < kinds.index("response.done")
        delta = next(e for e in events if e["type"] == "response.output_audio.delta")
        assert base64.b64decode(delta["delta"]) == SpeechAheadWorker.SPEECH
        assert [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"] == ["Hi."]
    finally:
        await worker.server.stop(0)


async def test_an_exception_in_a_tick_fails_that_tick_and_the_ticker_goes_on(recording, monkeypatch):
    async with running_gateway([recording]) as (gateway, addr):
        client = await RawClient.connect(addr)
        await client.event("session.created")
        session = gateway.pool.handles[0].sessions[created_sid(gateway)]
        monkeypatch.setattr(session, "take_tick_wire", lambda: 1 / 0)
        client.send(frame(append_event()))
        assert (await client.event("error"))[-1]["error"]["code"] == "step_failed"
        await until(lambda: not recording.servicer.open)
        other = await RawClient.connect(addr)
        await other.event("session.created")
        other.send(frame(append_event()))
        await other.event("metronome.tick")
        client.close()
        other.close()


async def test_the_backlog_of_a_backed_up_socket_is_bounded_in_bytes():
    conn = PicowsConnection(app=None, max_frame_bytes=MAX_MESSAGE, send_queue_events=100, send_queue_bytes=100)
    conn.transport = FakeTransport()
    conn.pause_writing()
    assert conn.send(b"a" * 60) and not conn.send(b"b" * 60)
    assert not conn.send_many([b"c" * 20, b"d" * 30]) and conn.send_many([b"e" * 20, b"f" * 20])
    assert conn.backlog_bytes == 100
    conn.resume_writing()
    assert conn.backlog_bytes == 0 and conn.send(b"g" * 60)
    aio = AiohttpConnection(ws=None, send_queue_events=100, send_queue_bytes=100)
    assert aio.send(b"a" * 60) and not aio.send(b"b" * 60) and not aio.send_many([b"c" * 20, b"d" * 30])
    assert aio.send_many([b"e" * 20, b"f" * 20]) and aio.queued_bytes == 100


async def test_the_aiohttp_transport_frees_a_slow_consumer_that_never_reads(recording, monkeypatch):
    monkeypatch.setattr(ws_aiohttp, "CLOSE_GRACE_S", 0.3, raising=False)
    config = GatewayConfig(workers=(recording.address,), port=0, budget_ms=BUDGET_MS, send_queue_events=8,
                           max_messages_per_s=1e6)
    async with aiohttp_gateway(config) as (gateway, addr):
        client = await non_reading_client(addr)
        await client.event("session.created")
        session = next(iter(gateway.pool.handles[0].sessions.values()))
        bad = frame(b"{not json" + b" " * 1000)
        async with asyncio.timeout(60):
            while not session.closed:
                client.send(bad * 200)
                await client.writer.drain()
                await asyncio.sleep(0)
        assert session.close_reason == "slow_consumer"
        await until(lambda: not gateway.connections and not recording.servicer.open)
        client.writer.transport.abort()


async def test_a_non_ascii_authorization_header_is_a_401(recording):
    async with running_gateway([recording], api_key="sekret") as (gateway, addr):
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                      "Authorization: Bearer s\xe9kret\r\n\r\n").encode("latin-1"))
        status = (await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).decode()
        assert " 401 " in status, status
        writer.close()


async def test_stopping_the_gateway_closes_every_session_on_the_worker(recording):
    config = GatewayConfig(workers=(recording.address,), port=0, budget_ms=BUDGET_MS)
    server = await serve_gateway(config)
    clients = [await RawClient.connect(server.address) for _ in range(3)]
    for client in clients:
        await client.event("session.created")
    assert len(recording.servicer.open) == 3
    await server.stop()
    assert not recording.servicer.open
    for client in clients:  # the sockets end after the stop: nothing may be spawned on the closed channels
        await client.close_frame()
        client.close()
    assert not server.gateway._tasks


@pytest.mark.parametrize("transport", ["picows", "aiohttp"])
async def test_a_browser_sends_the_api_key_as_a_subprotocol_and_gets_realtime_echoed(worker, transport):
    config = GatewayConfig(workers=(worker.address,), port=0, budget_ms=BUDGET_MS, tokens_per_tick=4, api_key="sekret")
    serving = running_gateway([worker], api_key="sekret") if transport == "picows" else aiohttp_gateway(config)
    async with serving as (gateway, addr), aiohttp.ClientSession() as http:
        # As OpenAI's browser clients: new WebSocket(url, ["realtime", "openai-insecure-api-key." + key]).
        async with http.ws_connect(f"ws://{addr}/v1/realtime",
                                   protocols=("realtime", "openai-insecure-api-key.sekret")) as ws:
            assert ws.protocol == "realtime"
            await recv_until(ws, of_type("session.created"))
        for offered in [("realtime", "openai-insecure-api-key.wrong"), ("realtime",)]:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(f"ws://{addr}/v1/realtime", protocols=offered)
            assert refused.value.status == 401
