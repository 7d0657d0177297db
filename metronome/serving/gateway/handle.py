"""The gateway's view of one worker: its connection, health, admission view and the tick in flight.

Under worker admission (the default) the worker owns its cap: the handle keeps what the worker last said
(``worker_cap``, ``worker_sessions``: sessions from every gateway) to place sessions by headroom, and
the worker has the last word at OpenSession. Under gateway admission ``controller`` is this gateway's
own, per worker (the paper's arrangement).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from metronome.serving.admission import AimdController, PaperAimdController
from metronome.serving.gateway.client_session import ClientSession
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc as pb_grpc

FILL_SAMPLES = 120  # ticks of KV usage behind the live time-to-wall estimate


@dataclass
class TickReport:
    tick: int
    latency_ms: float
    drift_ms: float
    deadline_met: bool
    batch: int
    engine_ms: float = 0.0     # the worker's engine time (prefill + decode) within latency_ms
    frontend_ms: float = 0.0   # the worker's audio front end within latency_ms
    worker_ms: float = 0.0     # the whole Step in the worker; latency_ms - worker_ms is transport and gateway
    kv_blocks_used: int = 0    # the worker's KV pool after the tick
    kv_blocks_total: int = 0


@dataclass
class TickCall:
    """A tick's RPC: ``rpc`` (cancel it to give up on the tick) and ``answer``, awaited for the tick's own
    StepResponse (a StreamStep's reader, which hands out the speech the worker sends ahead of it)."""

    rpc: grpc.aio.Call
    answer: Awaitable[pb.StepResponse]

    def cancel(self) -> None:
        self.rpc.cancel()
        if isinstance(self.answer, asyncio.Future):
            self.answer.cancel()


@dataclass
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub
    metadata: tuple[tuple[str, str], ...] = ()   # on every call: the worker token (``serving/auth.py``)
    # StreamStep (and Step, for a worker without it) with requests already in wire format (``step_request_wire``):
    # a tick can carry tens of MB of audio, and building it as messages would copy all of it once more.
    step_wire: Callable = field(init=False, repr=False)
    stream_step_wire: Callable = field(init=False, repr=False)
    controller: AimdController | PaperAimdController | None = None  # gateway admission: made once capacity is known
    worker_cap: int = 0              # worker admission: the cap the worker last reported
    static_cap: int | None = None    # ... and the operator's (``GatewayConfig.max_sessions``) under it
    worker_sessions: int = 0         # ... and the sessions open on it, from every gateway
    draining: bool = False           # the worker said it is stopping: nothing new goes to it
    retired: bool = False            # gone from discovery: nothing new goes to it; dropped once its sessions end
    tasks: list[asyncio.Task] = field(default_factory=list)   # its health loop and ticker
    sessions: dict[str, ClientSession] = field(default_factory=dict)
    pending: int = 0                 # admitted at the gateway, OpenSession in flight
    healthy: bool = False
    refused: str = ""                # why the pool does not use this worker (its B differs); "" when it does
    health: pb.HealthResponse | None = None
    ticks: int = 0
    last_tick: TickReport | None = None
    kv_fill: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=FILL_SAMPLES))

    # The next tick's StreamStep, open from the first input streamed to it until the tick's last message.
    stream: TickCall | None = None
    streamed_bytes: int = 0          # input written to ``stream`` so far
    stream_broken: bool = False      # a write to ``stream`` failed: nothing more goes on it
    streams: bool = True             # False: the worker has no StreamStep (an older one), so one Step a tick
    tick_task: asyncio.Task | None = None   # the last tick, until its response is handled

    def __post_init__(self) -> None:
        self.step_wire = self.channel.unary_unary(
            "/metronome.worker.v1.Worker/Step", request_serializer=None,
            response_deserializer=pb.StepResponse.FromString)
        self.stream_step_wire = self.channel.stream_stream(
            "/metronome.worker.v1.Worker/StreamStep", request_serializer=None,
            response_deserializer=pb.StepResponse.FromString)

    def take_stream(self) -> TickCall | None:
        """The open stream, now owned by the caller; the next input opens a new one."""
        call, self.stream, self.streamed_bytes, self.stream_broken = self.stream, None, 0, False
        return call

    async def stop_tasks(self) -> None:
        """Stop its health loop and ticker, and the tick and stream in flight (the channel stays open)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if (call := self.take_stream()) is not None:
            call.cancel()
        if self.tick_task is not None:
            self.tick_task.cancel()

    @property
    def live(self) -> int:
        """Sessions on the worker as far as this gateway knows, those being opened included."""
        mine = len(self.sessions) + self.pending
        return mine if self.controller else max(self.worker_sessions + self.pending, mine)

    @property
    def memory_capacity(self) -> int:
        return self.health.capacity_sessions if self.health else 0

    @property
    def cap(self) -> int:
        if self.controller is not None:
            return self.controller.cap
        return self.worker_cap if self.static_cap is None else min(self.worker_cap, self.static_cap)

    @property
    def placeable(self) -> bool:
        """May a new session be placed here (headroom apart)?"""
        return self.healthy and not self.draining and not self.retired and (
            self.controller is None or self.controller.admits(self.live))

    @property
    def failure_code(self) -> str:
        """How its sessions end when it goes away: drained (it said it was stopping) or lost."""
        return "worker_draining" if self.draining else "worker_unavailable"

    def headroom(self) -> int:
        return min(self.cap, self.memory_capacity) - self.live

    def heard(self, cap: int, sessions: int) -> None:
        """What the worker said of its admission (Health, OpenSession, a tick's answer)."""
        self.worker_cap, self.worker_sessions = cap, sessions


OutputSink = Callable[[WorkerHandle, ClientSession, pb.SessionOutput, TickReport], None]
SpeechSink = Callable[[WorkerHandle, ClientSession, pb.SessionOutput], None]   # speech sent between ticks
FailureSink = Callable[[WorkerHandle, ClientSession, str], None]
