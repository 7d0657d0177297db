"""The worker: the gRPC ``Worker`` service of ``proto/worker.proto`` over one ``Engine`` and one adapter.

Threading: the engine and the adapter are synchronous and not thread-safe, so EVERY call into them
(OpenSession, CloseSession, Step, a StreamStep once its last message is in) runs on one dedicated thread,
a ``ThreadPoolExecutor(max_workers=1)`` awaited through ``loop.run_in_executor``. The asyncio loop only
moves bytes and never blocks; two Step RPCs that arrive together run one after the other. Health answers
at once from a snapshot the engine thread refreshes after every call, so it does not wait behind a
running step.

One Step, per session: sid → engine session id; PCM16 decoded and resampled to the adapter's rate
(one streaming resampler per session, so chunk edges do not click or drift); then for the whole
batch ``adapter.prepare`` (audio → tokens; timed with decoding/resampling as ``frontend_ms``),
``engine.step`` (``prefill_ms``/``decode_ms`` from ``engine.last_timing``; ``gpu_ms`` is their sum)
and ``adapter.on_output`` (tokens → text delta). A problem with one session's input (unknown sid,
odd PCM byte count, sample rate outside 8-48 kHz, input refused by the adapter or the engine) is
reported on that session's ``SessionOutput.error`` and logged; its input for the tick is dropped and
the other sessions proceed. Only an unexpected exception fails the RPC (``INTERNAL``); the worker
stays up.

StreamStep (what the gateway uses) is the same tick with its input sent as it arrives: the event loop
files each message's audio and text by session, while the engine thread still runs the previous tick,
and the last message runs as a Step with each session's streamed input joined in front of its own.

Chunking: a session's input normally fits one engine forward (``max_chunk_tokens``, checked at start
against what the adapter feeds per tick of audio). Bursts — the first tick's system prompt, a long
typed message — up to ``max_input_tokens`` are prefilled in ``max_chunk_tokens`` pieces by extra
engine steps within the same tick, right-aligned so every session's decode still runs in the one
final step; beyond ``max_input_tokens`` the adapter refuses the tick with a per-session error.

>>> handle = await serve_worker(WorkerConfig(EngineConfig(model=ckpt, num_blocks=256), port=0))   # doctest: +SKIP
>>> channel = grpc.aio.insecure_channel(handle.address)                            # doctest: +SKIP
>>> stub = worker_pb2_grpc.WorkerStub(channel)                                     # doctest: +SKIP
>>> (await stub.OpenSession(worker_pb2.OpenSessionRequest(sid="a", mode="free_running"))).ok  # doctest: +SKIP
True
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter

import grpc
import numpy as np
import torch

from metronome import AdmissionError, Engine, EngineConfig, KVPolicy, SamplingParams, StepInput, StepOutput
from metronome.audio.adapter import AdapterContext, InteractionAdapter, PreparedInput, TickAudio
from metronome.audio.registry import ADAPTERS
from metronome.audio.pcm import SILENCE_DBFS, Resampler, check_sample_rate, decode_pcm16, levels
from metronome.engine.runner import DTYPES
from metronome.errors import ConfigError
from metronome.serving.gc_pauses import freeze_startup_heap
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.proto import worker_pb2_grpc

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs: the engine's config, the adapter, the frame budget and the address.

    ``port=0`` binds an ephemeral port (``WorkerServer.port`` says which). ``max_input_tokens``
    bounds one session's input per tick (see "Chunking" in the module docstring); ``None`` picks
    ``max(1024, max_chunk_tokens)``.
    ``max_message_bytes`` bounds a Step request, and a StreamStep's input before its last message: 2 s of
    48 kHz PCM16 is 192 KB per session.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    budget_ms: float = 2000.0
    adapter: str = "cascade"
    max_input_tokens: int | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    max_message_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.budget_ms <= 0:
            raise ConfigError(f"budget_ms must be > 0, got {self.budget_ms}")
        if self.adapter not in ADAPTERS:
            raise ConfigError(f"adapter must be one of {tuple(ADAPTERS)}, got {self.adapter!r}")
        chunk = self.engine.max_chunk_tokens
        if self.max_input_tokens is None:
            object.__setattr__(self, "max_input_tokens", max(1024, chunk))
        if self.max_input_tokens < chunk:
            raise ConfigError(f"max_input_tokens ({self.max_input_tokens}) must be >= max_chunk_tokens ({chunk})")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535] (0: ephemeral), got {self.port}")
        if self.max_message_bytes < 1024 * 1024:
            raise ConfigError(f"max_message_bytes must be >= 1 MiB, got {self.max_message_bytes}")



def adapter_context(config: WorkerConfig, engine: Engine) -> AdapterContext:
    return AdapterContext(
        tokenizer=engine.tokenizer, checkpoint=engine.checkpoint, embed=engine.model.embed,
        device=engine.device, dtype=DTYPES[engine.config.dtype],
        max_input_tokens=config.max_input_tokens, budget_ms=config.budget_ms,
        compute_logits=engine.model.compute_logits)


def make_adapter(config: WorkerConfig, engine: Engine) -> InteractionAdapter:
    """The adapter ``config.adapter`` names, built over the engine's tokenizer and embeddings."""
    if config.adapter not in ADAPTERS:
        raise ConfigError(f"adapter must be one of {tuple(ADAPTERS)}, got {config.adapter!r}")
    module, _, attr = ADAPTERS[config.adapter].partition(":")
    factory = importlib.import_module(module)
    for part in attr.split("."):
        factory = getattr(factory, part)
    return factory(adapter_context(config, engine))


