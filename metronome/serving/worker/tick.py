"""The worker's tick core: one engine and one adapter driven by the worker contract's messages, no transport.

``TickCore`` owns the worker's session state (sid → engine session, one streaming resampler per
session) and does a tick's work: ``open``/``close`` a session, ``step`` a ``StepRequest`` into a
``StepResponse``, and, for a StreamStep, ``StreamedTick.add`` files each earlier message's input by
session. It is synchronous and not thread-safe, like the engine; ``service.py`` puts it behind gRPC on
one engine thread. Messages are the ``proto/worker.proto`` types (plain protobuf, no gRPC).

One step, per session: sid → engine session id; PCM16 decoded and resampled to the adapter's rate
(streaming, so chunk edges do not click or drift); then for the whole batch ``adapter.prepare``
(audio → tokens; timed with decoding/resampling as ``frontend_ms``), ``engine.step``
(``prefill_ms``/``decode_ms`` from ``engine.last_timing``, on CUDA spans of the stream from the step's start,
so GPU work the adapter queued before it counts in neither; ``gpu_ms`` is their sum) and
``adapter.on_output`` (tokens → text delta). A problem with one session's input (unknown sid, odd PCM
byte count, sample rate outside 8-48 kHz, input refused by the adapter or the engine) is reported on
that session's ``SessionOutput.error`` and logged; its input for the tick is dropped and the other
sessions proceed. An unexpected exception propagates (the service turns it into an RPC error).

Chunking: a session's input normally fits one engine forward (``max_chunk_tokens``, checked at start
against what the adapter feeds per tick of audio). Bursts (the first tick's system prompt, a long typed
message) up to ``max_input_tokens`` are prefilled in ``max_chunk_tokens`` pieces by extra engine steps
within the same tick, right-aligned so every session's decode still runs in the one final step; beyond
``max_input_tokens`` the tick is refused for that session.

>>> core = TickCore(engine, adapter, WorkerConfig(adapter="energy"))                   # doctest: +SKIP
>>> core.open(pb.OpenSessionRequest(sid="a", mode="free_running")).ok                  # doctest: +SKIP
True
>>> core.step(pb.StepRequest(sessions=[pb.SessionInput(sid="a", text="hi")], tokens_per_tick=4)).outputs[0].tokens  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np
import torch

from metronome import AdmissionError, Engine, SamplingParams, StepInput, StepOutput, StepTiming
from metronome.audio.adapter import InteractionAdapter, PreparedInput, TickAudio, TurnDetection
from metronome.audio.pcm import SILENCE_DBFS, Resampler, check_sample_rate, decode_pcm16, levels
from metronome.errors import ConfigError
from metronome.serving.proto import worker_pb2 as pb
from metronome.serving.worker.admission import MEMORY
from metronome.serving.worker.budget import INPUT_TOO_LARGE
from metronome.serving.worker.config import WorkerConfig, model_name, policy_name

log = logging.getLogger(__name__)


@dataclass
class StreamedInput:
    """One session's input from a StreamStep's messages before the last (joined in front of its last input)."""

    sample_rate: int = 0
    audio: list[bytes] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    new_turn: bool = False
    cancel: bool = False
    cleared: bool = False
    error: str = ""
    turn_detection: pb.TurnDetection | None = None   # the latest change streamed

    def add(self, inp: pb.SessionInput, keep_audio: bool = True) -> int:
        """Take one SessionInput; returns the bytes it added. Audio before a change of sample rate is dropped.
        ``keep_audio`` False: the audio was heard as it came (``TickCore.hear``) and is only counted."""
        audio = inp.audio_pcm16   # read once: each read of a protobuf bytes field copies it
        size = len(audio) + len(inp.text)
        if inp.HasField("turn_detection"):
            self.turn_detection = inp.turn_detection
        if not keep_audio:
            audio = b""
        if inp.clear_audio:
            self.audio.clear()
            self.error = ""
            self.cleared = True
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
        return size


@dataclass
class StreamedTick:
    """A StreamStep's input before its last message, filed by session (bytes only: no decoding here).

    ``heard``: every message of the tick, its last included, was handed to ``TickCore.hear`` as it came (an
    adapter that hears early); the audio is then only counted here."""

    sessions: dict[str, StreamedInput] = field(default_factory=dict)
    size: int = 0
    text_tokens: dict[str, int] = field(default_factory=dict)   # sid -> tokens of its text this tick (``budget.py``)
    heard: bool = False

    def add(self, message: pb.StepRequest) -> int:
        """File one earlier message; returns the tick's streamed bytes so far."""
        for inp in message.sessions:
            self.size += self.sessions.setdefault(inp.sid, StreamedInput()).add(inp, keep_audio=not self.heard)
        return self.size


