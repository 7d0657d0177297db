"""The gRPC ``Worker`` service of ``proto/worker.proto`` over one ``TickCore``, and the server that runs it.

Threading: the engine and the adapter are synchronous and not thread-safe, so EVERY call into the tick
core (OpenSession, CloseSession, Step, a StreamStep once its last message is in) runs on one dedicated
thread, a ``ThreadPoolExecutor(max_workers=1)`` awaited through ``loop.run_in_executor``. The asyncio
loop only moves bytes and never blocks; two Step RPCs that arrive together run one after the other.
Health answers at once from the core's snapshot, so it does not wait behind a running step.

StreamStep (what the gateway uses) is a tick whose input is sent as it arrives: the event loop files each
message's bytes by session (``StreamedTick``) while the engine thread still runs the previous tick, so
the tick's critical path keeps only the last message's transfer and the join. An adapter that hears early
(the cascade) gets each message's audio as it comes, on the engine thread between ticks, in order with the
same gateway's ticks: its VAD finds the end of an utterance without waiting for the tick. Speech an adapter
finishes between ticks (the cascade's synthesis thread) goes out on the open StreamStep as soon as it is ready,
ahead of that tick's own answer, instead of waiting for the tick. Only an unexpected exception fails an RPC
(``INTERNAL``); the worker stays up.

Typed text and instructions are counted in tokens on a thread of their own before the engine thread
sees them (``budget.py``): over the limit, they are refused there. With ``WorkerConfig.auth_token`` set,
every RPC must carry the token (``auth.py``).

Admission is the worker's own (``admission.py``): OpenSession answers ok or refused with the reason
("memory", "latency cap", "draining"), and every tick's latency, from its last message to its answer,
feeds the worker's AIMD controller. SIGTERM drains (``WorkerServer.drain``): no more admissions, the
standard gRPC health service (what Kubernetes' grpc probes ask) says NOT_SERVING, live sessions run for
``drain_grace_s``, then the worker stops and gateways end what is left as ``worker_draining``.

>>> handle = await serve_worker(WorkerConfig(EngineConfig(model=ckpt, num_blocks=256), port=0))   # doctest: +SKIP
>>> channel = grpc.aio.insecure_channel(handle.address)                            # doctest: +SKIP
>>> stub = worker_pb2_grpc.WorkerStub(channel)                                     # doctest: +SKIP
>>> (await stub.OpenSession(worker_pb2.OpenSessionRequest(sid="a", mode="free_running"))).ok  # doctest: +SKIP
True
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1.health import aio as grpc_health   # the asyncio servicer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from metronome import Engine
from metronome.audio.adapter import InteractionAdapter
from metronome.serving.auth import TokenCheck
from metronome.serving.gc_pauses import freeze_startup_heap
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc
from metronome.serving.worker.admission import WorkerAdmission
from metronome.serving.worker.budget import InputBudget
from metronome.serving.worker.config import WorkerConfig, make_adapter, policy_name
from metronome.serving.worker.tick import StreamedTick, TickCore

log = logging.getLogger(__name__)


@dataclass
class _Opening:
    """One admitted OpenSession while it counts towards the sessions being opened."""

    counted: bool = True


@dataclass
class _SpeechOut:
    """A StreamStep's speech sent between ticks: ``wake`` is set when speech may be ready (or the stream named
    new sessions), ``sids`` are the sessions the stream carried input for."""

    wake: asyncio.Event
    sids: set[str] = field(default_factory=set)

    def add(self, sids: Iterable[str]) -> None:
        before = len(self.sids)
        self.sids.update(sids)
        if len(self.sids) > before:
            self.wake.set()   # speech already ready for them goes at once


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """The RPC handlers: every call into the tick core goes through ``executor`` (one thread)."""

    def __init__(self, engine: Engine, adapter: InteractionAdapter, config: WorkerConfig,
                 executor: ThreadPoolExecutor) -> None:
        self.core = TickCore(engine, adapter, config)
        self.config = config
        self._executor = executor
        self.budget = InputBudget(engine.tokenizer, config.max_input_tokens, config.max_instruction_tokens)
        self.admission = WorkerAdmission(config.aimd, engine.stats().capacity, config.max_sessions)
        # OpenSession calls admitted and not yet opened by the engine thread, which takes each off as it opens
        # it: counted once, never both here and in the core while the answer is on its way back to the loop.
        # A call given up before the engine thread ran it is taken off by the loop (``_Opening``).
        self._opening = 0
        self._opening_lock = threading.Lock()
        self._streams: dict[str, asyncio.Future] = {}   # peer -> its latest StreamStep, done once its tick is queued
        self._speech_waiters: set[asyncio.Event] | None = None   # open StreamSteps' wake-ups (``listen_for_speech``)

    @property
    def engine(self) -> Engine:
        return self.core.engine

    @property
    def adapter(self) -> InteractionAdapter:
        return self.core.adapter

    async def OpenSession(self, request, context):
        why = await self.budget.instructions_refusal(request.instructions)
        if why is not None:
            log.info("session %s refused: %s", request.sid, why)
            return pb.OpenSessionResponse(ok=False, error=why)
        if request.replace or self.core.is_open(request.sid):   # not an admission: the core answers it
            return await self._on_engine_thread(context, "OpenSession", self.core.open, request)
        # Decided and counted with no await between: concurrent gateways cannot both take the last slot.
        with self._opening_lock:
            refused = self.admission.refusal(self.live_sessions, request.gateway_admits)
            if refused is None:
                self._opening += 1
        if refused is not None:
            why = self.admission.explain(refused)
            log.info("session %s refused: %s", request.sid, why)
            return self._answer(pb.OpenSessionResponse(ok=False, error=why, refused=refused))
        opening = _Opening()
        try:
            opened = await self._on_engine_thread(context, "OpenSession", self._open_admitted, request, opening)
        except asyncio.CancelledError:
            # The caller gave up (its deadline passed behind a long tick): a session opened for nobody would
            # hold its reservation for good, so it is closed (closing is idempotent: it may never have opened).
            self._executor.submit(self.core.close, request.sid)
            raise
        finally:
            self._uncount(opening)
        return self._answer(opened)

    @property
    def live_sessions(self) -> int:
        """Sessions open on the engine and admitted on their way to it (what admission counts)."""
        return self.core.sessions + self._opening

    def _open_admitted(self, request: pb.OpenSessionRequest, opening: _Opening) -> pb.OpenSessionResponse:
        """Engine thread: open an admitted session; it leaves the admitted count as it enters the core's."""
        try:
            return self.core.open(request)
        finally:
            self._uncount(opening)

    def _uncount(self, opening: _Opening) -> None:
        """Take an admitted call off the opening count, once, from whichever thread comes first."""
        with self._opening_lock:
            if opening.counted:
                opening.counted = False
                self._opening -= 1

    def _answer(self, response: pb.OpenSessionResponse) -> pb.OpenSessionResponse:
        response.admission_cap, response.sessions = self.admission.cap, self.core.sessions
        return response

    async def CloseSession(self, request, context):
        return await self._on_engine_thread(context, "CloseSession", self.core.close, request.sid)

    async def Step(self, request, context):
        tally: dict[str, int] = {}
        await self.budget.charge(tally, ((inp.sid, inp.text) for inp in request.sessions))
        return self._observed(await self._timed(context, "Step", request, None, tally))

    async def StreamStep(self, request_iterator, context):
        """One tick whose input arrives over the frame period; the last message is the Step request proper.

        With an adapter that hears early, each message is handed to the engine thread as it comes (``hear``),
        after the same gateway's previous tick was queued there: audio stays in the order it was sent. Speech
        the adapter finishes while the input streams in goes out at once (``speech_only`` answers), for the
        sessions this stream carries input for; the tick's own answer comes last."""
        streamed = StreamedTick(heard=self.adapter.hears_early)
        speech = _SpeechOut(asyncio.Event()) if self._speech_waiters is not None else None
        previous, queued = self._in_turn(context.peer()) if streamed.heard or speech else (None, None)
        reading = asyncio.ensure_future(self._read_tick(request_iterator, context, streamed, previous, speech))
        speaking = asyncio.ensure_future(self._send_speech(reading, context, speech, previous)) if speech else None
        try:
            last = await reading
            # Queued (and timed) at once: a take of speech in flight was queued on the engine thread before it.
            timed = await self._timed(context, "StreamStep", last, streamed, streamed.text_tokens, queued)
            if speaking is not None:
                await speaking   # its answers go ahead of the tick's
            await context.write(self._observed(timed))
        finally:
            reading.cancel()
            if speaking is not None:
                speaking.cancel()
            if queued is not None and not queued.done():
                queued.set_result(None)

    async def _read_tick(self, request_iterator, context, streamed: StreamedTick, previous: asyncio.Future | None,
                         speech: _SpeechOut | None) -> pb.StepRequest:
        """A StreamStep's messages, filed (and heard, for an adapter that hears early) as they come; returns the
        last, once the same gateway's previous tick is queued on the engine thread."""
        try:
            return await self._read_messages(request_iterator, context, streamed, previous, speech)
        finally:
            if speech is not None:
                speech.wake.set()   # the tick's input is in (or lost): no more speech goes ahead of it

    async def _read_messages(self, request_iterator, context, streamed: StreamedTick,
                             previous: asyncio.Future | None, speech: _SpeechOut | None) -> pb.StepRequest:
        last = None
        async for message in request_iterator:
            if last is not None and streamed.add(last) > self.config.max_message_bytes:
                log.warning("a streamed tick passed %d bytes; its input is dropped", self.config.max_message_bytes)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"the tick's streamed input exceeds {self.config.max_message_bytes} bytes")
            # Each message's text is counted as it arrives, while the tick's later input still streams in:
            # only text in the tick's last message is counted on the tick's critical path.
            await self.budget.charge(streamed.text_tokens, ((inp.sid, inp.text) for inp in message.sessions))
            if streamed.heard:
                if previous is not None:
                    await asyncio.shield(previous)
                    previous = None
                self._executor.submit(self._hear, message)
            if speech is not None and message.speech_ahead and not (message.tick or message.tokens_per_tick):
                # A piece streamed ahead by a gateway that takes speech before the tick's answer: its sessions'
                # speech may go now. The tick hands out the rest itself.
                speech.add(inp.sid for inp in message.sessions)
            last = message
        if last is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a StreamStep needs at least its last message")
        if previous is not None:
            await asyncio.shield(previous)
        return last

    async def _send_speech(self, reading: asyncio.Future, context, speech: _SpeechOut,
                           previous: asyncio.Future | None) -> None:
        """Until the tick's input is all in: speech ready for the sessions that sent input on this stream, sent
        as it comes. It is taken on the engine thread after the gateway's previous tick was queued there, so it
        follows that tick's answer."""
        self._speech_waiters.add(speech.wake)
        try:
            while True:
                await speech.wake.wait()   # set also once the input is all in (``_read_tick``)
                if reading.done():
                    return
                speech.wake.clear()
                if previous is not None:
                    await asyncio.shield(previous)
                    previous = None
                # Checked again with no await until the take is queued: once the tick is queued, its answer
                # hands out the speech (a take behind it would send audio out of order).
                if reading.done():
                    return
                if not speech.sids:
                    continue
                taken = await self._on_engine_thread(context, "StreamStep", self.core.speech_between_ticks,
                                                     list(speech.sids))
                if taken.outputs:
                    try:
                        await context.write(taken)
                    except BaseException:
                        # Taken from the adapter, so the next tick will not send it again.
                        log.warning("speech ready between ticks for %d sessions was lost with its stream",
                                    len(taken.outputs))
                        raise
        finally:
            self._speech_waiters.discard(speech.wake)

    def listen_for_speech(self, loop: asyncio.AbstractEventLoop) -> None:
        """Have the adapter wake the open StreamSteps (on ``loop``) when speech is ready between ticks."""
        self._speech_waiters = set()

        def wake_all() -> None:
            for wake in self._speech_waiters:
                wake.set()

        self.adapter.on_speech_ready(lambda: loop.call_soon_threadsafe(wake_all))

    def _in_turn(self, peer: str) -> tuple[asyncio.Future | None, asyncio.Future]:
        """The future of the peer's previous StreamStep (done once its tick is queued on the engine thread) and
        this one's. A gateway opens a tick's stream after it sent the last one's end, so they start in order."""
        previous = self._streams.get(peer)
        queued = self._streams[peer] = asyncio.get_running_loop().create_future()
        queued.add_done_callback(lambda f: self._streams.pop(peer, None) if self._streams.get(peer) is f else None)
        return (previous if previous is not None and not previous.done() else None), queued

    def _hear(self, message: pb.StepRequest) -> None:
        """Engine thread: one streamed message for an adapter that hears early (the tick reports its problems)."""
        try:
            self.core.hear(message)
        except Exception:  # noqa: BLE001 - a bug here must not take the engine thread's later work with it
            log.exception("hearing a streamed message failed")

    async def _timed(self, context, what: str, request, streamed, tally,
                     queued: asyncio.Future | None = None) -> tuple[pb.StepResponse, float]:
        """The tick on the engine thread, and its latency here: the wait behind other gateways' ticks included.
        ``queued`` is set once the tick is in the engine thread's queue."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        pending = loop.run_in_executor(self._executor, self.core.step, request, streamed, self.budget.refusals(tally))
        if queued is not None:
            queued.set_result(None)
        response = await self._engine_result(context, what, pending)
        return response, (loop.time() - started) * 1e3

    def _observed(self, timed: tuple[pb.StepResponse, float]) -> pb.StepResponse:
        response, latency_ms = timed
        if response.outputs:   # a tick with no session says nothing about load
            self.admission.observe(latency_ms, self.core.sessions)
        response.draining = self.admission.draining
        return response

    async def Health(self, request, context):
        health = pb.HealthResponse()
        health.CopyFrom(self.core.health)
        health.admission_cap, health.draining = self.admission.cap, self.admission.draining
        return health

    async def _on_engine_thread(self, context, what: str, fn, *args):
        return await self._engine_result(context, what,
                                         asyncio.get_running_loop().run_in_executor(self._executor, fn, *args))

    @staticmethod
    async def _engine_result(context, what: str, pending: asyncio.Future):
        try:
            return await pending
        except Exception as exc:  # noqa: BLE001 - any bug must become a clean RPC error, not a dead worker
            log.exception("%s failed", what)
            await context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(exc).__name__}: {exc}")

    def close_all(self) -> None:
        """Close every session (shutdown). Engine thread only."""
        self.core.close_all()


@dataclass
class WorkerServer:
    """A started worker: the gRPC server, the port it is bound to, and the service (for introspection)."""

    server: grpc.aio.Server
    port: int
    host: str
    service: WorkerService
    executor: ThreadPoolExecutor
    health: grpc_health.HealthServicer

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def drain(self, grace_s: float, poll_s: float = 0.1) -> None:
        """Admit nothing more and tell the probes; return once no session is open or ``grace_s`` has passed."""
        self.service.admission.draining = True
        await self.health.enter_graceful_shutdown()   # every service NOT_SERVING from here on
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        log.info("draining: %d sessions open, up to %g s for them to end", self.service.core.sessions, grace_s)
        while self.service.core.sessions and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        if self.service.core.sessions:
            log.info("drain grace over: closing %d sessions", self.service.core.sessions)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving, close every session (their KV returns to the pool), release the engine thread."""
        await self.server.stop(grace)
        await asyncio.get_running_loop().run_in_executor(self.executor, self.service.close_all)
        self.executor.shutdown(wait=False)
        self.service.budget.shutdown()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def serve_worker(config: WorkerConfig, *, engine: Engine | None = None,
                       adapter: InteractionAdapter | None = None) -> WorkerServer:
    """Build the engine and adapter (on the engine thread) unless given, bind, start; returns at once.

    A given ``engine`` brings its own EngineConfig (the engine fields of ``config`` are then unused).
    """
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metronome-engine")
    loop = asyncio.get_running_loop()
    try:
        if engine is None:
            engine = await loop.run_in_executor(executor, Engine, config.engine)
        if adapter is None:
            adapter = await loop.run_in_executor(executor, make_adapter, config, engine)
        service = WorkerService(engine, adapter, config, executor)
        if adapter.speaks_between_ticks:
            service.listen_for_speech(loop)
        size = config.max_message_bytes
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", size),
                                          ("grpc.max_send_message_length", size)],
                                 interceptors=[TokenCheck(config.auth_token)] if config.auth_token else None)
        worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
        health = grpc_health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port(f"{config.host}:{config.port}")
        if port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        await server.start()
    except BaseException:
        executor.shutdown(wait=False)
        raise
    stats = engine.stats()
    if not config.auth_token:
        log.warning("worker on %s:%d takes RPCs from anyone who can reach it (no worker token set)",
                    config.host, port)
    log.info("worker on %s:%d: %s, %s, capacity %d sessions, budget %g ms, adapter %s",
             config.host, port, engine.config.model, policy_name(engine.config.policy), stats.capacity,
             config.budget_ms, adapter.name)
    return WorkerServer(server, port, config.host, service, executor, health)


def run_worker(config: WorkerConfig) -> None:
    """Serve until SIGINT or SIGTERM (the CLI's entry point); SIGTERM drains first (``drain_grace_s``). What is
    left is closed on the way out."""

    async def main() -> None:
        handle = await serve_worker(config)
        freeze_startup_heap()
        stop = asyncio.Event()
        signals: list[signal.Signals] = []
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, lambda sig=sig: (signals.append(sig), stop.set()))
            except (NotImplementedError, RuntimeError):  # not the main thread / not supported here
                pass
        waiter = asyncio.ensure_future(handle.wait_for_termination())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if signals and signals[0] == signal.SIGTERM:   # Kubernetes' stop; SIGINT (Ctrl-C) stops at once
            await handle.drain(config.drain_grace_s)
        await handle.stop(grace=1.0)

    asyncio.run(main())