def policy_name(policy: KVPolicy) -> str:
    """The policy as Health reports it.

    >>> policy_name(KVPolicy(sinks=16, window=1024)), policy_name(KVPolicy(window=None))
    ('sink_window(S=16,W=1024)', 'unbounded')
    """
    return f"sink_window(S={policy.sinks},W={policy.window})" if policy.bounded else "unbounded"


@dataclass
class StreamedInput:
    """One session's input from a StreamStep's messages before the last (joined in front of its last input)."""

    sample_rate: int = 0
    audio: list[bytes] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    new_turn: bool = False
    cancel: bool = False
    error: str = ""

    def add(self, inp) -> int:
        """Take one SessionInput; returns the bytes it added. Audio before a change of sample rate is dropped."""
        audio = inp.audio_pcm16   # read once: each read of a protobuf bytes field copies it
        if inp.clear_audio:
            self.audio.clear()
            self.error = ""
        if audio:
            if inp.sample_rate != self.sample_rate:
                self.audio.clear()
                self.sample_rate = inp.sample_rate
            if len(audio) % 2 and not self.error:   # joined, an odd piece would shift every later sample
                self.error = f"a streamed PCM16 piece has an odd number of bytes ({len(audio)})"
            self.audio.append(audio)
        if inp.text:
            self.text.append(inp.text)
        self.new_turn |= inp.new_turn
        self.cancel |= inp.cancel
        return len(audio) + len(inp.text)


@dataclass
class _Job:
    """One session's engine work this tick: its input split into pieces of at most max_chunk_tokens."""

    index: int                  # position in the request (and the response)
    session_id: int             # engine session id
    prepared: PreparedInput
    pieces: list[tuple[list[int] | None, torch.Tensor | None]]  # (token_ids, embeds) per engine step
    output: StepOutput | None = None
    preempted: bool = False


