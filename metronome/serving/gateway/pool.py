"""The gateway's workers: membership, health, placement of new sessions, and one ticker per worker.

Membership follows discovery (``discovery.py``): a worker that appears gets a handle, a health loop and
a ticker, and takes new sessions; one that leaves takes no new ones, keeps ticking the sessions it has
(a draining pod leaves its Service's DNS at once), and is dropped once they are over. Placement is
``placement.py``'s; admission is the workers' own unless ``GatewayConfig.admission`` is "gateway".

One ``WorkerHandle`` (``handle.py``) per worker address. Its ticker fires every frame budget B: one
``StreamStep`` RPC per tick with every live session's input since the last tick, then the outputs are
fanned out and the tick's latency feeds the worker's AIMD controller. A tick that overruns B makes the
next fire at once and counts as a deadline miss.

The pool owns B (``budget_ms``): the one the gateway was given, or else the first that a worker reports
in Health. A worker whose B differs is not used (its ticks would be paced and judged by the wrong
period); the error is logged once, and the worker is used once it reports the pool's B.

The tick's input goes to the worker as it arrives: every ``stream_interval_ms`` the sessions' new
audio and text are written to the next tick's stream, and at the tick only the remainder and the
controls are, so the tick's latency carries a fraction of its audio over the wire instead of all of it
(docs/benchmarks/gateway.md). The next tick's stream fills while the worker still computes this one.
Answers come back on the same stream: speech the worker finished between ticks as it is ready (handed out
once the tick before has been, so it follows the text it speaks), then the tick's own response.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc

from metronome.config import GatewayConfig
from metronome.monitor.fill import live_time_to_wall
from metronome.serving.auth import token_metadata
from metronome.serving.admission import AimdController, PaperAimdController
import metronome.serving.gateway.placement as placement
from metronome.serving.gateway.client_session import ClientSession, step_request_wire
from metronome.serving.gateway.discovery import Discovery, Resolver, parse_workers, resolve_dns
from metronome.serving.gateway.handle import FailureSink, OutputSink, SpeechSink, TickCall, TickReport, WorkerHandle
from metronome.serving.gateway.membership import Membership
from metronome.serving.gateway.step_fit import fit_step
from metronome.serving.metrics import GatewayMetrics
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc as pb_grpc
from metronome.serving.protocol import error_event

__all__ = ["HEALTH_INTERVAL_S", "TickReport", "WorkerHandle", "WorkerPool"]

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0


def _send_each(sessions: list[ClientSession], event: dict) -> None:
    for session in (s for s in sessions if not s.closed):
        session.send(event)


class WorkerPool:
    """All workers of one gateway; placement of new sessions on the one with the most headroom."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics, on_output: OutputSink,
                 on_failure: FailureSink, on_speech: SpeechSink, resolve: Resolver = resolve_dns) -> None:
        self.config = config
        self.handles: list[WorkerHandle] = []
        self.membership = Membership(Discovery(parse_workers(config.workers), resolve), self.handles, self.add,
                                     self.drop, config.discovery_interval_s)
        self.metrics = metrics
        self.on_output = on_output
        self.on_failure = on_failure
        self.on_speech = on_speech
        self._tasks: list[asyncio.Task] = []
        self._closes: set[asyncio.Task] = set()  # CloseSession for sessions a failure ended
        self._stopping = False
        self.budget_ms: float | None = config.budget_ms   # None until a worker reports its B
        self._budget_known = asyncio.Event()
        if self.budget_ms is not None:
            self._budget_known.set()
            metrics.set_budget(self.budget_ms)

    async def start(self) -> None:
        await self.membership.sync()
        if self.membership.discovery.dynamic:
            self._tasks.append(asyncio.create_task(self.membership.run(), name="discovery"))

    # ------------------------------------------------------------------ membership (``membership.py`` decides)
    async def add(self, address: str) -> None:
        channel = grpc.aio.insecure_channel(address)
        handle = WorkerHandle(address, channel, pb_grpc.WorkerStub(channel), token_metadata(self.config.worker_token),
                              static_cap=self.config.max_sessions)
        self.handles.append(handle)
        log.info("worker %s joined the fleet", address)
        await self._check_health(handle)
        handle.tasks = [asyncio.create_task(self._health_loop(handle), name=f"health {address}"),
                        asyncio.create_task(self._tick_loop(handle), name=f"ticker {address}")]

    async def drop(self, handle: WorkerHandle) -> None:
        self.handles.remove(handle)
        await handle.stop_tasks()
        await handle.channel.close()
        self.metrics.worker_up.labels(handle.address).set(0)
        log.info("worker %s dropped from the fleet", handle.address)

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(h.stop_tasks() for h in self.handles))
        if self._closes:
            await asyncio.wait(list(self._closes), timeout=5.0)
        for handle in self.handles:
            await handle.channel.close()

    async def close_all_sessions(self) -> None:
        """CloseSession for every live session on every worker (at shutdown: the workers keep running)."""
        calls = []
        for handle in self.handles:
            sessions, handle.sessions = list(handle.sessions), {}
            self.metrics.sessions_live.labels(handle.address).set(0)
            calls += [self._close_on_worker(handle, sid) for sid in sessions]
        await asyncio.gather(*calls)

    async def _close_on_worker(self, handle: WorkerHandle, sid: str) -> None:
        try:
            await handle.stub.CloseSession(pb.CloseSessionRequest(sid=sid), timeout=5.0, metadata=handle.metadata)
        except grpc.aio.AioRpcError as exc:
            log.warning("closing %s on %s failed: %s", sid, handle.address, exc.code().name)

    def _close_later(self, handle: WorkerHandle, sids: list[str]) -> None:
        """Free the worker side of sessions a failure ended (the gateway forgets them: nobody else will)."""
        if self._stopping or not sids:
            return
        task = asyncio.get_running_loop().create_task(
            asyncio.wait_for(asyncio.gather(*(self._close_on_worker(handle, sid) for sid in sids)), 10.0))
        self._closes.add(task)
        task.add_done_callback(self._closes.discard)

    # ------------------------------------------------------------------ placement
    def reserve(self) -> WorkerHandle | None:
        """Pick the worker with the most headroom and hold a slot on it (no await in between)."""
        return placement.pick(self.handles)

    def refusal(self) -> tuple[str, str]:
        return placement.refusal(self.handles)

    async def open_session(self, first: WorkerHandle, sid: str) -> tuple[WorkerHandle, pb.OpenSessionResponse]:
        """OpenSession on the reserved worker, then on the next while workers refuse (``placement.py``)."""
        return await placement.open_session(self.handles, first, sid, self.config.admission == "gateway")

    # ------------------------------------------------------------------ health
    async def _check_health(self, handle: WorkerHandle) -> None:
        try:
            health = await handle.stub.Health(pb.HealthRequest(), timeout=2.0, metadata=handle.metadata)
        except grpc.aio.AioRpcError as exc:
            if handle.healthy:
                log.warning("worker %s stopped answering: %s", handle.address, exc.code().name)
                # A timeout may be a busy worker, not a dead one: its sessions are closed there too.
                self._fail_sessions(handle, handle.failure_code, close=exc.code() != grpc.StatusCode.UNAVAILABLE)
            handle.healthy = False
            self.metrics.worker_up.labels(handle.address).set(0)
            return
        if not self._accept_budget(handle, health):
            return
        if not handle.healthy:
            log.info("worker %s is up: %s, capacity %d sessions, B = %g ms", handle.address, health.model,
                     health.capacity_sessions, health.budget_ms)
        handle.health = health
        handle.healthy = health.ready
        handle.draining = health.draining
        if self.config.admission == "worker":
            handle.heard(health.admission_cap or health.capacity_sessions, health.sessions)
        elif handle.controller is None:
            controller = PaperAimdController if self.config.controller == "paper" else AimdController
            handle.controller = controller(replace(self.config.aimd, budget_ms=self.budget_ms),
                                           memory_cap=health.capacity_sessions,
                                           static_cap=self.config.max_sessions, name=handle.address)
        else:
            handle.controller.set_memory_cap(health.capacity_sessions)
        m = self.metrics
        m.worker_up.labels(handle.address).set(1 if health.ready else 0)
        m.memory_capacity.labels(handle.address).set(health.capacity_sessions)
        m.kv_blocks_used.labels(handle.address).set(health.kv_blocks_used)
        m.kv_blocks_total.labels(handle.address).set(health.kv_blocks_total)
        m.admission_cap.labels(handle.address).set(handle.cap)

    def _accept_budget(self, handle: WorkerHandle, health: pb.HealthResponse) -> bool:
        """Adopt the worker's B if the pool has none yet; False (the worker is not used) if it differs."""
        if self.budget_ms is None and health.budget_ms > 0:
            self.budget_ms = health.budget_ms
            self.metrics.set_budget(self.budget_ms)
            self._budget_known.set()
            log.info("frame budget B = %g ms, as worker %s reports", self.budget_ms, handle.address)
        if self.budget_ms is not None and health.budget_ms == self.budget_ms:
            handle.refused = ""
            return True
        if self.budget_ms is None:
            why = "reports no frame budget B; start the gateway with an explicit budget"
        else:
            why = f"runs at B = {health.budget_ms:g} ms but this gateway ticks at B = {self.budget_ms:g} ms"
        if handle.refused != why:
            log.error("worker %s is not used: it %s", handle.address, why)
            handle.refused = why
        if handle.healthy:
            self._fail_sessions(handle, "worker_unavailable", close=True)
        handle.healthy = False
        self.metrics.worker_up.labels(handle.address).set(0)
        return False

    async def _health_loop(self, handle: WorkerHandle) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await self._check_health(handle)

    def _fail_sessions(self, handle: WorkerHandle, code: str, *, close: bool) -> None:
        """End every session on the worker; ``close``: it may still be alive, so free them there too."""
        sessions = list(handle.sessions.values())
        for session in sessions:
            self.on_failure(handle, session, code)
        handle.sessions.clear()
        self.metrics.sessions_live.labels(handle.address).set(0)
        if close:
            self._close_later(handle, [s.sid for s in sessions])

    def _fail_tick(self, handle: WorkerHandle, sessions: list[ClientSession], code: str) -> None:
        """End the sessions of one failed tick (the worker is alive): here and on the worker."""
        for session in sessions:
            self.on_failure(handle, session, code)
            handle.sessions.pop(session.sid, None)
        self.metrics.sessions_live.labels(handle.address).set(len(handle.sessions))
        self._close_later(handle, [s.sid for s in sessions])

    # ------------------------------------------------------------------ ticker
    async def _tick_loop(self, handle: WorkerHandle) -> None:
        loop = asyncio.get_running_loop()
        await self._budget_known.wait()
        budget = self.budget_ms / 1000.0
        interval = self.config.stream_interval_ms / 1000.0
        next_at = loop.time()
        while True:
            while (delay := next_at - loop.time()) > 0:
                await asyncio.sleep(min(delay, interval))
                if next_at - loop.time() > 0 and handle.healthy:
                    try:
                        await self._stream(handle)
                    except Exception:  # a bug must not stop this worker's ticker for every session on it
                        log.exception("streaming tick %d's input to %s failed", handle.ticks + 1, handle.address)
                        handle.stream_broken = True
            if handle.tick_task is not None:   # one tick at a time on a worker: this one waits for the last
                await handle.tick_task
                handle.tick_task = None
                if loop.time() > next_at:  # the last tick overran B: this one fires now
                    next_at = loop.time()
            started = loop.time()
            drift = started - next_at
            sessions = [s for s in handle.sessions.values() if s.started]
            if handle.healthy and sessions:
                try:
                    call, named, lost = await self._send_tick(handle, sessions)
                except Exception:  # as above
                    log.exception("tick %d on %s failed", handle.ticks, handle.address)
                    self._fail_tick(handle, sessions, "step_failed")
                else:
                    handle.tick_task = loop.create_task(
                        self._finish_tick(handle, call, named, lost, started, drift),
                        name=f"tick {handle.ticks} {handle.address}")
            else:   # nobody to tick, or the worker is down: what was streamed goes
                self._tell_input_lost(self._drop_stream(handle, sessions), "the worker is not ready")
            next_at += budget

    async def _stream(self, handle: WorkerHandle) -> None:
        """Send the sessions' input buffered since the last send to the next tick's stream (opened on demand)."""
        if not handle.streams or handle.stream_broken:
            return   # the input stays buffered for the tick's last message
        room = self.config.max_step_bytes - handle.streamed_bytes   # the worker bounds a tick's streamed bytes
        entries = []
        for session in handle.sessions.values():
            if not session.started or not session.has_unsent_input:
                continue
            size = session.tick_bytes
            if size > room:
                break   # the rest stays buffered for the tick's last message
            room -= size
            entries.append(session.take_stream_wire())
        if not entries:
            return
        handle.streamed_bytes = self.config.max_step_bytes - room
        if handle.stream is None:
            # A backstop: the tick's own timeout starts with its last message (``_tick``), which can follow the
            # first by B plus a late previous tick.
            handle.stream = self._open_stream(handle, self.budget_ms / 1000.0 + 2 * self.config.step_timeout_s)
        try:
            await handle.stream.rpc.write(step_request_wire(entries, 0, 0, speech_ahead=True))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # The call ended early (the worker refused the input, or went away). Writing on would only
            # overwrite its status; the tick sends its last message on a new call and reports the loss.
            log.warning("streaming tick %d's input to %s failed: %s", handle.ticks + 1, handle.address, exc)
            handle.stream_broken = True

    def _open_stream(self, handle: WorkerHandle, timeout: float) -> TickCall:
        """A new StreamStep for the next tick, and the task that reads its answers."""
        rpc = handle.stream_step_wire(timeout=timeout, metadata=handle.metadata)
        reader = asyncio.ensure_future(self._answers(handle, rpc, handle.tick_task))
        # A stream given up (cancelled, or its tick failed) is not awaited: its error was reported elsewhere.
        reader.add_done_callback(lambda t: t.cancelled() or t.exception())
        return TickCall(rpc, reader)

    async def _answers(self, handle: WorkerHandle, rpc: grpc.aio.StreamStreamCall,
                       previous: asyncio.Task | None) -> pb.StepResponse:
        """A StreamStep's answers: speech the worker sends ahead of the tick is handed out as it comes, once the
        tick before (``previous``) has been; the tick's own response is returned."""
        while (response := await rpc.read()) is not grpc.aio.EOF:
            if not response.speech_only:
                return response
            if previous is not None and not previous.done():
                await asyncio.wait((previous,))
            for output in response.outputs:
                session = handle.sessions.get(output.sid)
                if session is not None and not session.closed:
                    self.on_speech(handle, session, output)
        raise RuntimeError(f"worker {handle.address} ended tick {handle.ticks}'s stream without its answer")

    def _drop_stream(self, handle: WorkerHandle, sessions: list[ClientSession]) -> list[ClientSession]:
        """Cancel the open stream; returns the sessions whose input on it is lost (their bounds start again)."""
        if (tick := handle.take_stream()) is not None:
            tick.cancel()
        lost = []
        for session in sessions:
            if session.streamed_audio_bytes or session.streamed_text_bytes:
                lost.append(session)
            session.forget_streamed(lost=True)   # a clear it carried goes again with the last message
        if lost:
            log.warning("the input %d sessions streamed to %s was lost", len(lost), handle.address)
        return lost

    @staticmethod
    def _tell_input_lost(sessions: list[ClientSession], why: str) -> None:
        _send_each(sessions, error_event("tick_failed", f"part of this tick's input was lost ({why}); it was dropped",
                                         type="server_error"))

    def _last_message(self, handle: WorkerHandle, sessions: list[ClientSession]) -> tuple[bytes, list[ClientSession]]:
        """The tick's last message and the sessions it names: those whose remaining input fits
        ``max_step_bytes`` (the others keep theirs for a later tick), and those left out that streamed input
        this tick (named with nothing more, so the worker uses what they streamed)."""
        chosen = {s.sid for s in fit_step(sessions, handle.ticks, self.config.max_step_bytes)}
        entries, named = [], []
        for session in sessions:
            if session.sid in chosen:
                entries.append(session.take_tick_wire())
            elif session.streamed:
                entries.append(session.take_name_wire())
            else:
                continue
            named.append(session)
        return step_request_wire(entries, self.config.tokens_per_tick, handle.ticks), named

    async def _send_tick(self, handle: WorkerHandle, sessions: list[ClientSession]
                         ) -> tuple[TickCall, list[ClientSession], list[ClientSession]]:
        """The tick's last message on its stream (a new one if none is open or the open one failed); returns
        the call, the sessions the message names, and those whose streamed input a failed stream lost."""
        handle.ticks += 1
        # A broken stream, or one still open when the worker turned out to have no StreamStep: its input is gone.
        lost = self._drop_stream(handle, sessions) if handle.stream_broken or not handle.streams else []
        tick = handle.take_stream()
        try:
            request, sessions = self._last_message(handle, sessions)
            if not handle.streams:   # then no stream is open: ``_drop_stream`` took it
                rpc = handle.step_wire(request, timeout=self.config.step_timeout_s, metadata=handle.metadata)
                return TickCall(rpc, rpc), sessions, lost
            if tick is None:
                tick = self._open_stream(handle, self.config.step_timeout_s)
            try:
                await tick.rpc.write(request)
                await tick.rpc.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                log.debug("tick %d to %s: %s", handle.ticks, handle.address, exc)   # awaiting the call reports it
        except BaseException:
            if tick is not None:
                tick.cancel()
            raise
        return tick, sessions, lost

    async def _finish_tick(self, handle: WorkerHandle, call: TickCall, sessions: list[ClientSession],
                           lost: list[ClientSession], started: float, drift: float) -> None:
        """Await the tick's response and hand it out; sessions whose streamed input was lost hear of it when
        the tick itself went through (a failed tick reports its own error)."""
        m, name = self.metrics, handle.address
        try:
            report = await self._tick(handle, call, sessions, started, drift)
            # A failed tick told the sessions it named; the others that lost streamed input still need telling.
            named = set() if report is not None else {s.sid for s in sessions}
            self._tell_input_lost([s for s in lost if s.sid not in named and s.sid in handle.sessions],
                                  "the stream to the worker failed")
        except Exception:  # a bug must not stop this worker's ticker for every session on it
            log.exception("tick %d on %s failed", handle.ticks, handle.address)
            self._fail_tick(handle, sessions, "step_failed")
            report = None
        if report is not None:
            m.ticks.labels(name).inc()
            m.tick_latency.labels(name).observe(report.latency_ms / 1e3)
            m.tick_drift.labels(name).observe(max(0.0, drift))
            if not report.deadline_met:
                m.deadline_misses.labels(name).inc()
            if handle.controller is not None:
                handle.controller.observe(report.latency_ms, not report.deadline_met, handle.live)
            m.admission_cap.labels(name).set(handle.cap)

    def _tick_refused(self, handle: WorkerHandle, sessions: list[ClientSession], code: grpc.StatusCode) -> None:
        if code == grpc.StatusCode.UNIMPLEMENTED and handle.streams:
            # A worker without StreamStep: from now on one Step a tick, with the whole input at the tick.
            log.warning("worker %s has no StreamStep: one Step a tick until the gateway restarts",
                        handle.address)
            handle.streams = False
            code = grpc.StatusCode.INVALID_ARGUMENT   # this tick's input is lost; the sessions live on
        if code == grpc.StatusCode.UNAVAILABLE:  # unreachable: its sessions are gone with it
            handle.healthy = False
            self.metrics.worker_up.labels(handle.address).set(0)
            self._fail_sessions(handle, handle.failure_code, close=False)
        elif code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            handle.healthy = False  # hung or overloaded, maybe alive: free its sessions there too
            self.metrics.worker_up.labels(handle.address).set(0)
            self._fail_sessions(handle, handle.failure_code, close=True)
        elif code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT):
            # The request, not the sessions: this tick's input is lost, every session lives on.
            _send_each(sessions, self._tick_lost(code.name))
        else:
            self._fail_tick(handle, sessions, "step_failed")

    @staticmethod
    def _tick_lost(code: str) -> dict:
        return error_event("tick_failed", f"the worker refused this tick's input ({code}); it was dropped",
                           type="server_error")

    async def _tick(self, handle: WorkerHandle, call: TickCall, sessions: list[ClientSession],
                    started: float, drift: float) -> TickReport | None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.config.step_timeout_s):   # the stream's own deadline is looser
                response = await call.answer
        except TimeoutError:
            call.cancel()
            log.error("worker %s did not answer tick %d within %g s", handle.address, handle.ticks,
                      self.config.step_timeout_s)
            self._tick_refused(handle, sessions, grpc.StatusCode.DEADLINE_EXCEEDED)
            return None
        except grpc.aio.AioRpcError as exc:
            log.error("worker %s failed tick %d: %s %s", handle.address, handle.ticks, exc.code().name, exc.details())
            self._tick_refused(handle, sessions, exc.code())
            return None
        latency_ms = (loop.time() - started) * 1e3
        report = TickReport(handle.ticks, latency_ms, drift * 1e3, latency_ms <= self.budget_ms, len(sessions),
                            response.gpu_ms, response.frontend_ms, response.worker_ms,
                            response.kv_blocks_used, response.kv_blocks_total)
        handle.last_tick = report
        handle.draining = response.draining
        m, name = self.metrics, handle.address
        m.worker_time.labels(name, "frontend").inc(response.frontend_ms / 1e3)
        m.worker_time.labels(name, "prefill").inc(response.prefill_ms / 1e3)
        m.worker_time.labels(name, "decode").inc(response.decode_ms / 1e3)
        m.kv_blocks_used.labels(name).set(response.kv_blocks_used)
        m.kv_blocks_total.labels(name).set(response.kv_blocks_total)
        if response.kv_blocks_total:
            handle.kv_fill.append((started, response.kv_blocks_used / response.kv_blocks_total))
            t, rho = zip(*handle.kv_fill)
            m.time_to_wall.labels(name).set(live_time_to_wall(t, rho))
        by_sid = {s.sid: s for s in sessions}
        for output in response.outputs:
            session = by_sid.get(output.sid)
            if session is not None and not session.closed:
                self.on_output(handle, session, output, report)
        return report
