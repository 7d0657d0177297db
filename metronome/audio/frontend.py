"""The cascade's speech front end, beside the tick: streaming VAD and batched Whisper on threads of their own.

The tick never waits for a model here. Each tick hands every session's new audio to ``submit`` (it only
queues it) and collects with ``take`` what has finished since the last tick: speech onsets (the VAD heard
someone start talking: barge-in) and the transcripts of finished utterances. Two stages, one thread each:

* VAD: per submitted tick, every session's audio through Silero in one batched call (``feed_many``); a
  commit (``flush``) ends the session's utterance after its audio. Onsets and the speech marks (where
  speech started and stopped, in ms of the session's input audio) are ready at once; finished utterances
  go to the ASR queue.
* ASR: whenever it is free, every utterance queued (of any session, up to ``max_batch``) in one
  ``transcribe_batch`` call; the cleaned transcripts are ready then.

So a transcript joins the first tick that starts after Whisper finished with it (on average half a tick
after), and the VAD of later ticks never waits behind Whisper.

A guess saves a tick when Whisper is idle: once a session's silence has lasted half of what ends an utterance
and run past the end pad (the VAD's ``tentative``: the utterance's audio is then what it will be if the silence
lasts), Whisper transcribes it before the silence has lasted long enough to end the utterance, which may come a
tick later. If the utterance ends as guessed its transcript is reported without a second run; if the speech goes
on the guess is dropped. Guesses run only while no finished utterance waits, one at a time.

``busy`` says whether a session's audio is still on its way (a commit that came first waits for its transcript).

``configure`` (the client's turn detection) is queued in order with the audio, so the VAD thread, the only
owner of the VAD streams, applies it before the session's next audio. In manual mode (no server VAD) the
VAD thread holds a session's finished utterances (at most ``max_utterance_s`` of them, the oldest dropped)
until the commit, which flushes the stream and queues held + flushed as ONE utterance: one transcript.
Back in server-VAD mode, utterances still held are transcribed at once.

Per-session state is bounded: the VAD stream and the held utterances (``VadConfig.max_utterance_s`` of
audio each), at most ``max_queued`` utterances waiting for Whisper and ``max_queued`` transcripts not yet
taken (more are dropped with an error for that session). ``close`` drops all of a session's pending work. A
failure of the batched VAD or ASR call is retried per session, so only the session whose input fails gets
an error (logged).

>>> front = SpeechFrontend(SileroVad(), asr)                                     # doctest: +SKIP
>>> front.open("a")                                                              # doctest: +SKIP
>>> front.submit([("a", pcm_of_this_tick, False)])                               # doctest: +SKIP
>>> front.take(["a"])["a"]    # at the next tick                                 # doctest: +SKIP
Heard(started=True, transcripts=['What is the capital of France?'], error=None, started_ms=1480, stopped_ms=3120)
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from metronome.audio.vad import SAMPLE_RATE, SileroVad, Utterance, VadConfig, VadEvents, VadStream
from metronome.cpu import ThreadPlan, lower_thread_priority

log = logging.getLogger(__name__)

def samples_to_ms(samples: int | None) -> int | None:
    """A stream offset in samples as ms of the session's input audio (None stays None).

    >>> samples_to_ms(24000), samples_to_ms(None)
    (1500, None)
    """
    return None if samples is None else samples * 1000 // SAMPLE_RATE


# Whisper marks non-speech with bracketed tags ("[BLANK_AUDIO]", "(music)"); they are not words said.
_NON_SPEECH = re.compile(r"\[[^\]]*\]|\([^)]*\)|\*[^*]*\*")


def _same_span(a: Utterance, b: Utterance) -> bool:
    return (a.start, a.end) == (b.start, b.end)


def clean_transcript(text: str) -> str:
    """``text`` without Whisper's non-speech tags and surrounding/duplicated whitespace ("" if nothing is left).

    >>> clean_transcript("  [BLANK_AUDIO] ")
    ''
    >>> clean_transcript(" What is the capital of France? ")
    'What is the capital of France?'
    """
    return " ".join(_NON_SPEECH.sub(" ", text).split())


@dataclass
class Heard:
    """What the front end found for one session since the last ``take``."""

    started: bool = False                                  # the VAD heard speech begin (barge-in)
    transcripts: list[str] = field(default_factory=list)   # finished utterances, cleaned, non-empty
    error: str | None = None                               # the first failure on this session's input
    started_ms: int | None = None     # the first speech onset since the last take (ms of the session's input)
    stopped_ms: int | None = None     # the last end of speech since the last take (a pause, or a commit)


@dataclass
class FrontendStats:
    """Running totals (benchmarks, logs): VAD calls and their time, Whisper batches, utterances and speech."""

    vad_calls: int = 0
    vad_s: float = 0.0
    asr_batches: int = 0
    asr_s: float = 0.0
    utterances: int = 0
    speech_s: float = 0.0
    largest_batch: int = 0
    guesses: int = 0          # utterances transcribed on a guess
    guesses_used: int = 0     # ... that ended as guessed (the others cost Whisper time for nothing)


@dataclass(eq=False)
class _Stream:
    """One open session: its VAD stream (VAD thread only) and its utterances waiting for Whisper."""

    sid: str
    vad: VadStream
    queued: int = 0      # utterances in the ASR queue (under the front end's lock)
    submitted: int = 0   # audio jobs of this session the VAD thread has not done yet (likewise)
    unheard: int = 0     # utterances queued or in Whisper now (likewise)
    manual: bool = False                                    # VAD thread: only a commit ends a turn
    held: list[np.ndarray] = field(default_factory=list)    # VAD thread: finished utterances awaiting the commit
    guess: _Guess | None = None                             # the open utterance's guess (under the lock)


@dataclass(eq=False)
class _Guess:
    """The open utterance transcribed before its silence ended it (the VAD's ``tentative`` utterance)."""

    stream: _Stream
    utterance: Utterance
    state: str = "queued"                  # "queued", "running", "done"
    text: str | Exception | None = None    # Whisper's answer once done
    wanted: bool = False                   # the utterance ended as guessed: the answer is due when done


@dataclass
class _Configure:
    """A control entry in the VAD queue: the session segments with ``config`` from its next audio on."""

    stream: _Stream
    config: VadConfig
    manual: bool


@dataclass
class _Clear:
    """A control entry in the VAD queue: the session's uncommitted audio goes (the open utterance, and in
    manual mode the finished ones awaiting the commit)."""

    stream: _Stream


@dataclass
class _Utterance:
    stream: _Stream
    audio: np.ndarray


class SpeechFrontend:
    """VAD + ASR for every session of one adapter, on two threads; ``submit``/``take`` never block.

    ``asr``: anything with ``transcribe_batch(list[np.ndarray]) -> list[str]`` (``WhisperAsr``).
    ``vad_config``: the default segmentation of a session (``open`` may give another).
    """

    def __init__(self, vad: SileroVad, asr, *, vad_config: VadConfig | None = None, max_batch: int = 8,
                 max_queued: int = 4) -> None:
        if max_batch < 1 or max_queued < 1:
            raise ValueError("max_batch and max_queued must be >= 1")
        self.vad, self.asr = vad, asr
        self.vad_config = vad_config or VadConfig()
        self.max_batch, self.max_queued = max_batch, max_queued
        self.stats = FrontendStats()
        self._lock = threading.Condition()     # guards everything below, and signals the ASR thread
        self._streams: dict[str, _Stream] = {}
        self._ready: dict[str, Heard] = {}
        self._asr_queue: deque[_Utterance] = deque()
        self._guesses: deque[_Guess] = deque()   # at most one: guesses use Whisper's idle time only
        self._asr_busy = False
        self._pending = 0                      # submitted ticks and queued utterances not yet done
        self._stopping = False
        self._vad_jobs: queue.SimpleQueue[list[tuple[_Stream, np.ndarray, bool]] | _Configure | None] = \
            queue.SimpleQueue()
        self._nice = ThreadPlan.for_this_process(speech=True).speech_nice   # the tick goes first on a shared core
        self._threads = [threading.Thread(target=self._vad_loop, name="frontend-vad", daemon=True),
                         threading.Thread(target=self._asr_loop, name="frontend-asr", daemon=True)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ the tick's side (never blocks)
    def open(self, sid: str, vad_config: VadConfig | None = None) -> None:
        with self._lock:
            if sid in self._streams:
                raise ValueError(f"session {sid!r} is already open in the speech front end")
            self._streams[sid] = _Stream(sid, self.vad.open(vad_config or self.vad_config))

    def close(self, sid: str) -> None:
        """Forget the session: its audio and utterances still queued are skipped, nothing of it is reported."""
        with self._lock:
            stream = self._streams.pop(sid, None)
            self._ready.pop(sid, None)
            if stream is not None:
                self._drop_guess(stream)

    def submit(self, audio: list[tuple[str, np.ndarray, bool]]) -> None:
        """One tick's ``(sid, float32 16 kHz audio, commit)`` per session; unknown sessions are ignored."""
        with self._lock:
            job = [(self._streams[sid], pcm, commit) for sid, pcm, commit in audio
                   if sid in self._streams and (pcm.size or commit)]
            if not job:
                return
            self._pending += 1
            for stream, _, _ in job:
                stream.submitted += 1
        self._vad_jobs.put(job)

    def configure(self, sid: str, config: VadConfig, *, manual: bool) -> None:
        """From the session's next submitted audio on: segment with ``config`` (already validated); ``manual``:
        finished utterances wait for the commit. Applied on the VAD thread, in order with the audio."""
        with self._lock:
            stream = self._streams.get(sid)
            if stream is None:
                return
            self._pending += 1
        self._vad_jobs.put(_Configure(stream, config, manual))

    def clear(self, sid: str) -> None:
        """Drop the session's uncommitted audio, in order with its audio: what it submits later is kept."""
        with self._lock:
            stream = self._streams.get(sid)
            if stream is None:
                return
            self._pending += 1
        self._vad_jobs.put(_Clear(stream))

    def busy(self, sid: str) -> bool:
        """Is audio of this session still in the front end (a transcript of it may come at a later tick)?"""
        with self._lock:
            stream = self._streams.get(sid)
            return stream is not None and (stream.submitted > 0 or stream.unheard > 0)

    def speech_started(self, sid: str) -> bool:
        """Has the VAD heard this session's speech begin since the last ``take`` (not yet taken)?"""
        with self._lock:
            heard = self._ready.get(sid)
            return heard is not None and heard.started

    def take(self, sids: list[str]) -> dict[str, Heard]:
        """What is ready for these sessions (only those with something), each handed out once."""
        with self._lock:
            return {sid: self._ready.pop(sid) for sid in sids if sid in self._ready}

    # ------------------------------------------------------------------ control
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until everything submitted so far is done (tests and offline runs; never from a tick)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout)

    def shutdown(self) -> None:
        """Stop both threads (queued work is dropped)."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._vad_jobs.put(None)
        for t in self._threads:
            t.join()

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._streams)

    # ------------------------------------------------------------------ VAD thread
    def _vad_loop(self) -> None:
        lower_thread_priority(self._nice)
        while (job := self._vad_jobs.get()) is not None:
            try:
                if isinstance(job, _Configure):
                    self._apply(job)
                elif isinstance(job, _Clear):
                    job.stream.vad.discard()
                    job.stream.held = []
                    with self._lock:
                        self._drop_guess(job.stream)
                else:
                    self._run_vad(job)
            except Exception:  # noqa: BLE001 - a bug here must not stop the front end for every session
                log.exception("the speech front end's VAD step failed")
            finally:
                if isinstance(job, list):
                    with self._lock:
                        for stream, _, _ in job:
                            stream.submitted -= 1
                self._done(1)

    def _apply(self, c: _Configure) -> None:
        stream = c.stream
        stream.vad.reconfigure(c.config)
        stream.manual = c.manual
        if not c.manual and stream.held:   # the server's VAD takes over: what it would have ended, it ends now
            self._queue_asr([_Utterance(stream, np.concatenate(stream.held))])
            stream.held = []

    def _run_vad(self, job: list[tuple[_Stream, np.ndarray, bool]]) -> None:
        with self._lock:
            job = [item for item in job if self._streams.get(item[0].sid) is item[0]]
        if not job:
            return
        t0 = time.perf_counter()
        was = [s.vad.speaking for s, _, _ in job]
        events: list[VadEvents | Exception]
        try:
            events = list(self.vad.feed_many([s.vad for s, _, _ in job], [pcm for _, pcm, _ in job]))
        except Exception:  # noqa: BLE001 - find the session whose audio fails; the others go on
            events = []
            for s, pcm, _ in job:
                try:
                    events.append(s.vad.feed(pcm))
                except Exception as exc:  # noqa: BLE001
                    log.exception("session %s: voice activity detection failed", s.sid)
                    events.append(exc)
        with self._lock:
            self.stats.vad_calls += 1
            self.stats.vad_s += time.perf_counter() - t0
        finished: list[_Utterance] = []
        for (stream, _, commit), before, ev in zip(job, was, events):
            if isinstance(ev, Exception):
                self._report(stream, error=f"voice activity detection failed: {type(ev).__name__}: {ev}")
                continue
            # An utterance began in this audio: none was open before it, or one ended and another is open.
            started = (not before and (ev.speaking or bool(ev.utterances))) or \
                (ev.speaking and any(not u.forced for u in ev.utterances))
            unguessed = self._settle_guess(stream, ev.utterances)
            utterances, stopped_at = self._turns_ended(stream, dataclasses.replace(ev, utterances=unguessed), commit)
            if commit:   # the commit ended the open utterance itself
                with self._lock:
                    self._drop_guess(stream)
            if started or ev.started_at is not None or stopped_at is not None:
                self._report(stream, started=started, started_ms=samples_to_ms(ev.started_at),
                             stopped_ms=samples_to_ms(stopped_at))
            finished += [_Utterance(stream, audio) for audio in utterances]
        self._queue_asr(finished)
        for stream, _, commit in job:
            if not commit:
                self._guess(stream)

    # ------------------------------------------------------------------ guesses (VAD thread, and the lock)
    def _settle_guess(self, stream: _Stream, ended: list[Utterance]) -> list[Utterance]:
        """The utterances that ended in this audio, less the one the session's guess already covers (its
        transcript is reported now, or when Whisper is done with it). A guess that no longer holds is dropped."""
        with self._lock:
            guess = stream.guess
            if guess is None:
                return ended
            tentative = stream.vad.tentative()
            rest = []
            for u in ended:
                if guess is not None and not stream.manual and not u.forced and _same_span(u, guess.utterance):
                    self._use_guess(guess)
                    guess = None
                else:
                    rest.append(u)
            if guess is not None and (tentative is None or not _same_span(tentative, guess.utterance)):
                self._drop_guess(stream)   # the speech went on, or the utterance ended otherwise
            return rest

    def _use_guess(self, guess: _Guess) -> None:
        """The utterance ended as guessed (under the lock)."""
        stream = guess.stream
        stream.guess = None
        self.stats.guesses_used += 1
        if guess.state == "queued":   # Whisper has not started it: it becomes an utterance like any other
            self._guesses.remove(guess)
            self._queue_asr([_Utterance(stream, guess.utterance.audio)])
        elif guess.state == "running":   # reported when Whisper is done; the session is busy until then
            guess.wanted = True
            stream.unheard += 1
            self._pending += 1
        else:
            self._finish_guess(guess)

    def _finish_guess(self, guess: _Guess) -> None:
        """Under the lock: a used guess's transcript for its session; a failed one gets a run of its own."""
        audio = guess.utterance.audio
        if isinstance(guess.text, Exception):
            self._queue_asr([_Utterance(guess.stream, audio)])
            return
        self.stats.utterances += 1
        self.stats.speech_s += audio.size / SAMPLE_RATE
        self._deliver(guess.stream, guess.text)

    def _drop_guess(self, stream: _Stream) -> None:
        """Under the lock: forget the session's guess (a running one finishes unused)."""
        guess, stream.guess = stream.guess, None
        if guess is not None and guess.state == "queued":
            self._guesses.remove(guess)

    def _guess(self, stream: _Stream) -> None:
        """Start a guess on the session's silence under way, if Whisper has nothing else to do."""
        if stream.manual:
            return
        # Half the silence that ends an utterance, not just the end pad: fewer guesses on pauses within a sentence.
        tentative = stream.vad.tentative(stream.vad.config.min_silence_ms // 2)
        with self._lock:
            if tentative is None or self._streams.get(stream.sid) is not stream or stream.guess is not None:
                return
            if self._asr_queue or self._asr_busy or self._guesses:
                return
            stream.guess = _Guess(stream, tentative)
            self._guesses.append(stream.guess)
            self._lock.notify_all()

    @staticmethod
    def _turns_ended(stream: _Stream, ev: VadEvents, commit: bool) -> tuple[list[np.ndarray], int | None]:
        """The utterances to transcribe after this audio, and where speech stopped in it (samples).

        Manual mode keeps finished utterances in ``held`` (within ``max_utterance_s``, the oldest dropped:
        Whisper hears at most its window) until the commit, which flushes the open one and joins them all."""
        utterances, stopped_at = [u.audio for u in ev.utterances], ev.stopped_at
        if stream.manual:
            stream.held += utterances
            utterances = []
            limit = int(stream.vad.config.max_utterance_s * SAMPLE_RATE)
            while sum(a.size for a in stream.held) > limit:
                stream.held.pop(0)
        if commit:
            speaking = stream.vad.speaking
            u = stream.vad.flush()
            if speaking:
                stopped_at = stream.vad.last_end
            flushed = [u.audio] if u is not None else []
            if stream.manual and (stream.held or flushed):
                utterances = [np.concatenate(stream.held + flushed)]   # one committed turn: one transcript
                stream.held = []
            else:
                utterances += flushed
        return utterances, stopped_at

    def _queue_asr(self, utterances: list[_Utterance]) -> None:
        """Queue a tick's utterances together, so that Whisper takes them in one batch."""
        with self._lock:
            for u in utterances:
                stream = u.stream
                if self._streams.get(stream.sid) is not stream:
                    continue
                if stream.queued >= self.max_queued:
                    log.warning("session %s: %d utterances already wait for speech recognition; one is dropped",
                                stream.sid, stream.queued)
                    self._report_locked(stream, error="speech recognition is behind: an utterance was dropped")
                    continue
                stream.queued += 1
                stream.unheard += 1
                self._pending += 1
                self._asr_queue.append(u)
            self._lock.notify_all()

    # ------------------------------------------------------------------ ASR thread
    def _asr_loop(self) -> None:
        lower_thread_priority(self._nice)
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._asr_queue or self._guesses or self._stopping)
                if self._stopping:
                    return
                self._asr_busy = True
                if not self._asr_queue:   # finished utterances first; a guess only in idle time
                    guess = self._guesses.popleft()
                    guess.state = "running"
                    batch = []
                else:
                    guess = None
                    batch = [self._asr_queue.popleft() for _ in range(min(self.max_batch, len(self._asr_queue)))]
                    for u in batch:
                        u.stream.queued -= 1
                live = [u for u in batch if self._streams.get(u.stream.sid) is u.stream]
            try:
                if guess is not None:
                    self._run_guess(guess)
                elif live:
                    self._run_asr(live)
            except Exception:  # noqa: BLE001 - a bug here must not stop the front end for every session
                log.exception("the speech front end's ASR step failed")
            finally:
                with self._lock:
                    self._asr_busy = False
                    for u in batch:
                        u.stream.unheard -= 1
                if batch:
                    self._done(len(batch))

    def _run_guess(self, guess: _Guess) -> None:
        t0 = time.perf_counter()
        try:
            text: str | Exception = self.asr.transcribe_batch([guess.utterance.audio])[0]
        except Exception as exc:  # noqa: BLE001 - reported only if the utterance ends as guessed
            log.exception("session %s: speech recognition of a guess failed", guess.stream.sid)
            text = exc
        wall = time.perf_counter() - t0
        log.info("speech recognition on a guess: %.1f s of speech, in %.0f ms",
                 guess.utterance.audio.size / SAMPLE_RATE, wall * 1e3)
        with self._lock:
            self.stats.guesses += 1
            self.stats.asr_s += wall
            guess.state, guess.text = "done", text
            if guess.wanted:   # the utterance ended as guessed while Whisper had it
                self._finish_guess(guess)
                guess.stream.unheard -= 1
                self._done(1)

    def _run_asr(self, batch: list[_Utterance]) -> None:
        t0 = time.perf_counter()
        results: list[str | Exception]
        try:
            results = list(self.asr.transcribe_batch([u.audio for u in batch]))
        except Exception:  # noqa: BLE001 - one by one, so only the utterance that fails costs its session
            results = []
            for u in batch:
                try:
                    results.append(self.asr.transcribe_batch([u.audio])[0])
                except Exception as exc:  # noqa: BLE001
                    log.exception("session %s: speech recognition failed", u.stream.sid)
                    results.append(exc)
        wall = time.perf_counter() - t0
        log.info("speech recognition: %d utterances, %.1f s of speech, in %.0f ms", len(batch),
                 sum(u.audio.size for u in batch) / SAMPLE_RATE, wall * 1e3)
        with self._lock:
            s = self.stats
            s.asr_batches += 1
            s.asr_s += wall
            s.utterances += len(batch)
            s.speech_s += sum(u.audio.size for u in batch) / SAMPLE_RATE
            s.largest_batch = max(s.largest_batch, len(batch))
        for u, text in zip(batch, results):
            self._deliver(u.stream, text)

    def _deliver(self, stream: _Stream, text: str | Exception) -> None:
        """One utterance's transcript (or failure) for its session."""
        with self._lock:
            if isinstance(text, Exception):
                self._report_locked(stream, error=f"speech recognition failed: {type(text).__name__}: {text}")
            elif text := clean_transcript(text):
                self._report_locked(stream, transcript=text)

    # ------------------------------------------------------------------ results
    def _report(self, stream: _Stream, **what) -> None:
        with self._lock:
            self._report_locked(stream, **what)

    def _report_locked(self, stream: _Stream, *, started: bool = False, transcript: str = "",
                       error: str | None = None, started_ms: int | None = None,
                       stopped_ms: int | None = None) -> None:
        if self._streams.get(stream.sid) is not stream:
            return   # closed (or closed and reopened) meanwhile: its results are dropped
        heard = self._ready.setdefault(stream.sid, Heard())
        heard.started |= started
        if heard.started_ms is None:
            heard.started_ms = started_ms
        if stopped_ms is not None:
            heard.stopped_ms = stopped_ms
        if transcript and len(heard.transcripts) >= self.max_queued:   # a session nobody steps: bounded
            log.warning("session %s: %d transcripts not taken; one is dropped", stream.sid, len(heard.transcripts))
            error = error or "transcripts were not taken: one was dropped"
        elif transcript:
            heard.transcripts.append(transcript)
        heard.error = heard.error or error

    def _done(self, n: int) -> None:
        with self._lock:
            self._pending -= n
            if self._pending == 0:
                self._lock.notify_all()