def _split(prepared: PreparedInput, chunk: int) -> list[tuple[list[int] | None, torch.Tensor | None]]:
    if prepared.token_ids is not None and len(prepared.token_ids) > chunk:
        ids = list(prepared.token_ids)
        return [(ids[i:i + chunk], None) for i in range(0, len(ids), chunk)]
    if prepared.embeds is not None and prepared.embeds.shape[0] > chunk:
        e = prepared.embeds
        return [(None, e[i:i + chunk]) for i in range(0, e.shape[0], chunk)]
    return [(prepared.token_ids, prepared.embeds)]


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """The RPC handlers. All engine/adapter work goes through ``executor`` (one thread)."""

    def __init__(self, engine: Engine, adapter: InteractionAdapter, config: WorkerConfig,
                 executor: ThreadPoolExecutor) -> None:
        chunk = engine.config.max_chunk_tokens
        need = adapter.input_tokens_per_tick(config.budget_ms)
        if need > chunk:
            raise ConfigError(
                f"the {adapter.name} adapter feeds up to {need} tokens per {config.budget_ms:g} ms tick but the "
                f"engine's max_chunk_tokens is {chunk}; raise max_chunk_tokens to at least {need}")
        check_sample_rate(adapter.sample_rate)
        self.engine = engine
        self.adapter = adapter
        self.config = config
        self._executor = executor
        self._sessions: dict[str, int] = {}          # sid -> engine session id (engine thread only)
        self._resamplers: dict[str, Resampler] = {}  # sid -> its stream's resampler (engine thread only)
        self._health = self._snapshot()

    # ------------------------------------------------------------------ RPCs (event loop)
    async def OpenSession(self, request, context):
        return await self._on_engine_thread(context, "OpenSession", self._open, request)

    async def CloseSession(self, request, context):
        return await self._on_engine_thread(context, "CloseSession", self._close, request.sid)

    async def Step(self, request, context):
        return await self._on_engine_thread(context, "Step", self._step, request)

    async def StreamStep(self, request_iterator, context):
        """One tick whose input arrives over the frame period; the last message is the Step request proper.

        The loop only files each message's bytes by session (no decoding), so the tick's critical path
        keeps the last message's transfer and the join, not the whole tick's audio going over the wire.
        """
        streamed: dict[str, StreamedInput] = {}
        size, last = 0, None
        async for message in request_iterator:
            if last is not None:
                for inp in last.sessions:
                    size += streamed.setdefault(inp.sid, StreamedInput()).add(inp)
                if size > self.config.max_message_bytes:
                    log.warning("a streamed tick passed %d bytes; its input is dropped", self.config.max_message_bytes)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"the tick's streamed input exceeds {self.config.max_message_bytes} bytes")
            last = message
        if last is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a StreamStep needs at least its last message")
        return await self._on_engine_thread(context, "StreamStep", self._step, last, streamed)

    async def Health(self, request, context):
        return self._health

    async def _on_engine_thread(self, context, what: str, fn, *args):
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except Exception as exc:  # noqa: BLE001 - any bug must become a clean RPC error, not a dead worker
            log.exception("%s failed", what)
            await context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ engine thread
    def _snapshot(self) -> pb.HealthResponse:
        stats = self.engine.stats()
        return pb.HealthResponse(
            ready=True, model=str(self.engine.config.model), budget_ms=self.config.budget_ms,
            capacity_sessions=stats.capacity, kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total, sessions=len(self._sessions),
            input_sample_rate=self.adapter.sample_rate, kv_policy=policy_name(self.engine.config.policy))

    def _open(self, request) -> pb.OpenSessionResponse:
        sid = request.sid
        if not sid:
            return pb.OpenSessionResponse(ok=False, error="sid must not be empty")
        if sid in self._sessions:
            return pb.OpenSessionResponse(ok=False, error=f"session {sid!r} is already open")
        try:
            self.adapter.open_session(sid, request.mode, request.instructions)
        except ValueError as exc:
            return pb.OpenSessionResponse(ok=False, error=str(exc))
        try:
            self._sessions[sid] = self.engine.open_session()
        except AdmissionError as exc:
            self.adapter.close_session(sid)
            log.info("session %s refused: %s", sid, exc)
            return pb.OpenSessionResponse(ok=False, error=str(exc))
        self._health = self._snapshot()
        log.debug("session %s open (engine session %d)", sid, self._sessions[sid])
        return pb.OpenSessionResponse(ok=True)

    def _close(self, sid: str) -> pb.CloseSessionResponse:
        eid = self._sessions.pop(sid, None)
        self._resamplers.pop(sid, None)
        self.adapter.close_session(sid)
        if eid is not None:
            self.engine.close_session(eid)
            self._health = self._snapshot()
        return pb.CloseSessionResponse(closed=eid is not None)

    def close_all(self) -> None:
        """Close every session (shutdown). Engine thread only."""
        for sid in list(self._sessions):
            self._close(sid)

    def _tick_audio(self, inp, default_tokens: int, out: pb.SessionOutput,
                    earlier: StreamedInput | None = None) -> TickAudio:
        """One session's SessionInput (after its ``earlier`` streamed input) → TickAudio at the adapter's rate;
        ValueError for bad input.

        Level checks (RMS, clipping) of the audio as sent go on the session's output for the client."""
        if inp.sid not in self._sessions:
            raise ValueError(f"unknown session {inp.sid!r}")
        pcm = np.zeros(0, np.float32)
        out.input_dbfs = SILENCE_DBFS
        audio = inp.audio_pcm16   # read once: each read of a protobuf bytes field copies it
        text, new_turn, cancel = inp.text, inp.new_turn, inp.cancel
        if earlier is not None:
            if earlier.error and not inp.clear_audio:
                raise ValueError(earlier.error)
            if earlier.audio and earlier.sample_rate == inp.sample_rate and not inp.clear_audio:
                audio = b"".join([*earlier.audio, audio])
            text = "".join(earlier.text) + text
            new_turn, cancel = new_turn or earlier.new_turn, cancel or earlier.cancel
        if audio:
            check_sample_rate(inp.sample_rate)
            pcm = decode_pcm16(audio)
            lv = levels(pcm, inp.sample_rate)
            out.input_dbfs, out.input_clipping = lv.rms_dbfs, lv.clipping
            resampler = self._resamplers.get(inp.sid)
            if resampler is None or resampler.in_rate != inp.sample_rate:
                resampler = self._resamplers[inp.sid] = Resampler(inp.sample_rate, self.adapter.sample_rate)
            pcm = resampler.process(pcm)
        return TickAudio(session_id=inp.sid, pcm=pcm, new_turn=new_turn, text=text, cancel=cancel,
                         max_tokens=inp.max_tokens or default_tokens)

    def _step(self, request, streamed: dict[str, StreamedInput] | None = None) -> pb.StepResponse:
        t0 = perf_counter()
        streamed = streamed or {}
        outputs = [pb.SessionOutput(sid=inp.sid) for inp in request.sessions]
        ticks: list[TickAudio] = []
        indices: list[int] = []
        seen: set[str] = set()
        for i, inp in enumerate(request.sessions):
            try:
                if inp.sid in seen:
                    raise ValueError(f"session {inp.sid!r} appears more than once in one step")
                seen.add(inp.sid)
                ticks.append(self._tick_audio(inp, request.tokens_per_tick, outputs[i], streamed.get(inp.sid)))
                indices.append(i)
            except ValueError as exc:
                self._session_error(request.tick, outputs[i], str(exc))
        prepared = self.adapter.prepare(ticks) if ticks else []
        if len(prepared) != len(ticks):
            raise RuntimeError(f"the adapter returned {len(prepared)} inputs for {len(ticks)} sessions")
        frontend_ms = (perf_counter() - t0) * 1e3

        jobs = []
        chunk = self.engine.config.max_chunk_tokens
        for i, prep in zip(indices, prepared):
            outputs[i].transcript = prep.transcript
            if prep.error:
                self._session_error(request.tick, outputs[i], prep.error)
            elif prep.num_tokens > self.config.max_input_tokens:
                self._session_error(request.tick, outputs[i], f"input of {prep.num_tokens} tokens exceeds "
                                    f"max_input_tokens={self.config.max_input_tokens}")
            else:
                jobs.append(_Job(i, self._sessions[request.sessions[i].sid], prep, _split(prep, chunk)))
        prefill_ms, decode_ms = self._run_engine(jobs)
        hidden = [(outputs[job.index].sid, job.output.hidden) for job in jobs
                  if job.prepared.return_hidden and not job.output.error and job.output.hidden is not None]
        heads_failed: set[str] = set()
        if hidden:
            try:
                self.adapter.on_hidden(hidden)
            except Exception as exc:  # noqa: BLE001  (the adapter's own heads: report on those sessions only)
                log.exception("tick %d: the %s adapter's heads failed", request.tick, self.adapter.name)
                heads_failed = {sid for sid, _ in hidden}
                reason = f"the model's output heads failed this tick: {type(exc).__name__}: {exc}"

        for job in jobs:
            out, result = outputs[job.index], job.output
            if result.error:
                self._session_error(request.tick, out, result.error)
                continue
            if out.sid in heads_failed:
                self._session_error(request.tick, out, reason)
                continue
            out.tokens.extend(result.token_ids)
            capped = job.prepared.ends_response and len(result.token_ids) >= job.prepared.max_new_tokens
            out.finished = result.finished or capped
            out.preempted = job.preempted or result.preempted
            out.text = self.adapter.on_output(out.sid, list(result.token_ids), out.finished)
            audio = self.adapter.take_audio(out.sid)
            if audio:
                out.audio_pcm16, out.audio_sample_rate = audio, self.adapter.output_sample_rate
        stats = self.engine.stats()
        self._health = self._snapshot()
        return pb.StepResponse(outputs=outputs, gpu_ms=prefill_ms + decode_ms, in_flight=len(self._sessions),
                               frontend_ms=frontend_ms, prefill_ms=prefill_ms, decode_ms=decode_ms,
                               kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total,
                               worker_ms=(perf_counter() - t0) * 1e3)

    def _run_engine(self, jobs: list[_Job]) -> tuple[float, float]:
        """Feed every job's pieces, right-aligned so all decodes share the final engine step.

        Returns (prefill_ms, decode_ms) summed over the engine steps; sets each job's ``output``.
        """
        rounds = max((len(job.pieces) for job in jobs), default=0)
        prefill_ms = decode_ms = 0.0
        for r in range(rounds):
            last = r == rounds - 1
            batch = [job for job in jobs if job.output is None and r >= rounds - len(job.pieces)]
            if not batch:
                continue
            inputs = []
            for job in batch:
                ids, embeds = job.pieces[r - (rounds - len(job.pieces))]
                inputs.append(StepInput(job.session_id, token_ids=ids, embeds=embeds,
                                        max_new_tokens=job.prepared.max_new_tokens if last else 0,
                                        sampling=SamplingParams(stop_token_ids=job.prepared.stop_token_ids),
                                        return_hidden=job.prepared.return_hidden and last))
            results = self.engine.step(inputs)
            timing = self.engine.last_timing
            prefill_ms += timing.prefill_ms
            decode_ms += timing.decode_ms
            for job, result in zip(batch, results):
                job.preempted |= result.preempted
                if result.error or last:
                    job.output = result
        return prefill_ms, decode_ms

    @staticmethod
    def _session_error(tick: int, out: pb.SessionOutput, message: str) -> None:
        out.error = message
        log.warning("tick %d, session %s: %s", tick, out.sid, message)


