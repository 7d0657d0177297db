"""Streaming voice activity detection: Silero VAD (ONNX, bundled in the ``silero-vad`` wheel) per session.

One ``SileroVad`` holds the model (an onnxruntime session, stateless); each session gets a ``VadStream``
(``vad.open()`` when the session opens, dropped when it closes) that owns everything session-specific:
the model's recurrent state (``[2, 1, 128]`` floats), the last 64 samples of context the model needs,
the sub-window remainder of the last chunk, a short pre-roll and the current utterance. Nothing is
shared between streams, so interleaved sessions cannot disturb each other, and memory per session is
bounded by ``max_utterance_s`` plus ``min_silence_ms`` of audio.

Silero scores fixed 512-sample windows (32 ms at 16 kHz); ``VadStream.feed`` takes chunks of any size,
scores every complete window and keeps the remainder for the next call, so the segmentation depends
only on the audio, not on how it was chunked. The segmentation is the hysteresis of Silero's own
``VADIterator``:

* an utterance starts at the first window whose speech probability is ``>= threshold``; its audio
  begins ``speech_pad_ms`` earlier (pre-roll, never reaching back into the previous utterance);
* a window below ``neg_threshold`` (default ``threshold - 0.15``) starts a candidate silence; a window
  ``>= threshold`` cancels it; once the silence has lasted ``min_silence_ms`` the utterance ends
  ``speech_pad_ms`` after the silence began;
* utterances whose speech lasted less than ``min_speech_ms`` (clicks, coughs) are dropped;
* an utterance reaching ``max_utterance_s`` is cut there (``forced=True``) and a new one continues
  at once, so ASR never sees more than ``max_utterance_s`` (Whisper's window is 30 s).

Worked example (defaults: threshold 0.5, neg 0.35, min_silence 500 ms, pad 100 ms, min_speech 250 ms):
1 s of silence, 1.2 s of speech, 1 s of silence fed as 20 ms chunks. Windows are 32 ms; the first
window scoring >= 0.5 is around t = 1.0 s, so the utterance audio starts near 0.9 s (100 ms pad)
and ``speaking`` turns true on the chunk that completes that window. Around t = 2.2 s the score
drops below 0.35: silence begins. 500 ms later (t = 2.7 s) the chunk that completes that window returns
``VadEvents(utterances=[Utterance(start=~0.9 s, end=~2.3 s, ...)], speaking=False)``: the
utterance runs to 100 ms after the speech stopped, about 1.4 s of audio.

>>> import numpy as np
>>> vad = SileroVad()
>>> stream = vad.open()
>>> events = stream.feed(np.zeros(16000, np.float32))      # 1 s of digital silence
>>> events.utterances, events.speaking
([], False)
>>> stream.pending_samples                                 # 16000 = 31 windows of 512 + 128 kept
128
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
WINDOW = 512          # samples per Silero window at 16 kHz (32 ms)
CONTEXT = 64          # samples of the previous window prepended to each window (Silero v5+ input format)
STATE_SHAPE = (2, 1, 128)

_MODEL_FILE = "silero_vad.onnx"   # opset 16, 8 kHz and 16 kHz; the wheel also has .jit and variants


def silero_model_path() -> Path:
    """The ONNX model shipped inside the installed ``silero-vad`` wheel (``silero_vad/data/``).

    Located with ``importlib.util.find_spec`` so that the package itself (which imports torch) is not
    imported, and nothing is fetched from a hub. Raises ``RuntimeError`` naming the package if missing.
    """
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("voice activity detection needs the `silero-vad` package (pip install silero-vad==6.2.3)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / _MODEL_FILE
    if not path.is_file():
        raise RuntimeError(f"the installed `silero-vad` package has no bundled model at {path}; reinstall silero-vad")
    return path


@dataclass(frozen=True)
class VadConfig:
    threshold: float = 0.5
    neg_threshold: float | None = None    # None: max(threshold - 0.15, 0.01)
    min_silence_ms: int = 500
    speech_pad_ms: int = 100
    min_speech_ms: int = 250
    max_utterance_s: float = 15.0

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 < self.neg_threshold <= self.threshold:
            raise ValueError(f"neg_threshold must be in (0, threshold], got {self.neg_threshold}")
        if self.speech_pad_ms < 0 or self.min_speech_ms < 0:
            raise ValueError("speech_pad_ms and min_speech_ms must be >= 0")
        if self.min_silence_ms < self.speech_pad_ms:
            raise ValueError("min_silence_ms must be >= speech_pad_ms (the end pad is cut from the silence)")
        if self.max_utterance_s * SAMPLE_RATE < 4 * WINDOW:
            raise ValueError(f"max_utterance_s is too short: {self.max_utterance_s}")

    @property
    def negative(self) -> float:
        return self.neg_threshold if self.neg_threshold is not None else max(self.threshold - 0.15, 0.01)


@dataclass
class Utterance:
    """A completed utterance: ``audio`` is float32 16 kHz; ``start``/``end`` are sample offsets in the
    stream (``audio`` is exactly ``stream[start:end]``). ``forced``: cut at ``max_utterance_s``, not at a pause."""

    audio: np.ndarray
    start: int
    end: int
    forced: bool = False

    @property
    def duration_s(self) -> float:
        return (self.end - self.start) / SAMPLE_RATE


@dataclass
class VadEvents:
    utterances: list[Utterance] = field(default_factory=list)
    speaking: bool = False        # an utterance is open at the end of the fed audio
    probability: float = 0.0      # the last window's speech probability (0.0 before the first window)
    # Stream offsets (samples) where speech started / stopped in this audio; None: it did not. A cut at
    # ``max_utterance_s`` is neither (the speech goes on); speech too short to keep still stops.
    started_at: int | None = None
    stopped_at: int | None = None


class SileroVad:
    """The shared, stateless Silero model. Every per-session bit of state lives in ``VadStream``.

    ``threads``: onnxruntime intra-op threads (1 keeps results deterministic and the worker's cores free).
    """

    def __init__(self, path: str | Path | None = None, *, threads: int = 1) -> None:
        import onnxruntime

        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        self.path = Path(path) if path is not None else silero_model_path()
        self._session = onnxruntime.InferenceSession(str(self.path), sess_options=opts,
                                                     providers=["CPUExecutionProvider"])
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)

    def open(self, config: VadConfig | None = None) -> VadStream:
        """A new per-session stream (fresh model state)."""
        return VadStream(self, config or VadConfig())

    def score(self, windows: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step for a batch: ``windows`` [B, CONTEXT + WINDOW], ``state`` [2, B, 128] →
        (speech probabilities [B], new state [2, B, 128])."""
        out, new_state = self._session.run(None, {"input": np.ascontiguousarray(windows, dtype=np.float32),
                                                  "state": np.ascontiguousarray(state, dtype=np.float32),
                                                  "sr": self._sr})
        return out[:, 0].astype(np.float32), new_state

    def feed_many(self, streams: list[VadStream], chunks: list[np.ndarray]) -> list[VadEvents]:
        """``[s.feed(c) for s, c in zip(streams, chunks)]``, with the model run batched across streams:
        step k scores the k-th new window of every stream that has one (one model call per step, not per
        stream). Streams must be distinct."""
        if len(streams) != len(chunks):
            raise ValueError("feed_many needs one chunk per stream")
        if len({id(s) for s in streams}) != len(streams):
            raise ValueError("feed_many: a stream appears twice in one call")
        windows = [s._take_windows(c) for s, c in zip(streams, chunks)]
        probs = [np.zeros(len(w), np.float32) for w in windows]
        for k in range(max((len(w) for w in windows), default=0)):
            idx = [i for i, w in enumerate(windows) if len(w) > k]
            batch = np.stack([np.concatenate([streams[i]._context, windows[i][k]]) for i in idx])
            state = np.concatenate([streams[i]._state for i in idx], axis=1)
            p, new_state = self.score(batch, state)
            for j, i in enumerate(idx):
                probs[i][k] = p[j]
                streams[i]._state = new_state[:, j: j + 1, :].copy()
                streams[i]._context = windows[i][k][-CONTEXT:].copy()
        return [s._segment(w, p) for s, w, p in zip(streams, windows, probs)]


class VadStream:
    """One session's streaming VAD. Create with ``SileroVad.open()``; drop it when the session closes."""

    def __init__(self, model: SileroVad, config: VadConfig) -> None:
        self.model = model
        self.config = config
        self._state = np.zeros(STATE_SHAPE, np.float32)
        self._context = np.zeros(CONTEXT, np.float32)
        self._pending = np.zeros(0, np.float32)     # < WINDOW samples not yet scored
        self._pos = 0                               # samples scored so far (stream offset of the next window)
        self.reconfigure(config)
        self._recent = np.zeros(0, np.float32)      # last <= pad scored samples (pre-roll)
        self._last_end = 0                          # where the previous utterance ended
        self._triggered = False
        self._utt: list[np.ndarray] = []
        self._utt_start = 0
        self._utt_len = 0
        self._speech_start = 0
        self._silence_start: int | None = None
        self._last_prob = 0.0

    def reconfigure(self, config: VadConfig) -> None:
        """Segment with ``config`` from the next window on (the client changed its turn detection)."""
        self.config = config
        self._pad = config.speech_pad_ms * SAMPLE_RATE // 1000
        self._min_silence = config.min_silence_ms * SAMPLE_RATE // 1000
        self._min_speech = config.min_speech_ms * SAMPLE_RATE // 1000
        self._max_len = int(config.max_utterance_s * SAMPLE_RATE)

    @property
    def speaking(self) -> bool:
        return self._triggered

    @property
    def last_end(self) -> int:
        """Stream offset (samples) where the last utterance ended (0 before the first)."""
        return self._last_end

    @property
    def pending_samples(self) -> int:
        return int(self._pending.size)

    @property
    def position(self) -> int:
        """Samples scored so far (the stream offset up to which segmentation is decided)."""
        return self._pos

    def feed(self, chunk: np.ndarray) -> VadEvents:
        """Feed float32 16 kHz mono samples (any length, possibly empty); get the utterances completed
        by this audio and whether speech is ongoing."""
        windows = self._take_windows(chunk)
        probs = np.zeros(len(windows), np.float32)
        for k, w in enumerate(windows):
            p, self._state = self.model.score(np.concatenate([self._context, w])[None, :], self._state)
            self._context = w[-CONTEXT:].copy()
            probs[k] = p[0]
        return self._segment(windows, probs)

    def flush(self) -> Utterance | None:
        """End the open utterance now (the client committed its turn, or the session closes) and return
        it, or ``None`` if none is open or its speech is shorter than ``min_speech_ms``. Samples not yet
        scored (< 32 ms) are not included; the model state carries on."""
        if not self._triggered:
            return None
        speech_end = self._silence_start if self._silence_start is not None else self._pos
        return self._close(self._pos, speech_end, forced=False)

    def tentative(self, silent_ms: int = 0) -> Utterance | None:
        """The utterance the open one becomes if the silence now under way lasts until it ends the utterance,
        as ``feed`` would return it then; None while no silence is under way or it has lasted less than
        ``silent_ms``, before the scored audio reaches the end pad after the silence began, or when the speech
        is too short to keep. Nothing changes."""
        if not self._triggered or self._silence_start is None:
            return None
        end = self._silence_start + self._pad   # scored audio reaches it: within the open utterance's
        if self._pos < max(end, self._silence_start + silent_ms * SAMPLE_RATE // 1000) or \
                self._silence_start - self._speech_start < self._min_speech:
            return None
        audio = np.concatenate(self._utt)[: end - self._utt_start]
        return Utterance(audio.astype(np.float32, copy=False), self._utt_start, end)

    def discard(self) -> None:
        """Drop the open utterance, the pre-roll and the samples not yet scored (the client cleared its input
        buffer): the next utterance starts with audio that comes after this. Stream offsets count the dropped
        samples; the model state carries on."""
        self._pos += self._pending.size
        self._pending = np.zeros(0, np.float32)
        self._triggered = False
        self._utt, self._utt_len = [], 0
        self._silence_start = None
        self._recent = np.zeros(0, np.float32)
        self._last_end = self._pos

    # -- internals ------------------------------------------------------------------------------------

    def _take_windows(self, chunk: np.ndarray) -> list[np.ndarray]:
        chunk = np.asarray(chunk, dtype=np.float32).reshape(-1)
        buf = np.concatenate([self._pending, chunk]) if self._pending.size else chunk
        n = buf.size // WINDOW
        windows = [buf[i * WINDOW:(i + 1) * WINDOW].copy() for i in range(n)]
        self._pending = buf[n * WINDOW:].copy()
        return windows

    def _segment(self, windows: list[np.ndarray], probs: np.ndarray) -> VadEvents:
        cfg = self.config
        done: list[Utterance] = []
        started_at = stopped_at = None
        for w, p in zip(windows, probs):
            start, end = self._pos, self._pos + WINDOW
            if not self._triggered:
                if p >= cfg.threshold:
                    n_pre = min(self._recent.size, start - self._last_end)
                    pre = self._recent[self._recent.size - n_pre:]
                    self._triggered = True
                    self._utt = [pre.copy(), w]
                    self._utt_start = start - n_pre
                    self._utt_len = n_pre + WINDOW
                    self._speech_start = start
                    self._silence_start = None
                    if started_at is None:
                        started_at = self._utt_start
            else:
                self._utt.append(w)
                self._utt_len += WINDOW
                if p >= cfg.threshold:
                    self._silence_start = None
                elif p < cfg.negative and self._silence_start is None:
                    self._silence_start = start
                if self._silence_start is not None and end - self._silence_start >= self._min_silence:
                    u = self._close(self._silence_start + self._pad, self._silence_start, forced=False)
                    stopped_at = self._last_end
                    if u is not None:
                        done.append(u)
                elif self._utt_len >= self._max_len:
                    u = self._close(end, end, forced=True)
                    if u is not None:
                        done.append(u)
                    # speech goes on: the next utterance starts right here, without pre-roll
                    self._triggered = True
                    self._utt, self._utt_start, self._utt_len = [], end, 0
                    self._speech_start, self._silence_start = end, None
            self._pos = end
            if self._pad:
                self._recent = np.concatenate([self._recent, w])[-self._pad:]
            self._last_prob = float(p)
        return VadEvents(done, self._triggered, self._last_prob, started_at, stopped_at)

    def _close(self, end: int, speech_end: int, *, forced: bool) -> Utterance | None:
        end = min(end, self._utt_start + self._utt_len)
        audio = np.concatenate(self._utt)[: end - self._utt_start] if self._utt else np.zeros(0, np.float32)
        start = self._utt_start
        keep = forced or speech_end - self._speech_start >= self._min_speech
        self._triggered = False
        self._utt, self._utt_len, self._silence_start = [], 0, None
        self._last_end = end
        return Utterance(audio.astype(np.float32, copy=False), start, end, forced) if keep else None