@dataclass
class HeardInput:
    """One session's input handed to an adapter that hears early, since its last tick: the audio as sent (for
    the tick's levels) and the first problem, reported on the session's output at the tick."""

    pcm: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = 0
    error: str = ""
    error_code: str = ""


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


def turn_detection(message: pb.TurnDetection) -> TurnDetection:
    """The proto's turn detection as the adapter's (unset optional fields: the adapter's defaults)."""
    return TurnDetection(
        server_vad=message.server_vad,
        threshold=message.threshold if message.HasField("threshold") else None,
        prefix_padding_ms=message.prefix_padding_ms if message.HasField("prefix_padding_ms") else None,
        silence_duration_ms=message.silence_duration_ms if message.HasField("silence_duration_ms") else None,
        create_response=message.create_response, interrupt_response=message.interrupt_response)


class TickCore:
    """The worker's sessions and its tick over one engine and one adapter (one thread at a time)."""

    def __init__(self, engine: Engine, adapter: InteractionAdapter, config: WorkerConfig) -> None:
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
        self._sessions: dict[str, int] = {}          # sid -> engine session id
        self._opened: dict[str, tuple[str, str]] = {}  # sid -> (mode, instructions), until its first step
        self._resamplers: dict[str, Resampler] = {}  # sid -> its stream's resampler
        self._heard: dict[str, HeardInput] = {}      # sid -> input heard since its last tick (``hear``)
        self._speaking_after_text: set[str] = set()   # sessions whose answer text ended, speech not yet
        self.health = self._snapshot()               # refreshed after every call that changes it

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def is_open(self, sid: str) -> bool:
        return sid in self._sessions

    def _snapshot(self) -> pb.HealthResponse:
        stats = self.engine.stats()
        return pb.HealthResponse(
            ready=True, model=model_name(self.engine.config.model), budget_ms=self.config.budget_ms,
            capacity_sessions=stats.capacity, kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total, sessions=len(self._sessions),
            input_sample_rate=self.adapter.sample_rate, kv_policy=policy_name(self.engine.config.policy),
            max_input_tokens=self.config.max_input_tokens, max_instruction_tokens=self.config.max_instruction_tokens)

    # ------------------------------------------------------------------ sessions
    def open(self, request: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        sid = request.sid
        if not sid:
            return pb.OpenSessionResponse(ok=False, error="sid must not be empty")
        if request.replace:
            return self._replace(request)
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
            return pb.OpenSessionResponse(ok=False, error=str(exc), refused=MEMORY)
        self._opened[sid] = (request.mode, request.instructions)
        self.health = self._snapshot()
        log.debug("session %s open (engine session %d)", sid, self._sessions[sid])
        return pb.OpenSessionResponse(ok=True)

    def _replace(self, request: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        """A new mode and system prompt for a session not yet stepped; refused, it stays as it was."""
        sid = request.sid
        if sid not in self._sessions:
            return pb.OpenSessionResponse(ok=False, error=f"session {sid!r} is not open")
        if sid not in self._opened:
            return pb.OpenSessionResponse(ok=False, error=f"session {sid!r} has started; its header is fixed")
        before = self._opened[sid]
        self.adapter.close_session(sid)
        try:
            self.adapter.open_session(sid, request.mode, request.instructions)
        except ValueError as exc:
            self.adapter.open_session(sid, *before)   # opened with these once: it opens again
            return pb.OpenSessionResponse(ok=False, error=str(exc))
        self._opened[sid] = (request.mode, request.instructions)
        return pb.OpenSessionResponse(ok=True)

    def _finish_with_speech(self, sid: str, text_finished: bool) -> bool:
        """A response ends when its text and its speech have: while the adapter still speaks an answer whose
        text is done, the end waits (``_speaking_after_text``) for the tick that hands out the last audio."""
        if self.adapter.speaking(sid):
            if text_finished:
                self._speaking_after_text.add(sid)
            return False
        if sid in self._speaking_after_text:
            self._speaking_after_text.discard(sid)
            return True
        return text_finished

    def close(self, sid: str) -> pb.CloseSessionResponse:
        self._speaking_after_text.discard(sid)
        eid = self._sessions.pop(sid, None)
        self._opened.pop(sid, None)
        self._resamplers.pop(sid, None)
        self._heard.pop(sid, None)
        self.adapter.close_session(sid)
        if eid is not None:
            self.engine.close_session(eid)
            self.health = self._snapshot()
        return pb.CloseSessionResponse(closed=eid is not None)

    def close_all(self) -> None:
        """Close every session (shutdown)."""
        for sid in list(self._sessions):
            self.close(sid)

    # ------------------------------------------------------------------ the tick
    def hear(self, message: pb.StepRequest) -> None:
        """Hand each session's turn detection, clear and audio in ``message`` to an adapter that hears early
        (``InteractionAdapter.hears_early``), in the order the client sent them: a StreamStep's messages as they
        come, between ticks. What goes wrong is kept for the session's output at its tick, with the levels."""
        for inp in message.sessions:
            if inp.sid not in self._sessions:
                continue   # the tick says so
            heard = self._heard.setdefault(inp.sid, HeardInput())
            if inp.clear_audio:
                heard.pcm.clear()
                if heard.error_code == "invalid_input":
                    heard.error = heard.error_code = ""
            pcm = np.zeros(0, np.float32)
            audio = inp.audio_pcm16   # read once: each read of a protobuf bytes field copies it
            if audio:
                try:
                    check_sample_rate(inp.sample_rate)
                    sent = decode_pcm16(audio)
                except ValueError as exc:
                    heard.error, heard.error_code = heard.error or str(exc), heard.error_code or "invalid_input"
                else:
                    if inp.sample_rate != heard.sample_rate:   # the tick's levels are those of its latest rate
                        heard.pcm, heard.sample_rate = [], inp.sample_rate
                    heard.pcm.append(sent)
                    pcm = self._resample(inp.sid, inp.sample_rate, sent)
            turn = turn_detection(inp.turn_detection) if inp.HasField("turn_detection") else None
            refused = self.adapter.hear(inp.sid, pcm, clear=inp.clear_audio, turn_detection=turn)
            if refused and not heard.error:
                heard.error, heard.error_code = refused, "input_refused"

    def _resample(self, sid: str, rate: int, pcm: np.ndarray) -> np.ndarray:
        resampler = self._resamplers.get(sid)
        if resampler is None or resampler.in_rate != rate:
            resampler = self._resamplers[sid] = Resampler(rate, self.adapter.sample_rate)
        return resampler.process(pcm)

    @staticmethod
    def _measure(out: pb.SessionOutput, pcm: np.ndarray, rate: int) -> None:
        """Level checks (RMS, clipping) of the audio as sent, on the session's output for the client."""
        lv = levels(pcm, rate)
        out.input_dbfs, out.input_clipping = lv.rms_dbfs, lv.clipping

    def tick_audio(self, inp: pb.SessionInput, default_tokens: int, out: pb.SessionOutput,
                   earlier: StreamedInput | None = None) -> TickAudio:
        """One session's SessionInput (after its ``earlier`` streamed input) → TickAudio at the adapter's rate;
        ValueError for bad input. An adapter that hears early had the audio, clear and turn detection already
        (``hear``): the TickAudio carries the rest."""
        if inp.sid not in self._sessions:
            raise ValueError(f"unknown session {inp.sid!r}")
        pcm = np.zeros(0, np.float32)
        out.input_dbfs = SILENCE_DBFS
        audio = inp.audio_pcm16   # read once: each read of a protobuf bytes field copies it
        text, new_turn, cancel, cleared = inp.text, inp.new_turn, inp.cancel, inp.clear_audio
        turn = inp.turn_detection if inp.HasField("turn_detection") else None
        out.cancelled = cancel or (earlier is not None and earlier.cancel)
        if earlier is not None:
            if earlier.error and not inp.clear_audio:
                raise ValueError(earlier.error)
            if earlier.audio and earlier.sample_rate == inp.sample_rate and not inp.clear_audio:
                audio = b"".join([*earlier.audio, audio])
            text = "".join(earlier.text) + text
            new_turn, cancel = new_turn or earlier.new_turn, cancel or earlier.cancel
            cleared = cleared or earlier.cleared
            turn = turn or earlier.turn_detection
        if self.adapter.hears_early:
            heard = self._heard.get(inp.sid)
            if heard is not None and heard.pcm:
                self._measure(out, np.concatenate(heard.pcm), heard.sample_rate)
            audio, cleared, turn = b"", False, None
        if audio:
            check_sample_rate(inp.sample_rate)
            pcm = decode_pcm16(audio)
            self._measure(out, pcm, inp.sample_rate)
            pcm = self._resample(inp.sid, inp.sample_rate, pcm)
        return TickAudio(session_id=inp.sid, pcm=pcm, new_turn=new_turn, text=text, cancel=cancel, clear_buffer=cleared,
                         max_tokens=inp.max_tokens or default_tokens, max_output_tokens=inp.max_output_tokens,
                         turn_detection=turn_detection(turn) if turn is not None else None)

    def step(self, request: pb.StepRequest, streamed: StreamedTick | None = None,
             refused: dict[str, str] | None = None) -> pb.StepResponse:
        """One tick: ``request`` (a StreamStep's last message, after the ``streamed`` earlier ones) → outputs.

        ``refused``: sid -> why, sessions whose input this tick was refused before the engine thread
        (``budget.py``): they get ``input_too_large`` and their input is dropped."""
        t0 = perf_counter()
        if self.adapter.hears_early and not (streamed is not None and streamed.heard):
            self.hear(request)
        earlier = streamed.sessions if streamed is not None else {}
        refused = refused or {}
        outputs = [pb.SessionOutput(sid=inp.sid) for inp in request.sessions]
        ticks: list[TickAudio] = []
        indices: list[int] = []
        seen: set[str] = set()
        for i, inp in enumerate(request.sessions):
            try:
                if inp.sid in seen:
                    raise ValueError(f"session {inp.sid!r} appears more than once in one step")
                seen.add(inp.sid)
                self._opened.pop(inp.sid, None)   # stepped: its header is in the engine now
                if inp.sid not in self._sessions:   # closed while this tick was on its way: a race, not an error
                    self._session_error(request.tick, outputs[i], f"unknown session {inp.sid!r}", "unknown_session")
                    continue
                if inp.sid in refused:
                    self._session_error(request.tick, outputs[i], refused[inp.sid], INPUT_TOO_LARGE)
                    continue
                if (heard := self._heard.get(inp.sid)) is not None and heard.error:
                    self._session_error(request.tick, outputs[i], heard.error, heard.error_code)
                    continue
                ticks.append(self.tick_audio(inp, request.tokens_per_tick, outputs[i], earlier.get(inp.sid)))
                indices.append(i)
            except ValueError as exc:
                self._session_error(request.tick, outputs[i], str(exc), "invalid_input")
        self._heard.clear()   # this tick's: a session the tick does not name has its input dropped, as the audio
        prepared = self.adapter.prepare(ticks) if ticks else []
        if len(prepared) != len(ticks):
            raise RuntimeError(f"the adapter returned {len(prepared)} inputs for {len(ticks)} sessions")
        frontend_ms = (perf_counter() - t0) * 1e3

        jobs = []
        chunk = self.engine.config.max_chunk_tokens
        for i, prep in zip(indices, prepared):
            outputs[i].transcript = prep.transcript
            if prep.speech_started_ms is not None:
                outputs[i].speech_started_ms = prep.speech_started_ms
            if prep.speech_stopped_ms is not None:
                outputs[i].speech_stopped_ms = prep.speech_stopped_ms
            if prep.error:
                self._session_error(request.tick, outputs[i], prep.error, "input_refused")
            elif prep.num_tokens > self.config.max_input_tokens:
                self._session_error(request.tick, outputs[i], f"input of {prep.num_tokens} tokens exceeds "
                                    f"max_input_tokens={self.config.max_input_tokens}", INPUT_TOO_LARGE)
            else:
                jobs.append(_Job(i, self._sessions[request.sessions[i].sid], prep, _split(prep, chunk)))
        timings = self._run_engine(jobs)
        heads_failed = self._run_heads(request.tick, outputs, jobs)
        # Read after the heads: the engine's times wait for its work, which the heads queue behind. (A device
        # fault in the step then surfaces in the heads, reported on their sessions, and again here.)
        prefill_ms = sum(t.prefill_ms for t in timings)
        decode_ms = sum(t.decode_ms for t in timings)

        for job in jobs:
            out, result = outputs[job.index], job.output
            if result.error:
                self._session_error(request.tick, out, result.error)
                continue
            if out.sid in heads_failed:
                self._session_error(request.tick, out, heads_failed[out.sid])
                continue
            out.tokens.extend(result.token_ids)
            out.input_tokens = job.prepared.num_tokens
            capped = job.prepared.ends_response and len(result.token_ids) >= job.prepared.max_new_tokens
            out.finished = result.finished or capped
            out.cancelled |= job.prepared.cancelled   # the adapter cut the answer (barge-in): no more of it comes
            out.preempted = job.preempted or result.preempted
            out.text = self.adapter.on_output(out.sid, list(result.token_ids), out.finished)
            audio, spoken = self.adapter.take_spoken(out.sid)
            if audio:
                out.audio_pcm16, out.audio_sample_rate = audio, self.adapter.output_sample_rate
                out.audio_transcript = spoken
            out.finished = self._finish_with_speech(out.sid, out.finished)
        stats = self.engine.stats()
        self.health = self._snapshot()
        return pb.StepResponse(outputs=outputs, gpu_ms=prefill_ms + decode_ms, in_flight=len(self._sessions),
                               frontend_ms=frontend_ms, prefill_ms=prefill_ms, decode_ms=decode_ms,
                               kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total,
                               worker_ms=(perf_counter() - t0) * 1e3)

    def speech_between_ticks(self, sids: list[str]) -> pb.StepResponse:
        """Speech ready now for the open ones of ``sids`` (between ticks), as outputs with only their audio; a
        session with none is left out. What this takes, the next tick does not hand out again."""
        outputs = []
        for sid in sids:
            if sid not in self._sessions:
                continue
            audio, spoken = self.adapter.take_spoken(sid)
            if audio:
                outputs.append(pb.SessionOutput(sid=sid, audio_pcm16=audio, audio_transcript=spoken,
                                                audio_sample_rate=self.adapter.output_sample_rate))
        return pb.StepResponse(outputs=outputs, speech_only=True)

    def _run_engine(self, jobs: list[_Job]) -> list[StepTiming]:
        """Feed every job's pieces, right-aligned so all decodes share the final engine step.

        Returns the engine steps' timings; sets each job's ``output``.
        """
        rounds = max((len(job.pieces) for job in jobs), default=0)
        timings = []
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
                                        return_hidden=job.prepared.return_hidden and last,
                                        embeds_finite=job.prepared.embeds_finite))
            results = self.engine.step(inputs)
            timings.append(self.engine.last_timing)
            for job, result in zip(batch, results):
                job.preempted |= result.preempted
                if result.error or last:
                    job.output = result
        return timings

    def _run_heads(self, tick: int, outputs: list[pb.SessionOutput], jobs: list[_Job]) -> dict[str, str]:
        """The adapter's own output heads over the hidden states sessions asked for; returns sid -> error
        for the sessions whose heads failed (only they are affected)."""
        hidden = [(outputs[job.index].sid, job.output.hidden) for job in jobs
                  if job.prepared.return_hidden and not job.output.error and job.output.hidden is not None]
        if not hidden:
            return {}
        try:
            self.adapter.on_hidden(hidden)
        except Exception as exc:  # noqa: BLE001  (the adapter's own heads: report on those sessions only)
            log.exception("tick %d: the %s adapter's heads failed", tick, self.adapter.name)
            reason = f"the model's output heads failed this tick: {type(exc).__name__}: {exc}"
            return {sid: reason for sid, _ in hidden}
        return {}

    @staticmethod
    def _session_error(tick: int, out: pb.SessionOutput, message: str, code: str = "session_failed") -> None:
        out.error, out.error_code = message, code
        # Refused input is the client's doing (and a hostile one can do it every tick): not a warning.
        level = logging.INFO if code in (INPUT_TOO_LARGE, "input_refused") else logging.WARNING
        if code == "unknown_session":
            level = logging.DEBUG   # the gateway closed it as this tick was sent (a client left): it is gone
        log.log(level, "tick %d, session %s: %s", tick, out.sid, message)