@dataclass
class WorkerServer:
    """A started worker: the gRPC server, the port it is bound to, and the service (for introspection)."""

    server: grpc.aio.Server
    port: int
    host: str
    service: WorkerService
    executor: ThreadPoolExecutor

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving, close every session (their KV returns to the pool), release the engine thread."""
        await self.server.stop(grace)
        await asyncio.get_running_loop().run_in_executor(self.executor, self.service.close_all)
        self.executor.shutdown(wait=False)

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
        size = config.max_message_bytes
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", size),
                                          ("grpc.max_send_message_length", size)])
        worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
        port = server.add_insecure_port(f"{config.host}:{config.port}")
        if port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        await server.start()
    except BaseException:
        executor.shutdown(wait=False)
        raise
    stats = engine.stats()
    log.info("worker on %s:%d: %s, %s, capacity %d sessions, budget %g ms, adapter %s",
             config.host, port, engine.config.model, policy_name(engine.config.policy), stats.capacity,
             config.budget_ms, adapter.name)
    return WorkerServer(server, port, config.host, service, executor)


def run_worker(config: WorkerConfig) -> None:
    """Serve until SIGINT/SIGTERM (the CLI's entry point); sessions are closed on the way out."""

    async def main() -> None:
        handle = await serve_worker(config)
        freeze_startup_heap()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread / not supported here
                pass
        waiter = asyncio.ensure_future(handle.wait_for_termination())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        await handle.stop(grace=1.0)

    asyncio.run(main())
